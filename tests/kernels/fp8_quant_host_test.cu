// The __host__ __device__ math of kernels/quant/fp8_quant.cuh compiled by nvcc and run on the
// host, against the CPU reference (kernels/quant/fp8_reference.h): on the host the conversion is
// cuda_fp8.hpp's own software path, an implementation independent of the reference's, so this
// checks the reference against NVIDIA's definition without a GPU (the GPU's instruction is
// checked by Fp8QuantGpu). Also the scale formulas and the padding writer's layout rules.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/quant/fp8_quant.cuh"
#include "kernels/quant/fp8_reference.h"

namespace arfuse {
namespace {

namespace dq = ::arfuse::device::fp8;

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Every 256th bit pattern (all exponents, both signs, the top 15 fraction bits) and each one's
// neighbours, plus random patterns: cuda_fp8.hpp's conversion and the reference agree on all.
TEST(Fp8QuantHost, CudaSoftwareConversionMatchesTheReference) {
  uint64_t mismatches = 0;
  auto check = [&](uint32_t bits) {
    const float x = FromBits(bits);
    const uint8_t want = fp8::E4m3FromFloat(x);
    if (dq::E4m3FromFloat(x) != want && ++mismatches <= 5) {
      ADD_FAILURE() << std::hex << "bits 0x" << bits << ": cuda 0x" << int{dq::E4m3FromFloat(x)}
                    << ", reference 0x" << int{want};
    }
  };
  for (uint64_t b = 0; b < (1ull << 32); b += 256) {
    const auto bits = static_cast<uint32_t>(b);
    check(bits);
    check(bits + 1);
    check(bits - 1);
  }
  std::mt19937 rng(3);
  for (int i = 0; i < 1'000'000; ++i) check(static_cast<uint32_t>(rng()));
  EXPECT_EQ(mismatches, 0u);
  // Four at a time: element 0 in the low byte.
  EXPECT_EQ(dq::E4m3QuadFromFloats(1.0f, -2.0f, 448.0f, 0.0f), 0x007ec038u);
  EXPECT_EQ(dq::E4m3PairFromFloats(std::nanf(""), -INFINITY), 0xfe7fu);
}

TEST(Fp8QuantHost, ScaleFormulasMatchTheReference) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> exponent(-40.0f, 40.0f);
  for (int i = 0; i < 200000; ++i) {
    const float amax = std::exp2(exponent(rng)) * (i % 7 == 0 ? 448.0f : 1.0f);
    ASSERT_EQ(dq::DynamicTokenScale(amax), fp8::DynamicTokenScale(amax)) << amax;
    ASSERT_EQ(dq::GroupScaleFp32(amax), fp8::GroupScaleFp32(amax)) << amax;
    ASSERT_EQ(dq::Ue8m0FromAmax(amax), fp8::Ue8m0FromAmax(amax)) << amax;
    ASSERT_EQ(dq::StaticInvScale(amax), fp8::StaticInvScale(amax)) << amax;
    const uint8_t e = dq::Ue8m0FromAmax(amax);
    ASSERT_EQ(dq::Ue8m0Reciprocal(e), 1.0f / fp8::Ue8m0ToFloat(e)) << amax;
  }
  for (const float amax : {0.0f, 448.0f, INFINITY, 3.4e38f, 1e-30f}) {
    EXPECT_EQ(dq::DynamicTokenScale(amax), fp8::DynamicTokenScale(amax)) << amax;
    EXPECT_EQ(dq::Ue8m0FromAmax(amax), fp8::Ue8m0FromAmax(amax)) << amax;
  }
  EXPECT_EQ(dq::Ue8m0FromAmax(INFINITY), 0xff);
  // amax / 448 without a division: the quotient's bits for every 16th non-negative float from
  // 2^-100 up (the formulas floor anything smaller), and inf for inf.
  uint64_t off = 0;
  for (uint32_t bits = 0x0d800000u; bits <= 0x7f800000u; bits += 16) {
    const float amax = FromBits(bits);
    if (dq::AmaxOver448(amax) != amax / 448.0f && ++off <= 5) {
      ADD_FAILURE() << std::hexfloat << amax << " / 448: " << dq::AmaxOver448(amax);
    }
  }
  EXPECT_EQ(off, 0u);
  EXPECT_EQ(dq::AmaxOver448(INFINITY), INFINITY);
  EXPECT_EQ(dq::Ue8m0Reciprocal(0xff), 0.0f);  // 1 / inf: finite values quantize to +-0
  // Every byte: the reciprocal of the float whose exponent field it is.
  for (uint32_t byte = 0; byte < 256; ++byte) {
    EXPECT_EQ(dq::Ue8m0Reciprocal(static_cast<uint8_t>(byte)), 1.0f / FromBits(byte << 23)) << byte;
  }
}

// DivideByScale (the epilogue's division by a per-token or per-group scale, one reciprocal per
// scale and two fmas per element) against the IEEE quotient the reference takes: for every
// scale the formulas can give at the edges (the floors, an all-ones significand, a power of two,
// the largest finite) and random ones, every 1024th fp32 pattern of x and its neighbours (NaN, inf
// and subnormals included) whose quotient is at most 2^100 gives the code of E4M3(x / scale), and
// its bits wherever |x| >= 2^-100 and the quotient is normal (else the residual or the quotient is
// subnormal and the code +-0 either way).
TEST(Fp8QuantHost, DivideByScaleGivesTheCodesOfTheQuotient) {
  std::vector<float> scales = {fp8::kMinScalingFactor,
                               fp8::GroupScaleFp32(0.0f),
                               1.0f,
                               FromBits(0x3f7fffffu),  // 0x1.fffffep-1
                               FromBits(0x3fffffffu),
                               fp8::DynamicTokenScale(448.0f * 0.75f),
                               fp8::DynamicTokenScale(3.4028235e38f),
                               fp8::GroupScaleFp32(3.4028235e38f),
                               INFINITY};
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> exponent(-42.0f, 119.0f);
  for (int i = 0; i < 8; ++i) scales.push_back(std::exp2(exponent(rng)));
  uint64_t code_mismatches = 0;
  uint64_t bit_mismatches = 0;
  auto check = [&](float x, float scale, const dq::ScaleDivisor& d) {
    const float want = x / scale;
    // The epilogue's domain (its quotients are at most about 448); NaN x stay in.
    if (std::fabs(want) > 0x1p100f || (std::isinf(x) && !std::isinf(scale))) return;
    const float got = dq::DivideByScale(x, d);
    if (fp8::E4m3FromFloat(got) != fp8::E4m3FromFloat(want) && ++code_mismatches <= 5) {
      ADD_FAILURE() << std::hexfloat << "x " << x << " / " << scale << ": " << got << ", want "
                    << want;
    }
    uint32_t got_bits, want_bits;
    std::memcpy(&got_bits, &got, 4);
    std::memcpy(&want_bits, &want, 4);
    if (std::fabs(x) >= 0x1p-100f && std::fabs(want) >= 0x1p-126f && got_bits != want_bits &&
        ++bit_mismatches <= 5) {
      ADD_FAILURE() << std::hexfloat << "x " << x << " / " << scale << ": bits of " << got
                    << ", want " << want;
    }
  };
  for (const float scale : scales) {
    const dq::ScaleDivisor d(scale);
    for (uint64_t b = 0; b < (1ull << 32); b += 1024) {
      const auto bits = static_cast<uint32_t>(b);
      check(FromBits(bits), scale, d);
      check(FromBits(bits + 1), scale, d);
      check(FromBits(bits - 1), scale, d);
    }
  }
  for (int i = 0; i < 2'000'000; ++i) {
    const float scale = std::exp2(exponent(rng));
    check(FromBits(static_cast<uint32_t>(rng())), scale, dq::ScaleDivisor(scale));
  }
  EXPECT_EQ(code_mismatches, 0u);
  EXPECT_EQ(bit_mismatches, 0u);
  // The sign of a zero quotient, and an infinite scale (a row or group holding an infinity).
  const dq::ScaleDivisor one(1.0f);
  EXPECT_EQ(fp8::E4m3FromFloat(dq::DivideByScale(-0.0f, one)), 0x80);
  EXPECT_EQ(fp8::E4m3FromFloat(dq::DivideByScale(-0x1p-140f, dq::ScaleDivisor(4.0f))), 0x80);
  const dq::ScaleDivisor inf(INFINITY);
  EXPECT_EQ(fp8::E4m3FromFloat(dq::DivideByScale(-3.0f, inf)), 0x80);
  EXPECT_EQ(fp8::E4m3FromFloat(dq::DivideByScale(3.0f, inf)), 0x00);
  EXPECT_EQ(fp8::E4m3FromFloat(dq::DivideByScale(INFINITY, inf)), fp8::kE4m3NanCode);
}

}  // namespace
}  // namespace arfuse
