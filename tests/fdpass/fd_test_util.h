// What the fd channel tests share: socket pairs, pipes whose far end tells whether a descriptor
// is still open somewhere, and a count of this process's open descriptors.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <utility>

#include "common/fd/unique_fd.h"
#include "gtest/gtest.h"

namespace arfuse::testing {

struct SocketPair {
  SocketPair() {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv), 0);
    a.reset(sv[0]);
    b.reset(sv[1]);
  }
  UniqueFd a, b;
};

// A pipe: hand `write_end` away; `read_end` reads EOF once every copy of the write end closed.
struct Pipe {
  Pipe() {
    int p[2];
    EXPECT_EQ(::pipe2(p, O_CLOEXEC | O_NONBLOCK), 0);
    read_end.reset(p[0]);
    write_end.reset(p[1]);
  }
  // True when no copy of the write end is open any more (EOF on the read end).
  bool WriteEndClosedEverywhere() const {
    char c;
    return ::read(read_end.get(), &c, 1) == 0;
  }
  UniqueFd read_end, write_end;
};

// Open descriptors of this process.
inline int OpenFdCount() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.' ? 1 : 0;
  ::closedir(d);
  return n - 1;  // the directory's own descriptor
}

}  // namespace arfuse::testing
