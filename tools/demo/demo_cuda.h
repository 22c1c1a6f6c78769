// arfuse-demo, CUDA builds: what the in-stream and doorbell rows do alike on the device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tools/demo/demo_shape.h"

namespace arfuse::demo {

// A CUDA result as a status naming `what`.
absl::Status CudaCheck(cudaError_t err, const char* what);

// Replays `exec` (one op captured on `stream`) kDemoWarmup + iters times. Before each replay the
// input tensor at `tensors + L.input` gets variant i % kDemoVariants of `variants` (`tbytes`
// each), and after it residual_out and norm_out are copied to `history` ([variant][residual_out
// | norm_out]), both outside the graph, so the last replay of each variant is kept. Returns the
// timed replays' microseconds, from CUDA events around each, once the stream is idle.
absl::StatusOr<std::vector<double>> ReplayVariants(cudaGraphExec_t exec, cudaStream_t stream,
                                                   char* tensors, const Layout& L,
                                                   const char* variants, char* history,
                                                   size_t tbytes, int iters);

}  // namespace arfuse::demo
