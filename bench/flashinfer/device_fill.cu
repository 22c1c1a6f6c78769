#include <cuda_bf16.h>

#include "bench/flashinfer/device_fill.h"

namespace arfuse::bench_fi {
namespace {

__device__ uint32_t Mix(uint32_t x) {  // a 32-bit finalizer (lowbias32): well spread bits
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

__global__ void RandomBf16Kernel(__nv_bfloat16* dst, size_t count, uint32_t seed, float lo,
                                 float span) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    const uint32_t h = Mix(static_cast<uint32_t>(i) ^ Mix(seed ^ static_cast<uint32_t>(i >> 32)));
    const float u = static_cast<float>(h >> 8) * (1.0f / 16777216.0f);  // [0, 1)
    dst[i] = __float2bfloat16_rn(lo + u * span);
  }
}

__global__ void U16Kernel(uint16_t* dst, size_t count, uint16_t value) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    dst[i] = value;
  }
}

unsigned GridFor(size_t count) {
  const size_t blocks = (count + 255) / 256;
  return static_cast<unsigned>(blocks < 4096 ? (blocks == 0 ? 1 : blocks) : 4096);
}

}  // namespace

cudaError_t FillRandomBf16(void* dst, size_t count, uint32_t seed, float lo, float hi,
                           cudaStream_t stream) {
  RandomBf16Kernel<<<GridFor(count), 256, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), count,
                                                       seed, lo, hi - lo);
  return cudaGetLastError();
}

cudaError_t FillU16(void* dst, size_t count, uint16_t value, cudaStream_t stream) {
  U16Kernel<<<GridFor(count), 256, 0, stream>>>(static_cast<uint16_t*>(dst), count, value);
  return cudaGetLastError();
}

}  // namespace arfuse::bench_fi
