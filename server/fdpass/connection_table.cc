#include "server/fdpass/connection_table.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"

namespace arfuse {

std::optional<SocketCredentials> OwnProcessCredentials::ForPeer(absl::string_view) const {
  return OwnCredentials();
}

bool ConnectionTable::StillOpen(int fd, const Entry& e) {
  // Reads the process's descriptor table (/proc/self/fd/N names a socket "socket:[inode]")
  // rather than fstat(N): the descriptor's owner may close it at any moment, and what is asked is
  // only what the number refers to now, not an operation on the descriptor. Without /proc,
  // fstat answers the same.
  static const bool have_proc = ::access("/proc/self/fd", F_OK) == 0;
  if (!have_proc) {
    struct stat st {};
    return ::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) && st.st_ino == e.ino;
  }
  char link[64];
  char target[64];
  std::snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  const ssize_t n = ::readlink(link, target, sizeof(target) - 1);
  if (n <= 0) return false;
  target[n] = '\0';
  unsigned long long ino = 0;
  return std::sscanf(target, "socket:[%llu]", &ino) == 1 && ino == e.ino;
}

void ConnectionTable::Record(int fd, Channel channel, const SocketCredentials& creds) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  entries_.insert_or_assign(fd, Entry{channel, st.st_ino, creds});
}

size_t ConnectionTable::Live() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (StillOpen(it->first, it->second)) {
      ++it;
    } else {
      entries_.erase(it++);
    }
  }
  return entries_.size();
}

size_t ConnectionTable::LiveFor(uid_t uid, Channel channel) {
  Live();
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [fd, e] : entries_) n += e.creds.uid == uid && e.channel == channel ? 1 : 0;
  return n;
}

std::optional<int> ConnectionTable::FdOfPeer(absl::string_view peer) {
  int fd = -1;
  if (!absl::ConsumePrefix(&peer, "fd:") || !absl::SimpleAtoi(peer, &fd) || fd < 0) {
    return std::nullopt;
  }
  return fd;
}

std::optional<SocketCredentials> ConnectionTable::ForPeer(absl::string_view peer) const {
  std::optional<int> fd = FdOfPeer(peer);
  if (!fd) return std::nullopt;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(*fd);
  if (it == entries_.end() || it->second.channel != Channel::kMain || !StillOpen(*fd, it->second)) {
    return std::nullopt;
  }
  return it->second.creds;
}

}  // namespace arfuse
