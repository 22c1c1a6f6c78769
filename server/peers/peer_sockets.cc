#include "server/peers/peer_sockets.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace arfuse::peers {

absl::Status SplitHostPort(const std::string& address, std::string* host, std::string* port) {
  size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer address \"", address, "\" is not host:port"));
  }
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  for (char c : *port) {
    if (c < '0' || c > '9') {
      return absl::InvalidArgumentError(
          absl::StrCat("peer address \"", address, "\" has a non-numeric port"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, uint64_t* inode) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("peer socket path is ", path.size(),
                                                   " bytes, longer than the limit of ",
                                                   sizeof(addr.sun_path) - 1, ": ", path));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  // A live coordinator of the same group would be hijacked by unlinking its path: refuse.
  {
    UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (probe && ::connect(probe.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "another coordinator is live at ", path, ": is another rank 0 of this group running?"));
    }
  }
  ::unlink(path.c_str());  // a stale socket left by a coordinator that died
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot bind peer socket ", path, ": ", strerror(errno)));
  }
  ::chmod(path.c_str(), 0660);
  if (::listen(fd.get(), 128) != 0) {
    return absl::InternalError(absl::StrCat("listen on ", path, ": ", strerror(errno)));
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) *inode = st.st_ino;
  return fd;
}

absl::StatusOr<UniqueFd> ListenTcp(const std::string& address, int* bound_port) {
  std::string host, port;
  ARFUSE_RETURN_IF_ERROR(SplitHostPort(address, &host, &port));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve peer address ", address, ": ", gai_strerror(rc)));
  }
  std::string last_error = "no address";
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    UniqueFd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) continue;
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd.get(), 128) != 0) {
      last_error = strerror(errno);
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
    *bound_port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                           : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    ::freeaddrinfo(res);
    return fd;
  }
  ::freeaddrinfo(res);
  return absl::UnavailableError(
      absl::StrCat("cannot listen for peers on ", address, ": ", last_error));
}

}  // namespace arfuse::peers
