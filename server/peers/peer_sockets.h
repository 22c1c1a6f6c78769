// The peer channel's socket addresses and rank 0's listening sockets, apart from the
// coordinator's I/O loop: the dialing side (peer_link.cc) parses the same "host:port" spelling,
// and binding is the one place that decides who may own the Unix path.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/fd/unique_fd.h"

namespace arfuse::peers {

// Parses "host:port" or "[v6]:port". INVALID_ARGUMENT with the offending text otherwise.
absl::Status SplitHostPort(const std::string& address, std::string* host, std::string* port);

// Binds and listens on the Unix socket at `path` (non-blocking, mode 0660) and sets `*inode` to
// the socket file's inode, so that only this listener's owner removes the path later.
// FAILED_PRECONDITION when a live coordinator answers at `path` (its path is never taken over);
// a stale socket left by a dead one is replaced.
absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, uint64_t* inode);

// Binds and listens on the first address `address` ("host:port") resolves to that accepts,
// non-blocking; sets `*bound_port` (port 0 binds any). INVALID_ARGUMENT for an address that does
// not parse or resolve, UNAVAILABLE when no resolved address could be bound.
absl::StatusOr<UniqueFd> ListenTcp(const std::string& address, int* bound_port);

}  // namespace arfuse::peers
