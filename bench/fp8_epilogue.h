// The FP8 epilogue's cost per row for `arfuse-bench epilogue` (bench/fp8_epilogue.cu): one block
// runs a row's last step (the sum of squares' block reduction, then the norm store or the
// quantization) for rows in series, and clock64 counts the cycles of each.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace arfuse::bench {

// What one timed kernel does after the row's sum of squares. The first six are the kernels'
// own device functions (kernels/add_rmsnorm/row_math.cuh's NormRowStore,
// row_quant.cuh's QuantizeRow); the last two leave a step out to show what it costs, and their
// outputs are not the op's.
enum class EpilogueVariant : int {
  kUnquantized = 0,   // NormRowStore: bf16 norm_out
  kStatic,            // QuantizeRow, static scale
  kPerToken,          // QuantizeRow, per-token scale
  kPerTokenTwice,     // the same, the normalized values computed again after the reduction
  kPerGroupFp32,      // QuantizeRow, group 128, fp32 row-major scales
  kPerGroupUe8m0,     // QuantizeRow, group 128, packed UE8M0 scales
  kCodesOnly,         // the codes of x * 1: no amax, no scale
  kPerTokenWarpAmax,  // per-token with each warp's amax (no block reduction)
};
inline constexpr int kEpilogueVariants = 8;

const char* EpilogueVariantName(EpilogueVariant v);

struct EpilogueRun {
  EpilogueVariant variant = EpilogueVariant::kUnquantized;
  uint32_t hidden = 4096;  // bf16; a multiple of 128, at most kMaxEpilogueHidden
  uint32_t rows = 64;      // timed in series by one block
  int repeats = 30;        // launches; the fewest cycles count
};
// The row layout's first bucket (two vectors per thread at most): the sizes the bench covers.
inline constexpr uint32_t kMaxEpilogueHidden = 8192;

// Cycles per row (the best launch's total over `rows`), or the CUDA error; cudaErrorInvalidValue
// for a hidden outside 128..kMaxEpilogueHidden or not a multiple of 128, rows or repeats < 1.
cudaError_t TimeEpilogue(const EpilogueRun& run, double* cycles_per_row);

}  // namespace arfuse::bench
