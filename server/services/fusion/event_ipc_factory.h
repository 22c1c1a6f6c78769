// The event IPC of a device: none (null) for host memory, CUDA interprocess events for CUDA
// (UNIMPLEMENTED in a build without the CUDA toolkit).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "server/registry/types.h"
#include "server/services/fusion/event_ipc.h"

namespace arfuse {

absl::StatusOr<std::unique_ptr<EventIpc>> MakeEventIpc(MemoryKind device, int32_t device_id);

}  // namespace arfuse
