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

}  // namespace arfuse::bench
