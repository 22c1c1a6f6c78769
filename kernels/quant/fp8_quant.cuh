// Device math for FP8 E4M3 outputs computed in a fused kernel's epilogue from the fp32
// normalized value: the conversion, the amax reductions of a row held in registers with the
// row layout of kernels/add_rmsnorm/row_math.cuh, the scale formulas and the UE8M0 scales. CUDA
// only. kernels/quant/fp8_reference.h computes the same bits on the CPU; the formulas and the
// special values: docs/kernels.md, "FP8 outputs (quantization math)".
//
// Every arithmetic step is an explicitly rounded intrinsic (__frcp_rn, __fmul_rn, __fmaf_rn), so no
// compiler flag (--use_fast_math, FMA contraction) changes a result.
#pragma once

#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/quant/fp8_format.h"

namespace arfuse::device::fp8 {

using ::arfuse::fp8::GroupScaleLayout;
using ::arfuse::fp8::kE4m3Max;
using ::arfuse::fp8::kGroupEps;
using ::arfuse::fp8::kMinScalingFactor;

__host__ __device__ __forceinline__ float MulRn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// a * b + c with one rounding (std::fmaf on the host).
__host__ __device__ __forceinline__ float FmaRn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fmaf(a, b, c);
#endif
}

__host__ __device__ __forceinline__ uint32_t BitsOf(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  return bits;
}

// RN(1 / a), correctly rounded.
__host__ __device__ __forceinline__ float RcpRn(float a) {
#ifdef __CUDA_ARCH__
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}

// fp32 -> E4M3 code, round to nearest even, saturating to +-448 (cvt.rn.satfinite.e4m3x2.f32
// on sm_89 and later; cuda_fp8.hpp's software conversion on the host).
__host__ __device__ __forceinline__ uint8_t E4m3FromFloat(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// Two codes in one instruction, `lo` in the low byte (each exactly as E4m3FromFloat rounds it).
__host__ __device__ __forceinline__ uint32_t E4m3PairFromFloats(float lo, float hi) {
  return static_cast<uint32_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

// Four codes as one little-endian word, element 0 in the low byte (the order in memory).
__host__ __device__ __forceinline__ uint32_t E4m3QuadFromFloats(float a, float b, float c,
                                                                float d) {
  return E4m3PairFromFloats(a, b) | (E4m3PairFromFloats(c, d) << 16);
}

// amax / 448 for an amax (>= 0, or inf), correctly rounded without a division (one per row or
// group in the epilogue): q0 = RN(amax * RN(1 / 448)) is within one ulp of the quotient, the
// residual amax - q0 * 448 is exact in one fma, and RN(q0 + residual * RN(1 / 448)) is then the
// correctly rounded quotient (Markstein's theorem) wherever the residual and the quotient are
// normal: for amax >= 2^-100, and every formula floors smaller quotients far above that
// (kMinScalingFactor, kGroupEps). An infinite amax gives inf (its residual would be NaN).
// tests/kernels/fp8_quant_host_test.cu checks it against the IEEE quotient.
__host__ __device__ __forceinline__ float AmaxOver448(float amax) {
  constexpr float kInv448 = 1.0f / kE4m3Max;  // folded by the compiler: RN(1 / 448)
  const float q0 = MulRn(amax, kInv448);
  const float q = FmaRn(FmaRn(-q0, kE4m3Max, amax), kInv448, q0);
  return (BitsOf(q0) & 0x7fffffffu) == 0x7f800000u ? q0 : q;
}

// Scale formulas (fp8_reference.h states each; these give the same bits).
// RN(1 / scale), what every pattern but UE8M0 multiplies by: the static scale once per launch,
// a per-token or fp32 group scale once per row or group. __frcp_rn is correctly rounded, so it
// has the bits of the host's 1.0f / scale without a division's subroutine.
__host__ __device__ __forceinline__ float InvScale(float scale) { return RcpRn(scale); }
__host__ __device__ __forceinline__ float DynamicTokenScale(float amax) {
  return fmaxf(AmaxOver448(amax), kMinScalingFactor);
}
__host__ __device__ __forceinline__ float GroupScaleFp32(float amax) {
  return AmaxOver448(fmaxf(amax, kGroupEps));
}
// 2^ceil(log2(max(amax / 448, 1e-10))) as its exponent byte: the fp32 exponent field, plus one
// when any fraction bit is set (the value is then not a power of two). The floor keeps the
// scale a normal float, and a finite amax / 448 is far below 2^127, so no carry overflows.
__host__ __device__ __forceinline__ uint8_t Ue8m0FromAmax(float amax) {
  const float s = fmaxf(AmaxOver448(amax), kGroupEps);
  uint32_t bits;
  memcpy(&bits, &s, sizeof(bits));
  return static_cast<uint8_t>(((bits >> 23) & 0xffu) + ((bits & 0x7fffffu) != 0u ? 1u : 0u));
}
// 1 / 2^(byte - 127), exact: dividing by a power of two and multiplying by its reciprocal round
// the same real number, so x * Ue8m0Reciprocal(e) has the bits of x / 2^(e - 127). The
// reciprocal 2^(127 - byte) is a power of two too, written as its exponent field 254 - byte (no
// division): normal for bytes 1-253, the subnormal 2^-127 for 254, and 0 for 255
// (an infinite amax gives 2^128 = inf, and x / inf and x * 0 agree). Byte 0 reads as the float 0
// and gives inf; Ue8m0FromAmax never gives it (its floor is byte 94).
__host__ __device__ __forceinline__ float Ue8m0Reciprocal(uint8_t byte) {
  uint32_t bits;
  if (byte == 0u) {
    bits = 0x7f800000u;
  } else if (byte <= 253u) {
    bits = (254u - byte) << 23;
  } else {
    bits = byte == 254u ? 0x00400000u : 0u;
  }
  float reciprocal;
  memcpy(&reciprocal, &bits, sizeof(reciprocal));
  return reciprocal;
}

// ---- amax over a row held in registers --------------------------------------------------------
// The row layout (kernels/add_rmsnorm/row_math.cuh): a row of V 16-byte vectors of kElems
// elements (8 for bf16/fp16, 4 for fp32) is held by T row threads, a whole number of warps;
// row thread t holds vectors t, t + T, ..., t + (P - 1) T. An epilogue has the fp32 normalized
// values of its vectors in registers. fmaxf is exact, commutative and associative on the
// non-negative values |x| (NaN is never returned while another operand is a number), so any
// tree gives the CPU's bits.

// max(acc, |f[j]|) over the kElems values of one vector, for an acc of +0 or more (not NaN).
// The values meet in a tree, log2 kElems fmaxf deep, and then acc: as a chain of kElems from
// acc, the 16 fmaxf over a per-token row's two vectors lay in series on the row's way to its
// amax reduction (docs/performance.md, "The per-token amax as a tree"). A NaN loses to any
// number at every step, and a vector of NaNs alone leaves acc, as the chain from acc does.
template <int kElems>
__device__ __forceinline__ float AbsMaxInto(float acc, const float (&f)[kElems]) {
  static_assert(kElems >= 1 && (kElems & (kElems - 1)) == 0, "a power-of-two vector");
  float m[kElems];
#pragma unroll
  for (int j = 0; j < kElems; ++j) m[j] = fabsf(f[j]);
#pragma unroll
  for (int width = kElems / 2; width > 0; width /= 2) {
#pragma unroll
    for (int j = 0; j < width; ++j) m[j] = fmaxf(m[j], m[j + width]);
  }
  return fmaxf(acc, m[0]);
}

// Max over aligned groups of kLanes lanes of a warp (a power of two up to 32): each lane ends
// with its group's maximum. Every lane of the warp must call it. For amax values only: +0 or
// more, or +inf, never NaN or negative (AbsMaxInto's, which start from 0 and take fmaxf of |x|).
// Such floats order as their bit patterns do, so over the whole warp one redux.sync max over the
// bits (sm_80 and later) gives exactly the value a shuffle butterfly of fmaxf gives, in one
// instruction instead of five shuffles in series: the per-token scale's BlockMax, twice a row.
// Groups of 16 lanes (the per-group scales at group 128 for bf16/fp16) take two such whole-warp
// reductions instead of four shuffles: 113-127 cycles less per row (docs/performance.md, "The
// per-group amax in two whole-warp reductions"). redux.sync with a group's own lanes as the
// member mask measured slower at 512-2048 tokens ("The per-token pattern's own kernels").
// Smaller groups keep the butterfly.
template <int kLanes>
__device__ __forceinline__ float LaneGroupMax(float v) {
  static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0);
  if constexpr (kLanes == 32) {
    return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(v)));
  } else if constexpr (kLanes == 16) {
    // Two whole-warp reductions, each over one half's values with the other half's as +0 (the
    // identity for amax values): every lane runs both with the full member mask, so the warp
    // never splits into two groups of 16 as a redux.sync per half's mask does.
    const uint32_t bits = __float_as_uint(v);
    const bool low = (threadIdx.x & 16u) == 0;
    const uint32_t low_max = __reduce_max_sync(0xffffffffu, low ? bits : 0u);
    const uint32_t high_max = __reduce_max_sync(0xffffffffu, low ? 0u : bits);
    return __uint_as_float(low ? low_max : high_max);
  } else {
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset >>= 1) {
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
  }
}

// Max over the block of amax values (LaneGroupMax's): lanes, then every warp reduces the
// per-warp partials (0 beyond the last warp: amax starts at 0). blockDim.x must be a multiple of
// 32 and every thread must call it. `scratch` holds 32 floats and is read after
// the call's barrier without a trailing one: it must not be written again before every thread
// has passed a later barrier (alternate two buffers row by row, as the fused kernels'
// RowSumOfSquares does, or __syncthreads() before reuse).
__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  v = LaneGroupMax<32>(v);
  const uint32_t lane = threadIdx.x & 31u;
  // Every lane stores its warp's maximum (one value, to one word) and loads a word, those past
  // the last warp's discarded: with no branch around the store or the load, their addresses are
  // formed off the row's path. Behind `lane == 0` and `lane < warps` branches each address (an
  // S2R and about eight instructions) was formed after the redux.sync and after the barrier.
  scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  const float partial = scratch[lane];
  return LaneGroupMax<32>(lane < (blockDim.x >> 5) ? partial : 0.0f);
}

// Row threads that share one group of kGroupElems elements: the group is kGroupElems / kElems
// consecutive vectors, so with T a multiple of 32 it is held by that many consecutive, aligned
// lanes of one warp at the same k (at group 128: 16 lanes for bf16/fp16, the whole warp for
// fp32). A group never straddles two warps or two k.
template <int kGroupElems, int kElems>
inline constexpr int kGroupLanes = kGroupElems / kElems;

// The group amax of vector k of this thread: the thread's |max| over its vector, reduced over
// the group's lanes. Every lane of the warp must call it for the same k (lanes whose vector is
// past the row pass any value; their result is not used, since hidden is a multiple of the group
// and so a group is wholly in or out of the row).
template <int kGroupElems, int kElems>
__device__ __forceinline__ float GroupAbsMax(const float (&f)[kElems]) {
  constexpr int kLanes = kGroupLanes<kGroupElems, kElems>;
  static_assert(kGroupElems % kElems == 0 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0,
                "a group must be a power-of-two number of vectors, at most a warp");
  return LaneGroupMax<kLanes>(AbsMaxInto<kElems>(0.0f, f));
}

// ---- stores -----------------------------------------------------------------------------------

// The kElems codes of one vector (4 or 8 bytes) at `dst` (aligned to kElems bytes: vector v of a
// row of E4M3 codes starts at byte v * kElems).
template <int kElems>
__device__ __forceinline__ void StoreE4m3(const float (&scaled)[kElems], void* dst) {
  static_assert(kElems == 4 || kElems == 8);
  if constexpr (kElems == 4) {
    *static_cast<uint32_t*>(dst) = E4m3QuadFromFloats(scaled[0], scaled[1], scaled[2], scaled[3]);
  } else {
    *static_cast<uint2*>(dst) =
        make_uint2(E4m3QuadFromFloats(scaled[0], scaled[1], scaled[2], scaled[3]),
                   E4m3QuadFromFloats(scaled[4], scaled[5], scaled[6], scaled[7]));
  }
}

// q = E4M3(f * inv_scale), the codes of every pattern: inv_scale = InvScale(scale) for the
// static, per-token and fp32 group scales, Ue8m0Reciprocal(byte) for UE8M0 groups. Against the
// exact quotient's E4M3(f / scale) a code is at most one E4M3 step away (docs/kernels.md, "How
// the codes are computed"; tests/kernels/fp8_quant_gpu_test.cu checks every fp32 f): f * inv
// is within about one fp32 ulp of f / scale, so the two straddle at most one rounding boundary.
// An infinite scale (a row or group holding +-inf) has inv = +0: finite values give +-0 and an
// infinity NaN, what f / inf gives. One multiply per element and no division: the division's
// Markstein correction cost 260-430 cycles per per-token row of the epilogue (docs/
// performance.md, "Codes from the reciprocal for every scale").
template <int kElems>
__device__ __forceinline__ void StoreE4m3Multiplied(const float (&f)[kElems], float inv_scale,
                                                    void* dst) {
  float s[kElems];
#pragma unroll
  for (int j = 0; j < kElems; ++j) s[j] = MulRn(f[j], inv_scale);
  StoreE4m3<kElems>(s, dst);
}

// The scale of group g of token t: a float, or the exponent byte (kUe8m0Packed).
__device__ __forceinline__ void StoreGroupScale(GroupScaleLayout layout, void* scales,
                                                uint32_t token, uint32_t group, uint32_t tokens,
                                                uint32_t groups, float fp32_scale,
                                                uint8_t ue8m0_byte) {
  const uint64_t at = ::arfuse::fp8::GroupScaleByteOffset(layout, token, group, tokens, groups);
  if (layout == GroupScaleLayout::kUe8m0Packed) {
    static_cast<uint8_t*>(scales)[at] = ue8m0_byte;
  } else {
    *reinterpret_cast<float*>(static_cast<char*>(scales) + at) = fp32_scale;
  }
}

// Writes 0 into the bytes of the scale tensor that hold no group's scale and belong to token
// t's share: for kUe8m0Packed the unused bytes of t's last packed word; for the token-contiguous
// layouts, when t is the last token, the TMA padding entries (tokens .. TmaAlignedTokens - 1)
// of every column but the last. So a tensor from an uninitialized allocation comes out fully
// defined, as DeepGEMM's TMA loads read padding too. Called by `count` threads of the token's
// row, thread `index` of them writing every count-th entry: at one token and hidden 8192 the
// UE8M0 tensor has 45 padding words, which one thread alone writes in series after its row.
__device__ __forceinline__ void ZeroGroupScalePadding(GroupScaleLayout layout, void* scales,
                                                      uint32_t token, uint32_t tokens,
                                                      uint32_t groups, uint32_t index,
                                                      uint32_t count) {
  if (layout == GroupScaleLayout::kFp32RowMajor || groups == 0) return;
  auto* bytes = static_cast<uint8_t*>(scales);
  if (layout == GroupScaleLayout::kUe8m0Packed && index == 0) {
    for (uint32_t g = groups; g % 4u != 0u; ++g) {
      bytes[::arfuse::fp8::GroupScaleByteOffset(layout, token, g, tokens, groups)] = 0u;
    }
  }
  if (token + 1u != tokens) return;
  const uint32_t aligned = ::arfuse::fp8::TmaAlignedTokens(tokens);
  const uint32_t pads = aligned - tokens;  // 0-3 per column
  const uint32_t columns = ::arfuse::fp8::GroupScaleColumns(layout, groups);
  auto* words = reinterpret_cast<uint32_t*>(scales);
  for (uint32_t i = index; i < (columns - 1u) * pads; i += count) {
    words[static_cast<uint64_t>(i / pads) * aligned + tokens + i % pads] = 0u;
  }
}

}  // namespace arfuse::device::fp8
