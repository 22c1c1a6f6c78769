// The CPU implementation of the fused op: conversions, the GPU's numerics, argument checks.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/host/half_convert.h"
#include "kernels/host/reference_op.h"
#include "kernels/quant/fp8_reference.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;

TEST(HalfConvert, Bf16KnownValuesAndTiesToEven) {
  EXPECT_EQ(FloatToBf16Bits(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16Bits(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBf16Bits(BitsToFloat(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(FloatToBf16Bits(BitsToFloat(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(FloatToBf16Bits(BitsToFloat(0x3f808001u)), 0x3f81);  // above the tie
  EXPECT_EQ(FloatToBf16Bits(BitsToFloat(0x80000001u)), 0x8000);  // tiny negative -> -0
  EXPECT_EQ(FloatToBf16Bits(BitsToFloat(0x7f7fffffu)), 0x7f80);  // max float -> inf
  EXPECT_EQ(FloatToBf16Bits(std::nanf("")) & 0x7fc0, 0x7fc0);
}

TEST(HalfConvert, Fp16KnownValuesSubnormalsAndOverflow) {
  EXPECT_EQ(FloatToHalfBits(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalfBits(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(65520.0f), 0x7c00);               // tie rounds to infinity
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -25)), 0x0000);  // tie to even zero
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(FloatToHalfBits(-std::ldexp(3.0f, -25)), 0x8002);    // 1.5 ulp: tie, to even 2
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1023.5f, -24)), 0x0400);  // carries into min normal
  EXPECT_EQ(FloatToHalfBits(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalfBits(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_EQ(FloatToHalfBits(1.0f + std::ldexp(3.0f, -11)), 0x3c02);
}

TEST(HalfConvert, EveryNonNanHalfAndBf16RoundTrips) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    if ((bits & 0x7c00u) != 0x7c00u || (bits & 0x3ffu) == 0) {
      ASSERT_EQ(FloatToHalfBits(HalfBitsToFloat(bits)), bits) << std::hex << b;
    }
    if ((bits & 0x7f80u) != 0x7f80u || (bits & 0x7fu) == 0) {
      ASSERT_EQ(FloatToBf16Bits(Bf16BitsToFloat(bits)), bits) << std::hex << b;
    }
  }
  EXPECT_EQ(HalfBitsToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfBitsToFloat(0x7c00), INFINITY);
}

// A small op over owned buffers.
struct Op {
  Op(DType dtype, int world, uint32_t tokens, uint32_t hidden, Pattern pattern)
      : dtype(dtype), world(world), tokens(tokens), hidden(hidden) {
    const size_t bytes = static_cast<size_t>(tokens) * hidden * DTypeSize(dtype);
    inputs.assign(world, std::vector<uint8_t>(bytes));
    residual_in.resize(bytes);
    residual_out.resize(bytes);
    norm_out.resize(bytes);
    output.resize(bytes);
    gamma.resize(hidden * DTypeSize(dtype));
    for (auto& in : inputs) input_ptrs.push_back(in.data());
    args.pattern = pattern;
    args.dtype = dtype;
    args.world_size = world;
    args.hidden = hidden;
    args.num_tokens = tokens;
    args.rank_inputs = input_ptrs.data();
    args.output = output.data();
    args.residual_in = residual_in.data();
    args.residual_out = residual_out.data();
    args.norm_out = norm_out.data();
    args.gamma = gamma.data();
  }
  void Fill(std::mt19937& rng, float scale) {
    std::normal_distribution<float> dist(0.0f, scale);
    const size_t n = static_cast<size_t>(tokens) * hidden;
    for (auto& in : inputs) {
      for (size_t i = 0; i < n; ++i) StoreFromFloat(dtype, in.data(), i, dist(rng));
    }
    for (size_t i = 0; i < n; ++i) StoreFromFloat(dtype, residual_in.data(), i, dist(rng));
    for (size_t i = 0; i < hidden; ++i) StoreFromFloat(dtype, gamma.data(), i, 1.0f + dist(rng));
  }
  uint16_t Bits16(const std::vector<uint8_t>& v, size_t i) const {
    return reinterpret_cast<const uint16_t*>(v.data())[i];
  }
  DType dtype;
  int world;
  uint32_t tokens, hidden;
  std::vector<std::vector<uint8_t>> inputs;
  std::vector<const void*> input_ptrs;
  std::vector<uint8_t> residual_in, residual_out, norm_out, output, gamma;
  CpuOpArgs args;
};

TEST(ReferenceFusedOp, KnownValuesBf16) {
  Op op(DType::kBF16, 2, 1, 8, Pattern::kAllReduceResidualRmsNorm);
  for (int i = 0; i < 8; ++i) {
    StoreFromFloat(DType::kBF16, op.inputs[0].data(), i, static_cast<float>(i + 1));
    StoreFromFloat(DType::kBF16, op.inputs[1].data(), i, static_cast<float>(i + 1));
    StoreFromFloat(DType::kBF16, op.residual_in.data(), i, 1.0f);
    StoreFromFloat(DType::kBF16, op.gamma.data(), i, 2.0f);
  }
  op.args.eps = 0.0f;
  ASSERT_TRUE(ReferenceFusedOp(op.args).ok());
  // residual_out = 2(i+1) + 1 = 3,5,...,17; sum of squares = 9+25+49+81+121+169+225+289 = 968;
  // mean 121, rms 11: norm_out = 2 * residual_out / 11.
  for (int i = 0; i < 8; ++i) {
    const float r = static_cast<float>(2 * (i + 1) + 1);
    EXPECT_EQ(LoadAsFloat(DType::kBF16, op.residual_out.data(), i), r);
    EXPECT_EQ(op.Bits16(op.norm_out, i), FloatToBf16Bits(r / 11.0f * 2.0f)) << i;
  }
}

TEST(ReferenceFusedOp, NegativeZeroInputsGivePositiveZero) {
  for (DType dt : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    Op op(dt, 4, 2, 16, Pattern::kAllReduce);
    for (auto& in : op.inputs) {
      for (size_t i = 0; i < 32; ++i) StoreFromFloat(dt, in.data(), i, -0.0f);
    }
    ASSERT_TRUE(ReferenceFusedOp(op.args).ok());
    for (size_t i = 0; i < 32; ++i) {
      const float v = LoadAsFloat(dt, op.output.data(), i);
      EXPECT_EQ(FloatBits(v), 0u) << DTypeName(dt) << " element " << i;
    }
  }
}

TEST(ReferenceFusedOp, CancellingSubnormalsGivePositiveZero) {
  // fp16: the smallest subnormals of opposite sign cancel to exactly zero: +0.0, never -0.0.
  Op op(DType::kFP16, 2, 1, 8, Pattern::kAllReduce);
  StoreFromFloat(DType::kFP16, op.inputs[0].data(), 0, -std::ldexp(1.0f, -24));
  StoreFromFloat(DType::kFP16, op.inputs[1].data(), 0, std::ldexp(1.0f, -24));
  ASSERT_TRUE(ReferenceFusedOp(op.args).ok());
  EXPECT_EQ(op.Bits16(op.output, 0), 0x0000);
}

TEST(ReferenceFusedOp, Bf16SubnormalsAreSummedNotFlushed) {
  Op op(DType::kBF16, 2, 1, 8, Pattern::kAllReduce);
  uint16_t* a = reinterpret_cast<uint16_t*>(op.inputs[0].data());
  uint16_t* b = reinterpret_cast<uint16_t*>(op.inputs[1].data());
  const uint16_t lhs[8] = {0x0001, 0x8001, 0x807f, 0x0040, 0x8000, 0x8001, 0x0000, 0x007f};
  const uint16_t rhs[8] = {0x0001, 0x0001, 0x807f, 0x0040, 0x8001, 0x8001, 0x8000, 0x0001};
  const uint16_t want[8] = {0x0002, 0x0000, 0x80fe, 0x0080, 0x8001, 0x8002, 0x0000, 0x0080};
  for (int i = 0; i < 8; ++i) {
    a[i] = lhs[i];
    b[i] = rhs[i];
  }
  ASSERT_TRUE(ReferenceFusedOp(op.args).ok());
  for (int i = 0; i < 8; ++i) EXPECT_EQ(op.Bits16(op.output, i), want[i]) << i;
}

TEST(ReferenceFusedOp, SumsInRankOrder) {
  // fp32: ((1e8 + 1) - 1e8) + 1 = 1 in rank order (1e8 + 1 rounds to 1e8); any order that adds
  // the two ones first gives 2.
  Op op(DType::kFP32, 4, 1, 8, Pattern::kAllReduce);
  const float values[4] = {1e8f, 1.0f, -1e8f, 1.0f};
  for (int r = 0; r < 4; ++r) {
    for (int i = 0; i < 8; ++i) reinterpret_cast<float*>(op.inputs[r].data())[i] = values[r];
  }
  ASSERT_TRUE(ReferenceFusedOp(op.args).ok());
  for (int i = 0; i < 8; ++i) EXPECT_EQ(reinterpret_cast<float*>(op.output.data())[i], 1.0f);
}

TEST(ReferenceFusedOp, AllreduceRoundsTheSumBeforeTheResidualAdd) {
  // bf16: 1 + 2^-8 is not a bf16 (ties to 1); adding residual 2^-8 afterwards gives 1 again,
  // whereas adding it to the fp32 sum would give 1 + 2^-7.
  Op op(DType::kBF16, 2, 1, 8, Pattern::kAllReduceResidualRmsNorm);
  for (int i = 0; i < 8; ++i) {
    StoreFromFloat(DType::kBF16, op.inputs[0].data(), i, 1.0f);
    StoreFromFloat(DType::kBF16, op.inputs[1].data(), i, std::ldexp(1.0f, -8));
    StoreFromFloat(DType::kBF16, op.residual_in.data(), i, std::ldexp(1.0f, -8));
    StoreFromFloat(DType::kBF16, op.gamma.data(), i, 1.0f);
  }
  ASSERT_TRUE(ReferenceFusedOp(op.args).ok());
  for (int i = 0; i < 8; ++i) EXPECT_EQ(LoadAsFloat(DType::kBF16, op.residual_out.data(), i), 1.0f);
}

struct Case {
  DType dtype;
  int world;
  Pattern pattern;
};

class ReferenceVsFp64 : public ::testing::TestWithParam<Case> {};

TEST_P(ReferenceVsFp64, WithinDTypeToleranceAndDeterministic) {
  const Case c = GetParam();
  Op op(c.dtype, c.world, 5, 256, c.pattern);
  std::mt19937 rng(1234 + c.world);
  op.Fill(rng, 1.0f);
  ASSERT_TRUE(ReferenceFusedOp(op.args).ok());
  Fp64Result exact;
  ASSERT_TRUE(ReferenceFusedOpFp64(op.args, &exact).ok());
  const double ulp = c.dtype == DType::kBF16   ? std::ldexp(1.0, -8)
                     : c.dtype == DType::kFP16 ? std::ldexp(1.0, -11)
                                               : std::ldexp(1.0, -23);
  const size_t n = static_cast<size_t>(op.tokens) * op.hidden;
  for (size_t i = 0; i < n; ++i) {
    // Magnitude of the terms bounds the error of the roundings (sum, then residual add).
    double terms = 0.0;
    for (int r = 0; r < c.world; ++r)
      terms += std::fabs(LoadAsFloat(c.dtype, op.inputs[r].data(), i));
    if (c.pattern == Pattern::kAllReduce) {
      ASSERT_NEAR(LoadAsFloat(c.dtype, op.output.data(), i), exact.out[i], 2 * ulp * terms + 1e-30)
          << i;
      continue;
    }
    terms += std::fabs(LoadAsFloat(c.dtype, op.residual_in.data(), i));
    ASSERT_NEAR(LoadAsFloat(c.dtype, op.residual_out.data(), i), exact.residual_out[i],
                3 * ulp * terms)
        << i;
    const double g = std::fabs(LoadAsFloat(c.dtype, op.gamma.data(), i % op.hidden));
    ASSERT_NEAR(LoadAsFloat(c.dtype, op.norm_out.data(), i), exact.norm_out[i],
                4 * ulp * (std::fabs(exact.norm_out[i]) + g * terms))
        << i;
  }
  // Deterministic: a second run gives the same bits.
  const auto first_norm = op.norm_out;
  const auto first_out = op.output;
  ASSERT_TRUE(ReferenceFusedOp(op.args).ok());
  EXPECT_EQ(first_norm, op.norm_out);
  EXPECT_EQ(first_out, op.output);
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (DType dt : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (int w : {1, 2, 4, 8, 16}) {
      for (Pattern p : {Pattern::kAllReduce, Pattern::kAllReduceResidualRmsNorm}) {
        cases.push_back({dt, w, p});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(All, ReferenceVsFp64, ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(DTypeName(info.param.dtype)) + "_w" +
                                  std::to_string(info.param.world) + "_" +
                                  PatternName(info.param.pattern);
                         });

TEST(ReferenceFusedOp, ResidualInPlace) {
  Op op(DType::kBF16, 2, 3, 64, Pattern::kAllReduceResidualRmsNorm);
  std::mt19937 rng(7);
  op.Fill(rng, 2.0f);
  ASSERT_TRUE(ReferenceFusedOp(op.args).ok());
  const auto expected_residual = op.residual_out;
  const auto expected_norm = op.norm_out;
  op.args.residual_out = op.residual_in.data();
  ASSERT_TRUE(ReferenceFusedOp(op.args).ok());
  EXPECT_EQ(op.residual_in, expected_residual);
  EXPECT_EQ(op.norm_out, expected_norm);
}

TEST(ReferenceFusedOp, ZeroTokensIsANoOp) {
  Op op(DType::kBF16, 2, 1, 8, Pattern::kAllReduce);
  op.args.num_tokens = 0;
  op.args.rank_inputs = nullptr;
  EXPECT_TRUE(ReferenceFusedOp(op.args).ok());
}

void ExpectInvalid(const CpuOpArgs& args, const std::string& fragment) {
  const absl::Status s = ReferenceFusedOp(args);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << fragment;
  EXPECT_THAT(std::string(s.message()), HasSubstr(fragment));
}

TEST(ReferenceFusedOp, RejectsBadArguments) {
  Op op(DType::kBF16, 2, 1, 8, Pattern::kAllReduceResidualRmsNorm);
  CpuOpArgs a = op.args;
  a.dtype = static_cast<DType>(9);
  ExpectInvalid(a, "dtype 9");
  a = op.args;
  a.pattern = static_cast<Pattern>(7);
  ExpectInvalid(a, "pattern 7");
  a = op.args;
  a.world_size = 0;
  ExpectInvalid(a, "world_size 0");
  a.world_size = 17;
  ExpectInvalid(a, "world_size 17");
  a = op.args;
  a.hidden = 12;
  ExpectInvalid(a, "hidden 12");
  a.hidden = 0;
  ExpectInvalid(a, "hidden 0");
  a = op.args;
  a.eps = -1.0f;
  ExpectInvalid(a, "eps");
  a.eps = NAN;
  ExpectInvalid(a, "eps");
  a = op.args;
  a.rank_inputs = nullptr;
  ExpectInvalid(a, "rank_inputs is null");
  a = op.args;
  const void* one_missing[2] = {op.inputs[0].data(), nullptr};
  a.rank_inputs = one_missing;
  ExpectInvalid(a, "rank_inputs[1] is null");
  a = op.args;
  a.residual_in = nullptr;
  ExpectInvalid(a, "residual_in");
  a = op.args;
  a.residual_out = nullptr;
  ExpectInvalid(a, "residual_out");
  a = op.args;
  a.norm_out = nullptr;
  ExpectInvalid(a, "norm_out");
  a = op.args;
  a.gamma = nullptr;
  ExpectInvalid(a, "gamma");
  a = op.args;
  a.pattern = Pattern::kAllReduce;
  a.output = nullptr;
  ExpectInvalid(a, "output is null");
  Fp64Result r;
  EXPECT_EQ(ReferenceFusedOpFp64(op.args, nullptr).code(), absl::StatusCode::kInvalidArgument);
  a = op.args;
  a.hidden = 12;
  EXPECT_THAT(std::string(ReferenceFusedOpFp64(a, &r).message()), HasSubstr("hidden 12"));
}

// ---- The FP8 patterns (3-5) ----

// One FP8 op over an Op's tensors: quant_out and the scale buffer (static: the one fp32 input;
// per token: tokens floats; per group: the layout's extent, pre-filled with 0xab so that the
// padding the reference must zero shows).
struct Fp8Op {
  Fp8Op(DType dtype, int world, uint32_t tokens, uint32_t hidden, Pattern pattern,
        uint8_t layout = 0, float static_scale = 0.05f)
      : op(dtype, world, tokens, hidden, pattern) {
    quant.assign(size_t{tokens} * hidden, 0xcd);
    const QuantKind kind = TraitsOf(pattern).quant;
    size_t scale_bytes = 4;
    if (kind == QuantKind::kPerToken) scale_bytes = size_t{tokens} * 4;
    if (kind == QuantKind::kPerGroup) {
      scale_bytes = fp8::GroupScaleBytes(static_cast<fp8::GroupScaleLayout>(layout), tokens,
                                         hidden / fp8::kGroupSize);
    }
    scale.assign(scale_bytes < 4 ? 4 : scale_bytes, 0xab);
    if (kind == QuantKind::kStatic) std::memcpy(scale.data(), &static_scale, 4);
    op.args.quant_out = quant.data();
    op.args.scale = scale.data();
    op.args.scale_layout = layout;
  }
  Op op;
  std::vector<uint8_t> quant, scale;
};

// Step 5's fp32 value recomputed in the test from the op's residual_out (its dtype-rounded
// pre-norm value): the sum of squares in element order, the IEEE reciprocal of the root, then
// (y * inv) * gamma.
std::vector<float> NormalizedFromResidualOut(const Op& op) {
  std::vector<float> x(size_t{op.tokens} * op.hidden);
  for (size_t t = 0; t < op.tokens; ++t) {
    float ss = 0.0f;
    for (size_t i = 0; i < op.hidden; ++i) {
      const float y = LoadAsFloat(op.dtype, op.residual_out.data(), t * op.hidden + i);
      ss += y * y;
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(op.hidden) + op.args.eps);
    for (size_t i = 0; i < op.hidden; ++i) {
      const float y = LoadAsFloat(op.dtype, op.residual_out.data(), t * op.hidden + i);
      x[t * op.hidden + i] = (y * inv) * LoadAsFloat(op.dtype, op.gamma.data(), i);
    }
  }
  return x;
}

// What fp8_reference makes of `x` for the op's pattern: the codes and the scale bytes.
void QuantizeExpected(const Fp8Op& f, const std::vector<float>& x, std::vector<uint8_t>* q,
                      std::vector<uint8_t>* scale) {
  const Op& op = f.op;
  q->assign(size_t{op.tokens} * op.hidden, 0);
  *scale = f.scale;  // the static scale (an input) stays as it was
  switch (TraitsOf(op.args.pattern).quant) {
    case QuantKind::kStatic: {
      float s;
      std::memcpy(&s, f.scale.data(), 4);
      ASSERT_TRUE(fp8::QuantizeRowsStatic(x.data(), op.tokens, op.hidden, s, q->data()).ok());
      break;
    }
    case QuantKind::kPerToken:
      ASSERT_TRUE(fp8::QuantizeRowsPerToken(x.data(), op.tokens, op.hidden, q->data(),
                                            reinterpret_cast<float*>(scale->data()))
                      .ok());
      break;
    case QuantKind::kPerGroup:
      std::fill(scale->begin(), scale->end(), 0x11);
      ASSERT_TRUE(
          fp8::QuantizeRowsPerGroup(x.data(), op.tokens, op.hidden, fp8::kGroupSize,
                                    static_cast<fp8::GroupScaleLayout>(op.args.scale_layout),
                                    q->data(), scale->data())
              .ok());
      break;
    case QuantKind::kNone:
      FAIL() << "not an FP8 pattern";
  }
}

// Runs `f` and checks it against everything computed independently: residual_out and norm_out
// are pattern 2's bytes, the codes and scales fp8_reference's of the recomputed step-5 values,
// and a run without norm_out writes the same codes and scales.
void ExpectFp8MatchesIndependent(Fp8Op& f, const std::string& what) {
  Op& op = f.op;
  ASSERT_TRUE(ReferenceFusedOp(op.args).ok()) << what;
  Op plain_norm(op.dtype, op.world, op.tokens, op.hidden, Pattern::kAllReduceResidualRmsNorm);
  plain_norm.inputs = op.inputs;
  plain_norm.residual_in = op.residual_in;
  plain_norm.gamma = op.gamma;
  plain_norm.args.eps = op.args.eps;
  for (int r = 0; r < op.world; ++r) plain_norm.input_ptrs[r] = plain_norm.inputs[r].data();
  plain_norm.args.residual_in = plain_norm.residual_in.data();
  plain_norm.args.gamma = plain_norm.gamma.data();
  ASSERT_TRUE(ReferenceFusedOp(plain_norm.args).ok()) << what;
  ASSERT_EQ(op.residual_out, plain_norm.residual_out) << what;
  ASSERT_EQ(op.norm_out, plain_norm.norm_out) << what;
  std::vector<uint8_t> want_q, want_scale;
  QuantizeExpected(f, NormalizedFromResidualOut(op), &want_q, &want_scale);
  ASSERT_EQ(f.quant, want_q) << what;
  ASSERT_EQ(f.scale, want_scale) << what;
  // norm_out is optional: without it the same codes and scales, nothing else touched.
  std::vector<uint8_t> q2(f.quant.size(), 0x5a), s2 = f.scale;
  if (TraitsOf(op.args.pattern).quant != QuantKind::kStatic) std::fill(s2.begin(), s2.end(), 0x5a);
  std::vector<uint8_t> r2(op.residual_out.size());
  CpuOpArgs a = op.args;
  a.norm_out = nullptr;
  a.quant_out = q2.data();
  a.scale = s2.data();
  a.residual_out = r2.data();
  ASSERT_TRUE(ReferenceFusedOp(a).ok()) << what;
  ASSERT_EQ(q2, f.quant) << what << " without norm_out";
  ASSERT_EQ(s2, f.scale) << what << " without norm_out";
  ASSERT_EQ(r2, op.residual_out) << what << " without norm_out";
}

struct Fp8Case {
  Pattern pattern;
  DType dtype;
  int world;
  uint32_t hidden;
  uint8_t layout;
};

class ReferenceFp8 : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(ReferenceFp8, MatchesTheIndependentComputationAndNeedsNoNormOut) {
  const Fp8Case c = GetParam();
  for (uint32_t tokens : {1u, 2u, 3u, 4u, 5u, 7u, 31u, 64u}) {
    Fp8Op f(c.dtype, c.world, tokens, c.hidden, c.pattern, c.layout);
    std::mt19937 rng(99 + tokens * 7 + c.world);
    f.op.Fill(rng, 1.0f);
    // Rows of other magnitudes, so the dynamic scales differ from token to token.
    for (uint32_t t = 0; t < tokens; ++t) {
      const float k = std::ldexp(1.0f, static_cast<int>(t % 9) - 4);
      for (uint32_t i = 0; i < c.hidden; ++i) {
        const size_t at = size_t{t} * c.hidden + i;
        StoreFromFloat(c.dtype, f.op.residual_in.data(), at,
                       k * LoadAsFloat(c.dtype, f.op.residual_in.data(), at));
      }
    }
    ExpectFp8MatchesIndependent(f, "tokens " + std::to_string(tokens));
  }
}

std::vector<Fp8Case> Fp8Cases() {
  std::vector<Fp8Case> cases;
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    for (int w : {2, 4, 8}) {
      for (uint32_t h : {4096u, 8192u}) {
        cases.push_back({Pattern::kAllReduceResidualRmsNormFp8Static, dt, w, h, 0});
        cases.push_back({Pattern::kAllReduceResidualRmsNormFp8PerToken, dt, w, h, 0});
      }
      for (uint32_t h : {128u, 4096u, 8192u}) {
        for (uint8_t layout : {1, 2, 3}) {
          cases.push_back({Pattern::kAllReduceResidualRmsNormFp8PerGroup, dt, w, h, layout});
        }
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(All, ReferenceFp8, ::testing::ValuesIn(Fp8Cases()),
                         [](const ::testing::TestParamInfo<Fp8Case>& info) {
                           const Fp8Case& c = info.param;
                           return std::string(PatternName(c.pattern)) + "_" + DTypeName(c.dtype) +
                                  "_w" + std::to_string(c.world) + "_h" + std::to_string(c.hidden) +
                                  (c.layout != 0 ? "_l" + std::to_string(c.layout) : "");
                         });

TEST(ReferenceFp8, AllZeroRowsGetTheFloorScales) {
  for (Pattern p :
       {Pattern::kAllReduceResidualRmsNormFp8Static, Pattern::kAllReduceResidualRmsNormFp8PerToken,
        Pattern::kAllReduceResidualRmsNormFp8PerGroup}) {
    for (uint8_t layout : {1, 3}) {
      if (p != Pattern::kAllReduceResidualRmsNormFp8PerGroup && layout != 1) continue;
      Fp8Op f(DType::kBF16, 2, 3, 256, p,
              p == Pattern::kAllReduceResidualRmsNormFp8PerGroup ? layout : 0);
      std::mt19937 rng(5);
      f.op.Fill(rng, 1.0f);
      // Row 1 sums to zero everywhere: inputs and residual all zero.
      for (auto& in : f.op.inputs) std::fill(in.begin() + 256 * 2, in.begin() + 512 * 2, 0);
      std::fill(f.op.residual_in.begin() + 256 * 2, f.op.residual_in.begin() + 512 * 2, 0);
      ExpectFp8MatchesIndependent(f, PatternName(p));
      // +-0 (gamma's sign) for every element of the zero row.
      for (uint32_t i = 256; i < 512; ++i) ASSERT_EQ(f.quant[i] & 0x7f, 0x00) << i;
      if (p == Pattern::kAllReduceResidualRmsNormFp8PerToken) {
        float s1;
        std::memcpy(&s1, f.scale.data() + 4, 4);
        EXPECT_EQ(s1, fp8::kMinScalingFactor);
      }
      if (p == Pattern::kAllReduceResidualRmsNormFp8PerGroup) {
        const auto l = static_cast<fp8::GroupScaleLayout>(layout);
        for (uint32_t g = 0; g < 2; ++g) {
          const uint64_t at = fp8::GroupScaleByteOffset(l, 1, g, 3, 2);
          if (l == fp8::GroupScaleLayout::kUe8m0Packed) {
            EXPECT_EQ(f.scale[at], 94) << g;  // 2^-33
          } else {
            float s;
            std::memcpy(&s, f.scale.data() + at, 4);
            EXPECT_EQ(s, fp8::kGroupEps / fp8::kE4m3Max) << g;
          }
        }
      }
    }
  }
}

// An infinite input makes its row's sum of squares infinite and inv 0: every finite value
// normalizes to +-0 (code 0x00 / 0x80) and the infinity to inf * 0 = NaN (0x7f); the amax
// ignores the NaN, so the dynamic scale is the floor. A NaN input makes the whole row NaN (every
// code 0x7f, the floor scale). The static pattern converts the same values.
TEST(ReferenceFp8, InfAndNanInputsGiveNanCodesAndFloorScales) {
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    for (Pattern p : {Pattern::kAllReduceResidualRmsNormFp8Static,
                      Pattern::kAllReduceResidualRmsNormFp8PerToken,
                      Pattern::kAllReduceResidualRmsNormFp8PerGroup}) {
      Fp8Op f(dt, 2, 3, 128, p, p == Pattern::kAllReduceResidualRmsNormFp8PerGroup ? 1 : 0);
      std::mt19937 rng(11);
      f.op.Fill(rng, 1.0f);
      StoreFromFloat(dt, f.op.inputs[0].data(), 5, INFINITY);
      StoreFromFloat(dt, f.op.inputs[1].data(), 128 + 9, NAN);
      ExpectFp8MatchesIndependent(f, std::string(PatternName(p)) + " " + DTypeName(dt));
      for (uint32_t i = 0; i < 128; ++i) {
        if (i == 5) {
          EXPECT_EQ(f.quant[i], fp8::kE4m3NanCode);
        } else {
          EXPECT_TRUE(f.quant[i] == 0x00 || f.quant[i] == 0x80) << i;
        }
        EXPECT_EQ(f.quant[128 + i], fp8::kE4m3NanCode) << i;
      }
      if (p != Pattern::kAllReduceResidualRmsNormFp8Static) {
        float s0, s1;
        std::memcpy(&s0, f.scale.data(), 4);
        std::memcpy(&s1, f.scale.data() + 4, 4);
        const float floor = p == Pattern::kAllReduceResidualRmsNormFp8PerToken
                                ? fp8::kMinScalingFactor
                                : fp8::kGroupEps / fp8::kE4m3Max;
        EXPECT_EQ(s0, floor);
        EXPECT_EQ(s1, floor);
      }
    }
  }
}

// The static scale is used as given: a subnormal one has a reciprocal of 2^127 (2^-127) that
// saturates every non-zero value, or an infinite one (2^-149) that also turns zeros into NaN.
TEST(ReferenceFp8, SubnormalStaticScalesSaturate) {
  for (float scale : {std::ldexp(1.0f, -127), std::ldexp(1.0f, -149)}) {
    Fp8Op f(DType::kFP16, 2, 2, 128, Pattern::kAllReduceResidualRmsNormFp8Static, 0, scale);
    std::mt19937 rng(3);
    f.op.Fill(rng, 1.0f);
    // Token 1 is all zeros.
    for (auto& in : f.op.inputs) std::fill(in.begin() + 256, in.end(), 0);
    std::fill(f.op.residual_in.begin() + 256, f.op.residual_in.end(), 0);
    ExpectFp8MatchesIndependent(f, "scale " + std::to_string(scale));
    const bool inf = std::isinf(1.0f / scale);
    for (uint32_t i = 0; i < 128; ++i) {
      EXPECT_TRUE(f.quant[i] == fp8::kE4m3MaxCode || f.quant[i] == (0x80 | fp8::kE4m3MaxCode)) << i;
      if (inf) {
        EXPECT_EQ(f.quant[128 + i], fp8::kE4m3NanCode) << i;  // 0 * inf
      } else {
        EXPECT_EQ(f.quant[128 + i] & 0x7f, 0x00) << i;  // +-0 (gamma's sign)
      }
    }
  }
}

TEST(ReferenceFp8, ZeroTokensNeedNoTensors) {
  Fp8Op f(DType::kBF16, 2, 1, 128, Pattern::kAllReduceResidualRmsNormFp8PerGroup, 3);
  f.op.args.num_tokens = 0;
  f.op.args.rank_inputs = nullptr;
  f.op.args.quant_out = nullptr;
  f.op.args.scale = nullptr;
  EXPECT_TRUE(ReferenceFusedOp(f.op.args).ok());
}

// The fp64 reference computes the FP8 patterns' residual_out and norm_out (no codes).
TEST(ReferenceFp8, Fp64ReferenceGivesTheNormPart) {
  Fp8Op f(DType::kBF16, 2, 2, 128, Pattern::kAllReduceResidualRmsNormFp8PerToken);
  std::mt19937 rng(8);
  f.op.Fill(rng, 1.0f);
  Fp64Result r;
  ASSERT_TRUE(ReferenceFusedOpFp64(f.op.args, &r).ok());
  EXPECT_EQ(r.residual_out.size(), 256u);
  EXPECT_EQ(r.norm_out.size(), 256u);
  EXPECT_TRUE(r.out.empty());
}

TEST(ReferenceFp8, RejectsBadArguments) {
  for (Pattern p :
       {Pattern::kAllReduceResidualRmsNormFp8Static, Pattern::kAllReduceResidualRmsNormFp8PerToken,
        Pattern::kAllReduceResidualRmsNormFp8PerGroup}) {
    const std::string name = PatternName(p);
    Fp8Op f(DType::kBF16, 2, 1, 128, p, p == Pattern::kAllReduceResidualRmsNormFp8PerGroup ? 1 : 0);
    CpuOpArgs a = f.op.args;
    a.dtype = DType::kFP32;
    ExpectInvalid(a, "pattern " + name + " takes bf16 or fp16 input, not fp32");
    a = f.op.args;
    a.quant_out = nullptr;
    ExpectInvalid(a, "quant_out is null (" + name + ")");
    a = f.op.args;
    a.scale = nullptr;
    ExpectInvalid(a, "scale is null (" + name + ")");
    a = f.op.args;
    a.residual_in = nullptr;
    ExpectInvalid(a, "residual_in is null");
    a = f.op.args;
    a.residual_out = nullptr;
    ExpectInvalid(a, "residual_out is null");
    a = f.op.args;
    a.gamma = nullptr;
    ExpectInvalid(a, "gamma is null");
  }
  Fp8Op g(DType::kFP16, 2, 1, 64, Pattern::kAllReduceResidualRmsNormFp8PerGroup, 1);
  ExpectInvalid(g.op.args, "hidden 64 is not a multiple of the group size 128");
  Fp8Op l(DType::kFP16, 2, 1, 128, Pattern::kAllReduceResidualRmsNormFp8PerGroup, 1);
  CpuOpArgs a = l.op.args;
  for (uint8_t bad : {0, 4, 255}) {
    a.scale_layout = bad;
    ExpectInvalid(a, "scale layout " + std::to_string(bad) + " is not 1 (fp32 row-major)");
  }
  a = l.op.args;
  a.pattern = static_cast<Pattern>(6);
  ExpectInvalid(a, "pattern 6 is not 1 to 5");
  // A pattern's rules come before the tensors: a group hidden error even with tokens 0.
  a = g.op.args;
  a.num_tokens = 0;
  ExpectInvalid(a, "is not a multiple of the group size");
}

}  // namespace
}  // namespace arfuse
