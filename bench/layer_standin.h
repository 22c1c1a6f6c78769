// The layer loop of `arfuse-bench sidecar`: a client kernel standing in for a layer's compute
// (the GEMMs between two fused ops). It reads the previous op's norm_out, writes the next op's
// input from it (so the loop carries a real data dependence), and keeps every block busy for
// `busy_ns` of GPU time.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace arfuse::bench {

// bf16 tensors of `count` elements; input[i] = norm_out[i] / 2 (exact in bf16). Capturable.
cudaError_t LaunchLayerStandIn(const void* norm_out, void* input, size_t count, uint32_t busy_ns,
                               cudaStream_t stream);

// A client kernel that wants the whole GPU (what a GEMM of the layer does): a fixed amount of FMA
// work in `waves` waves of as many 256-thread blocks as fit every SM at once. Its time measures
// what kernels of other processes holding SM slots (the sidecar's idle serving launch) cost the
// client. `scratch` receives one float per block (never read; keeps the work alive).
cudaError_t LaunchFullGpuBusy(float* scratch, int waves, uint32_t iters, cudaStream_t stream);
// Blocks of LaunchFullGpuBusy's grid for `waves` (scratch must hold that many floats).
int FullGpuBusyBlocks(int waves);

// The same work shaped like a large GEMM's tile: 1024-thread blocks that each need more than half
// of an SM's register file, so one fits an SM only while no other kernel's block holding as much
// sits there. Its time shows what the sidecar's resident blocks cost a register-heavy client
// kernel (the light kernel above shares the SM with them). `waves` blocks per SM.
cudaError_t LaunchFullSmBusy(float* scratch, int waves, uint32_t iters, cudaStream_t stream);
int FullSmBusyBlocks(int waves);
// Registers per thread of LaunchFullSmBusy's kernel (0 when it cannot be queried).
int FullSmBusyRegisters();

}  // namespace arfuse::bench
