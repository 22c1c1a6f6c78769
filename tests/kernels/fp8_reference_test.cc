// The FP8 E4M3 reference (kernels/quant/fp8_reference.h) against formulations written here
// independently of it: E4M3 values decoded from the format's definition in double precision,
// encoding as a search for the nearest finite value with ties to the even code, and scales
// recomputed from their formulas with std::max_element, ldexp and log2 in double.
#include "kernels/quant/fp8_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace arfuse::fp8 {
namespace {

using ::testing::HasSubstr;

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
uint32_t ToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// The OCP E4M3 (e4m3fn) definition: bias 7, subnormals at exponent field 0, S.1111.111 is NaN.
double DefinitionValue(uint8_t code) {
  const int e = (code >> 3) & 0xf;
  const int m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (code & 0x80) ? -magnitude : magnitude;
}

// Nearest finite E4M3 value, ties to the even code, by search over the 127 non-negative finite
// values (codes 0x00 .. 0x7e are increasing). Everything at or above 448 is nearest to 448, so
// this is the saturating conversion; NaN gives 0x7f.
uint8_t NearestEven(float x) {
  if (std::isnan(x)) return 0x7f;
  static const std::vector<double> values = [] {
    std::vector<double> v;
    for (int c = 0; c <= 0x7e; ++c) v.push_back(DefinitionValue(static_cast<uint8_t>(c)));
    return v;
  }();
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= values.back()) return sign | 0x7e;
  // values[i] <= a < values[i + 1]
  const size_t i =
      static_cast<size_t>(std::upper_bound(values.begin(), values.end(), a) - values.begin()) - 1;
  const double mid = (values[i] + values[i + 1]) / 2;  // exact: 5 significant bits
  size_t pick;
  if (a < mid) {
    pick = i;
  } else if (a > mid) {
    pick = i + 1;
  } else {
    pick = (i % 2 == 0) ? i : i + 1;
  }
  return static_cast<uint8_t>(sign | pick);
}

TEST(Fp8Reference, DecodeOfEveryCodeMatchesTheDefinition) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const double want = DefinitionValue(code);
    const float got = E4m3ToFloat(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << std::hex << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << std::hex << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << std::hex << c;  // 0x80 is -0.0
    }
  }
  EXPECT_EQ(E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4m3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(E4m3ToFloat(0x08), std::ldexp(1.0f, -6));
}

TEST(Fp8Reference, EveryFiniteCodeRoundTripsAndNansBecomeTheCanonicalNan) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const uint8_t back = E4m3FromFloat(E4m3ToFloat(code));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_EQ(back, 0x7f) << std::hex << c;
    } else {
      EXPECT_EQ(back, code) << std::hex << c;
    }
  }
}

// Every midpoint between neighbouring codes of either sign: ties go to the even code, the float
// just above a midpoint to the upper code and just below to the lower one.
TEST(Fp8Reference, MidpointsTieToEvenAndNeighboursRoundToTheNearerCode) {
  int checked = 0;
  for (int c = 0; c < 0x7e; ++c) {
    for (const uint8_t sign : {uint8_t{0x00}, uint8_t{0x80}}) {
      const auto lo = static_cast<uint8_t>(sign | c);
      const auto hi = static_cast<uint8_t>(sign | (c + 1));
      const double mid = (DefinitionValue(lo) + DefinitionValue(hi)) / 2;
      const auto mid_f = static_cast<float>(mid);
      ASSERT_EQ(static_cast<double>(mid_f), mid) << "midpoint not exact in fp32";
      const uint8_t even = (c % 2 == 0) ? lo : hi;
      EXPECT_EQ(E4m3FromFloat(mid_f), even) << std::hex << int{lo} << " " << mid;
      const float away = std::nextafter(mid_f, sign ? -INFINITY : INFINITY);
      const float toward = std::nextafter(mid_f, 0.0f);
      EXPECT_EQ(E4m3FromFloat(away), hi) << mid;
      EXPECT_EQ(E4m3FromFloat(toward), lo) << mid;
      EXPECT_EQ(NearestEven(mid_f), even);
      checked += 3;
    }
  }
  EXPECT_EQ(checked, 126 * 2 * 3);
}

TEST(Fp8Reference, SaturationAt448AndTheTieAt464) {
  EXPECT_EQ(E4m3FromFloat(448.0f), 0x7e);
  EXPECT_EQ(E4m3FromFloat(std::nextafter(448.0f, 0.0f)), 0x7e);
  EXPECT_EQ(E4m3FromFloat(416.0f), 0x7d);  // the code below 448
  EXPECT_EQ(E4m3FromFloat(432.0f), 0x7e);  // tie between 416 (odd 0x7d) and 448 (even 0x7e)
  EXPECT_EQ(E4m3FromFloat(456.0f), 0x7e);
  EXPECT_EQ(E4m3FromFloat(464.0f), 0x7e);  // 448 + half an ulp: the tie goes to even 448
  EXPECT_EQ(E4m3FromFloat(std::nextafter(464.0f, 0.0f)), 0x7e);
  EXPECT_EQ(E4m3FromFloat(std::nextafter(464.0f, INFINITY)), 0x7e);  // saturates, no NaN
  EXPECT_EQ(E4m3FromFloat(480.0f), 0x7e);
  EXPECT_EQ(E4m3FromFloat(1e30f), 0x7e);
  EXPECT_EQ(E4m3FromFloat(std::numeric_limits<float>::max()), 0x7e);
  EXPECT_EQ(E4m3FromFloat(-464.0f), 0xfe);
  EXPECT_EQ(E4m3FromFloat(-std::nextafter(464.0f, INFINITY)), 0xfe);
  EXPECT_EQ(E4m3FromFloat(-std::numeric_limits<float>::max()), 0xfe);
}

TEST(Fp8Reference, InfinitiesSaturateAndEveryNanKindGivesTheCanonicalNan) {
  EXPECT_EQ(E4m3FromFloat(INFINITY), 0x7e);
  EXPECT_EQ(E4m3FromFloat(-INFINITY), 0xfe);
  for (const uint32_t nan : {0x7fc00000u, 0x7f800001u, 0x7fffffffu, 0xffc00000u, 0xff800001u,
                             0xffffffffu, 0x7fa00000u}) {
    EXPECT_EQ(E4m3FromFloat(FromBits(nan)), 0x7f) << std::hex << nan;
  }
}

TEST(Fp8Reference, E4m3SubnormalsStepBy2ToTheMinus9) {
  for (int k = 0; k <= 8; ++k) {
    EXPECT_EQ(E4m3FromFloat(std::ldexp(static_cast<float>(k), -9)), k);
    EXPECT_EQ(E4m3FromFloat(-std::ldexp(static_cast<float>(k), -9)), 0x80 | k);
  }
  EXPECT_EQ(E4m3FromFloat(std::ldexp(1.0f, -10)), 0x00);  // half the smallest: tie to even 0
  EXPECT_EQ(E4m3FromFloat(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(E4m3FromFloat(std::ldexp(3.0f, -10)), 0x02);   // 1.5 steps: tie to even 2
  EXPECT_EQ(E4m3FromFloat(std::ldexp(5.0f, -10)), 0x02);   // 2.5 steps: tie to even 2
  EXPECT_EQ(E4m3FromFloat(std::ldexp(15.0f, -10)), 0x08);  // 7.5 steps: to 8, the min normal
  EXPECT_EQ(E4m3FromFloat(std::ldexp(1.0f, -7)), 0x04);
}

TEST(Fp8Reference, ZerosAndEveryFp32SubnormalRoundToZeroKeepingTheSign) {
  EXPECT_EQ(E4m3FromFloat(0.0f), 0x00);
  EXPECT_EQ(E4m3FromFloat(-0.0f), 0x80);
  for (uint32_t m = 1; m < 0x800000u; ++m) {
    ASSERT_EQ(E4m3FromFloat(FromBits(m)), 0x00) << std::hex << m;
    ASSERT_EQ(E4m3FromFloat(FromBits(0x80000000u | m)), 0x80) << std::hex << m;
  }
  EXPECT_EQ(E4m3FromFloat(std::numeric_limits<float>::min()), 0x00);  // smallest normal fp32
}

// Every float whose low 12 bits are zero (all exponents, both signs, the top 11 fraction bits,
// which include every midpoint of the normal range) and its two neighbours, plus random bit
// patterns, against the nearest-value search.
TEST(Fp8Reference, StructuredAndRandomFloatsMatchTheNearestValueSearch) {
  int mismatches = 0;
  auto check = [&](uint32_t bits) {
    const float x = FromBits(bits);
    if (E4m3FromFloat(x) != NearestEven(x) && ++mismatches <= 5) {
      ADD_FAILURE() << std::hex << "bits 0x" << bits << ": got 0x" << int{E4m3FromFloat(x)}
                    << ", nearest 0x" << int{NearestEven(x)};
    }
  };
  for (uint32_t i = 0; i < (1u << 20); ++i) {
    const uint32_t bits = i << 12;
    check(bits);
    check(bits + 1);
    check(bits - 1);
  }
  std::mt19937 rng(42);
  for (int i = 0; i < 1'000'000; ++i) check(static_cast<uint32_t>(rng()));
  EXPECT_EQ(mismatches, 0);
}

TEST(Fp8Reference, ScaleFormulas) {
  EXPECT_EQ(kMinScalingFactor, 1.0f / (448.0f * 512.0f));
  EXPECT_EQ(ToBits(kMinScalingFactor), 0x36924925u);
  EXPECT_EQ(InvScale(0.5f), 2.0f);
  EXPECT_EQ(InvScale(3.0f), 1.0f / 3.0f);
  EXPECT_EQ(DynamicTokenScale(0.0f), kMinScalingFactor);  // all-zero row: the floor
  EXPECT_EQ(DynamicTokenScale(1e-6f), kMinScalingFactor);
  EXPECT_EQ(DynamicTokenScale(448.0f), 1.0f);
  EXPECT_EQ(DynamicTokenScale(896.0f), 2.0f);
  EXPECT_EQ(DynamicTokenScale(3.0f), 3.0f / 448.0f);
  EXPECT_EQ(DynamicTokenScale(INFINITY), INFINITY);
  EXPECT_EQ(GroupScaleFp32(0.0f), 1e-10f / 448.0f);  // eps floor on the amax, not the scale
  EXPECT_EQ(GroupScaleFp32(1.0f), 1.0f / 448.0f);
  EXPECT_EQ(GroupScaleFp32(448.0f), 1.0f);
  const float row[] = {0.5f, -3.0f, std::nanf(""), 2.0f, -0.0f};
  EXPECT_EQ(AbsMax(row, 5), 3.0f);  // the NaN is ignored
  const float inf_row[] = {1.0f, -INFINITY};
  EXPECT_EQ(AbsMax(inf_row, 2), INFINITY);
  EXPECT_EQ(AbsMax(row, 0), 0.0f);
}

TEST(Fp8Reference, Ue8m0OfPowersOfTwoAndOfValuesBetween) {
  // 448 * 1.5 * 2^k stays finite up to k = 118; FLT_MAX (below) covers the top byte.
  for (int k = -33; k <= 118; ++k) {
    const float amax = std::ldexp(448.0f, k);  // amax / 448 = 2^k exactly
    EXPECT_EQ(Ue8m0FromAmax(amax), 127 + k) << k;
    EXPECT_EQ(Ue8m0ToFloat(static_cast<uint8_t>(127 + k)), std::ldexp(1.0f, k));
    EXPECT_EQ(Ue8m0FromAmax(std::nextafter(amax, INFINITY)), 128 + k) << k;  // rounds up
    EXPECT_EQ(Ue8m0FromAmax(std::ldexp(448.0f * 1.5f, k)), 128 + k) << k;
    EXPECT_EQ(Ue8m0FromAmax(std::nextafter(amax, 0.0f)), 127 + k) << k;
  }
  // Against 2^ceil(log2(s)) in double for a spread of values.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-30.0f, 30.0f);
  for (int i = 0; i < 100000; ++i) {
    const float amax = std::exp2(exponent(rng));
    const double s = std::max(static_cast<double>(amax / 448.0f), static_cast<double>(kGroupEps));
    const int want = static_cast<int>(std::ceil(std::log2(s))) + 127;
    ASSERT_EQ(Ue8m0FromAmax(amax), want) << amax;
  }
  EXPECT_EQ(Ue8m0FromAmax(0.0f), 94);  // floor 1e-10 -> 2^-33
  EXPECT_EQ(Ue8m0FromAmax(1e-20f), 94);
  EXPECT_EQ(std::ldexp(1.0f, -33) >= kGroupEps, true);
  EXPECT_EQ(std::ldexp(1.0f, -34) < kGroupEps, true);
  EXPECT_EQ(Ue8m0FromAmax(std::numeric_limits<float>::max()), 127 + 120);
  EXPECT_EQ(Ue8m0FromAmax(INFINITY), 0xff);
  EXPECT_TRUE(std::isnan(Ue8m0ToFloat(0xff)));
}

TEST(Fp8Reference, GroupScaleLayoutsAndTheirPadding) {
  EXPECT_EQ(TmaAlignedTokens(0), 0u);
  EXPECT_EQ(TmaAlignedTokens(1), 4u);
  EXPECT_EQ(TmaAlignedTokens(4), 4u);
  EXPECT_EQ(TmaAlignedTokens(5), 8u);
  // hidden 384: 3 groups, one packed word per token whose byte 3 is unused.
  EXPECT_EQ(GroupScaleColumns(GroupScaleLayout::kUe8m0Packed, 3), 1u);
  EXPECT_EQ(GroupScaleElements(GroupScaleLayout::kUe8m0Packed, 5, 3), 5u);
  // hidden 4096: 32 groups = 8 words per token; 5 tokens -> columns of 8, the last holds 5.
  EXPECT_EQ(GroupScaleElements(GroupScaleLayout::kUe8m0Packed, 5, 32), 7u * 8u + 5u);
  EXPECT_EQ(GroupScaleByteOffset(GroupScaleLayout::kUe8m0Packed, 2, 9, 5, 32),
            (2u * 8u + 2u) * 4u + 1u);
  EXPECT_EQ(GroupScaleElements(GroupScaleLayout::kFp32MnMajor, 5, 32), 31u * 8u + 5u);
  EXPECT_EQ(GroupScaleByteOffset(GroupScaleLayout::kFp32MnMajor, 2, 9, 5, 32), (9u * 8u + 2u) * 4u);
  EXPECT_EQ(GroupScaleElements(GroupScaleLayout::kFp32RowMajor, 5, 32), 160u);
  EXPECT_EQ(GroupScaleByteOffset(GroupScaleLayout::kFp32RowMajor, 2, 9, 5, 32),
            (2u * 32u + 9u) * 4u);
  EXPECT_EQ(GroupScaleElements(GroupScaleLayout::kFp32RowMajor, 0, 32), 0u);
}

std::vector<float> RandomRows(uint32_t tokens, uint32_t hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> magnitude(-12.0f, 12.0f);
  std::vector<float> x(static_cast<size_t>(tokens) * hidden);
  for (uint32_t t = 0; t < tokens; ++t) {
    // Each row at its own magnitude, so the scales and the rounding positions spread.
    const float row_scale = std::exp2(magnitude(rng));
    for (uint32_t i = 0; i < hidden; ++i)
      x[static_cast<size_t>(t) * hidden + i] = normal(rng) * row_scale;
  }
  return x;
}

TEST(Fp8Reference, StaticRowsMultiplyByTheReciprocal) {
  const uint32_t tokens = 3, hidden = 4096;
  const std::vector<float> x = RandomRows(tokens, hidden, 1);
  std::vector<uint8_t> q(x.size());
  for (const float scale : {0.5f, 3.0f, 0.0123f, 1e-3f}) {
    ASSERT_TRUE(QuantizeRowsStatic(x.data(), tokens, hidden, scale, q.data()).ok());
    const float inv = 1.0f / scale;
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(q[i], NearestEven(x[i] * inv)) << i;
  }
  // A zero scale is used as given: its reciprocal is inf, so 0 * inf is NaN and the rest saturate.
  const float zeros_and_one[] = {0.0f, 1.0f, -1.0f, 0.0f};
  uint8_t out[4];
  ASSERT_TRUE(QuantizeRowsStatic(zeros_and_one, 1, 4, 0.0f, out).ok());
  EXPECT_THAT(out, ::testing::ElementsAre(0x7f, 0x7e, 0xfe, 0x7f));
}

TEST(Fp8Reference, PerTokenRowsAtHidden4096And8192) {
  for (const uint32_t hidden : {4096u, 8192u}) {
    const uint32_t tokens = 5;
    std::vector<float> x = RandomRows(tokens, hidden, hidden);
    std::fill(x.begin() + hidden, x.begin() + 2 * hidden, 0.0f);  // row 1: all zero
    x[2 * hidden + 17] = std::nanf("");                           // row 2: one NaN
    x[3 * hidden + 5] = -INFINITY;                                // row 3: one -inf
    std::vector<uint8_t> q(x.size());
    std::vector<float> scales(tokens);
    ASSERT_TRUE(QuantizeRowsPerToken(x.data(), tokens, hidden, q.data(), scales.data()).ok());
    for (uint32_t t = 0; t < tokens; ++t) {
      const float* row = x.data() + static_cast<size_t>(t) * hidden;
      float amax = 0.0f;
      for (uint32_t i = 0; i < hidden; ++i) {
        if (!std::isnan(row[i])) amax = std::max(amax, std::fabs(row[i]));
      }
      const float want_scale = std::max(amax / 448.0f, 1.0f / (448.0f * 512.0f));
      ASSERT_EQ(scales[t], want_scale) << "token " << t;
      for (uint32_t i = 0; i < hidden; ++i) {
        ASSERT_EQ(q[static_cast<size_t>(t) * hidden + i], NearestEven(row[i] / want_scale))
            << "token " << t << " element " << i;
      }
    }
    EXPECT_EQ(scales[1], kMinScalingFactor);
    EXPECT_TRUE(
        std::all_of(q.begin() + hidden, q.begin() + 2 * hidden, [](uint8_t c) { return c == 0; }));
    EXPECT_EQ(q[2 * hidden + 17], 0x7f);        // NaN stays NaN
    EXPECT_EQ(scales[3], INFINITY);             // an inf makes the scale inf ...
    EXPECT_EQ(q[3 * hidden + 5], 0x7f);         // ... -inf / inf is NaN ...
    EXPECT_EQ(q[3 * hidden + 4] & 0x7f, 0x00);  // ... and every finite value becomes +-0
    // The largest magnitude of an ordinary row lands on +-448.
    const auto* row0 = x.data();
    const size_t at = static_cast<size_t>(
        std::max_element(row0, row0 + hidden,
                         [](float a, float b) { return std::fabs(a) < std::fabs(b); }) -
        row0);
    EXPECT_EQ(q[at] & 0x7f, 0x7e);
  }
}

TEST(Fp8Reference, PerGroupRowsInEveryLayoutAtHidden4096And8192) {
  for (const uint32_t hidden : {4096u, 8192u, 384u}) {
    for (const uint32_t tokens : {1u, 3u, 5u}) {
      const uint32_t groups = hidden / kGroupSize;
      std::vector<float> x = RandomRows(tokens, hidden, hidden + tokens);
      std::fill(x.begin(), x.begin() + kGroupSize, 0.0f);  // token 0, group 0: all zero
      for (const GroupScaleLayout layout :
           {GroupScaleLayout::kFp32RowMajor, GroupScaleLayout::kFp32MnMajor,
            GroupScaleLayout::kUe8m0Packed}) {
        std::vector<uint8_t> q(x.size());
        const uint64_t scale_bytes = GroupScaleBytes(layout, tokens, groups);
        std::vector<uint8_t> scales(scale_bytes, 0xa5);  // poison: padding must come out 0
        ASSERT_TRUE(QuantizeRowsPerGroup(x.data(), tokens, hidden, kGroupSize, layout, q.data(),
                                         scales.data())
                        .ok());
        std::vector<bool> written(scale_bytes, false);
        for (uint32_t t = 0; t < tokens; ++t) {
          for (uint32_t g = 0; g < groups; ++g) {
            const float* group = x.data() + static_cast<size_t>(t) * hidden + g * kGroupSize;
            float amax = 0.0f;
            for (uint32_t i = 0; i < kGroupSize; ++i) amax = std::max(amax, std::fabs(group[i]));
            const uint64_t at = GroupScaleByteOffset(layout, t, g, tokens, groups);
            float scale;
            if (layout == GroupScaleLayout::kUe8m0Packed) {
              const double s = std::max(static_cast<double>(amax / 448.0f), 1e-10);
              const int e = static_cast<int>(std::ceil(std::log2(s)));
              ASSERT_EQ(scales[at], 127 + e) << t << " " << g;
              written[at] = true;
              scale = std::ldexp(1.0f, e);
              ASSERT_GE(scale, amax / 448.0f);
            } else {
              scale = std::max(amax, 1e-10f) / 448.0f;
              float stored;
              std::memcpy(&stored, scales.data() + at, sizeof(stored));
              ASSERT_EQ(stored, scale) << t << " " << g;
              for (int b = 0; b < 4; ++b) written[at + b] = true;
            }
            for (uint32_t i = 0; i < kGroupSize; ++i) {
              ASSERT_EQ(q[static_cast<size_t>(t) * hidden + g * kGroupSize + i],
                        NearestEven(group[i] / scale))
                  << "token " << t << " group " << g << " element " << i;
            }
          }
        }
        for (uint64_t b = 0; b < scale_bytes; ++b) {
          if (!written[b]) {
            ASSERT_EQ(scales[b], 0) << "padding byte " << b;
          }
        }
        EXPECT_TRUE(
            std::all_of(q.begin(), q.begin() + kGroupSize, [](uint8_t c) { return c == 0; }));
      }
    }
  }
}

TEST(Fp8Reference, RowChecksRefuseBadArguments) {
  const float x[256] = {};
  uint8_t q[256];
  float s[2];
  auto refused = [](const plain::Status& st, const char* part) {
    EXPECT_EQ(st.code(), plain::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(st.message(), HasSubstr(part));
  };
  refused(QuantizeRowsStatic(x, 1, 0, 1.0f, q), "hidden must be positive");
  refused(QuantizeRowsStatic(nullptr, 1, 8, 1.0f, q), "x is null");
  refused(QuantizeRowsStatic(x, 1, 8, 1.0f, nullptr), "q is null");
  refused(QuantizeRowsPerToken(x, 1, 8, q, nullptr), "scales is null");
  refused(QuantizeRowsPerToken(x, 2, 0, q, s), "hidden must be positive");
  refused(QuantizeRowsPerGroup(x, 1, 200, 128, GroupScaleLayout::kFp32RowMajor, q, s),
          "hidden 200 is not a positive multiple of group_size 128");
  refused(QuantizeRowsPerGroup(x, 1, 128, 0, GroupScaleLayout::kFp32RowMajor, q, s),
          "group_size 0");
  refused(QuantizeRowsPerGroup(x, 1, 128, 128, static_cast<GroupScaleLayout>(9), q, s),
          "unknown group scale layout 9");
  refused(QuantizeRowsPerGroup(x, 1, 128, 128, GroupScaleLayout::kUe8m0Packed, q, nullptr),
          "scales is null");
  // No tokens: nothing is read or written, null buffers are fine.
  EXPECT_TRUE(
      QuantizeRowsPerGroup(nullptr, 0, 128, 128, GroupScaleLayout::kUe8m0Packed, nullptr, nullptr)
          .ok());
  EXPECT_TRUE(QuantizeRowsPerToken(nullptr, 0, 128, nullptr, nullptr).ok());
}

}  // namespace
}  // namespace arfuse::fp8
