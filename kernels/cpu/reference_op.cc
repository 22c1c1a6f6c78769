#include <cmath>
#include <cstring>

#include "kernels/cpu/half_convert.h"
#include "kernels/cpu/reference_core.h"

namespace arfuse {
namespace {

bool IsKnownPattern(Pattern p) {
  return p == Pattern::kAllReduce || p == Pattern::kAllReduceResidualRmsNorm;
}

// -0.0 -> +0.0; every other value (including negative subnormals) unchanged. Raw bits, so no
// flush-to-zero mode can change the answer.
inline float SanitizeNegativeZero(float v) { return FloatBits(v) == 0x80000000u ? 0.0f : v; }

inline float RoundToDType(DType dtype, float v) {
  switch (dtype) {
    case DType::kBF16:
      return Bf16BitsToFloat(FloatToBf16Bits(v));
    case DType::kFP16:
      return HalfBitsToFloat(FloatToHalfBits(v));
    case DType::kFP32:
      return v;
  }
  return v;
}

}  // namespace

float LoadAsFloat(DType dtype, const void* data, size_t i) {
  switch (dtype) {
    case DType::kBF16:
      return Bf16BitsToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kFP16:
      return HalfBitsToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kFP32:
      return static_cast<const float*>(data)[i];
  }
  return 0.0f;
}

void StoreFromFloat(DType dtype, void* data, size_t i, float v) {
  switch (dtype) {
    case DType::kBF16:
      static_cast<uint16_t*>(data)[i] = FloatToBf16Bits(v);
      return;
    case DType::kFP16:
      static_cast<uint16_t*>(data)[i] = FloatToHalfBits(v);
      return;
    case DType::kFP32:
      static_cast<float*>(data)[i] = v;
      return;
  }
}

plain::Status ValidateCpuOpArgsPlain(const CpuOpArgs& args) {
  if (!IsFusionDType(args.dtype)) {
    return plain::InvalidArgumentError(
        plain::StrCat("dtype ", static_cast<int>(args.dtype), " is not bf16, fp16 or fp32"));
  }
  if (!IsKnownPattern(args.pattern)) {
    return plain::InvalidArgumentError(
        plain::StrCat("pattern ", static_cast<int>(args.pattern), " is not supported"));
  }
  if (args.world_size < 1 || args.world_size > kMaxWorldSize) {
    return plain::InvalidArgumentError(
        plain::StrCat("world_size ", args.world_size, " is outside 1..", kMaxWorldSize));
  }
  if (!IsHiddenAligned(args.hidden)) {
    return plain::InvalidArgumentError(contract::HiddenNotAligned(args.hidden));
  }
  if (!std::isfinite(args.eps) || args.eps < 0.0f) {
    return plain::InvalidArgumentError("eps must be finite and non-negative");
  }
  if (args.num_tokens == 0) return plain::OkStatus();
  if (args.rank_inputs == nullptr) return plain::InvalidArgumentError("rank_inputs is null");
  for (int r = 0; r < args.world_size; ++r) {
    if (args.rank_inputs[r] == nullptr) {
      return plain::InvalidArgumentError(plain::StrCat("rank_inputs[", r, "] is null"));
    }
  }
  if (args.pattern == Pattern::kAllReduce) {
    if (args.output == nullptr) return plain::InvalidArgumentError("output is null (allreduce)");
  } else {
    if (args.residual_in == nullptr) return plain::InvalidArgumentError("residual_in is null");
    if (args.residual_out == nullptr) return plain::InvalidArgumentError("residual_out is null");
    if (args.norm_out == nullptr) return plain::InvalidArgumentError("norm_out is null");
    if (args.gamma == nullptr) return plain::InvalidArgumentError("gamma is null");
  }
  return plain::OkStatus();
}

plain::Status ReferenceFusedOpPlain(const CpuOpArgs& args) {
  if (plain::Status s = ValidateCpuOpArgsPlain(args); !s.ok()) return s;
  const size_t hidden = args.hidden;
  const DType dt = args.dtype;
  for (size_t t = 0; t < args.num_tokens; ++t) {
    const size_t row = t * hidden;
    // Steps 1-4 for the whole row; residual_out may alias residual_in, so read before write.
    float sum_of_squares = 0.0f;
    for (size_t i = 0; i < hidden; ++i) {
      float s = SanitizeNegativeZero(LoadAsFloat(dt, args.rank_inputs[0], row + i));
      for (int r = 1; r < args.world_size; ++r) {
        s += SanitizeNegativeZero(LoadAsFloat(dt, args.rank_inputs[r], row + i));
      }
      const float reduced = SanitizeNegativeZero(RoundToDType(dt, SanitizeNegativeZero(s)));
      if (args.pattern == Pattern::kAllReduce) {
        StoreFromFloat(dt, args.output, row + i, reduced);
        continue;
      }
      const float pre_norm = RoundToDType(dt, reduced + LoadAsFloat(dt, args.residual_in, row + i));
      StoreFromFloat(dt, args.residual_out, row + i, pre_norm);
      sum_of_squares += pre_norm * pre_norm;
    }
    if (args.pattern == Pattern::kAllReduce) continue;
    const float inv_rms = 1.0f / std::sqrt(sum_of_squares / static_cast<float>(hidden) + args.eps);
    for (size_t i = 0; i < hidden; ++i) {
      const float y = LoadAsFloat(dt, args.residual_out, row + i);
      StoreFromFloat(dt, args.norm_out, row + i, (y * inv_rms) * LoadAsFloat(dt, args.gamma, i));
    }
  }
  return plain::OkStatus();
}

plain::Status ReferenceFusedOpFp64Plain(const CpuOpArgs& args, Fp64Result* result) {
  if (result == nullptr) return plain::InvalidArgumentError("result is null");
  if (plain::Status s = ValidateCpuOpArgsPlain(args); !s.ok()) return s;
  const size_t hidden = args.hidden;
  const size_t n = static_cast<size_t>(args.num_tokens) * hidden;
  const DType dt = args.dtype;
  result->out.clear();
  result->residual_out.clear();
  result->norm_out.clear();
  std::vector<double>& sums =
      args.pattern == Pattern::kAllReduce ? result->out : result->residual_out;
  sums.assign(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    double s = 0.0;
    for (int r = 0; r < args.world_size; ++r) s += LoadAsFloat(dt, args.rank_inputs[r], i);
    if (args.pattern == Pattern::kAllReduceResidualRmsNorm)
      s += LoadAsFloat(dt, args.residual_in, i);
    sums[i] = s;
  }
  if (args.pattern == Pattern::kAllReduce) return plain::OkStatus();
  result->norm_out.assign(n, 0.0);
  for (size_t t = 0; t < args.num_tokens; ++t) {
    double sum_of_squares = 0.0;
    for (size_t i = 0; i < hidden; ++i)
      sum_of_squares += sums[t * hidden + i] * sums[t * hidden + i];
    const double inv_rms = 1.0 / std::sqrt(sum_of_squares / static_cast<double>(hidden) +
                                           static_cast<double>(args.eps));
    for (size_t i = 0; i < hidden; ++i) {
      result->norm_out[t * hidden + i] =
          sums[t * hidden + i] * inv_rms * static_cast<double>(LoadAsFloat(dt, args.gamma, i));
    }
  }
  return plain::OkStatus();
}

}  // namespace arfuse
