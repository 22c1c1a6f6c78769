// Fused residual add + RMSNorm for the unfused path (after an NCCL allreduce), with the numerics
// of kernels/host/reference_op.h at world size 1: -0.0 in `input` read as +0.0,
// residual_out = round(input + residual_in), norm_out = round((y * inv) * gamma) with
// inv = 1 / sqrtf(mean(y^2) + eps) over the dtype-rounded residual_out values y.
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
  void* norm_out;           // [num_tokens, hidden]; may equal input
  const void* gamma;        // [hidden]
  uint32_t num_tokens;      // 0: nothing is launched
  uint32_t hidden;          // multiple of 8, at most MaxAddRmsNormHidden(dtype)
  float eps;
  DType dtype;
  uint8_t reserved[3];
};
static_assert(sizeof(AddRmsNormParams) == 56);
static_assert(offsetof(AddRmsNormParams, num_tokens) == 40);

inline constexpr uint32_t MaxAddRmsNormHidden(DType t) { return 1024u * 8u * (16u / DTypeSize(t)); }

// cudaErrorInvalidValue (nothing launched) when a pointer is null or not 16-byte aligned, hidden
// is not a positive multiple of 8 or too large, or dtype is unknown; `why` names the problem.
cudaError_t CheckAddRmsNormParams(const AddRmsNormParams& params, const char** why = nullptr);

cudaError_t LaunchAddRmsNorm(const AddRmsNormParams& params, cudaStream_t stream);

// Loads every instantiation of the kernel (each dtype and row bucket) into the current context
// now, as PrepareAllReduceFusionKernels does for the fused kernels: the engine launches it on the
// stream where the doorbell plane keeps a kernel resident. Not inside a graph capture.
cudaError_t PrepareAddRmsNormKernels();

}  // namespace arfuse
