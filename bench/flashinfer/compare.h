// The per-row correctness check: host copies of one launch's outputs (rank 0's, with rank 1's
// compared against them) and the comparison of arfuse's with FlashInfer's.
//
// residual_out must be bit-equal (both add the bf16-rounded sum of the two ranks to the residual
// in fp32 and round once). The FP8 codes may differ by one E4M3 step: FlashInfer quantizes the
// normalized value rounded to bf16 (with rsqrtf and its own reduction order), arfuse the fp32
// one, so a value near a rounding midpoint can land on either neighbour; never further. Where
// the two scales of a code differ (a UE8M0 group whose amax sits at a power-of-two boundary, or
// arfuse's fp32 group scales against FlashInfer's UE8M0 ones), codes are compared dequantized:
// at most the coarser of the two grids' spacings apart (compare.cc, CountDequantized).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bench/flashinfer/cases.h"

namespace arfuse::bench_fi {

// One launch's outputs: rank 0's on the host; rank_diff counts the elements (residual_out,
// norm_out) and bytes (codes, written scales) where rank 1's differ from them.
struct Snapshot {
  bool valid = false;
  std::vector<uint16_t> residual;
  std::vector<uint16_t> norm;  // kNorm only
  std::vector<uint8_t> quant;  // FP8 cases
  std::vector<uint8_t> scale;  // the written scale tensor (not the static case's input)
  uint64_t rank_diff = 0;
};

// `flashinfer`: whose outputs (the scale tensor's layout, WrittenScaleBytes).
cudaError_t TakeSnapshot(Case c, uint32_t tokens, uint32_t hidden, bool flashinfer,
                         const RankTensors (&t)[kWorld], Snapshot* out);

// arfuse against FlashInfer for one pair of snapshots; Merge keeps the worst of each counter.
struct CrossCheck {
  bool compared = false;
  uint64_t residual_diff = 0;  // residual_out elements not bit-equal
  uint64_t norm_diff = 0;      // kNorm: norm_out elements not bit-equal
  uint64_t norm_max_ulp = 0;   // ... and the largest distance in bf16 ulps
  uint64_t codes = 0;          // FP8 codes compared
  uint64_t codes_one_step = 0;
  uint64_t codes_beyond = 0;   // more than one step apart (or NaN): must be 0
  uint64_t dequantized = 0;    // of `codes`, compared dequantized (their scales differ)
  uint64_t scales_differ = 0;  // per-token or per-group scales not bit-equal
  double scale_max_rel = 0.0;  // largest |arfuse - FlashInfer| / FlashInfer scale
  bool ok() const { return compared && residual_diff == 0 && codes_beyond == 0; }
};

CrossCheck Compare(Case c, uint32_t tokens, uint32_t hidden, const Snapshot& arfuse,
                   const Snapshot& flashinfer);
void Merge(CrossCheck* into, const CrossCheck& other);

// Bytes (elements for bf16 tensors) where two snapshots of one framework differ.
uint64_t SnapshotDiff(const Snapshot& a, const Snapshot& b);

}  // namespace arfuse::bench_fi
