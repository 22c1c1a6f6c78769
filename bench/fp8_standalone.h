// The separate FP8 quantization kernel `arfuse-bench kernels --fp8` times after the unquantized
// fused op (bench/fp8_standalone.cu): bf16 rows in, E4M3 codes and scales out.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/op_types.h"

namespace arfuse::bench {

struct StandaloneFp8Params {
  QuantKind kind = QuantKind::kStatic;
  const void* norm = nullptr;  // bf16 [tokens, hidden]
  void* quant_out = nullptr;   // E4M3 [tokens, hidden]
  // kStatic: one fp32 (read); kPerToken: fp32 [tokens]; kPerGroup: fp32 [tokens, hidden / 128].
  void* scale = nullptr;
  uint32_t tokens = 0;
  uint32_t hidden = 0;  // a multiple of 128, at most 65536 (the row layout's limit)
};

// One kernel on `stream`; cudaErrorInvalidValue for a hidden it does not take.
cudaError_t LaunchStandaloneFp8Quant(const StandaloneFp8Params& p, cudaStream_t stream);

}  // namespace arfuse::bench
