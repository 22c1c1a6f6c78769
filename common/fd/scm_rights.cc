#include "common/fd/scm_rights.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace arfuse {

absl::Status SendWithFds(int fd, absl::string_view data, size_t* offset, absl::Span<const int> fds,
                         absl::string_view what) {
  // The control buffer below holds kMaxScmFds descriptors, and receivers refuse more.
  if (fds.size() > kMaxScmFds) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a message carries at most ", kMaxScmFds, " fds, got ", fds.size()));
  }
  while (*offset < data.size()) {
    iovec iov{const_cast<char*>(data.data() + *offset), data.size() - *offset};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int) * kMaxScmFds)];
    if (*offset == 0 && !fds.empty()) {
      msg.msg_control = ctrl;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    ssize_t n = ::sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::OkStatus();
      return absl::UnavailableError(absl::StrCat(what, " write failed: ", std::strerror(errno)));
    }
    *offset += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

std::vector<UniqueFd> TakeFds(std::deque<UniqueFd>& fds, size_t n) {
  std::vector<UniqueFd> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(std::move(fds.front()));
    fds.pop_front();
  }
  return out;
}

absl::StatusOr<bool> WaitForSocket(int fd, short events, absl::Time deadline) {
  for (;;) {
    absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    int ms = static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1000));
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, ms);
    if (r < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("poll failed: ", std::strerror(errno)));
    }
    if (r > 0) return true;
  }
}

absl::Status RecvWithFds(int fd, std::string& buf, std::deque<UniqueFd>& fds, bool* eof,
                         absl::string_view what, size_t max_bytes, size_t max_fds) {
  *eof = false;
  size_t total = 0;
  while (total < max_bytes) {
    char data[64 * 1024];
    alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int) * kMaxScmFds)];
    iovec iov{data, std::min(sizeof(data), max_bytes - total)};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctrl;
    msg.msg_controllen = sizeof(ctrl);
    ssize_t n = ::recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::OkStatus();
      return absl::UnavailableError(absl::StrCat(what, " read failed: ", std::strerror(errno)));
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int received;
          std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          fds.emplace_back(received);
        }
      }
    }
    if (msg.msg_flags & MSG_CTRUNC) {
      return absl::InvalidArgumentError(
          absl::StrCat(what,
                       ": the sender attached more file descriptors than a message may "
                       "carry"));
    }
    if (fds.size() > max_fds) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": more file descriptors arrived than the message may carry"));
    }
    if (n == 0) {
      *eof = true;
      return absl::OkStatus();
    }
    buf.append(data, static_cast<size_t>(n));
    total += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace arfuse
