#include "server/core/log.h"

#include <array>

#include "absl/strings/str_cat.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {
constexpr std::array<absl::string_view, 7> kLevels = {"trace", "debug",    "info", "warn",
                                                      "error", "critical", "off"};
}  // namespace

bool IsValidLogLevel(absl::string_view level) {
  for (auto l : kLevels) {
    if (l == level) return true;
  }
  return false;
}

absl::Status InitLogging(absl::string_view level) {
  if (!IsValidLogLevel(level)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown log level \"", level,
                     "\" (expected trace, debug, info, warn, error, critical or off)"));
  }
  auto logger = spdlog::stderr_logger_mt("arfuse");
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e level=%l pid=%P %v");
  spdlog::set_level(spdlog::level::from_str(std::string(level)));
  spdlog::flush_on(spdlog::level::info);
  return absl::OkStatus();
}

}  // namespace arfuse
