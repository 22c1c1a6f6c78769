// In-process tests of the coordinator's rules through LocalExchangeGroup (one thread per rank)
// and through the Coordinator API directly (join validation, epochs).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <functional>
#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/peers/coordinator.h"
#include "server/peers/local_exchange.h"

namespace arfuse {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Runs fn(rank) on one thread per rank and joins them.
void OnRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

absl::Time Soon(int seconds = 30) { return absl::Now() + absl::Seconds(seconds); }

TEST(LocalExchange, AllgatherReturnsPayloadsInRankOrder) {
  auto ex = LocalExchangeGroup::Create(4);
  std::vector<std::vector<std::string>> got(4);
  OnRanks(4, [&](int r) {
    auto all = ex[r]->Allgather("ids", absl::StrCat("p", r), Soon());
    ASSERT_TRUE(all.ok()) << all.status();
    got[r] = *all;
  });
  for (int r = 0; r < 4; ++r) EXPECT_THAT(got[r], ElementsAre("p0", "p1", "p2", "p3"));
}

TEST(LocalExchange, VoteIsAndWithReasonsOfNoVotersInRankOrder) {
  auto ex = LocalExchangeGroup::Create(4);
  std::vector<VoteResult> got(4);
  OnRanks(4, [&](int r) {
    bool yes = r == 0 || r == 2;
    auto v = ex[r]->Vote("fuse", yes, r == 1 ? "no mnnvl" : "", Soon());
    ASSERT_TRUE(v.ok()) << v.status();
    got[r] = *v;
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_FALSE(got[r].all_yes);
    EXPECT_THAT(got[r].reasons, ElementsAre("rank 1: no mnnvl", "rank 3: (no reason given)"));
  }
  // One byte per rank: std::vector<bool> packs the ranks' flags into one word, and four
  // threads writing their bits race (TSan).
  std::vector<char> all_yes(4, 0);
  OnRanks(4, [&](int r) {
    auto v = ex[r]->Vote("fuse", true, "", Soon());
    ASSERT_TRUE(v.ok());
    all_yes[r] = v->all_yes && v->reasons.empty();
  });
  EXPECT_THAT(all_yes, ElementsAre(1, 1, 1, 1));
}

TEST(LocalExchange, ReusedTagMatchesCallByCall) {
  auto ex = LocalExchangeGroup::Create(2);
  std::vector<std::vector<std::string>> seen(2);
  OnRanks(2, [&](int r) {
    for (int i = 0; i < 50; ++i) {
      auto all = ex[r]->Allgather("step", absl::StrCat(r, ":", i), Soon());
      ASSERT_TRUE(all.ok()) << all.status();
      seen[r].push_back((*all)[0] + "," + (*all)[1]);
    }
  });
  ASSERT_EQ(seen[0].size(), 50u);
  EXPECT_EQ(seen[0], seen[1]);
  EXPECT_EQ(seen[0][37], "0:37,1:37");
}

TEST(LocalExchange, MissingRankTimesOutNamingItAndLateArrivalFailsAtOnce) {
  auto ex = LocalExchangeGroup::Create(4);
  std::vector<absl::Status> st(3);
  OnRanks(3, [&](int r) { st[r] = ex[r]->Barrier("sync", absl::Now() + absl::Milliseconds(300)); });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(st[r].code(), absl::StatusCode::kDeadlineExceeded) << st[r];
    EXPECT_THAT(st[r].message(), HasSubstr("ranks 3 did not arrive (arrived: 0, 1, 2)"));
  }
  absl::Time t0 = absl::Now();
  absl::Status late = ex[3]->Barrier("sync", Soon());
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
  EXPECT_EQ(late.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(late.message(), HasSubstr("already failed"));
  // The group still works for the next collective.
  OnRanks(4, [&](int r) { EXPECT_TRUE(ex[r]->Barrier("again", Soon()).ok()); });
}

TEST(LocalExchange, KindMismatchFailsEveryRank) {
  auto ex = LocalExchangeGroup::Create(2);
  std::vector<absl::Status> st(2);
  OnRanks(2, [&](int r) {
    st[r] = r == 0 ? ex[0]->Barrier("x", Soon())
                   : ex[1]->Vote("x", true, "", Soon()).status();
  });
  for (auto& s : st) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("but other ranks called"));
  }
}

TEST(LocalExchange, DestroyedRankFailsPendingAndLaterCollectivesWithUnavailable) {
  auto ex = LocalExchangeGroup::Create(3);
  absl::Status pending;
  std::thread waiter([&] { pending = ex[0]->Barrier("b", Soon(60)); });
  // Whether rank 2 goes before or after ranks 0 and 1 arrive, both must fail naming it.
  std::thread waiter1([&] { (void)ex[1]->Barrier("b", Soon(60)); });
  ex[2].reset();  // rank 2 goes away
  waiter.join();
  waiter1.join();
  EXPECT_EQ(pending.code(), absl::StatusCode::kUnavailable) << pending;
  EXPECT_THAT(pending.message(), HasSubstr("rank 2"));
  absl::Status later = ex[0]->Barrier("c", Soon());
  EXPECT_EQ(later.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(later.message(), HasSubstr("rank 2 of group 'local' went away"));
}

TEST(LocalExchange, AllgatherFdHandsEveryRankEveryDescriptor) {
  auto ex = LocalExchangeGroup::Create(2);
  std::vector<std::vector<std::string>> got(2);
  OnRanks(2, [&](int r) {
    int fd = ::memfd_create("t", MFD_CLOEXEC);
    std::string c = absl::StrCat("rank", r);
    ASSERT_EQ(::write(fd, c.data(), c.size()), static_cast<ssize_t>(c.size()));
    auto fds = ex[r]->AllgatherFd("fd", fd, Soon());
    ::close(fd);
    ASSERT_TRUE(fds.ok()) << fds.status();
    for (int f : *fds) {
      char buf[16] = {};
      ASSERT_GT(::pread(f, buf, sizeof(buf), 0), 0);
      got[r].push_back(buf);
      ::close(f);
    }
  });
  EXPECT_THAT(got[0], ElementsAre("rank0", "rank1"));
  EXPECT_THAT(got[1], ElementsAre("rank0", "rank1"));
  auto bad = ex[0]->AllgatherFd("bad", -1, Soon());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("open descriptor"));
}

// ---- Coordinator rules, driven directly ----

peers::MemberInfo Member(int rank, int world, const std::string& group = "g", int nnodes = 1) {
  peers::MemberInfo m;
  m.rank = rank;
  m.world_size = world;
  m.nnodes = nnodes;
  m.group = group;
  return m;
}

absl::Status JoinNow(peers::Coordinator& c, uint64_t participant, const peers::MemberInfo& m,
                     absl::Time deadline = absl::InfiniteFuture()) {
  // Shared, not on this frame: a join that waits is answered later, when the group forms
  // (after this function returned).
  auto out = std::make_shared<std::optional<absl::Status>>();
  c.Join(participant, m, deadline, [out](peers::JoinResult r) { *out = r.status; });
  return out->value_or(absl::OkStatus());  // no answer yet = waiting for the others
}

TEST(Coordinator, RefusesJoinsThatDoNotFitTheGroup) {
  peers::Coordinator c("g", 2, 1);
  absl::Status s = JoinNow(c, 1, Member(0, 2, "other"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("asked to join group 'other'"));
  s = JoinNow(c, 1, Member(0, 4));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("world_size 4 but group 'g' has world_size 2"));
  s = JoinNow(c, 1, Member(0, 2, "g", 2));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("nnodes 2"));
  s = JoinNow(c, 1, Member(5, 2));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("rank 5 is out of range"));
  EXPECT_TRUE(JoinNow(c, 1, Member(0, 2)).ok());
  s = JoinNow(c, 2, Member(0, 2));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("rank 0 has already joined"));
}

TEST(Coordinator, JoinDeadlineNamesMissingRanks) {
  peers::Coordinator c("g", 3, 1);
  std::optional<absl::Status> out;
  c.Join(7, Member(1, 3), absl::Now() + absl::Milliseconds(5),
         [&](peers::JoinResult r) { out = r.status; });
  EXPECT_FALSE(out.has_value());
  c.Expire(absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(out->message(), HasSubstr("ranks 0, 2 did not join before the deadline (joined: 1)"));
}

TEST(Coordinator, StaleEpochAndUnformedGroupAreRefused) {
  peers::Coordinator c("g", 2, 1);
  auto contribute = [&](uint64_t epoch) {
    std::optional<absl::Status> out;
    peers::Contribution k;
    k.kind = peers::CollectiveKind::kBarrier;
    k.tag = "t";
    k.epoch = epoch;
    k.rank = 0;
    c.Contribute(0, std::move(k), [&](peers::CollectiveResult r) { out = r.status; });
    return out;
  };
  auto early = contribute(c.epoch());
  ASSERT_TRUE(early.has_value());
  EXPECT_EQ(early->code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(early->message(), HasSubstr("has not formed yet"));
  ASSERT_TRUE(JoinNow(c, 1, Member(0, 2)).ok());
  ASSERT_TRUE(JoinNow(c, 2, Member(1, 2)).ok());
  ASSERT_TRUE(c.formed());
  auto stale = contribute(c.epoch() + 1);
  ASSERT_TRUE(stale.has_value());
  EXPECT_EQ(stale->code(), absl::StatusCode::kAborted);
  EXPECT_THAT(stale->message(), HasSubstr("stale epoch"));
  // Neither the epoch sent nor the group's is told back (docs/security.md: a client must never
  // learn one).
  EXPECT_THAT(std::string(stale->message()),
              ::testing::Not(HasSubstr(std::to_string(c.epoch()))));
  EXPECT_THAT(std::string(stale->message()),
              ::testing::Not(HasSubstr(std::to_string(c.epoch() + 1))));
  peers::Coordinator other("g", 2, 1);
  EXPECT_NE(other.epoch(), c.epoch());
  // A rank that goes away breaks the group; joins are then refused as retryable (ABORTED).
  c.ParticipantGone(2, "connection closed");
  EXPECT_EQ(c.broken().code(), absl::StatusCode::kUnavailable);
  absl::Status rejoin = JoinNow(c, 3, Member(1, 2));
  EXPECT_EQ(rejoin.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(rejoin.message(), HasSubstr("is broken"));
  EXPECT_THAT(std::string(rejoin.message()),
              ::testing::Not(HasSubstr(std::to_string(c.epoch()))));
}

}  // namespace
}  // namespace arfuse
