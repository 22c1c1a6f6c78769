// arfused's Unix sockets (the main gRPC socket and the fd channel), accepted by arfused itself so
// that each client's credentials (SO_PEERCRED) are checked before a byte is read, and recorded
// (ConnectionTable) so that services know who makes each call. A registered region exposes
// memory to writes, so only allowed users may connect.
//
// Descriptors are a resource every client shares: connections are capped per uid and in total
// (the total leaves a reserve of the process's RLIMIT_NOFILE for the health port, the metrics
// port, region descriptors and the peer channel), and when the process is out of descriptors
// anyway (EMFILE/ENFILE) the accept loop sheds the pending connection with a spare descriptor
// kept for that (close the spare, accept, close, reopen), backs off, and logs at most once a
// second: it never spins.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/fd/unique_fd.h"
#include "server/fdpass/accept_reserve.h"
#include "server/fdpass/connection_table.h"
#include "server/fdpass/socket_credentials.h"
#include "server/fdpass/ticket_broker.h"

namespace arfuse {

struct PeerCredentialPolicy {
  // Always allowed: this process's uid and root. Plus these uids, and any uid whose primary or
  // supplementary groups (as the kernel reports for the connecting process) meet `gids`.
  std::set<uid_t> uids;
  std::set<gid_t> gids;
  bool Allows(const SocketCredentials& creds) const;
};

struct UnixListenerOptions {
  PeerCredentialPolicy policy;
  // Shared by every listener of the process: caps count connections on all of them.
  ConnectionTable* table = nullptr;
  ConnectionTable::Channel channel = ConnectionTable::Channel::kMain;
  // Open connections one uid may hold on this listener's channel (0: no cap). Each channel has
  // its own: fd-channel connections never count against the main socket's cap.
  size_t max_connections_per_uid = 64;
  // The flag that sets it, for the refusal's log line.
  std::string per_uid_flag = "--max-connections-per-uid";
  // Open connections in all (0: no cap); see ConnectionBudget().
  size_t max_connections = 0;
  // For logs: "main" or "fd".
  std::string label = "main";
};

// The connections a process with this RLIMIT_NOFILE soft limit may accept on its Unix sockets:
// the limit less a reserve of a quarter of it, at least 64 (health and metrics connections,
// region descriptors, peers, gRPC's own). At least 1.
size_t ConnectionBudget(uint64_t nofile_soft_limit);
// The same for this process's current limit.
size_t ConnectionBudget();
// That reserve: a quarter of the limit, at least 64.
uint64_t DescriptorReserve(uint64_t nofile_soft_limit);
// This process's RLIMIT_NOFILE soft limit (2^20 when unlimited or unknown).
uint64_t NofileSoftLimit();

// The budgets of pending descriptors (FdTicketBroker: deposited, offered, in transit) inside that
// reserve: in all, half of it; per uid, a quarter of that, at least one full ticket
// (kMaxFdChannelFds). RLIMIT_NOFILE 1024: 128 in all, 32 per uid. A flag's value other than 0
// replaces the figure it names.
FdTicketBrokerOptions PendingFdBudget(uint64_t nofile_soft_limit, size_t flag_total = 0,
                                      size_t flag_per_uid = 0);

class UnixListener {
 public:
  // Called on the accept thread with an allowed connection (non-blocking, close-on-exec) and its
  // credentials, already recorded in the table. Must not block.
  using Handler = std::function<void(UniqueFd conn, const SocketCredentials& creds)>;

  // Binds and listens on `path` (mode 0660). INVALID_ARGUMENT/UNAVAILABLE naming the path.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Bind(const std::string& path,
                                                            UnixListenerOptions options);
  ~UnixListener();  // stops the accept thread (never blocks on clients) and removes the socket
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;

  // Starts accepting. Connections from disallowed users, and over the caps, are closed and
  // logged (uid only, at most once a second per reason).
  void Serve(Handler handler);
  // Stops accepting new connections; those already handed over stay with their owner.
  void Stop();

  uint64_t refused() const { return refused_.load(); }
  // Connections closed at once because the process was out of descriptors.
  uint64_t shed() const { return shed_.load(); }
  // accept() calls made (tests: a loop that spins makes millions).
  uint64_t accept_calls() const { return accept_calls_.load(); }

 private:
  UnixListener(UniqueFd fd, UniqueFd wake_read, UniqueFd wake_write, std::string path,
               UnixListenerOptions options);
  void AcceptLoop();
  // Waits `d` on the wake pipe alone; true when Stop() was called.
  bool Pause(absl::Duration d);

  UniqueFd fd_;
  UniqueFd wake_read_;
  UniqueFd wake_write_;
  AcceptReserve reserve_;
  std::string path_;
  UnixListenerOptions options_;
  Handler handler_;
  std::thread thread_;
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> shed_{0};
  std::atomic<uint64_t> accept_calls_{0};
};

}  // namespace arfuse
