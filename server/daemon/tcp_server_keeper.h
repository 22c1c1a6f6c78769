// The main API over TCP (--listen, mutual TLS), kept answering after the process ran out of
// descriptors. gRPC 1.51's TCP listener stops accepting for good after one accept() that fails
// with EMFILE, and it cannot adopt a TLS connection by descriptor (grpc_server_add_channel_from_fd
// takes insecure credentials only), so this listener has to stay gRPC's. The keeper watches it
// from outside instead: a listening socket with a connection pending for longer than
// `stuck_after` is one nobody accepts from. Once descriptors are back (a few can be opened), the
// keeper stops that socket listening (shutdown(2) on a listening socket takes it out of the
// port's accept path) and builds a fresh server on the same port. The old server keeps serving
// the connections it already has; it is shut down with the rest, or once `max_retired` newer
// ones replaced it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/fd/unique_fd.h"
#include "grpcpp/server.h"

namespace arfuse {

struct TcpServerKeeperOptions {
  absl::Duration interval = absl::Milliseconds(50);
  absl::Duration stuck_after = absl::Milliseconds(300);
  // Descriptors that must be free before a server is built again.
  int headroom = 32;
  size_t max_retired = 4;
};

class TcpServerKeeper {
 public:
  // Builds and starts a server listening on "host:port" (`port` 0: a free one) and sets *bound to
  // the port it listens on; null when it cannot.
  using Build =
      std::function<std::unique_ptr<grpc::Server>(const std::string& address, int* bound)>;

  // Builds the first server on `address` ("host:port") and starts watching it. UNAVAILABLE when
  // it cannot be built.
  static absl::StatusOr<std::unique_ptr<TcpServerKeeper>> Start(
      const std::string& address, Build build, TcpServerKeeperOptions options = {});
  ~TcpServerKeeper();  // Shutdown(now)
  TcpServerKeeper(const TcpServerKeeper&) = delete;
  TcpServerKeeper& operator=(const TcpServerKeeper&) = delete;

  int port() const { return port_; }
  // Stops watching and shuts every server down (gRPC's Shutdown with `deadline`).
  void Shutdown(std::chrono::system_clock::time_point deadline);
  // Servers built again after their listener stopped accepting.
  uint64_t rebuilt() const { return rebuilt_.load(); }

 private:
  TcpServerKeeper(std::string host, Build build, TcpServerKeeperOptions options);
  void Watch();
  // Whether a listener is stuck now (updates stuck_since_).
  bool Stuck(absl::Time now);
  bool Rebuild();

  const std::string host_;
  const Build build_;
  const TcpServerKeeperOptions options_;
  int port_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  // The servers, the newest (the one listening) last; guarded by mu_.
  std::vector<std::unique_ptr<grpc::Server>> servers_;
  // Duplicates of the newest server's listening sockets (the watch thread's only).
  std::vector<UniqueFd> watched_;
  absl::Time stuck_since_ = absl::InfiniteFuture();
  bool stuck_ = false;
  std::atomic<uint64_t> rebuilt_{0};
  std::thread thread_;
};

// Duplicates of this process's listening TCP sockets on `port` (found in /proc/self/fd).
std::vector<UniqueFd> ListeningTcpSockets(int port);
// Whether `n` more descriptors can be opened now.
bool DescriptorsFree(int n);
// "host:port" split at its last colon ("[::1]:5" -> "[::1]", 5); port -1 when there is none.
std::pair<std::string, int> SplitHostPort(const std::string& address);

}  // namespace arfuse
