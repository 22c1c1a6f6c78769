// Who is at the other end of a connected Unix socket, as the kernel reports it (SO_PEERCRED,
// SO_PEERGROUPS): the credentials the connecting process had when it called connect(), which it
// cannot forge. Every gate that decides on a caller's identity (the main socket's policy, the fd
// channel's tickets, the named shared-memory check, the peer channel) reads them from here.
#pragma once

#include <sys/types.h>

#include <vector>

#include "absl/status/statusor.h"

namespace arfuse {

struct SocketCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;  // the primary (effective) group
  // Supplementary groups (SO_PEERGROUPS); empty when the kernel did not say.
  std::vector<gid_t> groups;

  // `g` is the primary group or one of the supplementary groups.
  bool InGroup(gid_t g) const;
};

// The credentials of the process at the other end of the connected Unix socket `fd` (for a
// listener's socket: the process that called listen). INTERNAL when the kernel does not say.
absl::StatusOr<SocketCredentials> PeerSocketCredentials(int fd);

// This process's own credentials, in the same form (tests, in-process servers).
SocketCredentials OwnCredentials();

}  // namespace arfuse
