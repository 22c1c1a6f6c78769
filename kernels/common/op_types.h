// Plain types shared by the kernels, the CPU implementation and the server libraries.
// No CUDA and no protobuf here: this header is included on machines without the toolkit.
#pragma once

#include <cstddef>
#include <cstdint>

namespace arfuse {

enum class DType : uint8_t { kBF16 = 1, kFP16 = 2, kFP32 = 3 };

// What an op computes. The FP8 patterns run the add-RMSNorm of kAllReduceResidualRmsNorm and
// quantize its fp32 normalized value to E4M3 codes (quant_out), with the scale formulas of
// kernels/quant/fp8_format.h; their norm_out (the dtype-rounded norm) is optional.
enum class Pattern : uint8_t {
  kAllReduce = 1,  // out = sum over ranks of input
  kAllReduceResidualRmsNorm =
      2,  // residual_out = sum + residual_in; norm_out = rmsnorm(...) * gamma
  // quant_out = e4m3(norm * (1 / scale[0])), scale a device pointer to one fp32 (an input).
  kAllReduceResidualRmsNormFp8Static = 3,
  // scale[t] = max(amax_t / 448, 1/(448*512)) per token (an output, fp32 [tokens]);
  // quant_out = e4m3(norm / scale[t]).
  kAllReduceResidualRmsNormFp8PerToken = 4,
  // Per group of 128 elements along hidden: the group's scale (fp32, or a UE8M0 exponent byte)
  // in the layout FusedOpArgs::scale_layout names (an output); quant_out = e4m3(norm / scale).
  kAllReduceResidualRmsNormFp8PerGroup = 5,
};
inline constexpr int kMaxPattern = 5;

// The pattern traits table: what each pattern reads and writes. Every station asks these instead
// of comparing patterns.
enum class QuantKind : uint8_t { kNone = 0, kStatic = 1, kPerToken = 2, kPerGroup = 3 };
struct PatternTraits {
  bool valid;              // a Pattern value at all
  bool norm;               // residual add + RMSNorm (residual_in, residual_out, gamma)
  bool norm_out_required;  // norm_out must be given (the FP8 patterns: optional)
  QuantKind quant;         // FP8 E4M3 quant_out and its scale
};
inline constexpr PatternTraits TraitsOf(Pattern p) {
  switch (p) {
    case Pattern::kAllReduce:
      return {true, false, false, QuantKind::kNone};
    case Pattern::kAllReduceResidualRmsNorm:
      return {true, true, true, QuantKind::kNone};
    case Pattern::kAllReduceResidualRmsNormFp8Static:
      return {true, true, false, QuantKind::kStatic};
    case Pattern::kAllReduceResidualRmsNormFp8PerToken:
      return {true, true, false, QuantKind::kPerToken};
    case Pattern::kAllReduceResidualRmsNormFp8PerGroup:
      return {true, true, false, QuantKind::kPerGroup};
  }
  return {false, false, false, QuantKind::kNone};
}
inline constexpr bool IsQuantPattern(Pattern p) { return TraitsOf(p).quant != QuantKind::kNone; }
inline constexpr bool IsNormPattern(Pattern p) { return TraitsOf(p).norm; }

inline constexpr size_t DTypeSize(DType t) { return t == DType::kFP32 ? 4 : 2; }

inline constexpr const char* DTypeName(DType t) {
  switch (t) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP16:
      return "fp16";
    case DType::kFP32:
      return "fp32";
  }
  return "unknown";
}

inline constexpr const char* PatternName(Pattern p) {
  switch (p) {
    case Pattern::kAllReduce:
      return "allreduce";
    case Pattern::kAllReduceResidualRmsNorm:
      return "allreduce_residual_rmsnorm";
    case Pattern::kAllReduceResidualRmsNormFp8Static:
      return "allreduce_residual_rmsnorm_fp8_static";
    case Pattern::kAllReduceResidualRmsNormFp8PerToken:
      return "allreduce_residual_rmsnorm_fp8_per_token";
    case Pattern::kAllReduceResidualRmsNormFp8PerGroup:
      return "allreduce_residual_rmsnorm_fp8_per_group";
  }
  return "unknown";
}

// One rank's op as the host sees it: the shape and this rank's tensors, pointers valid in the
// calling process. The engines' OpArgs (server/engine_api/engine.h), the host collective's op and
// the client library's request are this struct.
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
  void* norm_out = nullptr;  // optional for the FP8 patterns
  const void* gamma = nullptr;
  // FP8 patterns: [num_tokens, hidden] E4M3 codes; and the scale:
  // kAllReduceResidualRmsNormFp8Static one fp32 read (an input), ...PerToken fp32 [num_tokens]
  // written, ...PerGroup the group scales in `scale_layout` (a kernels/quant/fp8_format.h
  // GroupScaleLayout value) written.
  void* quant_out = nullptr;
  void* scale = nullptr;
  uint8_t scale_layout = 0;
};

// World sizes the fused kernels support.
inline constexpr bool IsSupportedWorldSize(int n) { return n == 2 || n == 4 || n == 8 || n == 16; }
inline constexpr int kMaxWorldSize = 16;
// The hidden-size rule and every other op rule: kernels/contract/op_contract.h.

}  // namespace arfuse
