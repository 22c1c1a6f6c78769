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

bool LogRateLimiter::Allow(absl::string_view key, absl::Time now, uint64_t* held_back) {
  absl::MutexLock lock(&mu_);
  Entry& e = entries_[key];
  if (now - e.last_written < interval_) {
    ++e.held_back;
    return false;
  }
  e.last_written = now;
  *held_back = e.held_back;
  e.held_back = 0;
  return true;
}

}  // namespace arfuse
