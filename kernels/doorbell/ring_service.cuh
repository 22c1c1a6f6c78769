// Taking a ring and completing it: the device steps that the sidecar's waiter kernel
// (doorbell_waiter.cu) and its serving launch (doorbell_sidecar.cu) share, so that a ring is taken,
// recorded and completed the same way whichever of them serves it. CUDA only, internal to
// kernels/doorbell. docs/doorbell.md has the protocol and the memory-ordering argument.
#pragma once

#include <cstdint>

#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/doorbell/doorbell.h"
#include "kernels/doorbell/doorbell_device.cuh"

namespace arfuse {
namespace ring_service {

using namespace ::arfuse::doorbell_device;  // NOLINT(build/namespaces): the memory-model helpers

// Every kWaitPollsPerClock polls the waiter reads the clock; the control words, abort words and
// the deadline are looked at when kWaitCheckNs passed since the last look. The control words are
// host-mapped (a PCIe read of about a microsecond): looking at them every poll would make a ring
// that lands during the read wait for it.
constexpr uint32_t kWaitPollsPerClock = 16;
constexpr uint64_t kWaitCheckNs = 10'000;

// Lane 0 only. Returns the DoorbellOutcome that ends the wait, or 0 to keep polling.
// Every word is loaded before any is looked at: the host-mapped ones cost a PCIe round trip
// each, and loads behind a branch on the previous one would take one round trip apiece (about
// 1 us each; the polling warp sees no ring meanwhile).
__device__ inline uint32_t WaiterCheck(const DoorbellWaitParams& w, uint64_t start, uint64_t now) {
  const uint32_t stop = LoadRelaxedSys(&w.control->stop);
  const uint32_t generation = LoadRelaxedSys(&w.control->generation);
  const uint32_t workspace_abort =
      w.workspace_abort != nullptr ? LoadRelaxedSys(w.workspace_abort) : 0u;
  const uint32_t host_abort = w.host_abort != nullptr ? LoadRelaxedSys(w.host_abort) : 0u;
  if (stop != 0) return static_cast<uint32_t>(DoorbellOutcome::kStopped);
  if (generation != w.generation) return static_cast<uint32_t>(DoorbellOutcome::kKicked);
  if (workspace_abort != 0 || host_abort != 0) {
    return static_cast<uint32_t>(DoorbellOutcome::kAborted);
  }
  if (now - start > w.idle_timeout_ns) return static_cast<uint32_t>(DoorbellOutcome::kIdle);
  return 0;
}

// What one poll for a ring ended with: the slot taken (served >= 0) and the token count rung
// with it, or the outcome that ended the poll with nothing consumed.
struct RingPoll {
  int served;
  uint32_t outcome;
  uint32_t tokens;
  bool local;  // rung with kDoorbellRequestLocal: the op completes at GPU scope
};

// Warp 0 only (all 32 lanes; the result is the same in every lane). Lane i polls slot i's request
// word when bit i of the mask is set; lane 0 looks at the control words, the abort words and the
// idle deadline (measured from `start`, lane 0's value) every kWaitCheckNs.
// The polls acquire: a lane that sees a request may read the slot's token count at once (the
// client stored it before its release), so that load and lane 0's CAS are in flight together
// (one round trip to take a ring, not two).
// `check_first`: look at the control and abort words before the first poll. A launch that has
// just started must (a queued waiter after a plan change or a pause leaves without polling at
// all); a serving launch polling again right after its op skips it, because that check's PCIe
// reads would stand between the op's completion and the client's next ring, which typically
// arrives 1-2 us later. Its next check comes within kWaitCheckNs, as for any idle wait.
__device__ inline RingPoll PollForRing(const DoorbellWaitParams& w, uint64_t start,
                                       bool check_first) {
  const uint32_t lane = threadIdx.x;
  const bool mine = ((w.slot_mask >> lane) & 1u) != 0;
  const uint32_t* my_request = &w.slots[lane].request;
  uint64_t last_check = start;
  uint32_t outcome = lane == 0 && check_first ? WaiterCheck(w, start, GlobalTimerNs()) : 0;
  outcome = __shfl_sync(0xffffffffu, outcome, 0);
  for (uint32_t polls = 1; outcome == 0; ++polls) {
    const uint32_t value = mine ? LoadAcquireSys(my_request) : 0u;
    const bool hit = value == kDoorbellRequest || value == kDoorbellRequestLocal;
    // Not used before the CAS's answer: both loads are outstanding at once.
    const uint32_t tokens = hit ? LoadRelaxedSys(&w.slots[lane].num_tokens) : 0u;
    uint32_t hits = __ballot_sync(0xffffffffu, hit);
    while (hits != 0) {
      // Lowest slot first. Take the request by CAS: the client may be withdrawing it (its ring
      // timed out) at the same moment; exactly one of the two CASes succeeds.
      const int s = __ffs(hits) - 1;
      // The value the lane saw: the CAS takes exactly that request (a withdrawing client CASes
      // the same value back to reset).
      const uint32_t seen = __shfl_sync(0xffffffffu, value, s);
      uint32_t won = 0;
      if (lane == 0) won = CasAcquireSys(&w.slots[s].request, seen, kDoorbellReset) == seen;
      won = __shfl_sync(0xffffffffu, won, 0);
      const uint32_t n = __shfl_sync(0xffffffffu, tokens, s);
      if (won != 0) {
        return RingPoll{s, static_cast<uint32_t>(DoorbellOutcome::kServed), n,
                        seen == kDoorbellRequestLocal};
      }
      hits &= hits - 1;
    }
    if (polls % kWaitPollsPerClock == 0) {
      if (lane == 0) {
        const uint64_t now = GlobalTimerNs();
        if (now - last_check >= kWaitCheckNs) {
          last_check = now;
          outcome = WaiterCheck(w, start, now);
        }
      }
      outcome = __shfl_sync(0xffffffffu, outcome, 0);
    }
  }
  return RingPoll{-1, outcome, 0, false};
}

// Warp 0 only: writes the op record for the kernels behind (and, in a serving launch, for the
// blocks of the grid): nothing consumed (r.served < 0, r.outcome says why), or the ring taken.
__device__ inline void WriteOpRecord(const DoorbellWaitParams& w, const RingPoll& r) {
  const int served = r.served;
  const uint32_t outcome = r.outcome;
  const uint32_t lane = threadIdx.x;
  DoorbellOp* op = w.op;
  if (served < 0) {
    // Nothing consumed: the fused launches behind see num_tokens == 0 and touch nothing.
    if (lane == 0) {
      op->params.num_tokens = 0;
      op->outcome = outcome;
      op->slot = 0xffffffffu;
      op->num_tokens = 0;
      op->local = 0;
    }
    __syncwarp();
    return;
  }
  // The plan table is written by the host before the plan's bit enters any waiter's mask, so
  // plain loads suffice; the whole warp copies the entry's params.
  const DoorbellPlanEntry* entry = &w.plans[served];
  {
    const uint64_t* src = reinterpret_cast<const uint64_t*>(&entry->params);
    uint64_t* dst = reinterpret_cast<uint64_t*>(&op->params);
    for (uint32_t i = lane; i < sizeof(FusionParams) / sizeof(uint64_t); i += 32) dst[i] = src[i];
  }
  __syncwarp();
  if (lane == 0) {
    const uint32_t n = r.tokens;
    const bool fits = n <= entry->max_tokens;
    op->params.num_tokens = fits ? n : 0u;
    op->params.algo = n >= entry->twoshot_min_tokens ? FusionAlgo::kTwoShot : FusionAlgo::kOneShot;
    op->outcome =
        static_cast<uint32_t>(fits ? DoorbellOutcome::kServed : DoorbellOutcome::kRejected);
    op->slot = static_cast<uint32_t>(served);
    op->num_tokens = n;
    op->local = r.local ? 1u : 0u;
  }
  __syncwarp();
}

// The slot error of an op whose workspace error word read `fusion` (0: the op succeeded).
__device__ __forceinline__ uint32_t FusionSlotError(uint32_t fusion) {
  return fusion != 0 ? (static_cast<uint32_t>(DoorbellError::kFusionFailed) | (fusion & 0xffu))
                     : 0u;
}

// Completes an op on `slot`. The error first (first one wins), then the release of the
// completion: a client that sees the completion sees the error. The count needs no answer (a
// reduction, no round trip). `local`: the ring came from this GPU (kDoorbellRequestLocal), so a
// GPU-scope release orders the op's outputs before the completion for it; a system-scope fence
// costs about 1.5 us more here.
__device__ inline void CompleteSlot(DoorbellSlot* slot, uint32_t error, bool local) {
  if (error != 0) CasRelaxedSys(&slot->error, 0u, error);
  atomicAdd(&slot->served, 1u);
  if (local) {
    StoreReleaseGpu32(&slot->complete, kDoorbellComplete);
  } else {
    StoreReleaseSys(&slot->complete, kDoorbellComplete);
  }
}

// The launch parameter checks' alignment test.
inline bool Aligned(const void* p, uintptr_t a) {
  return (reinterpret_cast<uintptr_t>(p) % a) == 0;
}

// Loads the waiter, completion and slot kernels (doorbell_waiter.cu) before any of the plane's
// kernels is resident; PrepareDoorbellSidecarKernels calls it with the serving kernels' load.
cudaError_t PrepareDoorbellWaiterKernels();

}  // namespace ring_service
}  // namespace arfuse
