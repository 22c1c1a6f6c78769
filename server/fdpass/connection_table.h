// The connections the daemon accepted on its Unix sockets, by descriptor number, with the
// credentials the kernel reported at accept (SO_PEERCRED): the CallerCredentials of the main
// gRPC server, and the count behind the per-uid and total connection caps.
//
// Why a descriptor number is a safe key: arfused accepts each connection and hands the
// descriptor to its owner (gRPC, which names the connection "fd:N"; the fd channel). The number
// is reused only after that owner closed it, and gRPC closes a connection's descriptor only when
// the transport is destroyed, which waits for every call on it to end: while a call is in
// progress, "fd:N" is the connection that carried it. A connection accepted later at the same
// number replaces the entry (Record). Entries of connections already closed are dropped once
// their number no longer holds the socket recorded (its inode, read from /proc/self/fd).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "server/fdpass/caller_credentials.h"

namespace arfuse {

class ConnectionTable final : public CallerCredentials {
 public:
  enum class Channel : uint8_t { kMain, kFd };

  // Records the connection just accepted at `fd`, replacing what the number held.
  void Record(int fd, Channel channel, const SocketCredentials& creds);

  // Connections still open, in all and of `uid` on `channel`; entries of closed ones are dropped
  // here. The per-uid caps count each channel apart: idle fd-channel connections never lock a
  // user out of the main socket.
  size_t Live();
  size_t LiveFor(uid_t uid, Channel channel);

  // "fd:N" of a main-socket connection still open; nullopt otherwise.
  std::optional<SocketCredentials> ForPeer(absl::string_view peer) const override;

  // The descriptor number gRPC's name of a connection handed over by descriptor carries
  // ("fd:N"); nullopt for other names.
  static std::optional<int> FdOfPeer(absl::string_view peer);

 private:
  struct Entry {
    Channel channel;
    ino_t ino;  // sockets' inode numbers are unique among live sockets
    SocketCredentials creds;
  };
  // The entry's descriptor still holds the socket recorded.
  static bool StillOpen(int fd, const Entry& e);

  // std::mutex rather than absl::Mutex: ThreadSanitizer sees its synchronization.
  mutable std::mutex mu_;
  absl::flat_hash_map<int, Entry> entries_;  // guarded by mu_
};

}  // namespace arfuse
