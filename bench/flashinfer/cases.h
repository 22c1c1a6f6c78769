// The ops arfuse-bench-flashinfer compares: each case names arfuse's pattern (and per-group
// scale layout) and the FlashInfer trtllm_allreduce_fusion pattern that computes the same thing,
// plus the tensors one rank of either framework reads and writes. Plain C++ (no CUDA, no
// FlashInfer): both frameworks' launch files include it.
#pragma once

#include <cstdint>

#include "kernels/common/op_types.h"
#include "kernels/quant/fp8_format.h"

namespace arfuse::bench_fi {

inline constexpr int kWorld = 2;  // the harness runs two ranks on one GPU
inline constexpr float kEps = 1e-6f;

enum class Case : uint8_t {
  kNorm = 0,           // arfuse 2 / FlashInfer kARResidualRMSNorm (1): bf16 norm_out
  kFp8Static = 1,      // arfuse 3 / kARResidualRMSNormFP8Quant (2): one fp32 scale, read
  kFp8PerToken = 2,    // arfuse 4 / kARResidualRMSNormDynamicFP8Quant (10): fp32 per token
  kFp8GroupUe8m0 = 3,  // arfuse 5, kUe8m0Packed / kARResidualRMSNormPerTokenGroupFP8PackedQuant (8)
  kFp8GroupFp32 = 4,   // arfuse 5, kFp32RowMajor / the same FlashInfer pattern 8 (UE8M0 scales)
};
inline constexpr int kNumCases = 5;

struct CaseInfo {
  const char* name;
  Pattern arfuse_pattern;
  uint8_t scale_layout;    // fp8::GroupScaleLayout for the per-group pattern, else 0
  int flashinfer_pattern;  // FlashInfer's AllReduceFusionPattern value
  const char* flashinfer_name;
  QuantKind quant;
};

inline constexpr CaseInfo InfoOf(Case c) {
  switch (c) {
    case Case::kNorm:
      return {"norm",          Pattern::kAllReduceResidualRmsNorm, 0, 1, "kARResidualRMSNorm",
              QuantKind::kNone};
    case Case::kFp8Static:
      return {"fp8_static",
              Pattern::kAllReduceResidualRmsNormFp8Static,
              0,
              2,
              "kARResidualRMSNormFP8Quant",
              QuantKind::kStatic};
    case Case::kFp8PerToken:
      return {"fp8_per_token",
              Pattern::kAllReduceResidualRmsNormFp8PerToken,
              0,
              10,
              "kARResidualRMSNormDynamicFP8Quant",
              QuantKind::kPerToken};
    case Case::kFp8GroupUe8m0:
      return {"fp8_group_ue8m0",
              Pattern::kAllReduceResidualRmsNormFp8PerGroup,
              static_cast<uint8_t>(fp8::GroupScaleLayout::kUe8m0Packed),
              8,
              "kARResidualRMSNormPerTokenGroupFP8PackedQuant",
              QuantKind::kPerGroup};
    case Case::kFp8GroupFp32:
      return {"fp8_group_fp32",
              Pattern::kAllReduceResidualRmsNormFp8PerGroup,
              static_cast<uint8_t>(fp8::GroupScaleLayout::kFp32RowMajor),
              8,
              "kARResidualRMSNormPerTokenGroupFP8PackedQuant",
              QuantKind::kPerGroup};
  }
  return {"unknown", Pattern::kAllReduceResidualRmsNorm, 0, 1, "unknown", QuantKind::kNone};
}

// Bytes of one rank's scale output for the case at `tokens` x `hidden` (FlashInfer's pattern 8
// writes the same UE8M0 packed tensor arfuse's kUe8m0Packed does); 4 for the static scale.
inline constexpr uint64_t ScaleBytesOf(Case c, uint32_t tokens, uint32_t hidden) {
  switch (InfoOf(c).quant) {
    case QuantKind::kNone:
      return 0;
    case QuantKind::kStatic:
      return 4;
    case QuantKind::kPerToken:
      return uint64_t{tokens} * 4;
    case QuantKind::kPerGroup:
      return fp8::GroupScaleBytes(static_cast<fp8::GroupScaleLayout>(InfoOf(c).scale_layout),
                                  tokens, hidden / fp8::kGroupSize);
  }
  return 0;
}

// Bytes of the scale tensor a framework writes for the case (0 for kNorm and the static scale,
// an input): FlashInfer's per-group pattern always writes UE8M0 packed scales.
inline constexpr uint64_t WrittenScaleBytes(Case c, uint32_t tokens, uint32_t hidden,
                                            bool flashinfer) {
  const QuantKind q = InfoOf(c).quant;
  if (q != QuantKind::kPerToken && q != QuantKind::kPerGroup) return 0;
  return ScaleBytesOf(flashinfer && q == QuantKind::kPerGroup ? Case::kFp8GroupUe8m0 : c, tokens,
                      hidden);
}

// What one rank of one framework reads and writes (device pointers of this process, bf16 rows
// of `hidden`). norm_out only for kNorm; quant_out and scale for the FP8 cases (the static
// case's scale is the input scale, shared by both ranks and frameworks).
struct RankTensors {
  const void* input = nullptr;
  const void* residual_in = nullptr;
  const void* gamma = nullptr;
  void* residual_out = nullptr;
  void* norm_out = nullptr;
  void* quant_out = nullptr;
  void* scale = nullptr;
};

// One op of one rank.
struct RankOp {
  Case c = Case::kNorm;
  bool oneshot = true;
  uint32_t tokens = 0;
  uint32_t hidden = 0;
  RankTensors t;
};

}  // namespace arfuse::bench_fi
