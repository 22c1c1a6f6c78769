// The unfused path's op agreement. An NCCL collective has no deadline and no check that the
// ranks run the same op: a rank that enqueues an allreduce its peers never run (their client died
// mid-step, or two racing client pairs paired ops of different shapes) leaves a kernel waiting
// forever, which not even ncclCommAbort frees (docs/reliability.md). So before the engine
// enqueues an unfused op, the ranks' sidecars agree on it over the peer channel, in two steps:
//   1. every rank publishes the op's key (allgather); all equal, or every rank refuses alike;
//   2. every rank confirms (barrier) right before it enqueues.
// A rank waits in step 1 for as long as its peers' clients take, and may die or freeze there
// after publishing its key (the coordinator may complete step 1 with it before it learns that);
// step 2 only passes once every rank is alive after step 1, so what is left is the few
// microseconds between a rank's confirmation and its enqueue. The coordinator completes or fails
// each step for all ranks at once (server/peers/coordinator.h): every rank enqueues or none does.
// CUDA-free: unit-tested in CI.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/common/op_types.h"

namespace arfuse {

class Exchange;

// What must be equal on every rank for one NCCL allreduce (and the add-RMSNorm after it) to be
// one op. eps is compared bit for bit.
struct UnfusedOpKey {
  uint32_t num_tokens = 0;
  uint32_t hidden = 0;
  DType dtype = DType::kBF16;
  Pattern pattern = Pattern::kAllReduce;
  float eps = 0.0f;
  bool symmetric = false;  // through the symmetric-window communicator
  // kAllReduceResidualRmsNormFp8PerGroup: the fp8::GroupScaleLayout of its scales (0 for every
  // other pattern). NCCL would pair the sums regardless, but two ranks writing their scales in
  // other layouts serve two different requests.
  uint8_t scale_layout = 0;
};

// "tokens=4 hidden=4096 dtype=bf16 pattern=allreduce eps=1e-06 nccl=regular", with
// " scale_layout=3" after the pattern for the per-group FP8 pattern.
std::string DescribeUnfusedOp(const UnfusedOpKey& key);

// The fixed-size encoding the ranks exchange (also what a test stands in with).
std::string EncodeUnfusedOp(const UnfusedOpKey& key);

// The exchange tag of the agreement for the engine generation `generation`: every op of one
// generation uses it (the k-th call meets the k-th call), a new generation starts afresh.
std::string UnfusedOpTag(uint64_t generation);

struct AgreementDeadlines {
  absl::Time arrive_by = absl::InfiniteFuture();     // step 1: every rank reached the op
  absl::Duration confirm_within = absl::Seconds(5);  // step 2, counted from the end of step 1
  absl::Time latest = absl::InfiniteFuture();        // neither step waits past this
};

// Collective over `exchange` under UnfusedOpTag(generation). OK: every rank published `mine` and
// confirmed it; enqueue now. INVALID_ARGUMENT naming the first rank whose op differs, with both
// ops (every rank sees the same payloads, so every rank refuses and nobody confirms). A failed
// exchange (DEADLINE_EXCEEDED: a rank did not reach or confirm the op in time; UNAVAILABLE: a
// peer is gone; ABORTED: the step already failed on the other ranks) keeps its code, its message
// saying which step failed; no rank enqueues.
absl::Status AgreeOnUnfusedOp(Exchange& exchange, uint64_t generation, const UnfusedOpKey& mine,
                              const AgreementDeadlines& deadlines);

}  // namespace arfuse
