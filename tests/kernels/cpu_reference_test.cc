// The CPU implementation of the fused op: conversions, the GPU's numerics, argument checks.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/half_convert.h"
#include "kernels/cpu/reference_op.h"

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
  EXPECT_EQ(FloatToHalfBits(65520.0f), 0x7c00);                   // tie rounds to infinity
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -24)), 0x0001);       // smallest subnormal
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -25)), 0x0000);       // tie to even zero
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(FloatToHalfBits(-std::ldexp(3.0f, -25)), 0x8002);      // 1.5 ulp: tie, to even 2
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1023.5f, -24)), 0x0400);    // carries into min normal
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
  const double ulp = c.dtype == DType::kBF16 ? std::ldexp(1.0, -8)
                     : c.dtype == DType::kFP16 ? std::ldexp(1.0, -11)
                                               : std::ldexp(1.0, -23);
  const size_t n = static_cast<size_t>(op.tokens) * op.hidden;
  for (size_t i = 0; i < n; ++i) {
    // Magnitude of the terms bounds the error of the roundings (sum, then residual add).
    double terms = 0.0;
    for (int r = 0; r < c.world; ++r) terms += std::fabs(LoadAsFloat(c.dtype, op.inputs[r].data(), i));
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

}  // namespace
}  // namespace arfuse
