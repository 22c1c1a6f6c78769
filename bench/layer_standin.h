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

}  // namespace arfuse::bench
