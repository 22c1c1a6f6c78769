// FP8 E4M3 outputs of the fused patterns: the constants of the scale formulas and the layouts of
// the scale tensors, shared by the device epilogue (kernels/quant/fp8_quant.cuh) and the CPU
// reference (kernels/quant/fp8_reference.h). Plain C++, no CUDA: the device code calls these
// constexpr functions with --expt-relaxed-constexpr. The formulas and why each constant has its
// value: docs/kernels.md, "FP8 outputs (quantization math)".
#pragma once

#include <cstdint>

namespace arfuse::fp8 {

// Largest finite E4M3 (OCP "e4m3fn": no infinities, 0x7f/0xff are NaN).
inline constexpr float kE4m3Max = 448.0f;
inline constexpr uint8_t kE4m3MaxCode = 0x7e;  // +448; -448 is 0xfe
inline constexpr uint8_t kE4m3NanCode = 0x7f;  // the one NaN a conversion produces

// Floor of a per-token dynamic scale: 1 / (448 * 512) rounded to fp32 (0x36924925), vLLM's
// min_scaling_factor<e4m3fn> and FlashInfer's kDynamicFP8MinScale (the smallest E4M3 subnormal,
// 2^-9, over 448). An all-zero row gets this finite, non-zero scale: no division by zero.
inline constexpr float kMinScalingFactor = 0x1.24924ap-18f;

// Floor of a group's amax for fp32 group scales (vLLM's and SGLang's per_token_group_quant_fp8
// eps default), and the floor of a UE8M0 scale before it is rounded up to a power of two
// (FlashInfer's kUE8M0MinScaleInput): the smallest UE8M0 scale is 2^-33, exponent byte 94.
inline constexpr float kGroupEps = 1e-10f;

// The group width DeepGEMM-style block-scaled GEMMs use along hidden.
inline constexpr uint32_t kGroupSize = 128;

// Where the scale of group g (0 .. groups-1) of token t (0 .. tokens-1) lives.
enum class GroupScaleLayout : uint8_t {
  // float [tokens][groups], row-major (per_token_group_quant_fp8's default).
  kFp32RowMajor = 1,
  // float, token-contiguous with TMA-aligned columns: element g * TmaAlignedTokens(tokens) + t
  // (a [tokens, groups] tensor of strides [1, TmaAlignedTokens(tokens)], DeepGEMM's SM90 input).
  kFp32MnMajor = 2,
  // UE8M0 exponent bytes packed four groups to an int32, token-contiguous with TMA-aligned
  // columns: byte g % 4 (little-endian) of word (g / 4) * TmaAlignedTokens(tokens) + t (a
  // [tokens, ceil(groups / 4)] int32 tensor of strides [1, TmaAlignedTokens(tokens)], DeepGEMM's
  // SM100 input, vLLM's per_token_group_quant_8bit_packed and FlashInfer's
  // kARResidualRMSNormPerTokenGroupFP8PackedQuant).
  kUe8m0Packed = 3,
};

inline constexpr bool IsGroupScaleLayout(GroupScaleLayout layout) {
  return layout == GroupScaleLayout::kFp32RowMajor || layout == GroupScaleLayout::kFp32MnMajor ||
         layout == GroupScaleLayout::kUe8m0Packed;
}

// Tokens rounded up to a multiple of 4: a TMA load needs 16-byte aligned columns, 4 elements of
// 4 bytes (DeepGEMM's get_tma_aligned_size for fp32 and int32).
inline constexpr uint32_t TmaAlignedTokens(uint32_t tokens) { return (tokens + 3u) / 4u * 4u; }

// Columns of the scale tensor: one per group, or one int32 per four groups (kUe8m0Packed).
inline constexpr uint32_t GroupScaleColumns(GroupScaleLayout layout, uint32_t groups) {
  return layout == GroupScaleLayout::kUe8m0Packed ? (groups + 3u) / 4u : groups;
}

// Elements (floats, or int32 words for kUe8m0Packed) a scale tensor of that layout spans. The
// token-contiguous layouts span (columns - 1) * TmaAlignedTokens + tokens: the last column holds
// only the real tokens, as DeepGEMM's tensors do.
inline constexpr uint64_t GroupScaleElements(GroupScaleLayout layout, uint32_t tokens,
                                             uint32_t groups) {
  if (tokens == 0 || groups == 0) return 0;
  if (layout == GroupScaleLayout::kFp32RowMajor) {
    return static_cast<uint64_t>(tokens) * groups;
  }
  return static_cast<uint64_t>(GroupScaleColumns(layout, groups) - 1u) * TmaAlignedTokens(tokens) +
         tokens;
}

// Bytes of that scale tensor (every element is 4 bytes).
inline constexpr uint64_t GroupScaleBytes(GroupScaleLayout layout, uint32_t tokens,
                                          uint32_t groups) {
  return GroupScaleElements(layout, tokens, groups) * 4u;
}

// Byte offset of the scale of group g of token t in that tensor: 4 bytes of a float, or the one
// exponent byte of kUe8m0Packed.
inline constexpr uint64_t GroupScaleByteOffset(GroupScaleLayout layout, uint32_t token,
                                               uint32_t group, uint32_t tokens, uint32_t groups) {
  switch (layout) {
    case GroupScaleLayout::kFp32RowMajor:
      return (static_cast<uint64_t>(token) * groups + group) * 4u;
    case GroupScaleLayout::kFp32MnMajor:
      return (static_cast<uint64_t>(group) * TmaAlignedTokens(tokens) + token) * 4u;
    case GroupScaleLayout::kUe8m0Packed:
      return (static_cast<uint64_t>(group / 4u) * TmaAlignedTokens(tokens) + token) * 4u +
             group % 4u;
  }
  return 0;
}

}  // namespace arfuse::fp8
