#include "server/daemon/unix_listener.h"

#include <errno.h>
#include <fcntl.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/core/log.h"
#include "spdlog/spdlog.h"

namespace arfuse {

bool PeerCredentialPolicy::Allows(uid_t uid, gid_t gid) const {
  return uid == 0 || uid == ::geteuid() || uids.count(uid) > 0 || gids.count(gid) > 0;
}

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Bind(const std::string& path,
                                                                 PeerCredentialPolicy policy) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path too long: ", path));
  }
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket(): ", std::strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  // Created 0660 from the start: no window in which others could connect.
  mode_t old_mask = ::umask(0117);
  int bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int bind_errno = errno;
  ::umask(old_mask);
  if (bound != 0 || ::listen(fd, 128) != 0) {
    int err = bound != 0 ? bind_errno : errno;
    ::close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot listen on unix:", path, ": ", std::strerror(err)));
  }
  ::chmod(path.c_str(), 0660);
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("pipe(): ", std::strerror(errno)));
  }
  return std::unique_ptr<UnixListener>(
      new UnixListener(fd, wake[0], wake[1], path, std::move(policy)));
}

UnixListener::UnixListener(int fd, int wake_read, int wake_write, std::string path,
                           PeerCredentialPolicy p)
    : fd_(fd),
      wake_read_(wake_read),
      wake_write_(wake_write),
      path_(std::move(path)),
      policy_(std::move(p)) {}

UnixListener::~UnixListener() {
  Stop();
  ::close(wake_read_);
  ::close(wake_write_);
  ::unlink(path_.c_str());
}

void UnixListener::Serve(grpc::Server* server) {
  thread_ = std::thread([this, server] { AcceptLoop(server); });
}

void UnixListener::Stop() {
  if (thread_.joinable()) {
    char byte = 1;
    (void)!::write(wake_write_, &byte, 1);
    thread_.join();
  }
  // Close the listening socket too: connections still queued in the backlog are refused at
  // once, instead of waiting out the shutdown grace period for an accept that never comes.
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

void UnixListener::AcceptLoop(grpc::Server* server) {
  while (true) {
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_read_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("event=accept_poll_failed error=\"{}\"", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    int conn = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (conn < 0) {
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
        spdlog::warn("event=accept_failed error=\"{}\"", std::strerror(errno));
      }
      continue;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
        !policy_.Allows(cred.uid, cred.gid)) {
      refused_.fetch_add(1);
      spdlog::warn("event=connection_refused uid={} gid={} reason=\"not an allowed user\"",
                   cred.uid, cred.gid);
      ::close(conn);
      continue;
    }
    // gRPC owns the descriptor from here on.
    grpc::AddInsecureChannelFromFd(server, conn);
  }
}

}  // namespace arfuse
