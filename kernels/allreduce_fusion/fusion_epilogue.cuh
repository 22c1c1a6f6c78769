// A row's last step in the fused kernels (step 5 of docs/kernels.md): the RMSNorm store, and for
// the FP8 patterns the E4M3 quantization of the fp32 normalized value with its scale. CUDA only;
// included by the one-shot and two-shot bodies. The quantization is kernels/add_rmsnorm/
// row_quant.cuh's (the unfused path's too), over kernels/quant/fp8_quant.cuh's math;
// docs/kernels.md, "FP8 outputs", gives the formulas and the special values.
#pragma once

#include <cstdint>

#include "kernels/add_rmsnorm/row_math.cuh"
#include "kernels/add_rmsnorm/row_quant.cuh"
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

// What a kernel's norm epilogue quantizes, fixed when it is instantiated: nothing (the
// unquantized patterns), one QuantKind (a kernel only launched for the FP8 pattern of that kind:
// the other kinds' code is not in it), or kAny (FusionParams::pattern says which at run time: the
// indirect kernels and the doorbell's serving kernel). The first four values are QuantKind's, so
// the two convert by value.
enum class EpilogueQuant : uint8_t { kNone = 0, kStatic = 1, kPerToken = 2, kPerGroup = 3, kAny };
static_assert(static_cast<int>(EpilogueQuant::kNone) == static_cast<int>(QuantKind::kNone) &&
              static_cast<int>(EpilogueQuant::kStatic) == static_cast<int>(QuantKind::kStatic) &&
              static_cast<int>(EpilogueQuant::kPerToken) ==
                  static_cast<int>(QuantKind::kPerToken) &&
              static_cast<int>(EpilogueQuant::kPerGroup) == static_cast<int>(QuantKind::kPerGroup));
inline constexpr EpilogueQuant EpilogueQuantOf(QuantKind kind) {
  return static_cast<EpilogueQuant>(kind);
}
// The kind a launch of a kQuant kernel quantizes with: kQuant's own, or the pattern's (kAny).
template <EpilogueQuant kQuant>
__device__ __forceinline__ QuantKind QuantKindOf(const FusionParams& p) {
  if constexpr (kQuant == EpilogueQuant::kAny) {
    return TraitsOf(p.pattern).quant;
  } else {
    return static_cast<QuantKind>(kQuant);
  }
}

// 1 / scale of the static FP8 pattern (0 otherwise), read once per launch by every thread.
template <EpilogueQuant kQuant>
__device__ __forceinline__ float StaticInvScaleOf(const FusionParams& p) {
  if constexpr (kQuant != EpilogueQuant::kNone) {
    if (QuantKindOf<kQuant>(p) == QuantKind::kStatic) {
      return device::fp8::InvScale(*static_cast<const float*>(p.scale));
    }
  }
  return 0.0f;
}

// Step 5 of row `row` for the norm patterns, after the block reduced the sum of squares to
// `total`: norm_out (pattern 2; optional for the FP8 patterns), and for the FP8 patterns the E4M3
// codes of the normalized values into quant_out and the row's scales (FusionParams::pattern says
// which scale). Row thread t0 of `stride` holds vectors t0 + k * stride (k < kVec) of the row:
// `pre` the dtype-rounded pre-norm sum, `g` gamma. `ok`: this thread's part of the op succeeded (a
// failed thread stores nothing). Every thread of the block calls it for every row, failed or not:
// the per-token scale is a block reduction and the per-group one a warp shuffle. `parity` picks
// the QuantScratch buffer (the row's, alternating); `static_inv_scale` is StaticInvScaleOf's.
template <DType DT, int kVec, EpilogueQuant kQuant>
__device__ __forceinline__ void NormEpilogue(const FusionParams& p, bool ok, uint32_t row,
                                             const Raw16 (&pre)[kVec], float total, uint32_t t0,
                                             uint32_t stride, uint32_t vecs_per_row,
                                             const Raw16 (&g)[kVec], QuantScratch* qs,
                                             uint32_t parity, float static_inv_scale) {
  const uint64_t row_bytes = static_cast<uint64_t>(vecs_per_row) * 16ull;
  if constexpr (kQuant == EpilogueQuant::kNone) {
    if (ok) {
      device::NormRowStore<DT, kVec>(pre, total, t0, stride, vecs_per_row, p.hidden, p.eps, g,
                                     static_cast<char*>(p.norm_out) + row * row_bytes);
    }
  } else {
    if (ok && p.norm_out != nullptr) {
      device::NormRowStore<DT, kVec>(pre, total, t0, stride, vecs_per_row, p.hidden, p.eps, g,
                                     static_cast<char*>(p.norm_out) + row * row_bytes);
    }
    // The unfused path's add-RMSNorm kernel quantizes with the same function: both paths give
    // the same codes and scales for the same normalized values.
    const device::QuantRowOp q{
        QuantKindOf<kQuant>(p), p.scale_layout, p.num_tokens, p.hidden, p.quant_out, p.scale};
    // A per-token kernel of its own computes the normalized values again after the amax's
    // reduction instead of keeping them (row_quant.cuh's kKeepValues): kept, its one-shot kernel
    // needed more registers than the kAny one and a stack (docs/performance.md, "One kernel per
    // FP8 pattern").
    constexpr bool kKeepValues = device::kKeepValuesFit<kVec> && kQuant == EpilogueQuant::kAny;
    device::QuantizeRow<DT, kVec, kKeepValues>(q, p.eps, ok, row, pre, total, t0, stride,
                                               vecs_per_row, g, qs->amax[parity], static_inv_scale);
  }
}

}  // namespace fusion_device
}  // namespace arfuse
