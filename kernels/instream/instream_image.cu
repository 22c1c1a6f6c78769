// Host side of the in-stream kernel image: entry names and geometry (instream_image.h).
#include <cstdio>
#include <cstring>

#include "kernels/add_rmsnorm/row_math.cuh"
#include "kernels/instream/instream_image.h"

namespace arfuse::instream {
namespace {

const char* DTypeToken(DType t) {
  switch (t) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP16:
      return "fp16";
    case DType::kFP32:
      return "fp32";
  }
  return nullptr;
}

}  // namespace

bool DescribeKernelEntry(DType dtype, Pattern pattern, FusionAlgo algo, uint32_t hidden,
                         int world_size, KernelEntry* entry) {
  const char* dname = DTypeToken(dtype);
  if (entry == nullptr || dname == nullptr || !IsSupportedWorldSize(world_size) ||
      !IsFusionSupported(dtype, world_size, pattern, algo) || !IsFusionHidden(hidden, dtype)) {
    return false;
  }
  const uint32_t elems_per_vec = static_cast<uint32_t>(16 / DTypeSize(dtype));
  if (hidden % elems_per_vec != 0) return false;
  const uint32_t vecs = hidden / elems_per_vec;
  KernelEntry e{};
  e.hidden = hidden;
  e.pattern = static_cast<uint8_t>(pattern);
  e.algo = static_cast<uint8_t>(algo);
  e.dtype = static_cast<uint8_t>(dtype);
  e.block_threads = static_cast<uint32_t>(device::RowBlockThreads(vecs));
  e.max_grid = 0;
  e.rows_divisor = algo == FusionAlgo::kOneShot ? 1u : static_cast<uint32_t>(world_size);
  // The FP8 patterns' own rules (contract::CheckPattern; any valid scale layout): not an entry
  // otherwise.
  if (!contract::CheckPattern(
           contract::OpShape{dtype, hidden, 0, pattern,
                             static_cast<uint8_t>(fp8::GroupScaleLayout::kFp32RowMajor)},
           contract::OpVoice::kEngine)
           .ok()) {
    return false;
  }
  // The norm patterns by QuantKind: the FP8 patterns have a function each (instream_kernels.cu
  // says which body each runs).
  static constexpr const char* kNormNames[] = {"arnorm", "arnormfp8static", "arnormfp8token",
                                               "arnormfp8group"};
  static_assert(static_cast<int>(QuantKind::kPerGroup) == 3);
  const PatternTraits traits = TraitsOf(pattern);
  const char* pname = traits.norm ? kNormNames[static_cast<int>(traits.quant)] : "allreduce";
  const int n =
      std::snprintf(e.function, sizeof(e.function), "arfuse_is_%s_%s_%s_b%d", dname, pname,
                    algo == FusionAlgo::kOneShot ? "oneshot" : "twoshot", device::RowBucket(vecs));
  if (n <= 0 || static_cast<size_t>(n) >= sizeof(e.function)) return false;
  *entry = e;
  return true;
}

}  // namespace arfuse::instream
