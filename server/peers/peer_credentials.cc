#include "server/peers/peer_credentials.h"

#include <unistd.h>

namespace arfuse::peers {

bool PeerUserAllowed(uid_t uid) { return uid == ::geteuid() || uid == 0; }

}  // namespace arfuse::peers
