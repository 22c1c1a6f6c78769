// Distances between E4M3 codes for the FP8 tests, which compare codes within one step of the
// format. constexpr, so device code calls it too (the build passes --expt-relaxed-constexpr).
#pragma once

#include <cstdint>

namespace arfuse::fp8_test {

// A code's place among the codes ordered by value (sign-magnitude: +0 and -0 are both 0). For
// the non-NaN codes, two codes are |E4m3Ordinal(a) - E4m3Ordinal(b)| steps of the format apart.
constexpr int E4m3Ordinal(uint8_t code) {
  return (code & 0x80u) ? -static_cast<int>(code & 0x7fu) : static_cast<int>(code & 0x7fu);
}

constexpr int E4m3Steps(uint8_t a, uint8_t b) {
  const int d = E4m3Ordinal(a) - E4m3Ordinal(b);
  return d < 0 ? -d : d;
}

// a and b are both NaN (0x7f / 0xff), or both numbers of the same sign at most one step apart:
// what a code computed another correct way may differ by (the quantization tests' tolerance).
constexpr bool E4m3WithinOneStepSameSign(uint8_t a, uint8_t b) {
  const bool nan_a = (a & 0x7fu) == 0x7fu, nan_b = (b & 0x7fu) == 0x7fu;
  if (nan_a || nan_b) return nan_a && nan_b;
  return ((a ^ b) & 0x80u) == 0u && E4m3Steps(a, b) <= 1;
}

}  // namespace arfuse::fp8_test
