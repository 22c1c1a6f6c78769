#include "server/collective/group_step.h"

#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/peers/local_exchange.h"

namespace arfuse {
namespace {

// Runs fn(rank, exchange) on one thread per rank of an in-process group.
template <typename Fn>
void OnEveryRank(int world, Fn fn) {
  std::vector<std::unique_ptr<Exchange>> group = LocalExchangeGroup::Create(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { fn(r, *group[r]); });
  for (std::thread& t : threads) t.join();
}

TEST(GroupStep, AllSucceedReturnsPayloadsInRankOrder) {
  std::vector<std::vector<std::string>> got(3);
  OnEveryRank(3, [&](int r, Exchange& ex) {
    auto all = AllgatherStep(ex, "step", absl::StatusOr<std::string>("p" + std::to_string(r)),
                             "test step", absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(all.ok()) << all.status();
    got[r] = *all;
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(got[r], (std::vector<std::string>{"p0", "p1", "p2"}));
}

TEST(GroupStep, OneRankFailingFailsEveryRankWithItsReasonAndCode) {
  std::vector<absl::Status> got(3);
  OnEveryRank(3, [&](int r, Exchange& ex) {
    absl::StatusOr<std::string> local = std::string("ok");
    if (r == 1) local = absl::ResourceExhaustedError("cudaMalloc of 96 MiB failed");
    got[r] =
        AllgatherStep(ex, "alloc", local, "workspace allocation", absl::Now() + absl::Seconds(10))
            .status();
  });
  // The failing rank gets its own error; the others get its code and reason, naming it.
  EXPECT_EQ(got[1].code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(got[1].message(), "cudaMalloc of 96 MiB failed");
  for (int r : {0, 2}) {
    EXPECT_EQ(got[r].code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(got[r].message().find("workspace allocation: rank 1: cudaMalloc of 96 MiB failed"),
              absl::string_view::npos)
        << got[r].message();
  }
}

TEST(GroupStep, StatusStepWithEmptyPayloads) {
  std::vector<absl::Status> got(2);
  OnEveryRank(2, [&](int r, Exchange& ex) {
    got[r] = StatusStep(ex, "init", absl::OkStatus(), "init", absl::Now() + absl::Seconds(10));
  });
  EXPECT_TRUE(got[0].ok()) << got[0];
  EXPECT_TRUE(got[1].ok()) << got[1];
  OnEveryRank(2, [&](int r, Exchange& ex) {
    got[r] = StatusStep(ex, "init",
                        r == 0 ? absl::FailedPreconditionError("no FABRIC") : absl::OkStatus(),
                        "handle export", absl::Now() + absl::Seconds(10));
  });
  EXPECT_EQ(got[1].code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(got[1].message().find("handle export: rank 0: no FABRIC"), absl::string_view::npos);
}

TEST(GroupStep, MissingRankEndsAtTheDeadline) {
  std::vector<std::unique_ptr<Exchange>> group = LocalExchangeGroup::Create(2);
  const absl::Time start = absl::Now();
  absl::Status s = StatusStep(*group[0], "alone", absl::OkStatus(), "lonely step",
                              start + absl::Milliseconds(200));
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(s) || absl::IsUnavailable(s)) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(GroupStep, PrefixedExchangeKeepsGenerationsApart) {
  std::vector<std::string> got(2);
  OnEveryRank(2, [&](int r, Exchange& ex) {
    PrefixedExchange g1(ex, "g1/");
    EXPECT_EQ(g1.rank(), r);
    EXPECT_EQ(g1.world_size(), 2);
    auto a = g1.Allgather("tag", std::to_string(r), absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(a.ok()) << a.status();
    auto v = g1.Vote("vote", r == 0, r == 0 ? "" : "rank says no", absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_FALSE(v->all_yes);
    got[r] = (*a)[0] + (*a)[1];
  });
  EXPECT_EQ(got[0], "01");
  EXPECT_EQ(got[1], "01");
}

}  // namespace
}  // namespace arfuse
