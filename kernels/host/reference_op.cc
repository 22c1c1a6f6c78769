#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/host/half_convert.h"
#include "kernels/host/reference_core.h"
#include "kernels/quant/fp8_reference.h"

namespace arfuse {
namespace {

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
  // The pattern's own rules (a Pattern value; the FP8 patterns' dtype, group and scale layout)
  // are the contract's, so the reference refuses exactly what every other station refuses.
  if (plain::Status s =
          contract::CheckPattern(contract::OpShape{args.dtype, args.hidden, args.num_tokens,
                                                   args.pattern, args.scale_layout},
                                 contract::OpVoice::kEngine);
      !s.ok()) {
    return s;
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
  const PatternTraits traits = TraitsOf(args.pattern);
  if (!traits.norm) {
    if (args.output == nullptr) return plain::InvalidArgumentError("output is null (allreduce)");
    return plain::OkStatus();
  }
  if (args.residual_in == nullptr) return plain::InvalidArgumentError("residual_in is null");
  if (args.residual_out == nullptr) return plain::InvalidArgumentError("residual_out is null");
  if (traits.norm_out_required && args.norm_out == nullptr) {
    return plain::InvalidArgumentError("norm_out is null");
  }
  if (args.gamma == nullptr) return plain::InvalidArgumentError("gamma is null");
  if (traits.quant != QuantKind::kNone) {
    if (args.quant_out == nullptr) {
      return plain::InvalidArgumentError(
          plain::StrCat("quant_out is null (", PatternName(args.pattern), ")"));
    }
    if (args.scale == nullptr) {
      return plain::InvalidArgumentError(
          plain::StrCat("scale is null (", PatternName(args.pattern), ")"));
    }
  }
  return plain::OkStatus();
}

plain::Status ReferenceFusedOpPlain(const CpuOpArgs& args) {
  if (plain::Status s = ValidateCpuOpArgsPlain(args); !s.ok()) return s;
  const size_t hidden = args.hidden;
  const DType dt = args.dtype;
  const PatternTraits traits = TraitsOf(args.pattern);
  const bool quant = traits.quant != QuantKind::kNone;
  // The FP8 patterns quantize step 5's fp32 value before its rounding to the dtype, and the
  // per-group layouts place a token's scales by the op's token count: the whole op's values are
  // kept and quantized at the end, by the same functions the GPU's epilogue is tested against.
  std::vector<float> normalized;
  if (quant && args.num_tokens > 0) normalized.resize(size_t{args.num_tokens} * hidden);
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
      if (!traits.norm) {
        StoreFromFloat(dt, args.output, row + i, reduced);
        continue;
      }
      const float pre_norm = RoundToDType(dt, reduced + LoadAsFloat(dt, args.residual_in, row + i));
      StoreFromFloat(dt, args.residual_out, row + i, pre_norm);
      sum_of_squares += pre_norm * pre_norm;
    }
    if (!traits.norm) continue;
    const float inv_rms = 1.0f / std::sqrt(sum_of_squares / static_cast<float>(hidden) + args.eps);
    for (size_t i = 0; i < hidden; ++i) {
      const float y = LoadAsFloat(dt, args.residual_out, row + i);
      const float x = (y * inv_rms) * LoadAsFloat(dt, args.gamma, i);
      if (args.norm_out != nullptr) StoreFromFloat(dt, args.norm_out, row + i, x);
      if (quant) normalized[row + i] = x;
    }
  }
  if (!quant || args.num_tokens == 0) return plain::OkStatus();
  auto* q = static_cast<uint8_t*>(args.quant_out);
  switch (traits.quant) {
    case QuantKind::kStatic: {
      float scale;
      std::memcpy(&scale, args.scale, sizeof(scale));  // one fp32, used as given
      return fp8::QuantizeRowsStatic(normalized.data(), args.num_tokens, args.hidden, scale, q);
    }
    case QuantKind::kPerToken:
      return fp8::QuantizeRowsPerToken(normalized.data(), args.num_tokens, args.hidden, q,
                                       static_cast<float*>(args.scale));
    case QuantKind::kPerGroup:
      return fp8::QuantizeRowsPerGroup(
          normalized.data(), args.num_tokens, args.hidden, fp8::kGroupSize,
          static_cast<fp8::GroupScaleLayout>(args.scale_layout), q, args.scale);
    case QuantKind::kNone:
      break;
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
    if (IsNormPattern(args.pattern)) s += LoadAsFloat(dt, args.residual_in, i);
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
