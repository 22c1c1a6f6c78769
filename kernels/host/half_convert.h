// bf16 / fp16 <-> fp32 conversions in plain C++ (no CUDA), bit-compatible with the CUDA
// intrinsics the kernels use (__float2bfloat16_rn, __float2half_rn, __bfloat162float,
// __half2float) for every finite value, infinities and subnormals: round to nearest, ties to
// even; fp16 overflow rounds to infinity. NaNs map to a quiet NaN of the same sign (the payload
// is not preserved; no test relies on NaN payloads).
#pragma once

#include <cstdint>
#include <cstring>

namespace arfuse {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float Bf16BitsToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToBf16Bits(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  // Round to nearest even on the 16 dropped bits: add 0x7fff plus the lowest kept bit.
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float HalfBitsToFloat(uint16_t h);
uint16_t FloatToHalfBits(float f);

}  // namespace arfuse
