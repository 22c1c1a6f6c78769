#include "kernels/host/half_convert.h"

namespace arfuse {

float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa x 2^-24 is exact in fp32.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return BitsToFloat(FloatBits(magnitude) | sign);
  }
  if (exponent == 31) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

uint16_t FloatToHalfBits(float f) {
  const uint32_t x = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;  // NaN -> quiet NaN
  // 65520 is halfway between 65504 (odd mantissa) and 65536: ties to even round it to infinity.
  if (ax >= 0x477ff000u) return sign | 0x7c00u;
  if (ax < 0x38800000u) {  // below 2^-14: an fp16 subnormal (or zero)
    // At or below 2^-25 (half of the smallest subnormal, a tie that goes to even 0) -> zero.
    if (ax <= 0x33000000u) return sign;
    const uint32_t biased_exp = ax >> 23;  // 102 .. 112
    const uint32_t mantissa = (ax & 0x7fffffu) | 0x800000u;
    // value = mantissa * 2^(e-150); in units of 2^-24 that is mantissa >> (126 - e).
    const uint32_t shift = 126u - biased_exp;  // 14 .. 24
    uint32_t q = mantissa >> shift;
    const uint32_t rem = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;  // may carry into the min normal
    return static_cast<uint16_t>(sign | q);
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits.
  uint32_t h = (ax >> 13) - (112u << 10);
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry may reach infinity: correct
  return static_cast<uint16_t>(sign | h);
}

}  // namespace arfuse
