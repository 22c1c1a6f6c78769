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
#include "tests/kernels/fp8_steps.h"

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
    ASSERT_EQ(dq::InvScale(amax), fp8::InvScale(amax)) << amax;
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

// The epilogue's codes for a per-token or fp32 group scale, E4M3(x * InvScale(scale)), against
// the IEEE quotient's E4M3(x / scale): for every scale the formulas can give at the edges (the
// floors, an all-ones significand, a power of two, the largest finite) and random ones, every
// 1024th fp32 pattern of x and its neighbours (NaN, inf and subnormals included) whose quotient
// is at most 2^100, and random x and scales: never more than one E4M3 step apart, with x's sign,
// NaN where the quotient's is NaN. The device's InvScale has the host's 1.0f / scale bits.
TEST(Fp8QuantHost, TheReciprocalsCodeIsWithinOneStepOfTheQuotients) {
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
  uint64_t differ = 0;
  uint64_t too_far = 0;
  auto check = [&](float x, float scale) {
    const float want = x / scale;
    // The epilogue's domain (its quotients are at most about 448); NaN x stay in.
    if (std::fabs(want) > 0x1p100f || (std::isinf(x) && !std::isinf(scale))) return;
    const uint8_t got = fp8::E4m3FromFloat(x * dq::InvScale(scale));
    const uint8_t code = fp8::E4m3FromFloat(want);
    differ += got != code;
    const bool far = !fp8_test::E4m3WithinOneStepSameSign(got, code);
    if (far && ++too_far <= 5) {
      ADD_FAILURE() << std::hexfloat << "x " << x << " / " << scale << ": code 0x" << std::hex
                    << int{got} << ", the quotient's 0x" << int{code};
    }
  };
  for (const float scale : scales) {
    ASSERT_EQ(dq::InvScale(scale), fp8::InvScale(scale)) << scale;
    for (uint64_t b = 0; b < (1ull << 32); b += 1024) {
      const auto bits = static_cast<uint32_t>(b);
      check(FromBits(bits), scale);
      check(FromBits(bits + 1), scale);
      check(FromBits(bits - 1), scale);
    }
  }
  for (int i = 0; i < 2'000'000; ++i) {
    check(FromBits(static_cast<uint32_t>(rng())), std::exp2(exponent(rng)));
  }
  EXPECT_EQ(too_far, 0u);
  EXPECT_GT(differ, 0u);  // some do differ: the comparison is not vacuous
  // The sign of a zero, and an infinite scale (a row or group holding an infinity): 1 / inf = +0.
  EXPECT_EQ(fp8::E4m3FromFloat(-0.0f * dq::InvScale(1.0f)), 0x80);
  EXPECT_EQ(fp8::E4m3FromFloat(-0x1p-140f * dq::InvScale(4.0f)), 0x80);
  EXPECT_EQ(dq::InvScale(INFINITY), 0.0f);
  EXPECT_EQ(fp8::E4m3FromFloat(-3.0f * dq::InvScale(INFINITY)), 0x80);
  EXPECT_EQ(fp8::E4m3FromFloat(3.0f * dq::InvScale(INFINITY)), 0x00);
  EXPECT_EQ(fp8::E4m3FromFloat(INFINITY * dq::InvScale(INFINITY)), fp8::kE4m3NanCode);
}

}  // namespace
}  // namespace arfuse
