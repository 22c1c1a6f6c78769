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

// The gossip board rank 0 echoes: every rank's latest payload, index = rank. Rank r's offer
// writes what the test decided rank r counted in the current round (the watch's own table is
// empty, so its payload is zeros: the test checks it is well formed and replaces it).
struct Board {
  std::vector<std::vector<RankDecisions>> rounds;
  size_t round = 0;
  std::vector<std::string> latest;
  InStreamDivergenceWatch::Offer OfferOf(int rank) {
    return [this, rank](std::string own) {
      EXPECT_TRUE(DecodeRankDecisions(own).valid);
      latest[rank] = EncodeRankDecisions(rounds[round][rank]);
    };
  }
  InStreamDivergenceWatch::Gathered Gathered() {
    return [this] { return latest; };
  }
};

// Two watches, one per rank, over one board: the first table is the baseline, rank 1 then
// declines 4 ops rank 0 fused and stays behind by them; every rank reports it once.
TEST(DivergenceWatch, EveryRankReportsTheDecliningRankOnce) {
  InStreamAttachments::Probe probe = [] { return InStreamProbe{}; };
  InStreamAttachments::Notify notify = [](uint64_t, const AttachEventData&) {};
  InStreamAttachments a0(notify, probe), a1(notify, probe);
  std::vector<InStreamAttachments*> tables = {&a0, &a1};
  std::vector<std::vector<DivergenceFinding>> seen(2);
  Board board;
  board.rounds = {
      {Snap(0), Snap(0)},
      {Snap(6), Snap(2, {{DeclineReason::kOther, 4}})},
      {Snap(7), Snap(3, {{DeclineReason::kOther, 4}})},
      {Snap(8), Snap(4, {{DeclineReason::kOther, 4}})},
  };
  board.latest = {"", ""};
  std::vector<std::unique_ptr<InStreamDivergenceWatch>> watches;
  for (int r = 0; r < 2; ++r) {
    watches.push_back(std::make_unique<InStreamDivergenceWatch>(
        2, tables[r], board.OfferOf(r), board.Gathered(),
        [&, r](const DivergenceFinding& f) { seen[r].push_back(f); }, absl::Seconds(10)));
  }
  const absl::Time t0 = absl::Now();
  for (board.round = 0; board.round < board.rounds.size(); ++board.round) {
    // Both ranks' gossip of this round is on the board before either reads it (a heartbeat
    // later than the other's is the next test's case).
    for (int r = 0; r < 2; ++r) board.OfferOf(r)(EncodeRankDecisions(Snap(0)));
    for (int r = 0; r < 2; ++r) {
      watches[r]->Tick(t0 + static_cast<int>(board.round) * absl::Seconds(10));
    }
  }
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

// A rank whose counts reach the board late (an older snapshot of a rank deciding alike: fewer
// fused, no more declined) is never a divergence, however often the table is read; a rank not
// heard from yet (an empty payload) is waited for and does not restart the baseline.
TEST(DivergenceWatch, ALateRankIsNoDivergenceAndAMissingOneIsWaitedFor) {
  std::vector<DivergenceFinding> seen;
  Board board;
  InStreamDivergenceWatch w(
      2, nullptr, [](std::string) {}, board.Gathered(),
      [&](const DivergenceFinding& f) { seen.push_back(f); }, absl::Milliseconds(1));
  absl::Time t = absl::Now();
  auto tick = [&] {
    t += absl::Milliseconds(1);
    return w.Tick(t);
  };
  const std::vector<std::pair<uint64_t, uint64_t>> steps = {{0, 0}, {100, 3}, {200, 6}, {300, 9}};
  for (size_t i = 0; i + 1 < steps.size(); ++i) {
    board.latest = {
        EncodeRankDecisions(
            Snap(steps[i + 1].first, {{DeclineReason::kRange, steps[i + 1].second}})),
        EncodeRankDecisions(Snap(steps[i].first, {{DeclineReason::kRange, steps[i].second}}))};
    for (int k = 0; k < 3; ++k) EXPECT_TRUE(tick().empty());
  }
  EXPECT_TRUE(seen.empty());

  // Rank 1 declines 4 ops rank 0 fused (seen once), then the group re-forms and rank 1 is not
  // heard from for a while: those ticks observe nothing, and the divergence is reported once
  // its counts are back, against the baseline from before.
  InStreamDivergenceWatch across(
      2, nullptr, [](std::string) {}, board.Gathered(),
      [&](const DivergenceFinding& f) { seen.push_back(f); }, absl::Milliseconds(1));
  board.latest = {EncodeRankDecisions(Snap(10)), EncodeRankDecisions(Snap(10))};
  t += absl::Milliseconds(1);
  EXPECT_TRUE(across.Tick(t).empty());  // the baseline
  const std::string diverged = EncodeRankDecisions(Snap(12, {{DeclineReason::kShape, 4}}));
  board.latest = {EncodeRankDecisions(Snap(16)), diverged};
  t += absl::Milliseconds(1);
  EXPECT_TRUE(across.Tick(t).empty());  // seen once
  board.latest = {EncodeRankDecisions(Snap(16)), ""};
  for (int k = 0; k < 3; ++k) {
    t += absl::Milliseconds(1);
    EXPECT_TRUE(across.Tick(t).empty());
  }
  board.latest = {EncodeRankDecisions(Snap(16)), diverged};
  t += absl::Milliseconds(1);
  const std::vector<DivergenceFinding> found = across.Tick(t);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].rank, 1u);
  EXPECT_EQ(found[0].ops, 4u);
  ASSERT_EQ(seen.size(), 1u);
}

// The ops that hung the group happened before any table was complete (the group re-formed
// because of them): measured from the sidecars' start, where every count is zero, they are still
// reported, once.
TEST(DivergenceWatch, ADivergenceBeforeTheFirstTableIsReported) {
  std::vector<DivergenceFinding> seen;
  Board board;
  board.latest = {EncodeRankDecisions(Snap(1)),
                  EncodeRankDecisions(Snap(0, {{DeclineReason::kOther, 1}}))};
  InStreamDivergenceWatch w(
      2, nullptr, [](std::string) {}, board.Gathered(),
      [&](const DivergenceFinding& f) { seen.push_back(f); }, absl::Milliseconds(1));
  absl::Time t = absl::Now();
  for (int k = 0; k < 5; ++k) {
    t += absl::Milliseconds(1);
    w.Tick(t);
  }
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].rank, 1u);
  EXPECT_EQ(seen[0].ops, 1u);
  EXPECT_EQ(seen[0].lead_rank, 0u);
  EXPECT_EQ(ZeroBaseline(3).base.size(), 3u);
  EXPECT_TRUE(ZeroBaseline(3).based);
}

TEST(DivergenceWatch, NoTableYetOrOneRankExchangesNothing) {
  int gathered = 0;
  InStreamDivergenceWatch waiting(
      2, nullptr, [](std::string) {},
      [&] {
        ++gathered;
        return std::vector<std::string>{};  // no echo yet
      },
      [](const DivergenceFinding&) { ADD_FAILURE() << "nothing to report"; }, absl::Seconds(1));
  const absl::Time t0 = absl::Now();
  EXPECT_TRUE(waiting.Tick(t0).empty());
  EXPECT_TRUE(waiting.Tick(t0 + absl::Milliseconds(500)).empty());  // not due yet
  EXPECT_EQ(gathered, 1);
  EXPECT_TRUE(waiting.Tick(t0 + absl::Seconds(1)).empty());
  EXPECT_EQ(gathered, 2);

  InStreamDivergenceWatch alone(
      1, nullptr, [](std::string) { ADD_FAILURE() << "a group of one offers nothing"; },
      [] {
        ADD_FAILURE() << "a group of one reads nothing";
        return std::vector<std::string>{};
      },
      nullptr);
  EXPECT_TRUE(alone.Tick(absl::Now()).empty());
}

TEST(DivergenceWatch, GarbageOrATableOfAnotherSizeReportsNothing) {
  int call = 0;
  InStreamDivergenceWatch w(
      2, nullptr, [](std::string) {},
      [&] {
        ++call;
        switch (call % 3) {
          case 0:
            return std::vector<std::string>{EncodeRankDecisions(Snap(call)), "isd1 garbage"};
          case 1:
            return std::vector<std::string>{EncodeRankDecisions(Snap(call)), std::string(500, '9')};
          default:
            return std::vector<std::string>{EncodeRankDecisions(Snap(call))};  // one rank
        }
      },
      [](const DivergenceFinding&) { ADD_FAILURE() << "garbage is not a divergence"; },
      absl::Milliseconds(1));
  absl::Time t = absl::Now();
  for (int i = 0; i < 9; ++i) {
    EXPECT_TRUE(w.Tick(t).empty());
    t += absl::Milliseconds(1);
  }
  EXPECT_EQ(call, 9);
}

}  // namespace
}  // namespace arfuse
