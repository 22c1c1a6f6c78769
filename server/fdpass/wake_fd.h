// Wakes a poll loop from another thread: Notify() makes fd() readable, the loop Drain()s it. The
// I/O threads of the peer channel and of the fd channel wait only in poll, so this is how callers
// hand them work and how their owners stop them.
#pragma once

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/fd/unique_fd.h"

namespace arfuse {

class WakeFd {
 public:
  absl::Status Open() {
    fd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!fd_) return absl::InternalError(absl::StrCat("eventfd: ", strerror(errno)));
    return absl::OkStatus();
  }
  int fd() const { return fd_.get(); }
  void Notify() {
    uint64_t one = 1;
    // A full eventfd counter still wakes the poller, so a failed write loses nothing.
    [[maybe_unused]] ssize_t n = ::write(fd_.get(), &one, sizeof(one));
  }
  void Drain() {
    uint64_t v;
    [[maybe_unused]] ssize_t n = ::read(fd_.get(), &v, sizeof(v));
  }

 private:
  UniqueFd fd_;
};

}  // namespace arfuse
