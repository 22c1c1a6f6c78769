// Host-only parts of the fused kernels' contract: sizing, parameter checks, the support table.
#include <cstdint>

#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/allreduce_fusion/fusion_control.h"

namespace arfuse {
namespace {

constexpr uint64_t RoundUp(uint64_t v, uint64_t m) { return (v + m - 1) / m * m; }
constexpr uint64_t kSectionAlign = 256;
constexpr uint64_t kTotalAlign = 2ull << 20;
constexpr uint64_t kMaxWorkspaceBytes = 1ull << 47;

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

bool IsKnownDType(DType t) { return t == DType::kBF16 || t == DType::kFP16 || t == DType::kFP32; }

}  // namespace

const char* FusionErrorName(uint32_t code) {
  switch (static_cast<FusionError>(code)) {
    case FusionError::kNone:
      return "none";
    case FusionError::kTimeout:
      return "timeout: a peer did not arrive before the spin deadline";
    case FusionError::kHostAbort:
      return "aborted by the host";
    case FusionError::kPeerAbort:
      return "aborted by a peer that failed";
    case FusionError::kPoisoned:
      return "workspace poisoned by an earlier error";
    case FusionError::kOpMismatch:
      return "ranks disagree on the op (tokens, hidden, eps, dtype, pattern or algorithm differ)";
    case FusionError::kAbandoned:
      return "abandoned: an attached client ended while an op it launched was in flight";
  }
  return "unknown fusion error";
}

WorkspaceLayout ComputeWorkspaceLayout(int world_size, uint32_t max_tokens, uint32_t hidden,
                                       DType dtype, const char** why) {
  WorkspaceLayout layout{};
  const char* problem = nullptr;
  if (!IsSupportedWorldSize(world_size)) {
    problem = "world size is not 2, 4, 8 or 16";
  } else if (!IsKnownDType(dtype)) {
    problem = "dtype is not bf16, fp16 or fp32";
  } else if (hidden == 0 || hidden % kHiddenMultiple != 0) {
    problem = "hidden is not a positive multiple of 8";
  } else if (hidden > MaxFusionHidden(dtype)) {
    problem = "hidden is above the largest row the fused kernels take";
  } else if (max_tokens == 0) {
    problem = "max_tokens is zero";
  }
  if (problem != nullptr) {
    if (why != nullptr) *why = problem;
    return WorkspaceLayout{};
  }
  const uint64_t n = static_cast<uint64_t>(world_size);
  const uint64_t row_bytes = static_cast<uint64_t>(hidden) * DTypeSize(dtype);
  const uint64_t slice_rows = (max_tokens + n - 1) / n;
  layout.control_offset = 0;
  layout.lamport_offset = RoundUp(sizeof(FusionControl), kSectionAlign);
  layout.lamport_slot_bytes = RoundUp(max_tokens * row_bytes, kSectionAlign);
  layout.lamport_buffer_bytes = n * layout.lamport_slot_bytes;
  layout.scatter_offset = layout.lamport_offset + 3 * layout.lamport_buffer_bytes;
  layout.scatter_slot_bytes = RoundUp(slice_rows * row_bytes, kSectionAlign);
  layout.gather_offset = layout.scatter_offset + n * layout.scatter_slot_bytes;
  const uint64_t end = layout.gather_offset + RoundUp(max_tokens * row_bytes, kSectionAlign);
  layout.total_bytes = RoundUp(end, kTotalAlign);
  layout.max_tokens = max_tokens;
  layout.hidden = hidden;
  layout.world_size = world_size;
  layout.dtype = dtype;
  if (layout.total_bytes > kMaxWorkspaceBytes) {
    if (why != nullptr) *why = "workspace would exceed 2^47 bytes";
    return WorkspaceLayout{};
  }
  if (why != nullptr) *why = nullptr;
  return layout;
}

bool IsFusionSupported(DType dtype, int world_size, Pattern pattern, FusionAlgo algo) {
  return IsKnownDType(dtype) && IsSupportedWorldSize(world_size) &&
         (pattern == Pattern::kAllReduce || pattern == Pattern::kAllReduceResidualRmsNorm) &&
         (algo == FusionAlgo::kOneShot || algo == FusionAlgo::kTwoShot);
}

cudaError_t CheckFusionParams(const FusionParams& p, const char** why) {
  const char* problem = nullptr;
  const WorkspaceLayout& l = p.layout;
  const uint64_t elems = static_cast<uint64_t>(p.num_tokens) * p.hidden;
  const uint64_t n = p.world_size > 0 ? static_cast<uint64_t>(p.world_size) : 1;
  const uint64_t slice_elems = (p.num_tokens + n - 1) / n * static_cast<uint64_t>(p.hidden);
  if (!IsFusionSupported(p.dtype, p.world_size, p.pattern, p.algo)) {
    problem = "unsupported (dtype, world size, pattern, algo) combination";
  } else if (l.total_bytes == 0) {
    problem = "workspace layout is empty";
  } else if (l.world_size != p.world_size) {
    problem = "world size differs from the workspace's";
  } else if (l.dtype != p.dtype) {
    problem = "dtype differs from the workspace's (the sentinel depends on it)";
  } else if (p.rank < 0 || p.rank >= p.world_size) {
    problem = "rank is outside 0..world_size-1";
  } else if (p.hidden == 0 || p.hidden % kHiddenMultiple != 0 ||
             p.hidden > MaxFusionHidden(p.dtype)) {
    problem = "hidden is not a positive multiple of 8 within the supported row size";
  } else if (elems * DTypeSize(p.dtype) > l.lamport_slot_bytes ||
             slice_elems * DTypeSize(p.dtype) > l.scatter_slot_bytes) {
    problem = "num_tokens x hidden does not fit the workspace";
  } else if (p.spin_timeout_ns == 0) {
    problem = "spin_timeout_ns is zero";
  }
  if (problem == nullptr && p.num_tokens > 0) {
    for (int r = 0; r < p.world_size; ++r) {
      if (p.peer_workspace[r] == nullptr || !Aligned16(p.peer_workspace[r])) {
        problem = "a peer workspace pointer is null or misaligned";
      }
    }
    if (problem == nullptr && (p.input == nullptr || !Aligned16(p.input))) {
      problem = "input is null or not 16-byte aligned";
    }
    if (problem == nullptr && p.pattern == Pattern::kAllReduce &&
        (p.output == nullptr || !Aligned16(p.output))) {
      problem = "output is null or not 16-byte aligned";
    }
    if (problem == nullptr && p.pattern == Pattern::kAllReduceResidualRmsNorm &&
        (p.residual_in == nullptr || p.residual_out == nullptr || p.norm_out == nullptr ||
         p.gamma == nullptr || !Aligned16(p.residual_in) || !Aligned16(p.residual_out) ||
         !Aligned16(p.norm_out) || !Aligned16(p.gamma))) {
      problem = "residual_in, residual_out, norm_out or gamma is null or not 16-byte aligned";
    }
  }
  if (why != nullptr) *why = problem;
  return problem == nullptr ? cudaSuccess : cudaErrorInvalidValue;
}

uint32_t* WorkspaceErrorWord(void* local_workspace, const WorkspaceLayout& layout) {
  auto* ctrl =
      reinterpret_cast<FusionControl*>(static_cast<char*>(local_workspace) + layout.control_offset);
  return &ctrl->error;
}

uint32_t* WorkspaceAbortWord(void* local_workspace, const WorkspaceLayout& layout) {
  auto* ctrl =
      reinterpret_cast<FusionControl*>(static_cast<char*>(local_workspace) + layout.control_offset);
  return &ctrl->abort;
}

cudaError_t ReadWorkspaceError(void* local_workspace, const WorkspaceLayout& layout,
                               cudaStream_t stream, uint32_t* error_code) {
  if (local_workspace == nullptr || error_code == nullptr) return cudaErrorInvalidValue;
  cudaError_t err = cudaMemcpyAsync(error_code, WorkspaceErrorWord(local_workspace, layout),
                                    sizeof(uint32_t), cudaMemcpyDeviceToHost, stream);
  if (err != cudaSuccess) return err;
  return cudaStreamSynchronize(stream);
}

}  // namespace arfuse
