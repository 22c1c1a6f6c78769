#include "server/services/fusion/event_ipc_factory.h"

#if defined(ARFUSE_WITH_CUDA_EVENTS)
#include "server/services/fusion/cuda/cuda_event_ipc.h"
#endif

namespace arfuse {

absl::StatusOr<std::unique_ptr<EventIpc>> MakeEventIpc(MemoryKind device, int32_t device_id) {
  if (device == MemoryKind::kHostShm) return std::unique_ptr<EventIpc>();
#if defined(ARFUSE_WITH_CUDA_EVENTS)
  return std::unique_ptr<EventIpc>(new CudaEventIpc(device_id));
#else
  (void)device_id;
  return absl::UnimplementedError("this build has no CUDA support: run --device=host");
#endif
}

}  // namespace arfuse
