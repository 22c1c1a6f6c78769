// A row's last step in the fused kernels (step 5 of docs/kernels.md): the RMSNorm store, and for
// the FP8 patterns the E4M3 quantization of the fp32 normalized value with its scale. CUDA only;
// included by the one-shot and two-shot bodies. The quantization math is kernels/quant/
// fp8_quant.cuh's; docs/kernels.md, "FP8 outputs", gives the formulas and the special values.
#pragma once

#include <cstdint>

#include "kernels/add_rmsnorm/row_math.cuh"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/quant/fp8_quant.cuh"

namespace arfuse {
namespace fusion_device {

using device::Raw16;

// Shared memory of the FP8 epilogue: two buffers for the per-token amax's block reduction,
// alternated row by row as RowSumOfSquares alternates its own (fp8::BlockMax reads its buffer
// after its barrier without a trailing one: row r's buffer is written again at row r + 2, after
// row r + 1's barriers, which every reader of row r passed).
struct QuantScratch {
  float amax[2][32];
};

// The fp32 normalized values of vector k of this thread: (y * inv_rms) * gamma, the value
// NormRowStore rounds to the dtype, computed with the same rounded operations.
template <DType DT, int kVec>
__device__ __forceinline__ void NormalizedVector(const Raw16 (&pre)[kVec], const Raw16 (&g)[kVec],
                                                 int k, float inv_rms,
                                                 float (&x)[device::VecTraits<DT>::kElems]) {
  using Tr = device::VecTraits<DT>;
#pragma unroll
  for (int j = 0; j < Tr::kElems; ++j) {
    const float y = Tr::ToFloat(device::GetBits<DT>(pre[k], j));
    const float gj = Tr::ToFloat(device::GetBits<DT>(g[k], j));
    x[j] = __fmul_rn(__fmul_rn(y, inv_rms), gj);
  }
}

// 1 / scale of the static FP8 pattern (0 otherwise), read once per launch by every thread.
template <bool kQuant>
__device__ __forceinline__ float StaticInvScaleOf(const FusionParams& p) {
  if constexpr (kQuant) {
    if (TraitsOf(p.pattern).quant == QuantKind::kStatic) {
      return device::fp8::StaticInvScale(*static_cast<const float*>(p.scale));
    }
  }
  return 0.0f;
}

// Step 5 of row `row` for the norm patterns, after the block reduced the sum of squares to
// `total`: norm_out (pattern 2; optional for the FP8 patterns), and with kQuant the E4M3 codes of
// the normalized values into quant_out and the row's scales (FusionParams::pattern says which
// scale). Row thread t0 of `stride` holds vectors t0 + k * stride (k < kVec) of the row: `pre`
// the dtype-rounded pre-norm sum, `g` gamma. `ok`: this thread's part of the op succeeded (a
// failed thread stores nothing). Every thread of the block calls it for every row, failed or not:
// the per-token scale is a block reduction and the per-group one a warp shuffle. `parity` picks
// the QuantScratch buffer (the row's, alternating); `static_inv_scale` is StaticInvScaleOf's.
template <DType DT, int kVec, bool kQuant>
__device__ __forceinline__ void NormEpilogue(const FusionParams& p, bool ok, uint32_t row,
                                             const Raw16 (&pre)[kVec], float total, uint32_t t0,
                                             uint32_t stride, uint32_t vecs_per_row,
                                             const Raw16 (&g)[kVec], QuantScratch* qs,
                                             uint32_t parity, float static_inv_scale) {
  using Tr = device::VecTraits<DT>;
  constexpr int kElems = Tr::kElems;
  const uint64_t row_bytes = static_cast<uint64_t>(vecs_per_row) * 16ull;
  if constexpr (!kQuant) {
    if (ok) {
      device::NormRowStore<DT, kVec>(pre, total, t0, stride, vecs_per_row, p.hidden, p.eps, g,
                                     static_cast<char*>(p.norm_out) + row * row_bytes);
    }
  } else {
    static_assert(kElems == 8, "the FP8 patterns take bf16 or fp16 input");
    if (ok && p.norm_out != nullptr) {
      device::NormRowStore<DT, kVec>(pre, total, t0, stride, vecs_per_row, p.hidden, p.eps, g,
                                     static_cast<char*>(p.norm_out) + row * row_bytes);
    }
    // The same inv_rms as NormRowStore (the CPU reference's IEEE operations).
    const float inv_rms = __fdiv_rn(
        1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, static_cast<float>(p.hidden)), p.eps)));
    // One E4M3 byte per element: vector v of the row starts at byte v * kElems.
    char* const q_row = static_cast<char*>(p.quant_out) + static_cast<uint64_t>(row) * p.hidden;
    const QuantKind kind = TraitsOf(p.pattern).quant;  // uniform across the grid
    if (kind == QuantKind::kStatic) {
      if (!ok) return;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const uint32_t v = t0 + k * stride;
        if (v >= vecs_per_row) continue;
        float x[kElems];
        NormalizedVector<DT, kVec>(pre, g, k, inv_rms, x);
        device::fp8::StoreE4m3Multiplied<kElems>(x, static_inv_scale, q_row + v * kElems);
      }
    } else if (kind == QuantKind::kPerToken) {
      float local = 0.0f;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const uint32_t v = t0 + k * stride;
        if (!ok || v >= vecs_per_row) continue;
        float x[kElems];
        NormalizedVector<DT, kVec>(pre, g, k, inv_rms, x);
        local = device::fp8::AbsMaxInto<kElems>(local, x);
      }
      const float amax = device::fp8::BlockMax(local, qs->amax[parity]);
      if (!ok) return;
      const float scale = device::fp8::DynamicTokenScale(amax);
      if (threadIdx.x == 0) static_cast<float*>(p.scale)[row] = scale;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const uint32_t v = t0 + k * stride;
        if (v >= vecs_per_row) continue;
        float x[kElems];
        NormalizedVector<DT, kVec>(pre, g, k, inv_rms, x);
        device::fp8::StoreE4m3Divided<kElems>(x, scale, q_row + v * kElems);
      }
    } else {
      // Per group of fp8::kGroupSize elements: kLanes consecutive, aligned lanes of one warp hold
      // a group at the same k (stride is whole warps and hidden a multiple of the group, so a
      // group is wholly inside or outside the row). Every lane shuffles for every k.
      constexpr uint32_t kGroup = fp8::kGroupSize;
      constexpr uint32_t kLanes = device::fp8::kGroupLanes<kGroup, kElems>;
      const auto layout = static_cast<fp8::GroupScaleLayout>(p.scale_layout);
      const uint32_t groups = p.hidden / kGroup;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const uint32_t v = t0 + k * stride;
        const bool mine = ok && v < vecs_per_row;
        float x[kElems];
        if (mine) {
          NormalizedVector<DT, kVec>(pre, g, k, inv_rms, x);
        } else {
#pragma unroll
          for (int j = 0; j < kElems; ++j) x[j] = 0.0f;
        }
        const float amax = device::fp8::GroupAbsMax<kGroup, kElems>(x);
        if (!mine) continue;
        const uint32_t group = v / kLanes;
        if (layout == fp8::GroupScaleLayout::kUe8m0Packed) {
          const uint8_t byte = device::fp8::Ue8m0FromAmax(amax);
          if (v % kLanes == 0) {
            device::fp8::StoreGroupScale(layout, p.scale, row, group, p.num_tokens, groups, 0.0f,
                                         byte);
          }
          device::fp8::StoreE4m3Multiplied<kElems>(x, device::fp8::Ue8m0Reciprocal(byte),
                                                   q_row + v * kElems);
        } else {
          const float scale = device::fp8::GroupScaleFp32(amax);
          if (v % kLanes == 0) {
            device::fp8::StoreGroupScale(layout, p.scale, row, group, p.num_tokens, groups, scale,
                                         0);
          }
          device::fp8::StoreE4m3Divided<kElems>(x, scale, q_row + v * kElems);
        }
      }
      if (ok && threadIdx.x == 0) {
        device::fp8::ZeroGroupScalePadding(layout, p.scale, row, p.num_tokens, groups);
      }
    }
  }
}

}  // namespace fusion_device
}  // namespace arfuse
