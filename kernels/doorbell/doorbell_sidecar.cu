// The sidecar's doorbell kernels: the waiter launched ahead on the sidecar's stream, the
// completion kernel behind the fused launch, and the slot maintenance kernels.
// docs/doorbell.md has the protocol and the memory-ordering argument.
#include "kernels/doorbell/doorbell.h"
#include "kernels/doorbell/doorbell_device.cuh"

namespace arfuse {
namespace {

using namespace doorbell_device;  // NOLINT(build/namespaces): the memory-model helpers

// Every kWaitPollsPerClock polls the waiter reads the clock; the control words, abort words and
// the deadline are looked at when kWaitCheckNs passed since the last look. The control words are
// host-mapped (a PCIe read of about a microsecond): looking at them every poll would make a ring
// that lands during the read wait for it.
constexpr uint32_t kWaitPollsPerClock = 16;
constexpr uint64_t kWaitCheckNs = 10'000;

// Lane 0 only. Returns the DoorbellOutcome that ends the wait, or 0 to keep polling.
__device__ uint32_t WaiterCheck(const DoorbellWaitParams& w, uint64_t start, uint64_t now) {
  if (LoadRelaxedSys(&w.control->stop) != 0) {
    return static_cast<uint32_t>(DoorbellOutcome::kStopped);
  }
  if (LoadRelaxedSys(&w.control->generation) != w.generation) {
    return static_cast<uint32_t>(DoorbellOutcome::kKicked);
  }
  if ((w.workspace_abort != nullptr && LoadRelaxedSys(w.workspace_abort) != 0) ||
      (w.host_abort != nullptr && LoadRelaxedSys(w.host_abort) != 0)) {
    return static_cast<uint32_t>(DoorbellOutcome::kAborted);
  }
  if (now - start > w.idle_timeout_ns) return static_cast<uint32_t>(DoorbellOutcome::kIdle);
  return 0;
}

// One warp: lane i polls slot i's request word when bit i of the mask is set.
__global__ void __launch_bounds__(32) DoorbellWaitKernel(const DoorbellWaitParams w) {
  // Launched as a programmatic dependent of the previous op's completion kernel: the op record
  // it reads must not be overwritten before that kernel finished.
  WaitForPrerequisiteGrid();
  const uint32_t lane = threadIdx.x;
  const bool mine = ((w.slot_mask >> lane) & 1u) != 0;
  const uint32_t* my_request = &w.slots[lane].request;
  const uint64_t start = GlobalTimerNs();
  uint64_t last_check = start;
  int served = -1;
  // Kicked or stopped before it started (a queued waiter after a plan change or a pause): leave
  // without polling at all.
  uint32_t outcome = lane == 0 ? WaiterCheck(w, start, start) : 0;
  outcome = __shfl_sync(0xffffffffu, outcome, 0);
  for (uint32_t polls = 1; outcome == 0; ++polls) {
    // Relaxed polls; the CAS below acquires.
    const uint32_t value = mine ? LoadRelaxedSys(my_request) : 0u;
    uint32_t hits = __ballot_sync(0xffffffffu, value == kDoorbellRequest);
    while (hits != 0) {
      // Lowest slot first. Take the request by CAS: the client may be withdrawing it (its ring
      // timed out) at the same moment; exactly one of the two CASes succeeds.
      const int s = __ffs(hits) - 1;
      uint32_t won = 0;
      if (lane == 0) {
        won = CasAcquireSys(&w.slots[s].request, kDoorbellRequest, kDoorbellReset) ==
              kDoorbellRequest;
      }
      won = __shfl_sync(0xffffffffu, won, 0);
      if (won != 0) {
        served = s;
        // Let the fused launch behind be scheduled now (programmatic dependent launch): its
        // blocks wait for this kernel to finish before they read the op.
        AllowDependentLaunch();
        break;
      }
      hits &= hits - 1;
    }
    if (served >= 0) break;
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

  DoorbellOp* op = w.op;
  if (served < 0) {
    // Nothing consumed: the fused launches behind see num_tokens == 0 and touch nothing.
    if (lane == 0) {
      op->params.num_tokens = 0;
      op->outcome = outcome;
      op->slot = 0xffffffffu;
      op->num_tokens = 0;
    }
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
    // Read after lane 0's acquiring CAS: the client stored it before its release.
    const uint32_t n = LoadRelaxedSys(&w.slots[served].num_tokens);
    const bool fits = n <= entry->max_tokens;
    op->params.num_tokens = fits ? n : 0u;
    op->params.algo = n >= entry->twoshot_min_tokens ? FusionAlgo::kTwoShot : FusionAlgo::kOneShot;
    op->outcome =
        static_cast<uint32_t>(fits ? DoorbellOutcome::kServed : DoorbellOutcome::kRejected);
    op->slot = static_cast<uint32_t>(served);
    op->num_tokens = n;
  }
}

// One thread, after the fused launches of the op on the same stream.
__global__ void __launch_bounds__(1) DoorbellCompleteKernel(const DoorbellCompleteParams c) {
  // As a programmatic dependent it may start while the fused kernel runs: wait for it (and its
  // stores: outputs, error word) before the release of the completion.
  WaitForPrerequisiteGrid();
  AllowDependentLaunch();
  const DoorbellOp* op = c.op;
  const uint32_t outcome = op->outcome;
  uint32_t error = 0;
  if (outcome == static_cast<uint32_t>(DoorbellOutcome::kServed) ||
      outcome == static_cast<uint32_t>(DoorbellOutcome::kRejected)) {
    DoorbellSlot* slot = &c.slots[op->slot];
    if (outcome == static_cast<uint32_t>(DoorbellOutcome::kRejected)) {
      error = static_cast<uint32_t>(DoorbellError::kBadTokenCount);
    } else if (c.workspace_error != nullptr) {
      // Written (if at all) by the fused kernel just before, or by an earlier op (sticky: the
      // workspace is poisoned and this op did nothing).
      const uint32_t fusion = LoadRelaxedSys(c.workspace_error);
      if (fusion != 0)
        error = static_cast<uint32_t>(DoorbellError::kFusionFailed) | (fusion & 0xffu);
    }
    // The error first, then the release of the completion: a client that sees the completion
    // sees the error.
    if (error != 0) CasRelaxedSys(&slot->error, 0u, error);
    StoreRelaxedSys(&slot->served, LoadRelaxedSys(&slot->served) + 1u);
    StoreReleaseSys(&slot->complete, kDoorbellComplete);
  }
  if (c.report != nullptr) {
    // Host-mapped: the host reads it after the event recorded behind this kernel completed.
    volatile DoorbellReport* r = c.report;
    r->outcome = outcome;
    r->slot = op->slot;
    r->num_tokens = op->num_tokens;
    r->error = error;
  }
}

__global__ void DoorbellSetErrorKernel(DoorbellSlot* slots, uint32_t mask, uint32_t code) {
  const uint32_t i = threadIdx.x;
  if (((mask >> i) & 1u) == 0) return;
  CasRelaxedSys(&slots[i].error, 0u, code);
}

__global__ void DoorbellResetSlotsKernel(DoorbellSlot* slots, uint32_t mask) {
  const uint32_t i = threadIdx.x;
  if (((mask >> i) & 1u) == 0) return;
  StoreRelaxedSys(&slots[i].request, kDoorbellReset);
  StoreRelaxedSys(&slots[i].num_tokens, 0u);
  StoreRelaxedSys(&slots[i].complete, kDoorbellReset);
  // The error last, with release: a ring that sees the slot healthy sees it armed.
  StoreReleaseSys(&slots[i].error, 0u);
}

bool Aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

template <typename Kernel, typename Params>
cudaError_t LaunchSmall(Kernel kernel, unsigned threads, const Params& params, cudaStream_t stream,
                        bool programmatic) {
  if (!programmatic) {
    kernel<<<1, threads, 0, stream>>>(params);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(1);
  config.blockDim = dim3(threads);
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, params);
}

}  // namespace

cudaError_t CheckDoorbellWaitParams(const DoorbellWaitParams& w, const char** why) {
  const char* problem = nullptr;
  if (w.slots == nullptr || !Aligned(w.slots, kDoorbellLineBytes)) {
    problem = "doorbell slots are null or not 128-byte aligned";
  } else if (w.plans == nullptr || !Aligned(w.plans, 8)) {
    problem = "doorbell plan table is null or misaligned";
  } else if (w.op == nullptr || !Aligned(w.op, 8)) {
    problem = "doorbell op record is null or misaligned";
  } else if (w.control == nullptr || !Aligned(w.control, 4)) {
    problem = "doorbell control words are null or misaligned";
  } else if (w.idle_timeout_ns == 0) {
    problem = "waiter idle timeout is zero";
  } else if (w.slot_mask == 0) {
    problem = "waiter has no slot to serve (empty slot mask)";
  }
  if (why != nullptr) *why = problem;
  return problem == nullptr ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t CheckDoorbellCompleteParams(const DoorbellCompleteParams& c, const char** why) {
  const char* problem = nullptr;
  if (c.slots == nullptr || !Aligned(c.slots, kDoorbellLineBytes)) {
    problem = "doorbell slots are null or not 128-byte aligned";
  } else if (c.op == nullptr || !Aligned(c.op, 8)) {
    problem = "doorbell op record is null or misaligned";
  } else if (c.report != nullptr && !Aligned(c.report, 4)) {
    problem = "doorbell report is misaligned";
  }
  if (why != nullptr) *why = problem;
  return problem == nullptr ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t LaunchDoorbellWait(const DoorbellWaitParams& params, cudaStream_t stream,
                               bool programmatic_dependent) {
  if (cudaError_t err = CheckDoorbellWaitParams(params, nullptr); err != cudaSuccess) return err;
  return LaunchSmall(DoorbellWaitKernel, 32, params, stream, programmatic_dependent);
}

cudaError_t LaunchDoorbellComplete(const DoorbellCompleteParams& params, cudaStream_t stream,
                                   bool programmatic_dependent) {
  if (cudaError_t err = CheckDoorbellCompleteParams(params, nullptr); err != cudaSuccess) {
    return err;
  }
  return LaunchSmall(DoorbellCompleteKernel, 1, params, stream, programmatic_dependent);
}

cudaError_t LaunchDoorbellSetError(DoorbellSlot* slots, uint32_t slot_mask, uint32_t code,
                                   cudaStream_t stream) {
  if (slots == nullptr || !Aligned(slots, kDoorbellLineBytes) || code == 0) {
    return cudaErrorInvalidValue;
  }
  if (slot_mask == 0) return cudaSuccess;
  DoorbellSetErrorKernel<<<1, kMaxDoorbellSlots, 0, stream>>>(slots, slot_mask, code);
  return cudaGetLastError();
}

cudaError_t LaunchDoorbellResetSlots(DoorbellSlot* slots, uint32_t slot_mask, cudaStream_t stream) {
  if (slots == nullptr || !Aligned(slots, kDoorbellLineBytes)) return cudaErrorInvalidValue;
  if (slot_mask == 0) return cudaSuccess;
  DoorbellResetSlotsKernel<<<1, kMaxDoorbellSlots, 0, stream>>>(slots, slot_mask);
  return cudaGetLastError();
}

}  // namespace arfuse
