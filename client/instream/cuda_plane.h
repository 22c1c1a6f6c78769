// CUDA mode of libarfuse_client: every rank's workspace mapped into the caller's context, the
// sidecar's kernel image loaded (every function loaded before first use), a host-mapped error
// word, and one cuLaunchKernelEx per op in the caller's stream. CUDA builds only.
#pragma once

#include <memory>

#include "client/instream/blob_reader.h"
#include "client/instream/plane.h"
#include "kernels/common/plain_status.h"

namespace arfuse::instream::lib {

// The blob's CUDA-only rules (the workspace layout against the header and the ranks), checked
// before the driver is loaded: INVALID_ARGUMENT naming the field.
plain::Status CheckCudaBlob(const ParsedBlob& blob);

// The GPU workspace's own limits (contract::CheckFits, what CheckFusionParams checks): OUT_OF_RANGE
// ("fusion unavailable for this op: ...") when tokens x hidden exceeds a one-shot slot or the
// two-shot slice (ceil(tokens / world) rows) exceeds a scatter slot.
plain::Status CheckCudaCapacity(const AttachHeader& header, uint32_t tokens, uint32_t hidden,
                                DType dtype);

// Maps, loads and allocates in the calling thread's current context. FAILED_PRECONDITION without
// a current context or on another GPU than the sidecar's; UNAVAILABLE without a driver; the
// driver's error (naming the rank or entry) when a mapping or a function fails.
plain::StatusOr<std::unique_ptr<Plane>> AttachCuda(const ParsedBlob& blob, const int* fds);

}  // namespace arfuse::instream::lib
