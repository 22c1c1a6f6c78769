#include "common/log.h"

#include <unistd.h>

#include <array>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/json.h"
#include "spdlog/formatter.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {
constexpr std::array<absl::string_view, 7> kLevels = {"trace", "debug",    "info", "warn",
                                                      "error", "critical", "off"};

// --log-format=json: one JSON object per line, for log pipelines that parse JSON (Loki, Fluent
// Bit, Cloud Logging). The message keeps its key=value text; its event= key, which every log
// line of arfused's starts with, is also a field of its own to filter on.
class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const absl::string_view text(msg.payload.data(), msg.payload.size());
    std::string line =
        absl::StrCat("{\"time\":",
                     JsonQuote(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::FromChrono(msg.time),
                                                absl::UTCTimeZone())),
                     ",\"level\":",
                     JsonQuote(absl::string_view(spdlog::level::to_string_view(msg.level).data(),
                                                 spdlog::level::to_string_view(msg.level).size())),
                     ",\"pid\":", pid_);
    if (absl::StartsWith(text, "event=")) {
      absl::string_view event = text.substr(6);
      event = event.substr(0, event.find(' '));
      absl::StrAppend(&line, ",\"event\":", JsonQuote(event));
    }
    absl::StrAppend(&line, ",\"msg\":", JsonQuote(text), "}\n");
    dest.append(line.data(), line.data() + line.size());
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }

 private:
  const int pid_ = static_cast<int>(getpid());
};

}  // namespace

bool IsValidLogLevel(absl::string_view level) {
  for (auto l : kLevels) {
    if (l == level) return true;
  }
  return false;
}

bool IsValidLogFormat(absl::string_view format) { return format == "text" || format == "json"; }

absl::Status InitLogging(absl::string_view level, absl::string_view format) {
  if (!IsValidLogLevel(level)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown log level \"", level,
                     "\" (expected trace, debug, info, warn, error, critical or off)"));
  }
  if (!IsValidLogFormat(format)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown log format \"", format, "\" (expected text or json)"));
  }
  auto logger = spdlog::stderr_logger_mt("arfuse");
  spdlog::set_default_logger(logger);
  if (format == "json") {
    spdlog::set_formatter(std::make_unique<JsonFormatter>());
  } else {
    spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e level=%l pid=%P %v");
  }
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
