// The op rules of libarfuse_client, checked on the host before anything is launched: whether the
// attachment can fuse an op of this shape (the dispatch: OUT_OF_RANGE "fusion unavailable for
// this op: ..." when it cannot, so the caller runs its own path) and whether the tensors are
// usable (INVALID_ARGUMENT). The same answer on every rank for the same arguments.
#pragma once

#include "client/instream/blob_reader.h"
#include "client/instream/plane.h"
#include "kernels/common/plain_status.h"
#include "kernels/instream/op_counters.h"

namespace arfuse::instream::lib {

// The algorithm and entry for (pattern, tokens, hidden, dtype); INVALID_ARGUMENT for a pattern or
// dtype value that does not exist. tokens may be 0 (nothing would run, and it fits). On failure
// `*why` (when not null) is the reason the op counter page counts it under.
plain::StatusOr<Dispatch> DispatchOp(const ParsedBlob& blob, const Plane& plane, Pattern pattern,
                                     uint32_t tokens, uint32_t hidden, DType dtype,
                                     DeclineReason* why = nullptr);

// INVALID_ARGUMENT when a tensor is NULL or not 16-byte aligned, an output overlaps another
// tensor (residual_out may equal residual_in, output may equal input) or eps is not finite and
// non-negative (kAllReduceResidualRmsNorm). Needs tokens > 0.
plain::Status CheckTensors(const OpRequest& op);

// INVALID_ARGUMENT unless pattern is 1 or 2 and dtype 1, 2 or 3 (the C ABI's plain ints).
plain::Status CheckEnums(int pattern, int dtype);

}  // namespace arfuse::instream::lib
