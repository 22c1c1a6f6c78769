// The client side of the fd channel (fd_wire.h), blocking and bounded: what the C++ client, the
// tests and tools call. The Python client speaks the same protocol
// (client/python/arfuse/fdpass.py).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/fd/unique_fd.h"

namespace arfuse {

// Where arfused serves the fd channel: its main socket's path + ".fd".
std::string FdChannelPath(absl::string_view main_socket_path);

// Connects to the fd channel at `path` (a Unix socket path), retrying while its backlog is full,
// until `deadline`. UNAVAILABLE naming the path when nothing accepts.
absl::StatusOr<UniqueFd> ConnectFdChannel(const std::string& path, absl::Time deadline);

// Hands `fds` to the sidecar (DEPOSIT) and returns the ticket a gRPC call then names. The
// sidecar keeps its own copies; the caller's descriptors stay open. Errors: the sidecar's
// (RESOURCE_EXHAUSTED over its caps, INVALID_ARGUMENT), UNAVAILABLE, DEADLINE_EXCEEDED.
absl::StatusOr<std::string> DepositFds(const std::string& path, const std::vector<int>& fds,
                                       absl::Duration timeout = absl::Seconds(10));

// Takes the descriptors the sidecar offered under `ticket` (PICKUP).
absl::StatusOr<std::vector<UniqueFd>> PickupFds(const std::string& path, absl::string_view ticket,
                                                absl::Duration timeout = absl::Seconds(10));

}  // namespace arfuse
