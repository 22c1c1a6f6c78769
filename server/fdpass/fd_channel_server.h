// arfused's side of the fd channel (fd_wire.h): serves the connections its listener accepted on
// <main socket>.fd, with the credentials the kernel reported for each, against a FdTicketBroker.
// One thread, every socket non-blocking: a client that stalls, floods or disappears costs its
// own connection only. Bounded everywhere: one request read at a time (exactly its bytes), at
// most kMaxFdChannelFds descriptors a message, a reply before the next request, an idle timeout,
// a cap on connections. Every descriptor the server holds for a client counts against the
// broker's budgets (ticket_broker.h): a DEPOSIT's from the moment they arrive, a PICKUP's until
// the client has read the reply that carries them (a descriptor in a socket's queue is still an
// open file of the daemon's user). A connection with such an unread reply is not closed for
// idleness: the charge ends only when the client reads it or closes the connection.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/fd/fd_wire.h"
#include "common/fd/unique_fd.h"
#include "server/fdpass/socket_credentials.h"
#include "server/fdpass/ticket_broker.h"
#include "server/fdpass/wake_fd.h"

namespace arfuse {

struct FdChannelServerOptions {
  // How long a deposited ticket waits for its claim.
  absl::Duration ticket_ttl = absl::Seconds(30);
  // A connection with no complete request (or an unsent reply) for this long is closed.
  absl::Duration idle_timeout = absl::Seconds(10);
  size_t max_connections = 256;
};

// The answer to one request, as the server sends it: the encoded reply, the descriptors that go
// with it (PICKUP_OK), and whether the connection closes once it is sent (the request was not a
// request at all). Pure apart from the broker: the server and the fuzzer call it.
// `inbound` is what the caller already charged for the request's descriptors (a DEPOSIT's move
// to its ticket); `charge` is what the reply's descriptors stay charged as until the client has
// them.
struct FdReply {
  std::string bytes;
  std::vector<UniqueFd> fds;
  FdCharge charge;
  bool close_after = false;
};
FdReply AnswerFdRequest(FdTicketBroker& broker, const SocketCredentials& client, FdMessage request,
                        absl::Duration ticket_ttl, FdCharge inbound = {});

class FdChannelServer {
 public:
  // Starts the serving thread. `broker` must outlive the server.
  static absl::StatusOr<std::unique_ptr<FdChannelServer>> Start(FdTicketBroker* broker,
                                                                FdChannelServerOptions options);
  ~FdChannelServer();  // stops the thread and closes every connection; never waits on a client
  FdChannelServer(const FdChannelServer&) = delete;
  FdChannelServer& operator=(const FdChannelServer&) = delete;

  // Serves `conn` (a connected, non-blocking Unix socket) as the client `creds`. Thread-safe,
  // never blocks.
  void Adopt(UniqueFd conn, const SocketCredentials& creds);

  // For tests and metrics.
  size_t connections() const { return open_.load(std::memory_order_relaxed); }
  // Descriptors of PICKUP replies sent and not yet read by their clients.
  size_t unread_fds() const { return unread_fds_.load(std::memory_order_relaxed); }
  uint64_t requests() const { return requests_.load(std::memory_order_relaxed); }
  uint64_t protocol_errors() const { return protocol_errors_.load(std::memory_order_relaxed); }

 private:
  struct Conn;
  FdChannelServer(FdTicketBroker* broker, FdChannelServerOptions options);
  void Loop();
  // Reads what the connection sent; answers a complete request. False: close it.
  bool OnReadable(Conn& c, absl::Time now);
  // Sends what is queued. False: close it.
  bool OnWritable(Conn& c);

  FdTicketBroker* const broker_;
  const FdChannelServerOptions options_;
  WakeFd wake_;
  std::mutex mu_;
  std::vector<std::pair<UniqueFd, SocketCredentials>> adopted_;  // guarded by mu_
  bool stop_ = false;                                            // guarded by mu_
  std::atomic<size_t> open_{0};
  std::atomic<size_t> unread_fds_{0};
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> protocol_errors_{0};
  std::thread thread_;
};

}  // namespace arfuse
