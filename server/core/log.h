// Logging: spdlog with key=value fields ("event=peer_join rank=1 world_size=2"). Never log
// handles or pointers: they let a reader of the logs reach another client's memory.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace arfuse {

// Sets up the process-wide logger on stderr with the given level ("trace", "debug", "info",
// "warn", "error", "critical", "off"). Returns INVALID_ARGUMENT for an unknown level.
absl::Status InitLogging(std::string_view level);

// True when `level` names a spdlog level.
bool IsValidLogLevel(std::string_view level);

}  // namespace arfuse
