#include <cuda_bf16.h>

#include "bench/layer_standin.h"

namespace arfuse::bench {
namespace {

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void LayerStandInKernel(const __nv_bfloat16* __restrict__ norm_out,
                                   __nv_bfloat16* __restrict__ input, size_t count,
                                   uint32_t busy_ns) {
  const uint64_t start = GlobalTimerNs();
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count;
       i += size_t{gridDim.x} * blockDim.x) {
    input[i] = __float2bfloat16(__bfloat162float(norm_out[i]) * 0.5f);
  }
  // The rest of the layer's time: the block stays resident, as a GEMM's would.
  while (GlobalTimerNs() - start < busy_ns) {
  }
}

constexpr int kBusyThreads = 256;

__global__ void FullGpuBusyKernel(float* scratch, uint32_t iters) {
  // Four independent FMA chains per thread: issue-bound, so every warp slot it loses to another
  // context's resident blocks shows in its time.
  float a = threadIdx.x * 1e-3f, b = a + 1.0f, c = a + 2.0f, d = a + 3.0f;
  for (uint32_t i = 0; i < iters; ++i) {
    a = fmaf(a, 0.9999f, 0.5f);
    b = fmaf(b, 0.9998f, 0.25f);
    c = fmaf(c, 0.9997f, 0.125f);
    d = fmaf(d, 0.9996f, 0.0625f);
  }
  if (threadIdx.x == 0) scratch[blockIdx.x] = a + b + c + d;
}

constexpr int kFullSmThreads = 1024;
constexpr int kFullSmChains = 24;

// kFullSmChains independent FMA chains per thread keep more than 32 registers live: 1024 threads
// then need more than half of the SM's 64K registers (ptxas: 47 at sm_90, allocated as 48).
__global__ void __launch_bounds__(kFullSmThreads, 1)
    FullSmBusyKernel(float* scratch, uint32_t iters) {
  float acc[kFullSmChains];
#pragma unroll
  for (int c = 0; c < kFullSmChains; ++c) acc[c] = threadIdx.x * 1e-3f + c;
  for (uint32_t i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < kFullSmChains; ++c) acc[c] = fmaf(acc[c], 0.9999f - c * 1e-5f, 0.5f);
  }
  float sum = 0.f;
#pragma unroll
  for (int c = 0; c < kFullSmChains; ++c) sum += acc[c];
  if (threadIdx.x == 0) scratch[blockIdx.x] = sum;
}

// `waves` times as many blocks of `kernel` as fit every SM of the current device at once (at
// least one per SM); 0 when the device cannot be queried.
int WavesOfResidentBlocks(const void* kernel, int threads, int waves) {
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess) {
    return 0;
  }
  return sms * (per_sm > 0 ? per_sm : 1) * (waves > 0 ? waves : 1);
}

}  // namespace

int FullSmBusyRegisters() {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, FullSmBusyKernel) == cudaSuccess ? a.numRegs : 0;
}

int FullSmBusyBlocks(int waves) {
  return WavesOfResidentBlocks(reinterpret_cast<const void*>(&FullSmBusyKernel), kFullSmThreads,
                               waves);
}

cudaError_t LaunchFullSmBusy(float* scratch, int waves, uint32_t iters, cudaStream_t stream) {
  const int blocks = FullSmBusyBlocks(waves);
  if (scratch == nullptr || blocks <= 0) return cudaErrorInvalidValue;
  FullSmBusyKernel<<<blocks, kFullSmThreads, 0, stream>>>(scratch, iters);
  return cudaGetLastError();
}

int FullGpuBusyBlocks(int waves) {
  return WavesOfResidentBlocks(reinterpret_cast<const void*>(&FullGpuBusyKernel), kBusyThreads,
                               waves);
}

cudaError_t LaunchFullGpuBusy(float* scratch, int waves, uint32_t iters, cudaStream_t stream) {
  const int blocks = FullGpuBusyBlocks(waves);
  if (scratch == nullptr || blocks <= 0) return cudaErrorInvalidValue;
  FullGpuBusyKernel<<<blocks, kBusyThreads, 0, stream>>>(scratch, iters);
  return cudaGetLastError();
}

cudaError_t LaunchLayerStandIn(const void* norm_out, void* input, size_t count, uint32_t busy_ns,
                               cudaStream_t stream) {
  if (norm_out == nullptr || input == nullptr || count == 0) return cudaErrorInvalidValue;
  constexpr int kThreads = 256;
  // A few blocks only: a stand-in, not a bandwidth test; under MPS it leaves the sidecar's
  // kernels their SMs.
  const size_t want = (count + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(want < 16 ? want : 16);
  LayerStandInKernel<<<blocks, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(norm_out),
                                                      static_cast<__nv_bfloat16*>(input), count,
                                                      busy_ns);
  return cudaGetLastError();
}

}  // namespace arfuse::bench
