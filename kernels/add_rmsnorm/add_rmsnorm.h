// Fused residual add + RMSNorm for the unfused path (after an NCCL allreduce), with the numerics
// of kernels/host/reference_op.h at world size 1: -0.0 in `input` read as +0.0,
// residual_out = round(input + residual_in), norm_out = round((y * inv) * gamma) with
// inv = 1 / sqrtf(mean(y^2) + eps) over the dtype-rounded residual_out values y. With a quant
// kind (the FP8 patterns, bf16 or fp16 only) it also writes the E4M3 codes of the fp32 value
// (y * inv) * gamma that norm_out is rounded from, and their scales, with the fused kernels'
// epilogue (kernels/add_rmsnorm/row_quant.cuh): an FP8 op gives the same bytes whichever path
// serves it, up to the order of the sum of squares (docs/kernels.md, "FP8 outputs").
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/op_types.h"

namespace arfuse {

struct AddRmsNormParams {
  const void* input;        // [num_tokens, hidden] the allreduced sum
  const void* residual_in;  // [num_tokens, hidden]
  void* residual_out;       // [num_tokens, hidden]; may equal residual_in
  void* norm_out;           // [num_tokens, hidden]; may equal input; optional with a quant kind
  const void* gamma;        // [hidden]
  uint32_t num_tokens;      // 0: nothing is launched
  uint32_t hidden;          // multiple of 8, at most MaxAddRmsNormHidden(dtype)
  float eps;
  DType dtype;
  // kNone (the zero value): add-RMSNorm only. Otherwise the FP8 output of that pattern
  // (TraitsOf(pattern).quant): quant_out and scale are required.
  QuantKind quant;
  uint8_t scale_layout;  // kPerGroup: an fp8::GroupScaleLayout value
  uint8_t reserved;
  // [num_tokens, hidden] E4M3 codes, 8-byte aligned (a vector's 8 codes are one store).
  void* quant_out;
  // kStatic: one fp32, read. kPerToken: fp32 [num_tokens], written. kPerGroup: the layout's
  // tensor (fp8::GroupScaleBytes), written. 4-byte aligned.
  void* scale;
};
static_assert(sizeof(AddRmsNormParams) == 72);
static_assert(offsetof(AddRmsNormParams, num_tokens) == 40);
static_assert(offsetof(AddRmsNormParams, quant) == 53);
static_assert(offsetof(AddRmsNormParams, quant_out) == 56);

inline constexpr uint32_t MaxAddRmsNormHidden(DType t) { return 1024u * 8u * (16u / DTypeSize(t)); }

// cudaErrorInvalidValue (nothing launched) when a pointer is null or not 16-byte aligned, hidden
// is not a positive multiple of 8 or too large, or dtype is unknown; with a quant kind also when
// the kind is unknown, dtype is not bf16 or fp16, quant_out or scale is null (norm_out may be) or
// misaligned (scale: 4 bytes), or, for kPerGroup, hidden is not a multiple of 128 or the scale
// layout is unknown. `why` names the problem.
cudaError_t CheckAddRmsNormParams(const AddRmsNormParams& params, const char** why = nullptr);

cudaError_t LaunchAddRmsNorm(const AddRmsNormParams& params, cudaStream_t stream);

// Loads every instantiation of the kernel (each dtype and row bucket) into the current context
// now, as PrepareAllReduceFusionKernels does for the fused kernels: the engine launches it on the
// stream where the doorbell plane keeps a kernel resident. Not inside a graph capture.
cudaError_t PrepareAddRmsNormKernels();

}  // namespace arfuse
