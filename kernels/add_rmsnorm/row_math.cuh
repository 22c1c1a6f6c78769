// Device helpers shared by the fused kernels: 16-byte vectors of bf16/fp16/fp32 handled as raw
// bits, the -0.0 sentinel rules, dtype rounding, and the residual-add + RMSNorm of one row with
// the numerics of kernels/cpu/reference_op.h. CUDA only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/op_types.h"

namespace arfuse {
namespace device {

// One 16-byte vector as four 32-bit words; element j of a 16-bit dtype lives in word j/2,
// low half first (little endian, as in memory).
struct alignas(16) Raw16 {
  uint32_t w[4];
};
static_assert(sizeof(Raw16) == 16);

__device__ __forceinline__ Raw16 LoadRaw(const void* p) {
  const uint4 v = *static_cast<const uint4*>(p);
  return Raw16{{v.x, v.y, v.z, v.w}};
}
// L2 only: for data other GPUs (or other kernels) wrote into this workspace, so no stale L1 line
// from an earlier call can be read.
__device__ __forceinline__ Raw16 LoadRawCg(const void* p) {
  const uint4 v = __ldcg(static_cast<const uint4*>(p));
  return Raw16{{v.x, v.y, v.z, v.w}};
}
// Every poll must reach memory again (the Lamport spin).
__device__ __forceinline__ Raw16 LoadRawVolatile(const void* p) {
  Raw16 r;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3])
               : "l"(p)
               : "memory");
  return r;
}
__device__ __forceinline__ void StoreRaw(void* p, const Raw16& r) {
  *static_cast<uint4*>(p) = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
}

template <DType DT>
struct VecTraits;

template <>
struct VecTraits<DType::kBF16> {
  static constexpr int kElems = 8;
  static constexpr uint32_t kSentinelWord = 0x80008000u;  // two bf16 -0.0
  __device__ static float ToFloat(uint32_t bits) { return __uint_as_float(bits << 16); }
  __device__ static uint32_t FromFloat(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
};

template <>
struct VecTraits<DType::kFP16> {
  static constexpr int kElems = 8;
  static constexpr uint32_t kSentinelWord = 0x80008000u;  // two fp16 -0.0
  __device__ static float ToFloat(uint32_t bits) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
  __device__ static uint32_t FromFloat(float f) { return __half_as_ushort(__float2half_rn(f)); }
};

template <>
struct VecTraits<DType::kFP32> {
  static constexpr int kElems = 4;
  static constexpr uint32_t kSentinelWord = 0x80000000u;  // fp32 -0.0
  __device__ static float ToFloat(uint32_t bits) { return __uint_as_float(bits); }
  __device__ static uint32_t FromFloat(float f) { return __float_as_uint(f); }
};

template <DType DT>
__device__ __forceinline__ uint32_t GetBits(const Raw16& v, int j) {
  if constexpr (VecTraits<DT>::kElems == 8) {
    return (v.w[j >> 1] >> ((j & 1) * 16)) & 0xffffu;
  } else {
    return v.w[j];
  }
}

template <DType DT>
__device__ __forceinline__ void SetBits(Raw16& v, int j, uint32_t bits) {
  if constexpr (VecTraits<DT>::kElems == 8) {
    const int shift = (j & 1) * 16;
    v.w[j >> 1] = (v.w[j >> 1] & ~(0xffffu << shift)) | (bits << shift);
  } else {
    v.w[j] = bits;
  }
}

// -0.0 -> +0.0 element by element, on raw bits (flush-to-zero cannot touch it; negative
// subnormals stay as they are).
template <DType DT>
__device__ __forceinline__ Raw16 SanitizeNegativeZero(Raw16 v) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t w = v.w[k];
    if constexpr (VecTraits<DT>::kElems == 8) {
      if ((w & 0xffffu) == 0x8000u) w &= 0xffff0000u;
      if ((w >> 16) == 0x8000u) w &= 0x0000ffffu;
    } else {
      if (w == 0x80000000u) w = 0u;
    }
    v.w[k] = w;
  }
  return v;
}

// Whether any element still holds the sentinel (-0.0 of the dtype): compares raw bits of every
// element, never floats (a float compare may flush subnormals and mistake data for -0.0).
template <DType DT>
__device__ __forceinline__ bool HasSentinel(const Raw16& v) {
  bool any = false;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (VecTraits<DT>::kElems == 8) {
      any |= (v.w[k] & 0xffffu) == 0x8000u;
      any |= (v.w[k] >> 16) == 0x8000u;
    } else {
      any |= v.w[k] == 0x80000000u;
    }
  }
  return any;
}

template <DType DT>
__device__ __forceinline__ Raw16 SentinelVector() {
  const uint32_t s = VecTraits<DT>::kSentinelWord;
  return Raw16{{s, s, s, s}};
}

// acc[j] (+)= float(v[j]); `first` starts the rank-order sum (x_0, then + x_1, ...).
template <DType DT>
__device__ __forceinline__ void Accumulate(float (&acc)[VecTraits<DT>::kElems], const Raw16& v,
                                           bool first) {
#pragma unroll
  for (int j = 0; j < VecTraits<DT>::kElems; ++j) {
    const float x = VecTraits<DT>::ToFloat(GetBits<DT>(v, j));
    acc[j] = first ? x : __fadd_rn(acc[j], x);
  }
}

// The allreduce result of step 3: round to dtype, then -0.0 -> +0.0.
template <DType DT>
__device__ __forceinline__ Raw16 RoundSum(const float (&acc)[VecTraits<DT>::kElems]) {
  Raw16 out{{0, 0, 0, 0}};
#pragma unroll
  for (int j = 0; j < VecTraits<DT>::kElems; ++j) {
    SetBits<DT>(out, j, VecTraits<DT>::FromFloat(acc[j]));
  }
  return SanitizeNegativeZero<DT>(out);
}

// Deterministic block sum: xor butterflies give every lane the same bits (fp add commutes
// exactly), then every warp reduces the per-warp partials in the same order. blockDim.x must be
// a multiple of 32. `scratch` holds 32 floats; the trailing barrier lets the caller reuse it.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : 0.0f;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    t = __fadd_rn(t, __shfl_xor_sync(0xffffffffu, t, offset));
  }
  __syncthreads();
  return t;
}

// Most 16-byte vectors one thread keeps of a row (1024 threads x 8 vectors bounds hidden).
inline constexpr int kMaxVecPerThread = 8;

// Steps 4-5 for one row whose allreduced vectors (step 3, sanitized) this thread holds in
// `reduced[k]` for vector index threadIdx.x + k * blockDim.x of the row. Every thread of the
// block must call it (it synchronizes). Pointers are to the row's start.
template <DType DT>
__device__ __forceinline__ void ResidualRmsNormRow(Raw16 (&reduced)[kMaxVecPerThread],
                                                   uint32_t vecs_per_row, uint32_t hidden,
                                                   float eps, const void* residual_in_row,
                                                   void* residual_out_row, void* norm_out_row,
                                                   const void* gamma, float* scratch) {
  using Tr = VecTraits<DT>;
  float sum_of_squares = 0.0f;
#pragma unroll
  for (int k = 0; k < kMaxVecPerThread; ++k) {
    const uint32_t v = threadIdx.x + k * blockDim.x;
    if (v < vecs_per_row) {
      const Raw16 res = LoadRaw(static_cast<const uint4*>(residual_in_row) + v);
      Raw16 pre{{0, 0, 0, 0}};
#pragma unroll
      for (int j = 0; j < Tr::kElems; ++j) {
        const float a = Tr::ToFloat(GetBits<DT>(reduced[k], j));
        const float r = Tr::ToFloat(GetBits<DT>(res, j));
        SetBits<DT>(pre, j, Tr::FromFloat(__fadd_rn(a, r)));
      }
      StoreRaw(static_cast<uint4*>(residual_out_row) + v, pre);
#pragma unroll
      for (int j = 0; j < Tr::kElems; ++j) {
        const float y = Tr::ToFloat(GetBits<DT>(pre, j));
        sum_of_squares = __fadd_rn(sum_of_squares, __fmul_rn(y, y));
      }
      reduced[k] = pre;
    }
  }
  const float total = BlockSum(sum_of_squares, scratch);
  // IEEE division and square root, as the CPU reference: only the order of the adds differs.
  const float inv_rms =
      __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, static_cast<float>(hidden)), eps)));
#pragma unroll
  for (int k = 0; k < kMaxVecPerThread; ++k) {
    const uint32_t v = threadIdx.x + k * blockDim.x;
    if (v < vecs_per_row) {
      const Raw16 g = LoadRaw(static_cast<const uint4*>(gamma) + v);
      Raw16 out{{0, 0, 0, 0}};
#pragma unroll
      for (int j = 0; j < Tr::kElems; ++j) {
        const float y = Tr::ToFloat(GetBits<DT>(reduced[k], j));
        const float gj = Tr::ToFloat(GetBits<DT>(g, j));
        SetBits<DT>(out, j, Tr::FromFloat(__fmul_rn(__fmul_rn(y, inv_rms), gj)));
      }
      StoreRaw(static_cast<uint4*>(norm_out_row) + v, out);
    }
  }
}

// Threads per block for rows of `vecs_per_row` vectors: the fewest vectors per thread that fit
// 1024 threads, then the fewest whole warps that cover the row. Depends only on the shape.
inline int RowBlockThreads(uint32_t vecs_per_row) {
  const uint32_t per_thread = (vecs_per_row + 1023u) / 1024u;
  const uint32_t threads = (vecs_per_row + per_thread - 1u) / per_thread;
  return static_cast<int>((threads + 31u) / 32u * 32u);
}

}  // namespace device
}  // namespace arfuse
