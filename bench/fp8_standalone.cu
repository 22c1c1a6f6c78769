// A separate FP8 quantization kernel for `arfuse-bench kernels --fp8`: what a framework runs after
// an unquantized fused op when the op cannot quantize (vLLM's static/dynamic scaled_fp8_quant,
// per_token_group_quant_fp8). One block of 128 threads per token reads the bf16 norm_out row and
// writes E4M3 codes and the scales with kernels/quant's device math, so the baseline's arithmetic
// is the fused epilogue's and only the extra kernel and memory round trip differ.
#include "bench/fp8_standalone.h"
#include "kernels/add_rmsnorm/row_math.cuh"
#include "kernels/quant/fp8_quant.cuh"

namespace arfuse::bench {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxVecs = 16;  // hidden up to 16384 bf16: 2048 vectors / 128 threads

template <QuantKind kKind>
__global__ void __launch_bounds__(kThreads) StandaloneQuantKernel(StandaloneFp8Params p) {
  using Tr = device::VecTraits<DType::kBF16>;
  constexpr int kElems = Tr::kElems;
  __shared__ float scratch[32];
  const uint32_t row = blockIdx.x;
  const uint32_t vecs = p.hidden / kElems;
  const char* in = static_cast<const char*>(p.norm) + static_cast<uint64_t>(row) * p.hidden * 2;
  char* q = static_cast<char*>(p.quant_out) + static_cast<uint64_t>(row) * p.hidden;
  float x[kMaxVecs][kElems];
#pragma unroll
  for (int k = 0; k < kMaxVecs; ++k) {
    const uint32_t v = threadIdx.x + k * kThreads;
    const device::Raw16 raw =
        v < vecs ? device::LoadRaw(reinterpret_cast<const uint4*>(in) + v) : device::Raw16{};
#pragma unroll
    for (int j = 0; j < kElems; ++j) {
      x[k][j] = v < vecs ? Tr::ToFloat(device::GetBits<DType::kBF16>(raw, j)) : 0.0f;
    }
  }
  if constexpr (kKind == QuantKind::kStatic) {
    const float inv = device::fp8::StaticInvScale(*static_cast<const float*>(p.scale));
#pragma unroll
    for (int k = 0; k < kMaxVecs; ++k) {
      const uint32_t v = threadIdx.x + k * kThreads;
      if (v < vecs) device::fp8::StoreE4m3Multiplied<kElems>(x[k], inv, q + v * kElems);
    }
  } else if constexpr (kKind == QuantKind::kPerToken) {
    float local = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxVecs; ++k) local = device::fp8::AbsMaxInto<kElems>(local, x[k]);
    const float scale = device::fp8::DynamicTokenScale(device::fp8::BlockMax(local, scratch));
    if (threadIdx.x == 0) static_cast<float*>(p.scale)[row] = scale;
    const device::fp8::ScaleDivisor divisor(scale);
#pragma unroll
    for (int k = 0; k < kMaxVecs; ++k) {
      const uint32_t v = threadIdx.x + k * kThreads;
      if (v < vecs) device::fp8::StoreE4m3Divided<kElems>(x[k], divisor, q + v * kElems);
    }
  } else {
    constexpr uint32_t kLanes = device::fp8::kGroupLanes<fp8::kGroupSize, kElems>;
    const uint32_t groups = p.hidden / fp8::kGroupSize;
#pragma unroll
    for (int k = 0; k < kMaxVecs; ++k) {
      const uint32_t v = threadIdx.x + k * kThreads;
      const float amax = device::fp8::GroupAbsMax<fp8::kGroupSize, kElems>(x[k]);
      if (v >= vecs) continue;
      const float scale = device::fp8::GroupScaleFp32(amax);
      if (v % kLanes == 0) {
        device::fp8::StoreGroupScale(fp8::GroupScaleLayout::kFp32RowMajor, p.scale, row, v / kLanes,
                                     p.tokens, groups, scale, 0);
      }
      device::fp8::StoreE4m3Divided<kElems>(x[k], device::fp8::ScaleDivisor(scale), q + v * kElems);
    }
  }
}

}  // namespace

cudaError_t LaunchStandaloneFp8Quant(const StandaloneFp8Params& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  if (p.hidden % fp8::kGroupSize != 0 || p.hidden > kMaxVecs * kThreads * 8) {
    return cudaErrorInvalidValue;
  }
  switch (p.kind) {
    case QuantKind::kStatic:
      StandaloneQuantKernel<QuantKind::kStatic><<<p.tokens, kThreads, 0, stream>>>(p);
      break;
    case QuantKind::kPerToken:
      StandaloneQuantKernel<QuantKind::kPerToken><<<p.tokens, kThreads, 0, stream>>>(p);
      break;
    case QuantKind::kPerGroup:
      StandaloneQuantKernel<QuantKind::kPerGroup><<<p.tokens, kThreads, 0, stream>>>(p);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace arfuse::bench
