// A separate FP8 quantization kernel for `arfuse-bench kernels --fp8`: what a framework runs after
// an unquantized fused op when the op cannot quantize (vLLM's static/dynamic scaled_fp8_quant,
// per_token_group_quant_fp8). One block per token reads the bf16 norm_out row in the fused
// kernels' row layout (kernels/add_rmsnorm/row_math.cuh: RowBlockThreads threads, each holding
// RowVecsPerThread vectors) and writes E4M3 codes and the scales with kernels/quant's device
// math, so the baseline's arithmetic and parallelism are the fused epilogue's and only the extra
// kernel and memory round trip differ.
#include "bench/fp8_standalone.h"
#include "kernels/add_rmsnorm/add_rmsnorm.h"
#include "kernels/add_rmsnorm/row_math.cuh"
#include "kernels/quant/fp8_quant.cuh"

namespace arfuse::bench {
namespace {

template <QuantKind kKind, int kBucket>
__global__ void __launch_bounds__(device::BucketMaxThreads(kBucket))
    StandaloneQuantKernel(StandaloneFp8Params p) {
  using Tr = device::VecTraits<DType::kBF16>;
  constexpr int kElems = Tr::kElems;
  constexpr int kVec = device::BucketVecs(kBucket);
  __shared__ float scratch[32];
  const uint32_t row = blockIdx.x;
  const uint32_t vecs = p.hidden / kElems;
  const uint32_t t0 = threadIdx.x;
  const uint32_t stride = blockDim.x;
  const char* in = static_cast<const char*>(p.norm) + static_cast<uint64_t>(row) * p.hidden * 2;
  char* q = static_cast<char*>(p.quant_out) + static_cast<uint64_t>(row) * p.hidden;
  device::Raw16 raw[kVec];
  device::LoadRowVectors<kVec>(raw, in, t0, stride, vecs);
  float x[kVec][kElems];
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const bool mine = t0 + k * stride < vecs;
#pragma unroll
    for (int j = 0; j < kElems; ++j) {
      x[k][j] = mine ? Tr::ToFloat(device::GetBits<DType::kBF16>(raw[k], j)) : 0.0f;
    }
  }
  if constexpr (kKind == QuantKind::kStatic) {
    const float inv = device::fp8::InvScale(*static_cast<const float*>(p.scale));
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const uint32_t v = t0 + k * stride;
      if (v < vecs) device::fp8::StoreE4m3Multiplied<kElems>(x[k], inv, q + v * kElems);
    }
  } else if constexpr (kKind == QuantKind::kPerToken) {
    float local = 0.0f;
#pragma unroll
    for (int k = 0; k < kVec; ++k) local = device::fp8::AbsMaxInto<kElems>(local, x[k]);
    const float scale = device::fp8::DynamicTokenScale(device::fp8::BlockMax(local, scratch));
    if (threadIdx.x == 0) static_cast<float*>(p.scale)[row] = scale;
    const float inv = device::fp8::InvScale(scale);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const uint32_t v = t0 + k * stride;
      if (v < vecs) device::fp8::StoreE4m3Multiplied<kElems>(x[k], inv, q + v * kElems);
    }
  } else {
    constexpr uint32_t kLanes = device::fp8::kGroupLanes<fp8::kGroupSize, kElems>;
    const uint32_t groups = p.hidden / fp8::kGroupSize;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const uint32_t v = t0 + k * stride;
      const float amax = device::fp8::GroupAbsMax<fp8::kGroupSize, kElems>(x[k]);
      if (v >= vecs) continue;
      const float scale = device::fp8::GroupScaleFp32(amax);
      if (v % kLanes == 0) {
        device::fp8::StoreGroupScale(fp8::GroupScaleLayout::kFp32RowMajor, p.scale, row, v / kLanes,
                                     p.tokens, groups, scale, 0);
      }
      device::fp8::StoreE4m3Multiplied<kElems>(x[k], device::fp8::InvScale(scale), q + v * kElems);
    }
  }
}

template <QuantKind kKind>
cudaError_t LaunchKind(const StandaloneFp8Params& p, uint32_t vecs, cudaStream_t stream) {
  const dim3 grid(p.tokens);
  const dim3 block(static_cast<uint32_t>(device::RowBlockThreads(vecs)));
  device::WithRowBucket(vecs, [&](auto bucket) {
    StandaloneQuantKernel<kKind, decltype(bucket)::value><<<grid, block, 0, stream>>>(p);
  });
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchStandaloneFp8Quant(const StandaloneFp8Params& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  // The row layout's largest row, as the unfused path's add-RMSNorm kernel bounds it.
  if (p.hidden % fp8::kGroupSize != 0 || p.hidden > MaxAddRmsNormHidden(DType::kBF16)) {
    return cudaErrorInvalidValue;
  }
  const uint32_t vecs = p.hidden / device::VecTraits<DType::kBF16>::kElems;
  switch (p.kind) {
    case QuantKind::kStatic:
      return LaunchKind<QuantKind::kStatic>(p, vecs, stream);
    case QuantKind::kPerToken:
      return LaunchKind<QuantKind::kPerToken>(p, vecs, stream);
    case QuantKind::kPerGroup:
      return LaunchKind<QuantKind::kPerGroup>(p, vecs, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace arfuse::bench
