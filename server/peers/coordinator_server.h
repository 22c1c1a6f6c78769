// Rank 0's socket front of the Coordinator: listens on a Unix socket in the peer directory (one
// node; carries file descriptors) and/or a TCP address (several nodes), and runs one I/O thread
// that never blocks on a peer (non-blocking sockets, poll with the next deadline as timeout).
//
// Liveness: the thread echoes every kHeartbeat at once, and a connection that announced a
// heartbeat timeout (the frame's timeout_ms) and then sent nothing at all for longer is closed as
// "stopped answering": for a joined rank that breaks the group, naming the rank, exactly as if
// its connection had closed. A frozen (SIGSTOP) rank keeps its socket open, so this is how an
// idle group notices it.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/fd/unique_fd.h"
#include "common/log.h"
#include "server/fdpass/accept_reserve.h"
#include "server/fdpass/wake_fd.h"
#include "server/peers/coordinator.h"
#include "server/peers/peer_tls.h"
#include "server/peers/wire.h"

namespace arfuse::peers {

struct CoordinatorServerOptions {
  std::string group;
  int world_size = 1;
  int nnodes = 1;
  std::string unix_path;    // empty: no Unix listener
  std::string tcp_address;  // "host:port"; empty: no TCP listener
  // Mutual TLS on the TCP listener (peer_tls.h): every connection must complete it with a
  // certificate of the CA before a byte of the peer protocol is read; a plain joiner is answered
  // with an UNAUTHENTICATED error frame. Null: plain TCP (a network the deployment isolates).
  std::shared_ptr<const PeerTls> tls;
};

class CoordinatorServer {
 public:
  // Binds the listeners (INVALID_ARGUMENT for a bad address, FAILED_PRECONDITION when another
  // live coordinator owns the Unix path, UNAVAILABLE when the TCP port is taken) and starts the
  // I/O thread.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(
      const CoordinatorServerOptions& options);
  // Stops the I/O thread (bounded: it only ever waits in poll) and closes every connection, so
  // peers see the coordinator go away at once. Removes the Unix path if it is still ours.
  ~CoordinatorServer();

  std::shared_ptr<Coordinator> coordinator() const { return coordinator_; }
  // The bound TCP port (useful with port 0); 0 without a TCP listener.
  int tcp_port() const { return tcp_port_; }
  // Connections to the Unix socket closed at once because their process runs as another user
  // (peer_credentials.h).
  uint64_t refused_connections() const { return refused_.load(std::memory_order_relaxed); }
  // TCP connections closed because they did not authenticate (no TLS, no certificate or one the
  // CA did not sign, a handshake that did not finish in time).
  uint64_t unauthenticated_connections() const {
    return unauthenticated_.load(std::memory_order_relaxed);
  }

  struct Conn;
  using Wake = WakeFd;

 private:
  explicit CoordinatorServer(const CoordinatorServerOptions& options);
  void Loop();
  void HandleFrame(const std::shared_ptr<Conn>& conn, Frame frame);
  void CloseConn(uint64_t id, const std::string& reason);
  // Advances a TLS connection's handshake; false when the connection was closed.
  bool AdvanceHandshake(const std::shared_ptr<Conn>& c);
  // Closes a connection that did not authenticate, after telling it why where it can hear it.
  void RefuseUnauthenticated(const std::shared_ptr<Conn>& c, const absl::Status& why);
  // Closes every connection whose heartbeat timeout passed without a byte from it; returns the
  // earliest time another one can.
  absl::Time ExpireSilentConns(absl::Time now);

  CoordinatorServerOptions options_;
  std::shared_ptr<Coordinator> coordinator_;
  std::shared_ptr<Wake> wake_;
  UniqueFd unix_listen_;
  UniqueFd tcp_listen_;
  uint64_t unix_inode_ = 0;
  int tcp_port_ = 0;
  std::map<uint64_t, std::shared_ptr<Conn>> conns_;  // I/O thread only
  uint64_t next_conn_id_ = 1;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> unauthenticated_{0};
  // Out of descriptors: the spare that sheds a pending connection, and when to accept again.
  AcceptReserve accept_reserve_;
  absl::Time accept_paused_until_ = absl::InfinitePast();
  LogRateLimiter accept_log_{absl::Seconds(1)};
  std::thread thread_;
};

}  // namespace arfuse::peers
