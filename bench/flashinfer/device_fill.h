// Device fills for the harness: deterministic pseudo-random bf16 tensors (every rank's input,
// the residual, gamma) and a 16-bit pattern (FlashInfer's Lamport buffers start as bf16 -0.0).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace arfuse::bench_fi {

// `count` bf16 values uniform in [lo, hi), element i a hash of (seed, i): the same on every call.
cudaError_t FillRandomBf16(void* dst, size_t count, uint32_t seed, float lo, float hi,
                           cudaStream_t stream);

// `count` 16-bit words of `value`.
cudaError_t FillU16(void* dst, size_t count, uint16_t value, cudaStream_t stream);

}  // namespace arfuse::bench_fi
