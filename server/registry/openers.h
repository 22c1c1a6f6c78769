// Picks the memory opener for a sidecar's device: host shared memory for --device=host, CUDA IPC
// for --device=cuda (UNIMPLEMENTED in a build without the CUDA toolkit).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "server/registry/opener.h"

namespace arfuse {

absl::StatusOr<std::unique_ptr<MemoryOpener>> MakeMemoryOpener(MemoryKind kind,
                                                               int32_t device_id);

}  // namespace arfuse
