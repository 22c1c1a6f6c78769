#include "server/peers/peer_credentials.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace arfuse::peers {

absl::StatusOr<SocketCredentials> PeerSocketCredentials(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof(cred)) {
    return absl::InternalError(
        absl::StrCat("cannot read the peer socket's credentials: ", std::strerror(errno)));
  }
  return SocketCredentials{cred.pid, cred.uid, cred.gid};
}

bool PeerUserAllowed(uid_t uid) { return uid == ::geteuid() || uid == 0; }

}  // namespace arfuse::peers
