// The main server's Unix socket, accepted by arfused itself so each client's credentials
// (SO_PEERCRED) are checked before gRPC reads a byte: a registered region exposes device memory
// to writes, so only allowed users may register one. Accepted connections are handed to the
// gRPC server as already-connected descriptors.
#pragma once

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <atomic>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace arfuse {

struct PeerCredentialPolicy {
  // Always allowed: this process's uid and root. Plus these uids, and any uid whose primary gid
  // (as the kernel reports for the connecting process) is in `gids`.
  std::set<uid_t> uids;
  std::set<gid_t> gids;
  bool Allows(uid_t uid, gid_t gid) const;
};

class UnixListener {
 public:
  // Binds and listens on `path` (mode 0660). INVALID_ARGUMENT/UNAVAILABLE naming the path.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Bind(const std::string& path,
                                                            PeerCredentialPolicy policy);
  ~UnixListener();  // stops the accept thread (never blocks on clients) and closes the socket
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;

  // Starts accepting for `server` (already started). Connections from disallowed users are
  // closed and logged (uid only).
  void Serve(grpc::Server* server);
  // Stops accepting new connections; those already handed to gRPC stay with it.
  void Stop();

  uint64_t refused() const { return refused_.load(); }

 private:
  UnixListener(int fd, int wake_read, int wake_write, std::string path, PeerCredentialPolicy p);
  void AcceptLoop(grpc::Server* server);

  int fd_;
  int wake_read_;
  int wake_write_;
  std::string path_;
  PeerCredentialPolicy policy_;
  std::thread thread_;
  std::atomic<uint64_t> refused_{0};
};

}  // namespace arfuse
