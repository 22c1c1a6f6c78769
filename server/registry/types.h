// Plain request types of the region registry: what the Fusion service decodes from protobuf and
// what the fuzzers generate. No gRPC, no protobuf, no CUDA, so validation can be unit-tested and
// fuzzed without a server or a device.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "common/fd/unique_fd.h"
#include "kernels/common/op_types.h"
#include "kernels/contract/op_contract.h"
#include "server/fdpass/socket_credentials.h"

namespace arfuse {

// Numbers match arfuse.v1.DeviceKind.
enum class MemoryKind : uint8_t { kCudaIpc = 1, kHostShm = 2 };

inline constexpr const char* MemoryKindName(MemoryKind k) {
  return k == MemoryKind::kCudaIpc ? "cuda_ipc" : "host_shm";
}

// cudaIpcMemHandle_t and cudaIpcEventHandle_t are both 64 opaque bytes.
inline constexpr size_t kCudaIpcHandleBytes = 64;
// Every tensor starts on a 16-byte boundary: the kernels load 16-byte vectors.
inline constexpr uint64_t kTensorAlignment = 16;

// One RegisterRegion request. `kind` is unset when the client sent neither memory variant.
struct RegionSpec {
  std::string name;
  uint64_t byte_size = 0;
  std::optional<MemoryKind> kind;
  // kCudaIpc: the raw cudaIpcMemHandle_t bytes and the device they belong to.
  std::string cuda_handle;
  int32_t device_id = 0;
  // kHostShm by name: a POSIX shared-memory object name ("/arfuse-...").
  std::string shm_name;
  // kHostShm by descriptor (host_fd): the fd ticket the client sent, and the descriptor the
  // service claimed with it (shared so that a spec stays copyable; closed with the last copy).
  bool host_by_fd = false;
  std::string fd_ticket;
  std::shared_ptr<const UniqueFd> host_fd;
  // Who made the call, when the sidecar knows (a connection it accepted on its Unix socket).
  // Memory is opened by name only for a caller that could open it itself.
  std::optional<SocketCredentials> caller;
};

// A tensor inside a registered region; `present` is false when the client left it out.
struct TensorRef {
  bool present = false;
  uint64_t region_id = 0;
  uint64_t generation = 0;
  uint64_t offset = 0;
};

// One OpSpec as sent. Enums stay raw wire values so a newer client's unknown values reach
// validation (and get a clear INVALID_ARGUMENT) instead of being silently coerced.
struct OpRequest {
  int32_t pattern = 0;
  int32_t dtype = 0;
  uint32_t hidden = 0;
  uint32_t max_tokens = 0;
  std::optional<float> eps;
  TensorRef input;
  TensorRef output;
  TensorRef residual_in;
  TensorRef residual_out;
  TensorRef norm_out;
  TensorRef gamma;
  TensorRef quant_out;  // the FP8 patterns'
  TensorRef scale;
  int32_t scale_layout = 0;  // the per-group FP8 pattern's (arfuse.v1.ScaleLayout)
};

// The shape part of an OpRequest after validation.
struct OpShape {
  Pattern pattern = Pattern::kAllReduceResidualRmsNorm;
  DType dtype = DType::kBF16;
  uint32_t hidden = 0;
  uint32_t max_tokens = 0;
  float eps = 1e-6f;
  uint8_t scale_layout = 0;  // a fp8::GroupScaleLayout value for the per-group pattern, else 0
};

// What the sidecar's workspace serves (--max-tokens, --hidden, --dtype): the op contract's type.
using WorkspaceCapacity = contract::WorkspaceCapacity;

// Limits the registry enforces. Per-session caps stop one client from exhausting the sidecar.
struct RegistryLimits {
  uint32_t max_sessions = 64;
  uint32_t max_regions_per_session = 64;
  uint64_t max_bytes_per_session = uint64_t{64} << 30;
  uint32_t max_plans_per_session = 256;
  // Ops larger than this many tokens are refused at validation (engines refuse what does not fit
  // their workspace on top of this).
  uint32_t max_tokens = 1u << 20;
  uint32_t max_hidden = 1u << 16;
  size_t max_name_bytes = 128;
  // When set, plans and explicit ops the workspace cannot serve are refused with OUT_OF_RANGE
  // (CheckOpFitsWorkspace): clients take that as "fusion unavailable, run your own path".
  std::optional<WorkspaceCapacity> workspace;
};

}  // namespace arfuse
