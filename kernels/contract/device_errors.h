// The one table of device error codes: what a workspace's error word, the host workspace's error
// word, an in-stream launch's error word and the low byte of a doorbell slot's kFusionFailed code
// hold. Every other name of these codes is an alias of this table (FusionError in
// kernels/allreduce_fusion/allreduce_fusion.h, HostWsError in kernels/host/host_workspace.h,
// kErrorStaleGeneration and kErrorLaunchAbi in kernels/instream/attach_abi.h, DoorbellError's
// kFusionFailed range in kernels/doorbell/doorbell.h), and every name text comes from the row
// here. The numbers cross process and ABI boundaries (kernels write them, libarfuse_client and
// the sidecar read them, arfuse_error_name hands them to frameworks), so each is pinned below.
//
// No CUDA, no protobuf, no abseil: libarfuse_client includes this header.
#pragma once

#include <cstdint>

namespace arfuse {

enum class DeviceError : uint32_t {
  kNone = 0,
  kTimeout = 1,    // a spin passed its deadline: a peer did not arrive
  kHostAbort = 2,  // the host abort word was set (Engine::Abort, an in-stream abort)
  kPeerAbort = 3,  // a peer failed and told this rank to stop
  kPoisoned = 4,   // launched on a workspace that already held an error; nothing was done
  // The ranks launched different ops (num_tokens, hidden, eps, dtype, pattern, algo or world size
  // differ): no rank stores any output of the call. Only the GPU kernels store it; host mode
  // refuses such an op with INVALID_ARGUMENT instead.
  kOpMismatch = 5,
  // Written by the owning sidecar, never by a kernel: an op's launcher (an attached client) ended
  // while the op was in flight, so what it published is retired by poisoning every rank.
  kAbandoned = 6,
  // Only in-stream launches report these two (their own error word, never the workspace's).
  kStaleGeneration = 16,  // the workspace was re-initialized since the attach
  kLaunchAbi = 17,        // the launch arguments' ABI differs from the kernels'
};

// Numbers that cross a process or ABI boundary: never renumber.
static_assert(static_cast<uint32_t>(DeviceError::kNone) == 0);
static_assert(static_cast<uint32_t>(DeviceError::kTimeout) == 1);
static_assert(static_cast<uint32_t>(DeviceError::kHostAbort) == 2);
static_assert(static_cast<uint32_t>(DeviceError::kPeerAbort) == 3);
static_assert(static_cast<uint32_t>(DeviceError::kPoisoned) == 4);
static_assert(static_cast<uint32_t>(DeviceError::kOpMismatch) == 5);
static_assert(static_cast<uint32_t>(DeviceError::kAbandoned) == 6);
static_assert(static_cast<uint32_t>(DeviceError::kStaleGeneration) == 16);
static_assert(static_cast<uint32_t>(DeviceError::kLaunchAbi) == 17);

// A doorbell slot's code for an op the sidecar ran that failed in the fused kernel:
// kDoorbellFusionFailed | the DeviceError (DoorbellError::kFusionFailed).
inline constexpr uint32_t kDoorbellFusionFailed = 0x100;

// One row of the table: the code, its short name (arfuse_error_name, the InStreamStatus error
// name of host mode, metrics), the sentence the sidecar's logs and statuses use, and the sentence
// a doorbell slot's kDoorbellFusionFailed | code is named by.
struct DeviceErrorInfo {
  DeviceError code;
  const char* name;
  const char* text;
  const char* doorbell_text;
};

inline constexpr DeviceErrorInfo kDeviceErrors[] = {
    {DeviceError::kNone, "none", "none", "fused op failed (workspace poisoned)"},
    {DeviceError::kTimeout, "timeout", "timeout: a peer did not arrive before the spin deadline",
     "fused op failed: a peer did not arrive before the spin deadline (workspace poisoned)"},
    {DeviceError::kHostAbort, "host_abort", "aborted by the host",
     "fused op failed: aborted by the host (workspace poisoned)"},
    {DeviceError::kPeerAbort, "peer_abort", "aborted by a peer that failed",
     "fused op failed: aborted by a peer that failed (workspace poisoned)"},
    {DeviceError::kPoisoned, "poisoned", "workspace poisoned by an earlier error",
     "fused op not run: workspace poisoned by an earlier error"},
    {DeviceError::kOpMismatch, "op_mismatch",
     "ranks disagree on the op (tokens, hidden, eps, dtype, pattern or algorithm differ)",
     "fused op refused: ranks disagree on the op (tokens, hidden, eps, dtype, pattern or "
     "algorithm differ; workspace poisoned)"},
    {DeviceError::kAbandoned, "abandoned",
     "abandoned: an attached client ended while an op it launched was in flight",
     "fused op not run: an attached client ended mid-op (workspace poisoned)"},
    {DeviceError::kStaleGeneration, "stale_generation",
     "stale generation: the workspace was re-initialized since the attach",
     "fused op failed (workspace poisoned)"},
    {DeviceError::kLaunchAbi, "launch_abi",
     "launch ABI mismatch: the launch arguments differ from the kernels'",
     "fused op failed (workspace poisoned)"},
};

// The row of `code`, or nullptr for a number that is no DeviceError.
inline constexpr const DeviceErrorInfo* FindDeviceError(uint32_t code) {
  for (const DeviceErrorInfo& e : kDeviceErrors) {
    if (static_cast<uint32_t>(e.code) == code) return &e;
  }
  return nullptr;
}

// The short name of `code` ("timeout", "op_mismatch", "stale_generation"), "unknown" for a number
// that is no DeviceError. Never NULL.
inline constexpr const char* DeviceErrorName(uint32_t code) {
  const DeviceErrorInfo* e = FindDeviceError(code);
  return e != nullptr ? e->name : "unknown";
}

}  // namespace arfuse
