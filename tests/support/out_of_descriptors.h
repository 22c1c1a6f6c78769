// Test helper: this process out of file descriptors for a while, the way a daemon under a low
// RLIMIT_NOFILE is, to see what its accept loops do then. Sockets that are to connect meanwhile
// must be made before (connect() takes no new descriptor).
#pragma once

#include <errno.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

namespace arfuse::testing {

class OutOfDescriptors {
 public:
  // Lowers the soft RLIMIT_NOFILE to `limit` and opens /dev/null until the process has none left.
  explicit OutOfDescriptors(rlim_t limit = 256) {
    if (::getrlimit(RLIMIT_NOFILE, &saved_) != 0) return;
    rlimit low = saved_;
    low.rlim_cur = limit;
    if (::setrlimit(RLIMIT_NOFILE, &low) != 0) return;
    lowered_ = true;
    for (int fd; (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) filler_.push_back(fd);
    exhausted_ = errno == EMFILE;
  }
  // Gives the descriptors back and restores the limit.
  ~OutOfDescriptors() {
    for (int fd : filler_) ::close(fd);
    if (lowered_) ::setrlimit(RLIMIT_NOFILE, &saved_);
  }
  OutOfDescriptors(const OutOfDescriptors&) = delete;
  OutOfDescriptors& operator=(const OutOfDescriptors&) = delete;

  // The process is out of descriptors (the next open fails with EMFILE).
  bool exhausted() const { return exhausted_; }

 private:
  rlimit saved_{};
  bool lowered_ = false;
  bool exhausted_ = false;
  std::vector<int> filler_;
};

// Connects the unconnected Unix stream socket `fd` to `path`; false when connect() failed.
inline bool ConnectUnix(int fd, const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  return ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
}

}  // namespace arfuse::testing
