// Preparing the main server's Unix socket path: length, directory, a live server already there,
// or a stale file left by a dead process.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace arfuse {

// sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
inline constexpr size_t kMaxUnixSocketPath = 107;

// Checks `path` can serve a new arfused: the path fits, its directory exists (created with mode
// 0750 when `create_dir` is set), and no live server answers on it. A socket file nobody listens
// on (left by a dead process) is removed. Errors: INVALID_ARGUMENT (too long, missing directory,
// not a socket), ALREADY_EXISTS (a live server is there).
absl::Status PrepareUnixSocketPath(const std::string& path, bool create_dir);

// True when something accepts connections on the Unix socket `path`.
bool UnixSocketIsLive(const std::string& path);

}  // namespace arfuse
