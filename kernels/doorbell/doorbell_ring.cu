// The client's ring kernel (docs/doorbell.md). Compiled into arfuse_kernels_doorbell and, on its
// own, into the client library libarfuse_ring.so.
#include <cstdlib>
#include <cstring>

#include "kernels/common/launch.cuh"
#include "kernels/doorbell/doorbell.h"
#include "kernels/doorbell/doorbell_device.cuh"

namespace arfuse {
namespace {

using namespace doorbell_device;  // NOLINT(build/namespaces): the memory-model helpers

// Polls between looks at the error word and the clock: those are loads of another line.
constexpr uint32_t kRingPollsPerCheck = 64;

// One thread. The op's inputs were written by kernels earlier on this stream; kernel-boundary
// ordering puts those writes before this thread's release, and release is cumulative, so the
// sidecar's acquire of the request sees them. Symmetrically the sidecar's outputs are visible to
// this stream's later kernels once this thread acquired the completion.
//
// Launched as a programmatic dependent (sm_90+): the launch overlaps the kernel before it on the
// stream. Nothing is read or written before griddepcontrol.wait, which returns once that kernel
// finished and its stores are visible: the op's inputs, and a previous ring's re-arm of this slot.
// For the same reason the kernel lets its own dependent (the next ring of a graph that rings
// back to back) launch at once: that ring waits in griddepcontrol.wait until this one ended, and
// its launch latency is off the op's path, as the fused kernel's is when it runs in-process.
__global__ void __launch_bounds__(1)
    DoorbellRingKernel(DoorbellSlot* slot, uint32_t num_tokens, uint64_t timeout_ns) {
  WaitForPrerequisiteGrid();
  AllowDependentLaunch();
  // A sticky error: the slot is not usable until the sidecar resets it. Do not ring (the op
  // does not run; the client reads the error word).
  // Both loads are issued before either is used: one round trip to the sidecar's memory, not two.
  const uint32_t error = LoadRelaxedSys(&slot->error);
  const uint32_t complete = LoadRelaxedSys(&slot->complete);
  if (error != 0) return;
  // The completion word must be armed. It is not when an op whose ring timed out completed late:
  // ringing now would take that stale completion for this op's.
  if (complete != kDoorbellReset) {
    CasRelaxedSys(&slot->error, 0u, static_cast<uint32_t>(DoorbellError::kDesynchronized));
    return;
  }
  StoreRelaxedSys(&slot->num_tokens, num_tokens);
  StoreReleaseSys(&slot->request, kDoorbellRequest);
  const uint64_t start = GlobalTimerNs();
  for (uint32_t polls = 1;; ++polls) {
    if (LoadAcquireSys(&slot->complete) == kDoorbellComplete) break;
    if (polls % kRingPollsPerCheck != 0) continue;
    const bool sidecar_error = LoadRelaxedSys(&slot->error) != 0;
    const bool late = GlobalTimerNs() - start > timeout_ns;
    if (!sidecar_error && !late) continue;
    // Withdraw the request if the sidecar has not taken it: both sides move it from
    // kDoorbellRequest to kDoorbellReset by CAS, so exactly one of them succeeds.
    const bool withdrawn =
        CasRelaxedSys(&slot->request, kDoorbellRequest, kDoorbellReset) == kDoorbellRequest;
    if (withdrawn) {
      // The op will not run. A sidecar error (it stopped) is already recorded.
      if (!sidecar_error) {
        CasRelaxedSys(&slot->error, 0u, static_cast<uint32_t>(DoorbellError::kRingTimeout));
      }
      return;
    }
    if (late) {
      // Taken but not completed in time: the completion may still come, so the slot stays
      // unusable (sticky error) until the sidecar resets it.
      CasRelaxedSys(&slot->error, 0u, static_cast<uint32_t>(DoorbellError::kRingTimeoutInFlight));
      return;
    }
    // The sidecar set an error but took the request: its completion is coming; keep waiting
    // (still bounded by the deadline).
  }
  // Re-arm for the next replay. Ordered before this client's next request (a later kernel of
  // the stream, which reads it only after this kernel finished), which the sidecar must see
  // before it completes again.
  StoreRelaxedSys(&slot->complete, kDoorbellReset);
}

// Programmatic launches unless ARFUSE_RING_PDL=0 (for measuring what they are worth), on sm_90+.
bool RingUsesProgrammaticLaunch() {
  static const bool enabled = [] {
    const char* env = std::getenv("ARFUSE_RING_PDL");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  if (!enabled) return false;
  int device = 0;
  int major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it, launch plainly
    return false;
  }
  return major >= 9;
}

}  // namespace

cudaError_t LaunchDoorbellRing(DoorbellSlot* slot, uint32_t num_tokens, uint64_t timeout_ns,
                               cudaStream_t stream) {
  if (cudaError_t err = CheckDoorbellRingArgs(slot, timeout_ns, nullptr); err != cudaSuccess) {
    return err;
  }
  return LaunchKernel(DoorbellRingKernel, 1, 1, RingUsesProgrammaticLaunch(), stream, slot,
                      num_tokens, timeout_ns);
}

cudaError_t PrepareDoorbellRing() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, DoorbellRingKernel);
}

cudaError_t CheckDoorbellRingArgs(const DoorbellSlot* slot, uint64_t timeout_ns, const char** why) {
  const char* problem = nullptr;
  if (slot == nullptr) {
    problem = "doorbell slot pointer is null";
  } else if (reinterpret_cast<uintptr_t>(slot) % kDoorbellLineBytes != 0) {
    problem = "doorbell slot pointer is not 128-byte aligned (wrong offset?)";
  } else if (timeout_ns == 0) {
    problem = "ring timeout is zero";
  }
  if (why != nullptr) *why = problem;
  return problem == nullptr ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace arfuse
