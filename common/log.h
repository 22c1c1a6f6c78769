// Logging: spdlog with key=value fields ("event=peer_join rank=1 world_size=2"). Never log
// handles or pointers: they let a reader of the logs reach another client's memory.
#pragma once

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "fmt/format.h"

namespace arfuse {

// Sets up the process-wide logger on stderr with the given level ("trace", "debug", "info",
// "warn", "error", "critical", "off") and format: "text" (one line: time, level=, pid=, then the
// key=value message) or "json" (one JSON object per line: "time" (RFC 3339, UTC, milliseconds),
// "level", "pid", "event" when the message starts with event=..., and "msg", the whole message;
// always valid JSON, whatever the message holds). INVALID_ARGUMENT for an unknown level or format.
absl::Status InitLogging(absl::string_view level, absl::string_view format = "text");

// True when `level` names a spdlog level.
bool IsValidLogLevel(absl::string_view level);

// True for "text" and "json".
bool IsValidLogFormat(absl::string_view format);

// Lets a repeated log line through at most once per `interval` for each key, and counts the
// lines it held back: a client retrying a failing op in a tight loop must not flood the log, but
// the operator must still see that ops fail, how often, and why. Thread-safe.
class LogRateLimiter {
 public:
  explicit LogRateLimiter(absl::Duration interval) : interval_(interval) {}

  // True when a line for `key` may be written at `now`; then `*held_back` receives how many
  // lines for `key` were held back since the last one written (and the count restarts).
  bool Allow(absl::string_view key, absl::Time now, uint64_t* held_back);

 private:
  struct Entry {
    absl::Time last_written = absl::InfinitePast();
    uint64_t held_back = 0;
  };
  const absl::Duration interval_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

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
