// The CPU implementation of the fused op (reference_core.h, where its numerics are described)
// with absl::Status answers: the oracle of the kernel tests and the engine of --device=host.
#pragma once

#include "absl/status/status.h"
#include "kernels/common/plain_status_absl.h"
#include "kernels/host/reference_core.h"

namespace arfuse {

// INVALID_ARGUMENT naming the offending field when the arguments are not usable.
inline absl::Status ValidateCpuOpArgs(const CpuOpArgs& args) {
  return ToAbsl(ValidateCpuOpArgsPlain(args));
}

// Runs the op with the GPU's numerics. Output buffers may not alias inputs except that
// residual_out may equal residual_in and output may equal rank_inputs[r] (elementwise in place).
inline absl::Status ReferenceFusedOp(const CpuOpArgs& args) {
  return ToAbsl(ReferenceFusedOpPlain(args));
}

// The same op in fp64 from the dtype input values, no intermediate rounding (Fp64Result).
inline absl::Status ReferenceFusedOpFp64(const CpuOpArgs& args, Fp64Result* result) {
  return ToAbsl(ReferenceFusedOpFp64Plain(args, result));
}

}  // namespace arfuse
