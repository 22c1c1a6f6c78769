// Device helpers shared by the fused kernels: 16-byte vectors of bf16/fp16/fp32 handled as raw
// bits, the -0.0 sentinel rules, dtype rounding, and the residual-add + RMSNorm of one row with
// the numerics of kernels/host/reference_op.h. CUDA only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

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
  // Two elements rounded in one instruction (each exactly as FromFloat rounds it), `lo` in the
  // low half: half the conversion-pipe work of two FromFloat and no repacking.
  __device__ static uint32_t FromFloatPair(float lo, float hi) {
    uint32_t w;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
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
  __device__ static uint32_t FromFloatPair(float lo, float hi) {
    uint32_t w;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
  }
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

// The 16-bit halves of `w` that hold -0.0 (0x8000): bit 15 of each such half set, every other
// bit clear. (h & 0x7fff) + 0x7fff sets bit 15 exactly when h's magnitude bits are not all zero
// and stays below 0x10000, so no carry crosses into the other half. Integer operations only:
// the same answer for subnormals, NaNs and infinities as a comparison of each element's bits
// (tests/kernels/sentinel_bits_test.cu checks every 16-bit value in either half).
__host__ __device__ __forceinline__ uint32_t NegativeZeroHalves(uint32_t w) {
  const uint32_t magnitude_nonzero = (w & 0x7fff7fffu) + 0x7fff7fffu;
  return w & ~magnitude_nonzero & 0x80008000u;
}

// -0.0 -> +0.0 element by element, on raw bits (flush-to-zero cannot touch it; negative
// subnormals stay as they are).
template <DType DT>
__host__ __device__ __forceinline__ Raw16 SanitizeNegativeZero(Raw16 v) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (VecTraits<DT>::kElems == 8) {
      v.w[k] ^= NegativeZeroHalves(v.w[k]);  // clears the sign bit of the -0.0 halves only
    } else if (v.w[k] == 0x80000000u) {
      v.w[k] = 0u;
    }
  }
  return v;
}

// Whether any element still holds the sentinel (-0.0 of the dtype): compares raw bits of every
// element, never floats (a float compare may flush subnormals and mistake data for -0.0).
template <DType DT>
__host__ __device__ __forceinline__ bool HasSentinel(const Raw16& v) {
  if constexpr (VecTraits<DT>::kElems == 8) {
    return (NegativeZeroHalves(v.w[0]) | NegativeZeroHalves(v.w[1]) | NegativeZeroHalves(v.w[2]) |
            NegativeZeroHalves(v.w[3])) != 0u;
  } else {
    bool any = false;
#pragma unroll
    for (int k = 0; k < 4; ++k) any |= v.w[k] == 0x80000000u;
    return any;
  }
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
// Rounds the kElems floats of `f` to one vector of the dtype (element j from f[j]).
template <DType DT>
__device__ __forceinline__ Raw16 RoundVector(const float (&f)[VecTraits<DT>::kElems]) {
  Raw16 out;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (VecTraits<DT>::kElems == 8) {
      out.w[k] = VecTraits<DT>::FromFloatPair(f[2 * k], f[2 * k + 1]);
    } else {
      out.w[k] = VecTraits<DT>::FromFloat(f[k]);
    }
  }
  return out;
}

template <DType DT>
__device__ __forceinline__ Raw16 RoundSum(const float (&acc)[VecTraits<DT>::kElems]) {
  return SanitizeNegativeZero<DT>(RoundVector<DT>(acc));
}

// The xor butterfly of one warp: every lane ends with the same bits (fp add commutes exactly).
__device__ __forceinline__ float WarpButterflySum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Deterministic block sum: xor butterflies give every lane the same bits, then every warp
// reduces the per-warp partials (zeros beyond the last warp) with the same butterfly. blockDim.x
// must be a multiple of 32. `scratch` holds 32 floats; the trailing barrier lets the caller
// reuse it. The fused kernels reproduce exactly this tree (also across the CTAs of a cluster).
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  v = WarpButterflySum(v);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const float t = WarpButterflySum(lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : 0.0f);
  __syncthreads();
  return t;
}

// Most 16-byte vectors one thread keeps of a row (1024 threads x 8 vectors bounds hidden).
inline constexpr int kMaxVecPerThread = 8;

// The row layout every GPU path shares (it fixes the order of the sum of squares, so the fused
// kernels and the add-RMSNorm kernel agree bit for bit): a row of V vectors is handled by T
// "row threads"; row thread t holds vectors t, t + T, ..., t + (P - 1) T (those below V), with
// P = RowVecsPerThread(V) and T = RowBlockThreads(V) (whole warps): one vector per thread up to
// 256, two up to 1024 (T <= 512), then up to 8 with T <= 512, then 8 with up to 1024 threads.
// Few vectors per thread keep the per-row latency low; few warps keep the block reduction cheap.
// Depends only on the shape.
inline int RowVecsPerThread(uint32_t vecs_per_row) {
  if (vecs_per_row <= 256u) return 1;
  if (vecs_per_row <= 1024u) return 2;
  return static_cast<int>(std::min<uint32_t>(8u, (vecs_per_row + 511u) / 512u));
}
inline int RowBlockThreads(uint32_t vecs_per_row) {
  const uint32_t per_thread = static_cast<uint32_t>(std::max(1, RowVecsPerThread(vecs_per_row)));
  const uint32_t threads = (vecs_per_row + per_thread - 1u) / per_thread;
  return static_cast<int>((threads + 31u) / 32u * 32u);
}
// Kernels are instantiated per bucket of the layout: register arrays of kVec = BucketVecs(b)
// vectors and blocks of at most BucketMaxThreads(b) threads (their __launch_bounds__).
//   0: P <= 2   1: P <= 4   2: P <= 8 (T <= 512 for all three)   3: P = 8, T <= 1024
inline int RowBucket(uint32_t vecs_per_row) {
  const int p = RowVecsPerThread(vecs_per_row);
  if (p <= 2) return 0;
  if (p <= 4) return 1;
  return RowBlockThreads(vecs_per_row) <= 512 ? 2 : 3;
}
constexpr int BucketVecs(int bucket) { return bucket == 0 ? 2 : (bucket == 1 ? 4 : 8); }
constexpr int BucketMaxThreads(int bucket) { return bucket == 3 ? 1024 : 512; }
constexpr int BucketMinBlocks(int /*bucket*/) { return 1; }
inline constexpr int kRowBuckets = 4;

// The one switch from a row's shape to the kernels instantiated per bucket: calls
// f(std::integral_constant<int, RowBucket(vecs_per_row)>{}) and returns what it returns, so a
// launcher names its kernel as Kernel<..., decltype(bucket)::value, ...> once, for every bucket.
template <typename F>
decltype(auto) WithRowBucket(uint32_t vecs_per_row, F&& f) {
  static_assert(kRowBuckets == 4, "one case per bucket of RowBucket");
  switch (RowBucket(vecs_per_row)) {
    case 0:
      return f(std::integral_constant<int, 0>{});
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    default:
      return f(std::integral_constant<int, 3>{});
  }
}

// Steps 4-5 for one row, split in two so callers can overlap the sum of squares' reduction with
// their own barriers. Row thread `t0` (see RowBlockThreads) holds, for k < kVec, the allreduced
// vector t0 + k * stride (step 3, sanitized) in `reduced[k]` and the residual_in vector in `res[k]`
// (vectors >= vecs_per_row are ignored). Stores residual_out, leaves the dtype-rounded pre-norm
// sum in `reduced` and returns this thread's sum of squares (its vectors in k order).
template <DType DT, int kVec>
__device__ __forceinline__ float ResidualAddRow(Raw16 (&reduced)[kVec], const Raw16 (&res)[kVec],
                                                uint32_t t0, uint32_t stride, uint32_t vecs_per_row,
                                                void* residual_out_row) {
  using Tr = VecTraits<DT>;
  float sum_of_squares = 0.0f;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const uint32_t v = t0 + k * stride;
    if (v < vecs_per_row) {
      float sum[Tr::kElems];
#pragma unroll
      for (int j = 0; j < Tr::kElems; ++j) {
        const float a = Tr::ToFloat(GetBits<DT>(reduced[k], j));
        const float r = Tr::ToFloat(GetBits<DT>(res[k], j));
        sum[j] = __fadd_rn(a, r);
      }
      const Raw16 pre = RoundVector<DT>(sum);
      StoreRaw(static_cast<uint4*>(residual_out_row) + v, pre);
#pragma unroll
      for (int j = 0; j < Tr::kElems; ++j) {
        const float y = Tr::ToFloat(GetBits<DT>(pre, j));
        sum_of_squares = __fadd_rn(sum_of_squares, __fmul_rn(y, y));
      }
      reduced[k] = pre;
    }
  }
  return sum_of_squares;
}

// Loads this thread's vectors of a row (row thread t0, k < kVec; vectors >= vecs_per_row are
// left alone). All loads are issued before any is used: one memory latency, not kVec.
template <int kVec>
__device__ __forceinline__ void LoadRowVectors(Raw16 (&dst)[kVec], const void* row, uint32_t t0,
                                               uint32_t stride, uint32_t vecs_per_row) {
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const uint32_t v = t0 + k * stride;
    if (v < vecs_per_row) dst[k] = LoadRaw(static_cast<const uint4*>(row) + v);
  }
}

// norm_out for the vectors of ResidualAddRow, given the row's total sum of squares and this
// thread's gamma vectors (loaded beforehand: a load between the stores would wait for each).
template <DType DT, int kVec>
__device__ __forceinline__ void NormRowStore(const Raw16 (&pre)[kVec], float total, uint32_t t0,
                                             uint32_t stride, uint32_t vecs_per_row,
                                             uint32_t hidden, float eps, const Raw16 (&g)[kVec],
                                             void* norm_out_row) {
  using Tr = VecTraits<DT>;
  // IEEE division and square root, as the CPU reference: only the order of the adds differs.
  const float inv_rms =
      __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, static_cast<float>(hidden)), eps)));
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const uint32_t v = t0 + k * stride;
    if (v < vecs_per_row) {
      float out[Tr::kElems];
#pragma unroll
      for (int j = 0; j < Tr::kElems; ++j) {
        const float y = Tr::ToFloat(GetBits<DT>(pre[k], j));
        const float gj = Tr::ToFloat(GetBits<DT>(g[k], j));
        out[j] = __fmul_rn(__fmul_rn(y, inv_rms), gj);
      }
      StoreRaw(static_cast<uint4*>(norm_out_row) + v, RoundVector<DT>(out));
    }
  }
}

// Steps 4-5 for one row handled by the whole block (row thread = threadIdx.x, T = blockDim.x).
// Every thread of the block must call it (it synchronizes). Pointers are to the row's start.
template <DType DT, int kVec>
__device__ __forceinline__ void ResidualRmsNormRow(Raw16 (&reduced)[kVec], uint32_t vecs_per_row,
                                                   uint32_t hidden, float eps,
                                                   const void* residual_in_row,
                                                   void* residual_out_row, void* norm_out_row,
                                                   const void* gamma, float* scratch) {
  Raw16 res[kVec];
  Raw16 g[kVec];
  LoadRowVectors<kVec>(res, residual_in_row, threadIdx.x, blockDim.x, vecs_per_row);
  LoadRowVectors<kVec>(g, gamma, threadIdx.x, blockDim.x, vecs_per_row);
  const float mine = ResidualAddRow<DT, kVec>(reduced, res, threadIdx.x, blockDim.x, vecs_per_row,
                                              residual_out_row);
  const float total = BlockSum(mine, scratch);
  NormRowStore<DT, kVec>(reduced, total, threadIdx.x, blockDim.x, vecs_per_row, hidden, eps, g,
                         norm_out_row);
}

}  // namespace device
}  // namespace arfuse
