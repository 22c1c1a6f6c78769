// Ranks whose in-stream decisions differ (docs/instream.md#ranks-that-decide-differently): a rank
// whose client library declines an op that its peers' libraries fuse runs its own path while its
// peers spin in the fused kernel for it, which hangs them (until the spin timeout poisons the
// workspace). The sidecars of a group exchange their ranks' cumulative in-stream counts
// (InStreamDivergenceWatch, divergence_watch.h) and each runs the same pure step below over the
// same gathered snapshots, so every sidecar reports the same ranks.
//
// A rank r diverges by `a` ops in an exchange when, since the common baseline, the rank that
// fused the most (the lead) fused `lag` more ops than r, r declined `excess` more ops than the
// lead, and a = min(lag, excess) > 0: r declined what the lead fused. It is reported when that
// holds in two exchanges in a row, so a count sampled while an op was in flight (one rank
// already counted it, another not yet) is never reported. After a report every rank's snapshot
// becomes the new baseline: one report per divergence, and the next one needs new ops.
//
// Everything here is pure (no clock, no I/O) and takes the snapshots as untrusted bytes: a
// snapshot that does not parse, or a count that went back or jumped beyond
// instream::kMaxOpCounterDelta (a restarted sidecar, garbage), restarts the baseline and reports
// nothing. Counts wrap at 2^64 and are compared modulo 2^64.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/instream/op_counters.h"
#include "server/instream/op_counts.h"

namespace arfuse {

// One rank's cumulative in-stream counts as its sidecar sends them in the exchange.
struct RankDecisions {
  bool valid = false;  // false: the rank's payload did not parse
  uint64_t fused = 0;
  uint64_t declined = 0;
  uint64_t declined_by_reason[instream::kDeclineReasons] = {};
  bool operator==(const RankDecisions& o) const = default;
};

RankDecisions DecisionsOf(const InStreamOpCounts& counts);
// The exchange's payload: "isd1 <fused> <declined> <declined by reason...>" in decimal.
std::string EncodeRankDecisions(const RankDecisions& d);
// valid == false for anything EncodeRankDecisions does not produce (another version, missing or
// extra numbers, a number out of range, reasons that do not sum to `declined` modulo 2^64).
RankDecisions DecodeRankDecisions(std::string_view payload);

struct DivergenceFinding {
  uint32_t rank = 0;       // the rank that declined what its peers fused
  uint64_t ops = 0;        // how many ops, at this exchange
  uint32_t lead_rank = 0;  // the rank that fused the most
  // The rank's decline reasons since the baseline, largest first (at most kTopReasons), as
  // (instream::kDeclineReasonNames entry, count).
  std::vector<std::pair<std::string, uint64_t>> top_reasons;
  bool operator==(const DivergenceFinding& o) const = default;
};
inline constexpr size_t kDivergenceTopReasons = 3;

// "other 3, dtype 1" (empty when there are none).
std::string DivergenceReasonsText(const DivergenceFinding& f);

struct DivergenceState {
  bool based = false;               // `base` holds the common baseline
  std::vector<RankDecisions> base;  // by rank
  std::vector<uint64_t> candidate;  // by rank: the divergence seen at the previous exchange
  bool operator==(const DivergenceState& o) const = default;
};

struct DivergenceStep {
  DivergenceState next;
  std::vector<DivergenceFinding> findings;  // in rank order
};

// The state a watch starts from: every rank's counts at zero, as a sidecar's are when it starts,
// so a divergence that happened before the first exchange completed (the op that hung and made
// the group re-form, say) is still seen. A rank whose sidecar started later than its peers' only
// ever trails them, so it is never taken for a diverging one.
DivergenceState ZeroBaseline(size_t ranks);

// One exchange: `now` is every rank's snapshot, indexed by rank, as the exchange gathered it.
DivergenceStep ObserveDecisions(const DivergenceState& prev, const std::vector<RankDecisions>& now);

}  // namespace arfuse
