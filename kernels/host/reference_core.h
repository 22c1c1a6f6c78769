// CPU implementation of the fused op (docs/kernels.md) with exactly the summation order and
// rounding steps of the GPU kernels. It is the oracle of the kernel tests and the engine of
// --device=host (the host engine gathers every rank's input in host shared memory and calls
// ReferenceFusedOp on each rank).
//
// Numerics, identical on the CPU and in every GPU kernel (one-shot, two-shot, and the unfused
// path's add-RMSNorm kernel after NCCL):
//   1. x_r = float(input_r[i]) for r = 0 .. world_size-1, with a -0.0 input mapped to +0.0.
//   2. s = ((x_0 + x_1) + x_2) + ...   fp32 adds in rank order: bit-identical on every rank.
//   3. a = round_to_dtype(s), then -0.0 mapped to +0.0. This is the allreduce result: the output
//      of kAllReduce, and what NCCL (sum, then store in dtype) hands the unfused path, so the
//      fused and unfused paths agree bit for bit at world size 2 and on integer-valued inputs.
//   4. kAllReduceResidualRmsNorm: residual_out[i] = round_to_dtype(float(a) +
//   float(residual_in[i]))
//      (one fp32 add; no FMA can form).
//   5. y_i = float(residual_out[i]) (the dtype-rounded value); ss = sum of y_i * y_i in fp32;
//      inv = 1.0f / sqrtf(ss / float(hidden) + eps) with IEEE (correctly rounded) division and
//      square root; norm_out[i] = round_to_dtype((y_i * inv) * float(gamma[i])).
//   6. The FP8 patterns (3-5) quantize x = (y_i * inv) * float(gamma[i]) of step 5 in fp32, before
//      its rounding to the dtype, to E4M3 codes with kernels/quant/fp8_reference.h's functions
//      (the GPU epilogue's math, bit for bit): static q = e4m3(x * (1 / scale[0])); per token
//      scale[t] = DynamicTokenScale(amax of row t), q = e4m3(x * (1 / scale[t])); per group of
//      128 QuantizeRowsPerGroup in the op's scale_layout. norm_out, when given, is step 5's.
// Steps 1-4 are bit-exact between CPU and GPU. The order of the adds in the sum of squares (5)
// differs: the GPU adds per-thread partial sums in a shuffle tree, the CPU adds sequentially,
// and the GPU may contract y*y+acc into an FMA. So norm_out may differ from the GPU in the last
// bit or two of the dtype; tests compare norm_out within a tolerance, everything else exactly.
//
// This header's functions answer plain::Status (kernels/common/plain_status.h), so that
// libarfuse_client, which runs the op in host mode, links no abseil; reference_op.h wraps them in
// absl::Status for everything else.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/common/op_types.h"
#include "kernels/common/plain_status.h"
#include "kernels/contract/op_contract.h"

namespace arfuse {

struct CpuOpArgs {
  Pattern pattern = Pattern::kAllReduceResidualRmsNorm;
  DType dtype = DType::kBF16;
  // 1 .. kMaxWorldSize (1 is the add-RMSNorm of the unfused path: rank_inputs[0] = allreduced).
  int world_size = 0;
  uint32_t hidden = 0;      // multiple of kHiddenMultiple
  uint32_t num_tokens = 0;  // may be 0: nothing is written
  float eps = 1e-6f;
  // world_size pointers, rank order; each [num_tokens, hidden] of dtype, row-major, contiguous.
  const void* const* rank_inputs = nullptr;
  void* output = nullptr;             // kAllReduce: [num_tokens, hidden]
  const void* residual_in = nullptr;  // kAllReduceResidualRmsNorm: [num_tokens, hidden]
  void* residual_out = nullptr;       // kAllReduceResidualRmsNorm: [num_tokens, hidden]
  void* norm_out = nullptr;           // kAllReduceResidualRmsNorm: [num_tokens, hidden]
  const void* gamma = nullptr;        // kAllReduceResidualRmsNorm: [hidden]
  // The FP8 patterns (FusedOpArgs::quant_out, ::scale, ::scale_layout); they also read
  // residual_in and gamma and write residual_out, and norm_out is optional there (null: only
  // the codes and scales are written). quant_out: [num_tokens, hidden] E4M3 codes. scale: one
  // fp32 read (static; used as given, so a zero or subnormal scale gives an infinite or huge
  // reciprocal and saturated codes), fp32 [num_tokens] written (per token), or
  // fp8::GroupScaleBytes(layout, num_tokens, hidden / 128) bytes written (per group, padding 0).
  void* quant_out = nullptr;
  void* scale = nullptr;
  uint8_t scale_layout = 0;  // per group: a fp8::GroupScaleLayout value
};

// INVALID_ARGUMENT naming the offending field when the arguments are not usable: the dtype, the
// pattern's rules (contract::CheckPattern: a pattern 1..5; FP8 patterns bf16 or fp16, per group
// hidden a multiple of 128 and a scale layout 1..3), world_size, hidden, eps, and with tokens
// the pattern's tensors (FP8: quant_out and scale; norm_out only for kAllReduceResidualRmsNorm).
plain::Status ValidateCpuOpArgsPlain(const CpuOpArgs& args);

// Runs the op with the GPU's numerics (above). Output buffers may not alias inputs except that
// residual_out may equal residual_in and output may equal rank_inputs[r] (elementwise in place);
// quant_out and scale alias nothing. The FP8 patterns keep the op's fp32 values
// (num_tokens x hidden floats) while they run.
plain::Status ReferenceFusedOpPlain(const CpuOpArgs& args);

// The same op in fp64 from the dtype input values, no intermediate rounding: the exact answer
// the tolerance tests compare against. Fills `out` (kAllReduce) or `residual_out` and `norm_out`
// (the norm patterns) with num_tokens * hidden values; the unused vector is cleared. The FP8
// patterns get their residual_out and norm_out only: no codes or scales (the FP8 tests compare
// codes with fp8_reference's bit-exact math instead).
struct Fp64Result {
  std::vector<double> out;
  std::vector<double> residual_out;
  std::vector<double> norm_out;
};
plain::Status ReferenceFusedOpFp64Plain(const CpuOpArgs& args, Fp64Result* result);

// Value of element `i` of a dtype array, as float (for tests and tools).
float LoadAsFloat(DType dtype, const void* data, size_t i);
// Stores round_to_dtype(v) into element `i` of a dtype array.
void StoreFromFloat(DType dtype, void* data, size_t i, float v);

}  // namespace arfuse
