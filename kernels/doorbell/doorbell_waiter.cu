// The sidecar's doorbell kernels around the fused launch: the waiter queued ahead of it on the
// sidecar's stream, the completion kernel behind it, and the slot maintenance kernels, with their
// launch checks. The serving launch, which takes and runs rings itself, is in doorbell_sidecar.cu.
// docs/doorbell.md has the protocol and the memory-ordering argument.
#include "kernels/common/launch.cuh"
#include "kernels/doorbell/doorbell.h"
#include "kernels/doorbell/ring_service.cuh"

namespace arfuse {
namespace {

// The ring's steps and, through them, the memory-model helpers.
using namespace ring_service;  // NOLINT(build/namespaces)

// One warp: polls, then writes the op for the kernels behind.
__global__ void __launch_bounds__(32) DoorbellWaitKernel(const DoorbellWaitParams w) {
  // Launched as a programmatic dependent of the previous op's completion kernel: the op record
  // it reads must not be overwritten before that kernel finished.
  WaitForPrerequisiteGrid();
  const RingPoll r = PollForRing(w, GlobalTimerNs(), /*check_first=*/true);
  // Let the fused launch behind be scheduled now (programmatic dependent launch): its blocks wait
  // for this kernel to finish before they read the op.
  if (r.served >= 0) AllowDependentLaunch();
  WriteOpRecord(w, r);
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
    if (outcome == static_cast<uint32_t>(DoorbellOutcome::kRejected)) {
      error = static_cast<uint32_t>(DoorbellError::kBadTokenCount);
    } else if (c.workspace_error != nullptr) {
      // Written (if at all) by the fused kernel just before, or by an earlier op (sticky: the
      // workspace is poisoned and this op did nothing).
      error = FusionSlotError(LoadRelaxedSys(c.workspace_error));
    }
    CompleteSlot(&c.slots[op->slot], error, op->local != 0);
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

}  // namespace

cudaError_t ring_service::PrepareDoorbellWaiterKernels() {
  return LoadKernelFunctions({reinterpret_cast<const void*>(&DoorbellWaitKernel),
                              reinterpret_cast<const void*>(&DoorbellCompleteKernel),
                              reinterpret_cast<const void*>(&DoorbellSetErrorKernel),
                              reinterpret_cast<const void*>(&DoorbellResetSlotsKernel)});
}

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
  return LaunchKernel(DoorbellWaitKernel, 1, 32, programmatic_dependent, stream, params);
}

cudaError_t LaunchDoorbellComplete(const DoorbellCompleteParams& params, cudaStream_t stream,
                                   bool programmatic_dependent) {
  if (cudaError_t err = CheckDoorbellCompleteParams(params, nullptr); err != cudaSuccess) {
    return err;
  }
  return LaunchKernel(DoorbellCompleteKernel, 1, 1, programmatic_dependent, stream, params);
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
