// Who may be on the other end of a peer Unix socket (--peer-dir): a process running as this
// sidecar's effective user, or root. The peer channel carries the group's membership, its votes
// and, for the mnnvl and host backends, file descriptors of workspace memory, so the directory's
// permissions (the deployment shares it only between the group's sidecars) are not the only
// gate: rank 0 refuses a connecting process of another user, and a rank refuses to join through
// a socket that another user's process listens on. Both read the kernel's SO_PEERCRED
// (server/fdpass/socket_credentials.h), which a process cannot forge. TCP peers (several nodes)
// rely on network isolation (docs/security.md).
#pragma once

#include <sys/types.h>

#include "server/fdpass/socket_credentials.h"

namespace arfuse::peers {

// This sidecar's effective uid or root (uid 0).
bool PeerUserAllowed(uid_t uid);

}  // namespace arfuse::peers
