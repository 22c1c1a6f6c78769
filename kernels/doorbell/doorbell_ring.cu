// The client's ring kernel (docs/doorbell.md). Compiled into arfuse_kernels_doorbell and, on its
// own, into the client library libarfuse_ring.so.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

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
//
// Scope: with kDevice (the ring runs on the GPU that holds the slot, and so does the sidecar's
// serving kernel) both threads are on one GPU and GPU-scope release/acquire orders everything
// the op needs; the request value tells the sidecar to complete at GPU scope as well. Otherwise
// (kSystem) every ordering is at system scope, as a ring from another GPU needs.
__global__ void __launch_bounds__(1)
    DoorbellRingKernel(DoorbellSlot* slot, uint32_t num_tokens, uint64_t timeout_ns,
                       DoorbellScope scope, bool stamps) {
  WaitForPrerequisiteGrid();
  AllowDependentLaunch();
  const uint64_t started = stamps ? GlobalTimerNs() : 0;
  const bool local = scope == DoorbellScope::kDevice;
  const uint32_t request = local ? kDoorbellRequestLocal : kDoorbellRequest;
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
  if (stamps) {
    // Diagnostics: on the request line, so the sidecar's acquire of the request sees them.
    uint64_t* words = reinterpret_cast<uint64_t*>(&slot->reserved0[kDoorbellRingStampWord]);
    StoreRelaxedSys64(words, started);
    StoreRelaxedSys64(words + 1, GlobalTimerNs());
  }
  StoreRelaxedSys(&slot->num_tokens, num_tokens);
  if (local) {
    StoreReleaseGpu32(&slot->request, request);
  } else {
    StoreReleaseSys(&slot->request, request);
  }
  const uint64_t start = GlobalTimerNs();
  for (uint32_t polls = 1;; ++polls) {
    if (LoadAcquireSys(&slot->complete) == kDoorbellComplete) break;
    if (polls % kRingPollsPerCheck != 0) continue;
    const bool sidecar_error = LoadRelaxedSys(&slot->error) != 0;
    const bool late = GlobalTimerNs() - start > timeout_ns;
    if (!sidecar_error && !late) continue;
    // Withdraw the request if the sidecar has not taken it: both sides move it from the value
    // this ring stored (kDoorbellRequest or kDoorbellRequestLocal) to kDoorbellReset by CAS, so
    // exactly one of them succeeds.
    const bool withdrawn = CasRelaxedSys(&slot->request, request, kDoorbellReset) == request;
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
                               cudaStream_t stream, DoorbellScope scope) {
  if (cudaError_t err = CheckDoorbellRingArgs(slot, timeout_ns, nullptr); err != cudaSuccess) {
    return err;
  }
  if (scope != DoorbellScope::kSystem && scope != DoorbellScope::kDevice) {
    return cudaErrorInvalidValue;
  }
  static const bool stamps = [] {
    const char* env = std::getenv("ARFUSE_RING_TRACE");
    return env != nullptr && std::strcmp(env, "1") == 0;
  }();
  return LaunchKernel(DoorbellRingKernel, 1, 1, RingUsesProgrammaticLaunch(), stream, slot,
                      num_tokens, timeout_ns, scope, stamps);
}

namespace {

// The UUID of every visible device, read by PrepareDoorbellRing (outside any capture:
// cudaGetDeviceProperties may not be called while a stream captures) and only read afterwards.
struct DeviceUuids {
  std::mutex mu;
  std::atomic<int> count{-1};  // devices whose UUID is known; -1 until the first prepare
  unsigned char bytes[64][16];
};

DeviceUuids& Uuids() {
  static DeviceUuids* uuids = new DeviceUuids;  // never destroyed: rings may outlive statics
  return *uuids;
}

}  // namespace

cudaError_t DoorbellRingScopeFor(const uint8_t* owner_uuid, DoorbellScope* scope) {
  if (owner_uuid == nullptr || scope == nullptr) return cudaErrorInvalidValue;
  *scope = DoorbellScope::kSystem;
  // A kernel launch must go to a stream of the current device (CUDA fails it otherwise), so the
  // ring runs on the current device. A thread-local query, allowed during capture.
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  DeviceUuids& u = Uuids();
  if (device < 0 || device >= u.count.load(std::memory_order_acquire)) {
    return cudaSuccess;  // not prepared: system scope is right from any GPU
  }
  if (std::memcmp(u.bytes[device], owner_uuid, 16) == 0) *scope = DoorbellScope::kDevice;
  return cudaSuccess;
}

cudaError_t DoorbellRingScopeForSlot(const DoorbellSlot* slot, DoorbellScope* scope) {
  if (slot == nullptr || scope == nullptr) return cudaErrorInvalidValue;
  uint8_t owner[sizeof(DoorbellSlot::owner_uuid)];
  if (cudaError_t err = cudaMemcpy(owner, slot->owner_uuid, sizeof(owner), cudaMemcpyDeviceToHost);
      err != cudaSuccess) {
    return err;
  }
  return DoorbellRingScopeFor(owner, scope);
}

cudaError_t PrepareDoorbellRing() {
  cudaFuncAttributes attributes;
  if (cudaError_t err = cudaFuncGetAttributes(&attributes, DoorbellRingKernel);
      err != cudaSuccess) {
    return err;
  }
  DeviceUuids& u = Uuids();
  if (u.count.load(std::memory_order_acquire) >= 0) return cudaSuccess;
  std::lock_guard<std::mutex> lock(u.mu);
  if (u.count.load(std::memory_order_relaxed) >= 0) return cudaSuccess;
  int devices = 0;
  if (cudaError_t err = cudaGetDeviceCount(&devices); err != cudaSuccess) return err;
  devices = std::min(devices, 64);
  for (int d = 0; d < devices; ++d) {
    cudaDeviceProp prop;
    if (cudaError_t err = cudaGetDeviceProperties(&prop, d); err != cudaSuccess) return err;
    static_assert(sizeof(prop.uuid.bytes) == 16);
    std::memcpy(u.bytes[d], prop.uuid.bytes, 16);
  }
  u.count.store(devices, std::memory_order_release);
  return cudaSuccess;
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
