// The FP8 E4M3 quantization math of the fused patterns' epilogue in plain C++, bit for bit what
// kernels/quant/fp8_quant.cuh computes on the GPU: the fp32 -> E4M3 conversion done in software
// (round to nearest, ties to even, saturating to +-448), the row and group amax, the scale
// formulas and the UE8M0 scales. It is the oracle of the quantization tests and the math a CPU
// (host-mode) implementation of the FP8 patterns runs. The formulas and every special value:
// docs/kernels.md, "FP8 outputs (quantization math)".
//
// Statuses are kernels/common/plain_status.h's, so the library links nothing beyond the C++
// standard library (libarfuse_client could carry it).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/plain_status.h"
#include "kernels/quant/fp8_format.h"

namespace arfuse::fp8 {

// fp32 -> E4M3 code: round to nearest, ties to even; every finite value beyond 448 in magnitude
// and +-inf saturate to +-448 (0x7e / 0xfe); any NaN -> 0x7f; -0.0 and negative values that
// round to zero -> 0x80. What __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) returns.
uint8_t E4m3FromFloat(float x);

// The exact value of an E4M3 code; 0x7f and 0xff are NaN.
float E4m3ToFloat(uint8_t code);

// The IEEE reciprocal 1.0f / scale every pattern multiplies by (E4M3(x * InvScale(scale))): as
// FlashInfer's kARResidualRMSNormFP8Quant and vLLM's static_scaled_fp8_quant do for the static
// scale. Against E4M3(x / scale) a code is at most one E4M3 step away.
float InvScale(float scale);

// max |x_i| over n values, from 0: NaNs are ignored (fmax), +-inf gives inf.
float AbsMax(const float* x, size_t n);

// Dynamic per-token scale: max(amax / 448, kMinScalingFactor).
float DynamicTokenScale(float amax);

// fp32 group scale: max(amax, kGroupEps) / 448.
float GroupScaleFp32(float amax);

// UE8M0 group scale as its exponent byte: 2^ceil(log2(max(amax / 448, kGroupEps))), byte =
// exponent + 127 (94 .. 247 for finite amax); amax = inf gives 0xff.
uint8_t Ue8m0FromAmax(float amax);

// The value of a UE8M0 exponent byte, 2^(byte - 127); 0xff is NaN.
float Ue8m0ToFloat(uint8_t byte);

// Row-major [tokens, hidden] fp32 values in, [tokens, hidden] E4M3 codes out.
// q = E4M3(x * InvScale(scale)), scale used as given.
plain::Status QuantizeRowsStatic(const float* x, uint32_t tokens, uint32_t hidden, float scale,
                                 uint8_t* q);

// Per token t: scales[t] = DynamicTokenScale(AbsMax(row t)); q = E4M3(x * InvScale(scales[t])).
plain::Status QuantizeRowsPerToken(const float* x, uint32_t tokens, uint32_t hidden, uint8_t* q,
                                   float* scales);

// Per group of group_size consecutive elements of a row: the group's amax, its scale
// (GroupScaleFp32, or the value of Ue8m0FromAmax for kUe8m0Packed) and
// q = E4M3(x * InvScale(scale)) (for UE8M0 the reciprocal is exact: x / scale).
// `scales` spans GroupScaleBytes(layout, tokens, hidden / group_size) bytes; every byte of it
// that holds no group's scale (TMA padding, unused bytes of a packed word) is written as 0.
plain::Status QuantizeRowsPerGroup(const float* x, uint32_t tokens, uint32_t hidden,
                                   uint32_t group_size, GroupScaleLayout layout, uint8_t* q,
                                   void* scales);

}  // namespace arfuse::fp8
