// Memory-model helpers of the doorbell kernels (CUDA only, internal to kernels/doorbell and
// client/ring): the shared ones of kernels/common. System scope for every word a client shares:
// the other side is another process (the client's kernels run in its own context, under MPS on
// the same GPU).
#pragma once

#include "kernels/common/memory_model.cuh"

namespace arfuse {
namespace doorbell_device = device_sync;
}  // namespace arfuse
