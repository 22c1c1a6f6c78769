#include "server/fdpass/socket_credentials.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace arfuse {

bool SocketCredentials::InGroup(gid_t g) const {
  return g == gid || std::find(groups.begin(), groups.end(), g) != groups.end();
}

absl::StatusOr<SocketCredentials> PeerSocketCredentials(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof(cred)) {
    return absl::InternalError(
        absl::StrCat("cannot read the peer socket's credentials: ", std::strerror(errno)));
  }
  SocketCredentials out;
  out.pid = cred.pid;
  out.uid = cred.uid;
  out.gid = cred.gid;
  // Linux 4.13+; without it only the primary group is known (a stricter check, never a looser).
  std::vector<gid_t> groups(64);
  for (int attempt = 0; attempt < 2; ++attempt) {
    socklen_t glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen) == 0) {
      groups.resize(glen / sizeof(gid_t));
      out.groups = std::move(groups);
      break;
    }
    if (errno != ERANGE) break;
    groups.resize(glen / sizeof(gid_t) + 1);
  }
  return out;
}

SocketCredentials OwnCredentials() {
  SocketCredentials out;
  out.pid = ::getpid();
  out.uid = ::geteuid();
  out.gid = ::getegid();
  int n = ::getgroups(0, nullptr);
  if (n > 0) {
    out.groups.resize(static_cast<size_t>(n));
    n = ::getgroups(n, out.groups.data());
    out.groups.resize(n > 0 ? static_cast<size_t>(n) : 0);
  }
  return out;
}

}  // namespace arfuse
