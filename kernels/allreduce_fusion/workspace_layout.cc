// Host-only parts of the fused kernels: the parameter check, the support table, the error names
// and words. The sizing formula and the op rules are kernels/contract/op_contract.h's.
#include <cstdint>

#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/allreduce_fusion/fusion_control.h"

namespace arfuse {
namespace {

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
bool AlignedTo(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1u)) == 0;
}

}  // namespace

const char* FusionErrorName(uint32_t code) {
  // Only the kernels' codes: an in-stream launch's own codes are not the workspace's.
  const DeviceErrorInfo* e =
      code <= static_cast<uint32_t>(FusionError::kAbandoned) ? FindDeviceError(code) : nullptr;
  return e != nullptr ? e->text : "unknown fusion error";
}

bool IsFusionSupported(DType dtype, int world_size, Pattern pattern, FusionAlgo algo) {
  const PatternTraits traits = TraitsOf(pattern);
  return IsFusionDType(dtype) && IsSupportedWorldSize(world_size) && traits.valid &&
         (traits.quant == QuantKind::kNone || dtype == DType::kBF16 || dtype == DType::kFP16) &&
         (algo == FusionAlgo::kOneShot || algo == FusionAlgo::kTwoShot);
}

cudaError_t CheckFusionParams(const FusionParams& p, const char** why) {
  const char* problem = nullptr;
  const WorkspaceLayout& l = p.layout;
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
  } else if (!IsFusionHidden(p.hidden, p.dtype)) {
    problem = "hidden is not a positive multiple of 8 within the supported row size";
  } else if (!contract::CheckPattern(
                  contract::OpShape{p.dtype, p.hidden, p.num_tokens, p.pattern, p.scale_layout},
                  contract::OpVoice::kEngine)
                  .ok()) {
    problem = "the FP8 pattern's rules: hidden a multiple of 128 and a known scale layout";
  } else if (!contract::Fits(l, contract::OpShape{p.dtype, p.hidden, p.num_tokens})) {
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
    const PatternTraits traits = TraitsOf(p.pattern);
    if (problem == nullptr && traits.norm &&
        (p.residual_in == nullptr || p.residual_out == nullptr ||
         (traits.norm_out_required && p.norm_out == nullptr) || p.gamma == nullptr ||
         !Aligned16(p.residual_in) || !Aligned16(p.residual_out) || !Aligned16(p.norm_out) ||
         !Aligned16(p.gamma))) {
      problem = "residual_in, residual_out, norm_out or gamma is null or not 16-byte aligned";
    }
    // E4M3 codes are stored a vector's elements at a time (8 bytes for bf16/fp16).
    if (problem == nullptr && traits.quant != QuantKind::kNone &&
        (p.quant_out == nullptr || !AlignedTo(p.quant_out, 8) || p.scale == nullptr ||
         !AlignedTo(p.scale, 4))) {
      problem = "quant_out or scale is null, or quant_out not 8-byte or scale not 4-byte aligned";
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
