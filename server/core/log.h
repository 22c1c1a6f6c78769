// Logging: spdlog with key=value fields ("event=peer_join rank=1 world_size=2"). Never log
// handles or pointers: they let a reader of the logs reach another client's memory.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "fmt/format.h"

namespace arfuse {

// Sets up the process-wide logger on stderr with the given level ("trace", "debug", "info",
// "warn", "error", "critical", "off"). Returns INVALID_ARGUMENT for an unknown level.
absl::Status InitLogging(absl::string_view level);

// True when `level` names a spdlog level.
bool IsValidLogLevel(absl::string_view level);

}  // namespace arfuse

// Debian's abseil has its own string_view type; let spdlog/fmt format it like std::string_view.
template <>
struct fmt::formatter<absl::string_view> : fmt::formatter<fmt::string_view> {
  template <typename FormatContext>
  auto format(absl::string_view value, FormatContext& ctx) const {
    return fmt::formatter<fmt::string_view>::format(fmt::string_view(value.data(), value.size()),
                                                    ctx);
  }
};
