// Plain types shared by the kernels, the CPU implementation and the server libraries.
// No CUDA and no protobuf here: this header is included on machines without the toolkit.
#pragma once

#include <cstddef>
#include <cstdint>

namespace arfuse {

enum class DType : uint8_t { kBF16 = 1, kFP16 = 2, kFP32 = 3 };

// Keep an enum so quantized-output patterns can be added.
enum class Pattern : uint8_t {
  kAllReduce = 1,                // out = sum over ranks of input
  kAllReduceResidualRmsNorm = 2  // residual_out = sum + residual_in; norm_out = rmsnorm(...) * gamma
};

inline constexpr size_t DTypeSize(DType t) { return t == DType::kFP32 ? 4 : 2; }

inline constexpr const char* DTypeName(DType t) {
  switch (t) {
    case DType::kBF16: return "bf16";
    case DType::kFP16: return "fp16";
    case DType::kFP32: return "fp32";
  }
  return "unknown";
}

inline constexpr const char* PatternName(Pattern p) {
  switch (p) {
    case Pattern::kAllReduce: return "allreduce";
    case Pattern::kAllReduceResidualRmsNorm: return "allreduce_residual_rmsnorm";
  }
  return "unknown";
}

// One rank's op as the host sees it: the shape and this rank's tensors, pointers valid in the
// calling process. The engines' OpArgs (server/engine/engine.h), the host collective's op and the
// client library's request are this struct.
struct FusedOpArgs {
  Pattern pattern = Pattern::kAllReduceResidualRmsNorm;
  DType dtype = DType::kBF16;
  uint32_t hidden = 0;
  uint32_t num_tokens = 0;
  float eps = 1e-6f;
  const void* input = nullptr;
  void* output = nullptr;  // kAllReduce
  const void* residual_in = nullptr;
  void* residual_out = nullptr;
  void* norm_out = nullptr;
  const void* gamma = nullptr;
};

// World sizes the fused kernels support.
inline constexpr bool IsSupportedWorldSize(int n) { return n == 2 || n == 4 || n == 8 || n == 16; }
inline constexpr int kMaxWorldSize = 16;
// The hidden-size rule and every other op rule: kernels/contract/op_contract.h.

}  // namespace arfuse
