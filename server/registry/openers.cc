#include "server/registry/openers.h"

#include "server/registry/host_shm_opener.h"
#if defined(ARFUSE_WITH_CUDA_OPENER)
#include "server/registry/cuda/cuda_ipc_opener.h"
#endif

namespace arfuse {

absl::StatusOr<std::unique_ptr<MemoryOpener>> MakeMemoryOpener(MemoryKind kind,
                                                               int32_t device_id) {
  if (kind == MemoryKind::kHostShm) return std::unique_ptr<MemoryOpener>(new HostShmOpener());
#if defined(ARFUSE_WITH_CUDA_OPENER)
  return std::unique_ptr<MemoryOpener>(new CudaIpcOpener(device_id));
#else
  (void)device_id;
  return absl::UnimplementedError("this build has no CUDA support: run --device=host");
#endif
}

}  // namespace arfuse
