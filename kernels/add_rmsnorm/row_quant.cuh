// The FP8 E4M3 part of a row's last step, shared by the fused kernels' epilogue
// (kernels/allreduce_fusion/fusion_epilogue.cuh) and the unfused path's add-RMSNorm kernel
// (add_rmsnorm.cu): the fp32 normalized value of each element, its code, and the row's scales, in
// the row layout of row_math.cuh. One home, so both paths quantize the same value with the same
// operations (kernels/quant/fp8_quant.cuh's device math). CUDA only; docs/kernels.md, "FP8
// outputs", gives the formulas and the special values.
#pragma once

#include <cstdint>

#include "kernels/add_rmsnorm/row_math.cuh"
#include "kernels/common/op_types.h"
#include "kernels/quant/fp8_quant.cuh"

namespace arfuse {
namespace device {

// What a row's quantization reads of its op: the kind (kStatic, kPerToken or kPerGroup; uniform
// across the grid), the [num_tokens, hidden] E4M3 codes and the per-token / per-group scales
// (written; the static scale is read once per launch into static_inv_scale instead).
struct QuantRowOp {
  QuantKind kind;
  uint8_t scale_layout;  // kPerGroup: an fp8::GroupScaleLayout value
  uint32_t num_tokens;
  uint32_t hidden;
  void* quant_out;
  void* scale;
};

// The fp32 normalized values of vector k of this thread: (y * inv_rms) * gamma, the value
// NormRowStore rounds to the dtype, computed with the same rounded operations.
template <DType DT, int kVec>
__device__ __forceinline__ void NormalizedVector(const Raw16 (&pre)[kVec], const Raw16 (&g)[kVec],
                                                 int k, float inv_rms,
                                                 float (&x)[VecTraits<DT>::kElems]) {
  using Tr = VecTraits<DT>;
#pragma unroll
  for (int j = 0; j < Tr::kElems; ++j) {
    const float y = Tr::ToFloat(GetBits<DT>(pre[k], j));
    const float gj = Tr::ToFloat(GetBits<DT>(g[k], j));
    x[j] = __fmul_rn(__fmul_rn(y, inv_rms), gj);
  }
}

// The E4M3 codes of row `row` and its scales, after the block reduced the sum of squares to
// `total`. Row thread t0 of `stride` holds vectors t0 + k * stride (k < kVec) of the row: `pre`
// the dtype-rounded pre-norm sum, `g` gamma. `ok`: this thread's part of the op succeeded (a
// failed thread stores nothing). Every thread of the block calls it for every row, failed or not:
// the per-token scale is a block reduction (fp8::BlockMax over `amax_scratch`, 32 floats, which
// must not be written again before every thread passed a later barrier) and the per-group one a
// warp shuffle. `static_inv_scale`: fp8::InvScale of the static scale (kStatic only).
// kKeepValues (per-token): keep the normalized values in registers across the block reduction
// instead of computing them again after it. At up to two vectors per thread (hidden up to 8192
// at 16-bit dtypes) keeping them saves about 140 of a row's 2270-2920 cycles (`arfuse-bench
// epilogue`, docs/performance.md); larger rows compute them twice, their kernels being at the
// register limit their block size allows (kKeepValuesFit).
template <int kVec>
inline constexpr bool kKeepValuesFit = kVec <= 2;

template <DType DT, int kVec, bool kKeepValues = kKeepValuesFit<kVec>>
__device__ __forceinline__ void QuantizeRow(const QuantRowOp& q, float eps, bool ok, uint32_t row,
                                            const Raw16 (&pre)[kVec], float total, uint32_t t0,
                                            uint32_t stride, uint32_t vecs_per_row,
                                            const Raw16 (&g)[kVec], float* amax_scratch,
                                            float static_inv_scale) {
  constexpr int kElems = VecTraits<DT>::kElems;
  static_assert(kElems == 8, "the FP8 patterns take bf16 or fp16 input");
  // The same inv_rms as NormRowStore (the CPU reference's IEEE operations).
  const float inv_rms =
      __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, static_cast<float>(q.hidden)), eps)));
  // One E4M3 byte per element: vector v of the row starts at byte v * kElems.
  char* const q_row = static_cast<char*>(q.quant_out) + static_cast<uint64_t>(row) * q.hidden;
  if (q.kind == QuantKind::kStatic) {
    if (!ok) return;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const uint32_t v = t0 + k * stride;
      if (v >= vecs_per_row) continue;
      float x[kElems];
      NormalizedVector<DT, kVec>(pre, g, k, inv_rms, x);
      fp8::StoreE4m3Multiplied<kElems>(x, static_inv_scale, q_row + v * kElems);
    }
  } else if (q.kind == QuantKind::kPerToken) {
    // The values are needed before the block reduction (amax) and after it (codes). At up to
    // kKeepValuesFit's two vectors per thread every k is computed whether its vector lies in the
    // row or not (only an in-row vector's amax counts and its codes are stored): with no branch
    // around each k, the arithmetic of the thread's vectors overlaps. Larger rows branch, so as
    // not to add to their kernels' registers.
    constexpr bool kEveryK = kKeepValuesFit<kVec>;
    float kept[kKeepValues ? kVec : 1][kElems];
    float local = 0.0f;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const bool in_row = ok && t0 + k * stride < vecs_per_row;
      if (!kEveryK && !in_row) continue;
      float x[kElems];
      NormalizedVector<DT, kVec>(pre, g, k, inv_rms, x);
      const float with_k = fp8::AbsMaxInto<kElems>(local, x);
      local = in_row ? with_k : local;
      if constexpr (kKeepValues) {
#pragma unroll
        for (int j = 0; j < kElems; ++j) kept[k][j] = x[j];
      }
    }
    const float amax = fp8::BlockMax(local, amax_scratch);
    if (!ok) return;
    const float scale = fp8::DynamicTokenScale(amax);
    if (threadIdx.x == 0) static_cast<float*>(q.scale)[row] = scale;
    const float inv_scale = fp8::InvScale(scale);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const uint32_t v = t0 + k * stride;
      if (!kEveryK && v >= vecs_per_row) continue;
      float x[kElems];
      if constexpr (kKeepValues) {
#pragma unroll
        for (int j = 0; j < kElems; ++j) x[j] = kept[k][j];
      } else {
        NormalizedVector<DT, kVec>(pre, g, k, inv_rms, x);
      }
      if (v < vecs_per_row) fp8::StoreE4m3Multiplied<kElems>(x, inv_scale, q_row + v * kElems);
    }
  } else {
    // Per group of fp8::kGroupSize elements: kLanes consecutive, aligned lanes of one warp hold
    // a group at the same k (stride is whole warps and hidden a multiple of the group, so a
    // group is wholly inside or outside the row). Every lane shuffles for every k.
    constexpr uint32_t kGroup = ::arfuse::fp8::kGroupSize;
    constexpr uint32_t kLanes = fp8::kGroupLanes<kGroup, kElems>;
    const auto layout = static_cast<::arfuse::fp8::GroupScaleLayout>(q.scale_layout);
    const uint32_t groups = q.hidden / kGroup;
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
      const float amax = fp8::GroupAbsMax<kGroup, kElems>(x);
      if (!mine) continue;
      const uint32_t group = v / kLanes;
      if (layout == ::arfuse::fp8::GroupScaleLayout::kUe8m0Packed) {
        const uint8_t byte = fp8::Ue8m0FromAmax(amax);
        if (v % kLanes == 0) {
          fp8::StoreGroupScale(layout, q.scale, row, group, q.num_tokens, groups, 0.0f, byte);
        }
        fp8::StoreE4m3Multiplied<kElems>(x, fp8::Ue8m0Reciprocal(byte), q_row + v * kElems);
      } else {
        const float scale = fp8::GroupScaleFp32(amax);
        if (v % kLanes == 0) {
          fp8::StoreGroupScale(layout, q.scale, row, group, q.num_tokens, groups, scale, 0);
        }
        fp8::StoreE4m3Multiplied<kElems>(x, fp8::InvScale(scale), q_row + v * kElems);
      }
    }
    if (ok) fp8::ZeroGroupScalePadding(layout, q.scale, row, q.num_tokens, groups, t0, stride);
  }
}

}  // namespace device
}  // namespace arfuse
