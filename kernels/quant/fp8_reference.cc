#include "kernels/quant/fp8_reference.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace arfuse::fp8 {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

constexpr uint32_t kInfBits = 0x7f800000u;
constexpr uint32_t kBits464 = 0x43e80000u;        // 464 = 448 + half an ulp of 448: the tie
constexpr uint32_t kBitsMinNormal = 0x3c800000u;  // 2^-6, the smallest normal E4M3

// Rounds m / 2^shift to the nearest integer, ties to even (shift >= 1).
uint32_t RoundShiftNearestEven(uint32_t m, uint32_t shift) {
  if (shift > 31u) return 0u;  // m < 2^24: far below one half
  const uint32_t kept = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  return kept + ((rest > half || (rest == half && (kept & 1u) != 0u)) ? 1u : 0u);
}

bool ValidRows(const float* x, uint32_t tokens, uint32_t hidden, const void* q,
               plain::Status* status) {
  if (hidden == 0) {
    *status = plain::InvalidArgumentError("hidden must be positive, got 0");
    return false;
  }
  if (tokens > 0 && (x == nullptr || q == nullptr)) {
    *status = plain::InvalidArgumentError(
        plain::StrCat(x == nullptr ? "x" : "q", " is null with ", tokens, " tokens"));
    return false;
  }
  return true;
}

}  // namespace

uint8_t E4m3FromFloat(float x) {
  const uint32_t u = Bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > kInfBits) return kE4m3NanCode;
  // Beyond the tie at 464 (infinity included) the nearest finite value is 448: saturate.
  if (a > kBits464) return static_cast<uint8_t>(sign | kE4m3MaxCode);
  const uint32_t exponent = a >> 23;
  const uint32_t fraction = a & 0x7fffffu;
  if (a >= kBitsMinNormal) {
    // Normal E4M3 (2^-6 .. 464): keep 3 of the 23 fraction bits. A carry out of the fraction
    // moves into the exponent field, which is the next code; 464 itself ties to even 448.
    const uint32_t e4m3_exponent = exponent - 127u + 7u;  // 1 .. 15
    const uint32_t code = (e4m3_exponent << 3) | (fraction >> 20);
    return static_cast<uint8_t>(sign |
                                RoundShiftNearestEven(code << 20 | (fraction & 0xfffffu), 20u));
  }
  // Below 2^-6 E4M3 steps by 2^-9: the code is |x| / 2^-9 rounded to an integer (0 .. 8; 8 is
  // the smallest normal, 2^-6). |x| = m * 2^(e - 150) with the implicit bit for normal floats,
  // so |x| / 2^-9 = m / 2^(141 - e); fp32 subnormals (e = 0) have m * 2^-149.
  const uint32_t m = exponent == 0 ? fraction : (fraction | 0x800000u);
  const uint32_t shift = exponent == 0 ? 140u : 141u - exponent;
  return static_cast<uint8_t>(sign | RoundShiftNearestEven(m, shift));
}

float E4m3ToFloat(uint8_t code) {
  const bool negative = (code & 0x80u) != 0;
  const uint32_t magnitude = code & 0x7fu;
  if (magnitude == 0x7fu) {
    return negative ? -std::numeric_limits<float>::quiet_NaN()
                    : std::numeric_limits<float>::quiet_NaN();
  }
  const int exponent = static_cast<int>(magnitude >> 3);
  const int mantissa = static_cast<int>(magnitude & 7u);
  const float v = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  return negative ? -v : v;
}

float InvScale(float scale) { return 1.0f / scale; }

float AbsMax(const float* x, size_t n) {
  float m = 0.0f;
  for (size_t i = 0; i < n; ++i) m = std::fmax(m, std::fabs(x[i]));
  return m;
}

float DynamicTokenScale(float amax) { return std::fmax(amax / kE4m3Max, kMinScalingFactor); }

float GroupScaleFp32(float amax) { return std::fmax(amax, kGroupEps) / kE4m3Max; }

uint8_t Ue8m0FromAmax(float amax) {
  const float s = std::fmax(amax / kE4m3Max, kGroupEps);
  if (std::isinf(s)) return 0xffu;
  // s = f * 2^e with f in [0.5, 1): ceil(log2(s)) is e - 1 when s is a power of two, else e.
  int e = 0;
  const float f = std::frexp(s, &e);
  const int ceil_log2 = f == 0.5f ? e - 1 : e;
  return static_cast<uint8_t>(ceil_log2 + 127);
}

float Ue8m0ToFloat(uint8_t byte) {
  if (byte == 0xffu) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(byte) - 127);
}

plain::Status QuantizeRowsStatic(const float* x, uint32_t tokens, uint32_t hidden, float scale,
                                 uint8_t* q) {
  plain::Status status;
  if (!ValidRows(x, tokens, hidden, q, &status)) return status;
  const float inv = InvScale(scale);
  const uint64_t n = static_cast<uint64_t>(tokens) * hidden;
  for (uint64_t i = 0; i < n; ++i) q[i] = E4m3FromFloat(x[i] * inv);
  return plain::OkStatus();
}

plain::Status QuantizeRowsPerToken(const float* x, uint32_t tokens, uint32_t hidden, uint8_t* q,
                                   float* scales) {
  plain::Status status;
  if (!ValidRows(x, tokens, hidden, q, &status)) return status;
  if (tokens > 0 && scales == nullptr) {
    return plain::InvalidArgumentError(plain::StrCat("scales is null with ", tokens, " tokens"));
  }
  for (uint32_t t = 0; t < tokens; ++t) {
    const float* row = x + static_cast<uint64_t>(t) * hidden;
    uint8_t* out = q + static_cast<uint64_t>(t) * hidden;
    const float s = DynamicTokenScale(AbsMax(row, hidden));
    scales[t] = s;
    const float inv = InvScale(s);
    for (uint32_t i = 0; i < hidden; ++i) out[i] = E4m3FromFloat(row[i] * inv);
  }
  return plain::OkStatus();
}

plain::Status QuantizeRowsPerGroup(const float* x, uint32_t tokens, uint32_t hidden,
                                   uint32_t group_size, GroupScaleLayout layout, uint8_t* q,
                                   void* scales) {
  plain::Status status;
  if (!ValidRows(x, tokens, hidden, q, &status)) return status;
  if (group_size == 0 || hidden % group_size != 0) {
    return plain::InvalidArgumentError(
        plain::StrCat("hidden ", hidden, " is not a positive multiple of group_size ", group_size));
  }
  if (!IsGroupScaleLayout(layout)) {
    return plain::InvalidArgumentError(
        plain::StrCat("unknown group scale layout ", static_cast<int>(layout)));
  }
  if (tokens > 0 && scales == nullptr) {
    return plain::InvalidArgumentError(plain::StrCat("scales is null with ", tokens, " tokens"));
  }
  const uint32_t groups = hidden / group_size;
  auto* scale_bytes = static_cast<uint8_t*>(scales);
  if (tokens > 0) std::memset(scale_bytes, 0, GroupScaleBytes(layout, tokens, groups));
  for (uint32_t t = 0; t < tokens; ++t) {
    for (uint32_t g = 0; g < groups; ++g) {
      const uint64_t first =
          static_cast<uint64_t>(t) * hidden + static_cast<uint64_t>(g) * group_size;
      const float amax = AbsMax(x + first, group_size);
      const uint64_t at = GroupScaleByteOffset(layout, t, g, tokens, groups);
      float s;
      if (layout == GroupScaleLayout::kUe8m0Packed) {
        const uint8_t e = Ue8m0FromAmax(amax);
        scale_bytes[at] = e;
        s = Ue8m0ToFloat(e);
        if (e == 0xffu) s = std::numeric_limits<float>::infinity();  // the kernel's 2^128
      } else {
        s = GroupScaleFp32(amax);
        std::memcpy(scale_bytes + at, &s, sizeof(s));
      }
      // UE8M0: 1 / 2^e is exact (the kernel's exponent field), so this is x / 2^e.
      const float inv = InvScale(s);
      for (uint32_t i = 0; i < group_size; ++i) q[first + i] = E4m3FromFloat(x[first + i] * inv);
    }
  }
  return plain::OkStatus();
}

}  // namespace arfuse::fp8
