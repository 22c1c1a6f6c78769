// arfused's side of the fd channel (fd_wire.h): serves the connections its listener accepted on
// <main socket>.fd, with the credentials the kernel reported for each, against a FdTicketBroker.
// One thread, every socket non-blocking: a client that stalls, floods or disappears costs its
// own connection only. Bounded everywhere: one request read at a time (exactly its bytes), at
// most kMaxFdChannelFds descriptors a message, a reply before the next request, an idle timeout,
// a cap on connections.
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
#include "server/fdpass/fd_wire.h"
#include "server/fdpass/socket_credentials.h"
#include "server/fdpass/ticket_broker.h"
#include "server/fdpass/unique_fd.h"
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
struct FdReply {
  std::string bytes;
  std::vector<UniqueFd> fds;
  bool close_after = false;
};
FdReply AnswerFdRequest(FdTicketBroker& broker, const SocketCredentials& client, FdMessage request,
                        absl::Duration ticket_ttl);

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
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> protocol_errors_{0};
  std::thread thread_;
};

}  // namespace arfuse
