// The ranks' comparison of their in-stream decisions (server/instream/divergence.h and
// divergence_watch.h): the pure step over gathered snapshots, the payload's parsing of untrusted
// bytes, and the watch over an in-process exchange of two ranks.
#include "server/instream/divergence.h"

#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/instream/divergence_watch.h"
#include "server/peers/local_exchange.h"

namespace arfuse {
namespace {

using instream::DeclineReason;

constexpr uint32_t R(DeclineReason r) { return static_cast<uint32_t>(r); }

RankDecisions Snap(uint64_t fused, std::vector<std::pair<DeclineReason, uint64_t>> declined = {}) {
  RankDecisions d;
  d.valid = true;
  d.fused = fused;
  for (const auto& [reason, n] : declined) {
    d.declined_by_reason[R(reason)] += n;
    d.declined += n;
  }
  return d;
}

// Runs the step over a sequence of exchanges; returns every exchange's findings.
std::vector<std::vector<DivergenceFinding>> ObserveAll(
    const std::vector<std::vector<RankDecisions>>& exchanges, DivergenceState* state = nullptr) {
  DivergenceState s;
  std::vector<std::vector<DivergenceFinding>> out;
  for (const auto& now : exchanges) {
    DivergenceStep step = ObserveDecisions(s, now);
    s = step.next;
    out.push_back(step.findings);
  }
  if (state != nullptr) *state = s;
  return out;
}

TEST(DivergencePayload, RoundTrips) {
  RankDecisions d = Snap(12345, {{DeclineReason::kOther, 7}, {DeclineReason::kDtype, 2}});
  EXPECT_EQ(DecodeRankDecisions(EncodeRankDecisions(d)), d);
  const RankDecisions max = Snap(std::numeric_limits<uint64_t>::max(),
                                 {{DeclineReason::kShape, std::numeric_limits<uint64_t>::max()}});
  EXPECT_EQ(DecodeRankDecisions(EncodeRankDecisions(max)), max);
  EXPECT_EQ(DecodeRankDecisions(EncodeRankDecisions(Snap(0))), Snap(0));
}

TEST(DivergencePayload, GarbageIsInvalid) {
  const std::string good = EncodeRankDecisions(Snap(3, {{DeclineReason::kOther, 1}}));
  EXPECT_TRUE(DecodeRankDecisions(good).valid);
  const std::vector<std::string> bad = {
      "",
      "isd1",
      "isd2" + good.substr(4),                              // another version
      good + " 0",                                          // one number too many
      good.substr(0, good.rfind(' ')),                      // one too few
      "isd1 1 1 1 0 0 0 0 0 0 0 0 0 x",                     // not a number
      "isd1 -1 0 0 0 0 0 0 0 0 0 0 0 0",                    // a sign
      "isd1 01 0 0 0 0 0 0 0 0 0 0 0 0",                    // a leading zero
      "isd1 18446744073709551616 0 0 0 0 0 0 0 0 0 0 0 0",  // 2^64
      "isd1 1 2 1 0 0 0 0 0 0 0 0 0 0",                     // reasons do not sum to declined
      "isd1  1 0 0 0 0 0 0 0 0 0 0 0 0",                    // an empty word
      std::string("isd1 1 0 0 0 0 0 0 0 0 0 0 0 0\0", 31),
  };
  for (const std::string& b : bad) EXPECT_FALSE(DecodeRankDecisions(b).valid) << b;
}

TEST(Divergence, EqualDecisionsReportNothing) {
  const auto found = ObserveAll({
      {Snap(0), Snap(0)},
      {Snap(10, {{DeclineReason::kRange, 2}}), Snap(10, {{DeclineReason::kRange, 2}})},
      {Snap(20, {{DeclineReason::kRange, 4}}), Snap(20, {{DeclineReason::kRange, 4}})},
      {Snap(30, {{DeclineReason::kRange, 9}}), Snap(30, {{DeclineReason::kRange, 9}})},
  });
  for (const auto& f : found) EXPECT_TRUE(f.empty());
}

TEST(Divergence, ADecliningRankIsReportedAfterTwoExchanges) {
  DivergenceState s;
  const auto found = ObserveAll(
      {
          {Snap(5), Snap(5)},                                // the baseline
          {Snap(8), Snap(5, {{DeclineReason::kOther, 3}})},  // seen once
          {Snap(8), Snap(5, {{DeclineReason::kOther, 3}})},  // held: reported
          {Snap(8), Snap(5, {{DeclineReason::kOther, 3}})},  // the new baseline: quiet
          {Snap(9), Snap(9)},                                // in step again
      },
      &s);
  EXPECT_TRUE(found[0].empty());
  EXPECT_TRUE(found[1].empty());
  ASSERT_EQ(found[2].size(), 1u);
  const DivergenceFinding& f = found[2][0];
  EXPECT_EQ(f.rank, 1u);
  EXPECT_EQ(f.ops, 3u);
  EXPECT_EQ(f.lead_rank, 0u);
  ASSERT_EQ(f.top_reasons.size(), 1u);
  EXPECT_EQ(f.top_reasons[0], (std::pair<std::string, uint64_t>{"other", 3}));
  EXPECT_EQ(DivergenceReasonsText(f), "other 3");
  EXPECT_TRUE(found[3].empty());
  EXPECT_TRUE(found[4].empty());
}

TEST(Divergence, AnOpInFlightIsNotReported) {
  // Rank 1 counted an op rank 0 has not counted yet, once; and a lag without declines (a rank
  // whose ops are still in flight) however long.
  const auto found = ObserveAll({
      {Snap(0), Snap(0), Snap(0)},
      {Snap(4, {{DeclineReason::kOther, 1}}), Snap(5), Snap(5)},  // rank 0: one exchange only
      {Snap(6, {{DeclineReason::kOther, 1}}), Snap(5, {{DeclineReason::kOther, 1}}),
       Snap(6, {{DeclineReason::kOther, 1}})},
      {Snap(9, {{DeclineReason::kOther, 1}}), Snap(2 + 5, {{DeclineReason::kOther, 1}}),
       Snap(9, {{DeclineReason::kOther, 1}})},  // rank 1 lags without declining
      {Snap(12, {{DeclineReason::kOther, 1}}), Snap(8, {{DeclineReason::kOther, 1}}),
       Snap(12, {{DeclineReason::kOther, 1}})},
  });
  for (const auto& f : found) EXPECT_TRUE(f.empty());
}

TEST(Divergence, ReportsTheSmallerOfLagAndExcessAndTheTopReasons) {
  const auto found = ObserveAll({
      {Snap(0), Snap(0)},
      {Snap(10), Snap(4, {{DeclineReason::kOther, 2},
                          {DeclineReason::kDtype, 5},
                          {DeclineReason::kShape, 1},
                          {DeclineReason::kRange, 3}})},
      {Snap(10), Snap(4, {{DeclineReason::kOther, 2},
                          {DeclineReason::kDtype, 5},
                          {DeclineReason::kShape, 1},
                          {DeclineReason::kRange, 3}})},
  });
  ASSERT_EQ(found[2].size(), 1u);
  EXPECT_EQ(found[2][0].ops, 6u);  // lag 6, excess 11
  EXPECT_EQ(DivergenceReasonsText(found[2][0]), "dtype 5, range 3, other 2");
}

TEST(Divergence, DeclinesEveryRankMadeAreNotDivergence) {
  // Both declined 4 (the same ops); rank 1 declined 1 more, but nobody fused more than it.
  const auto found = ObserveAll({
      {Snap(0), Snap(0)},
      {Snap(3, {{DeclineReason::kRange, 4}}), Snap(3, {{DeclineReason::kRange, 5}})},
      {Snap(3, {{DeclineReason::kRange, 4}}), Snap(3, {{DeclineReason::kRange, 5}})},
  });
  for (const auto& f : found) EXPECT_TRUE(f.empty());
}

TEST(Divergence, EveryRankAgainstTheLeadInAGroupOfFour) {
  const auto found = ObserveAll({
      {Snap(0), Snap(0), Snap(0), Snap(0)},
      {Snap(7), Snap(7), Snap(5, {{DeclineReason::kMemory, 2}}),
       Snap(6, {{DeclineReason::kOther, 1}})},
      {Snap(7), Snap(7), Snap(5, {{DeclineReason::kMemory, 2}}),
       Snap(6, {{DeclineReason::kOther, 1}})},
  });
  ASSERT_EQ(found[2].size(), 2u);
  EXPECT_EQ(found[2][0].rank, 2u);
  EXPECT_EQ(found[2][0].ops, 2u);
  EXPECT_EQ(found[2][0].lead_rank, 0u);  // the lowest rank of those that fused the most
  EXPECT_EQ(found[2][1].rank, 3u);
  EXPECT_EQ(found[2][1].ops, 1u);
}

TEST(Divergence, CountsThatWrapAt2To64CompareRight) {
  const uint64_t near = std::numeric_limits<uint64_t>::max() - 1;
  RankDecisions r1_base = Snap(near);
  r1_base.declined_by_reason[R(DeclineReason::kOther)] = near;
  r1_base.declined = near;
  RankDecisions r1_now = Snap(near);
  r1_now.declined_by_reason[R(DeclineReason::kOther)] = near + 4;  // wraps to 2
  r1_now.declined = near + 4;
  const auto found = ObserveAll({
      {Snap(near), r1_base},
      {Snap(near + 4), r1_now},  // rank 0's fused wraps too
      {Snap(near + 4), r1_now},
  });
  EXPECT_TRUE(found[1].empty());
  ASSERT_EQ(found[2].size(), 1u);
  EXPECT_EQ(found[2][0].rank, 1u);
  EXPECT_EQ(found[2][0].ops, 4u);
}

TEST(Divergence, GarbageOrACountThatWentBackRestartsTheBaseline) {
  RankDecisions garbage;  // valid == false: a payload that did not parse
  DivergenceState s;
  const auto found = ObserveAll(
      {
          {Snap(0), Snap(0)},
          {Snap(5), Snap(2, {{DeclineReason::kOther, 3}})},
          {Snap(5), garbage},                                // nothing compared, baseline dropped
          {Snap(5), Snap(2, {{DeclineReason::kOther, 3}})},  // the new baseline
          {Snap(5), Snap(2, {{DeclineReason::kOther, 3}})},
      },
      &s);
  for (const auto& f : found) EXPECT_TRUE(f.empty());
  EXPECT_TRUE(s.based);

  // A restarted peer's counts start again from 0: a rebase, not a lag of 100.
  const auto restarted = ObserveAll({
      {Snap(100), Snap(100)},
      {Snap(100), Snap(0, {{DeclineReason::kOther, 1}})},
      {Snap(100), Snap(0, {{DeclineReason::kOther, 1}})},
  });
  for (const auto& f : restarted) EXPECT_TRUE(f.empty());

  // A jump beyond kMaxOpCounterDelta is garbage too.
  const auto jumped = ObserveAll({
      {Snap(0), Snap(0)},
      {Snap(instream::kMaxOpCounterDelta + 1), Snap(0, {{DeclineReason::kOther, 5}})},
      {Snap(instream::kMaxOpCounterDelta + 1), Snap(0, {{DeclineReason::kOther, 5}})},
  });
  for (const auto& f : jumped) EXPECT_TRUE(f.empty());
}

TEST(Divergence, OneRankOrAChangedGroupSizeComparesNothing) {
  DivergenceStep one = ObserveDecisions({}, {Snap(5)});
  EXPECT_FALSE(one.next.based);
  EXPECT_TRUE(one.findings.empty());
  DivergenceState s;
  const auto found = ObserveAll(
      {
          {Snap(0), Snap(0)},
          {Snap(5), Snap(2, {{DeclineReason::kOther, 3}})},
          {Snap(5), Snap(2, {{DeclineReason::kOther, 3}}), Snap(5)},  // a third rank: rebase
          {Snap(5), Snap(2, {{DeclineReason::kOther, 3}}), Snap(5)},
      },
      &s);
  for (const auto& f : found) EXPECT_TRUE(f.empty());
  EXPECT_EQ(s.base.size(), 3u);
}

TEST(Divergence, AStateOfAnotherShapeIsRebased) {
  DivergenceState bad;
  bad.based = true;
  bad.base = {Snap(0), Snap(0)};
  bad.candidate = {1};  // shorter than base
  DivergenceStep step = ObserveDecisions(bad, {Snap(5), Snap(0, {{DeclineReason::kOther, 5}})});
  EXPECT_TRUE(step.findings.empty());
  EXPECT_EQ(step.next.candidate.size(), 2u);
}

// Two watches over an in-process exchange, one per rank, each ticking on its own thread as the
// supervisors do.
TEST(DivergenceWatch, EveryRankReportsTheDecliningRankOnce) {
  std::vector<std::unique_ptr<Exchange>> ex = LocalExchangeGroup::Create(2);
  InStreamAttachments::Probe probe = [] { return InStreamProbe{}; };
  InStreamAttachments::Notify notify = [](uint64_t, const AttachEventData&) {};
  InStreamAttachments a0(notify, probe), a1(notify, probe);
  std::vector<InStreamAttachments*> tables = {&a0, &a1};
  std::mutex mu;
  std::vector<std::vector<DivergenceFinding>> seen(2);
  // The watches read the counts through the tables: fake pages are not needed, the test feeds
  // the snapshots through the exchange by wrapping the payload.
  std::vector<RankDecisions> offered = {Snap(6), Snap(2, {{DeclineReason::kOther, 4}})};
  std::vector<std::unique_ptr<InStreamDivergenceWatch>> watches;
  for (int r = 0; r < 2; ++r) {
    watches.push_back(std::make_unique<InStreamDivergenceWatch>(
        2, tables[r],
        [&, r](const std::string& own, absl::Time deadline) {
          // The table's own counts are zero: the first exchange offers them (the baseline), the
          // later ones what the test decided this rank counted.
          EXPECT_TRUE(DecodeRankDecisions(own).valid);
          static thread_local int calls = 0;
          const std::string payload = calls++ == 0 ? own : EncodeRankDecisions(offered[r]);
          return ex[r]->Allgather("instream-decisions", payload, deadline);
        },
        [&, r](const DivergenceFinding& f) {
          std::lock_guard<std::mutex> lock(mu);
          seen[r].push_back(f);
        },
        absl::Seconds(10)));
  }
  // Ticks at the schedule's times (each is due), so the test does not wait for it.
  const absl::Time t0 = absl::Now();
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      for (int i = 0; i < 4; ++i) watches[r]->Tick(t0 + i * absl::Seconds(10));
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(seen[r].size(), 1u) << "rank " << r;
    EXPECT_EQ(seen[r][0].rank, 1u);
    EXPECT_EQ(seen[r][0].ops, 4u);
    const InStreamAttachments::DivergenceRecord rec = tables[r]->divergence();
    EXPECT_EQ(rec.total, 1u);
    EXPECT_EQ(rec.last_rank, 1u);
    EXPECT_EQ(rec.last_ops, 4u);
    EXPECT_EQ(rec.last_reasons, "other 4");
  }
}

TEST(DivergenceWatch, AFailedExchangeIsSkippedAndOneRankExchangesNothing) {
  int calls = 0;
  InStreamDivergenceWatch failing(
      2, nullptr,
      [&](const std::string&, absl::Time) -> absl::StatusOr<std::vector<std::string>> {
        ++calls;
        return absl::DeadlineExceededError("rank 1 did not arrive");
      },
      [](const DivergenceFinding&) { ADD_FAILURE() << "nothing to report"; }, absl::Seconds(1));
  const absl::Time t0 = absl::Now();
  EXPECT_TRUE(failing.Tick(t0).empty());
  EXPECT_TRUE(failing.Tick(t0 + absl::Milliseconds(500)).empty());  // not due yet
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(failing.Tick(t0 + absl::Seconds(1)).empty());
  EXPECT_EQ(calls, 2);

  InStreamDivergenceWatch alone(
      1, nullptr,
      [&](const std::string&, absl::Time) -> absl::StatusOr<std::vector<std::string>> {
        ADD_FAILURE() << "a group of one exchanges nothing";
        return std::vector<std::string>{};
      },
      nullptr);
  EXPECT_TRUE(alone.Tick(absl::Now()).empty());
}

TEST(DivergenceWatch, GarbageFromAPeerReportsNothing) {
  int call = 0;
  InStreamDivergenceWatch w(
      2, nullptr,
      [&](const std::string& own, absl::Time) -> absl::StatusOr<std::vector<std::string>> {
        ++call;
        return std::vector<std::string>{own, call % 2 ? "isd1 garbage" : std::string(500, '9')};
      },
      [](const DivergenceFinding&) { ADD_FAILURE() << "garbage is not a divergence"; },
      absl::Milliseconds(1));
  absl::Time t = absl::Now();
  for (int i = 0; i < 6; ++i) {
    EXPECT_TRUE(w.Tick(t).empty());
    t += absl::Milliseconds(1);
  }
  EXPECT_EQ(call, 6);
}

}  // namespace
}  // namespace arfuse
