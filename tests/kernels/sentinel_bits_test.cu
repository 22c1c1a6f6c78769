// The sentinel tests of the fused kernels (kernels/add_rmsnorm/row_math.cuh) on raw bits, run on
// the host: NegativeZeroHalves finds the -0.0 halves of a word with integer arithmetic over both
// halves at once, so it is checked against the per-element rule (bits == 0x8000) for every
// 16-bit value in either half, next to neighbours that could carry or borrow into it.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/add_rmsnorm/row_math.cuh"

namespace arfuse {
namespace {

using device::HasSentinel;
using device::NegativeZeroHalves;
using device::Raw16;
using device::SanitizeNegativeZero;

// The per-element rule the packed form replaces.
uint32_t NegativeZeroHalvesOneByOne(uint32_t w) {
  uint32_t mask = 0;
  if ((w & 0xffffu) == 0x8000u) mask |= 0x8000u;
  if ((w >> 16) == 0x8000u) mask |= 0x80000000u;
  return mask;
}

// Halves that sit at the edges of the carry: zero magnitudes of both signs, the largest
// magnitude, the smallest subnormals, NaN and infinity patterns of bf16 and fp16.
const std::vector<uint32_t>& Neighbours() {
  static const std::vector<uint32_t> kValues = {0x0000u, 0x8000u, 0x0001u, 0x8001u, 0x7fffu,
                                                0xffffu, 0x7f80u, 0xff80u, 0x7c00u, 0xfc00u,
                                                0x7fc0u, 0x3f80u, 0xbf80u, 0x00ffu, 0x80ffu};
  return kValues;
}

TEST(SentinelBits, NegativeZeroHalvesMatchesTheRuleForEveryHalfAndNeighbour) {
  int mismatches = 0;
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    for (uint32_t other : Neighbours()) {
      for (const uint32_t w : {h | (other << 16), other | (h << 16)}) {
        if (NegativeZeroHalves(w) != NegativeZeroHalvesOneByOne(w) && ++mismatches <= 5) {
          ADD_FAILURE() << std::hex << "word 0x" << w << ": packed 0x" << NegativeZeroHalves(w)
                        << ", one by one 0x" << NegativeZeroHalvesOneByOne(w);
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(SentinelBits, SanitizeMapsOnlyNegativeZeroToPositiveZero16Bit) {
  for (int j = 0; j < 8; ++j) {
    Raw16 v{{0x3f80bf80u, 0x80017fffu, 0xffff0001u, 0x00008001u}};  // no -0.0 anywhere
    const Raw16 untouched = SanitizeNegativeZero<DType::kBF16>(v);
    for (int k = 0; k < 4; ++k) EXPECT_EQ(untouched.w[k], v.w[k]) << "word " << k;
    EXPECT_FALSE(HasSentinel<DType::kBF16>(v));
    // Element j becomes -0.0: found, and cleared alone.
    const int shift = (j & 1) * 16;
    v.w[j >> 1] = (v.w[j >> 1] & ~(0xffffu << shift)) | (0x8000u << shift);
    EXPECT_TRUE(HasSentinel<DType::kBF16>(v)) << "element " << j;
    EXPECT_TRUE(HasSentinel<DType::kFP16>(v)) << "element " << j;
    const Raw16 clean = SanitizeNegativeZero<DType::kFP16>(v);
    for (int k = 0; k < 4; ++k) {
      const uint32_t want = k == (j >> 1) ? v.w[k] & ~(0x8000u << shift) : v.w[k];
      EXPECT_EQ(clean.w[k], want) << "element " << j << " word " << k;
    }
    EXPECT_FALSE(HasSentinel<DType::kBF16>(clean)) << "element " << j;
  }
}

TEST(SentinelBits, AllNegativeZeroVectorIsTheSentinelAndSanitizesToZero) {
  const Raw16 sentinel{{0x80008000u, 0x80008000u, 0x80008000u, 0x80008000u}};
  EXPECT_TRUE(HasSentinel<DType::kBF16>(sentinel));
  const Raw16 clean = SanitizeNegativeZero<DType::kBF16>(sentinel);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(clean.w[k], 0u);
}

TEST(SentinelBits, Fp32ComparesWholeWords) {
  // 0x80008000 is two bf16 -0.0 but an ordinary negative fp32 value: not the fp32 sentinel.
  const Raw16 halves{{0x80008000u, 0x00000001u, 0x80000001u, 0x7f800000u}};
  EXPECT_FALSE(HasSentinel<DType::kFP32>(halves));
  const Raw16 same = SanitizeNegativeZero<DType::kFP32>(halves);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(same.w[k], halves.w[k]);
  const Raw16 with_zero{{0x3f800000u, 0x80000000u, 0x00000000u, 0x80000001u}};
  EXPECT_TRUE(HasSentinel<DType::kFP32>(with_zero));
  const Raw16 clean = SanitizeNegativeZero<DType::kFP32>(with_zero);
  EXPECT_EQ(clean.w[1], 0u);
  EXPECT_EQ(clean.w[3], 0x80000001u);
  EXPECT_FALSE(HasSentinel<DType::kFP32>(clean));
}

}  // namespace
}  // namespace arfuse
