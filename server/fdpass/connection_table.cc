#include "server/fdpass/connection_table.h"

#include <sys/stat.h>

#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"

namespace arfuse {

std::optional<SocketCredentials> OwnProcessCredentials::ForPeer(absl::string_view) const {
  return OwnCredentials();
}

bool ConnectionTable::StillOpen(int fd, const Entry& e) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) && st.st_dev == e.dev && st.st_ino == e.ino;
}

void ConnectionTable::Record(int fd, Channel channel, const SocketCredentials& creds) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return;
  absl::MutexLock lock(&mu_);
  entries_.insert_or_assign(fd, Entry{channel, st.st_dev, st.st_ino, creds});
}

size_t ConnectionTable::Live() {
  absl::MutexLock lock(&mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (StillOpen(it->first, it->second)) {
      ++it;
    } else {
      entries_.erase(it++);
    }
  }
  return entries_.size();
}

size_t ConnectionTable::LiveFor(uid_t uid) {
  Live();
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [fd, e] : entries_) n += e.creds.uid == uid ? 1 : 0;
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
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(*fd);
  if (it == entries_.end() || it->second.channel != Channel::kMain || !StillOpen(*fd, it->second)) {
    return std::nullopt;
  }
  return it->second.creds;
}

}  // namespace arfuse
