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
  EXPECT_EQ(dq::Ue8m0Reciprocal(0xff), 0.0f);  // 1 / inf: finite values quantize to +-0
}

}  // namespace
}  // namespace arfuse
