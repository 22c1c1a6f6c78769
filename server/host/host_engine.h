// The engine of --device=host: a host shared-memory workspace and the CPU implementation of the
// op (kernels/host), running the same protocol shape as the GPU one-shot so CI exercises the
// server, peers and fault handling without a GPU. One node only (shared memory).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "server/engine_api/engine.h"

namespace arfuse {

// INVALID_ARGUMENT for options no host workspace can serve (dtype, capacity, ranks).
absl::StatusOr<std::unique_ptr<Engine>> MakeHostEngine(const EngineOptions& options);

}  // namespace arfuse
