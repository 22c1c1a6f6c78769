// arfused's plaintext TCP health port, accepted by arfused itself rather than by gRPC. gRPC's own
// TCP listener (1.51) stops accepting for good after one accept() that fails with EMFILE, and a
// port whose listener stopped never answers again: a liveness probe would restart a process
// that recovered long ago. This listener is the project's: out of descriptors, it answers a
// pending connection with the spare descriptor it keeps for that (AcceptReserve), and it accepts
// as before as soon as descriptors come back. Each accepted connection goes to the handler (the
// health server, through grpc::AddInsecureChannelFromFd); open connections are capped, so that
// a flood on the port cannot take the descriptors the Unix sockets' clients need.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/fd/unique_fd.h"
#include "server/fdpass/accept_reserve.h"
#include "server/fdpass/connection_table.h"

namespace arfuse {

struct TcpListenerOptions {
  // Open connections in all (0: no cap); more are closed at once.
  size_t max_connections = 64;
  // For logs.
  std::string label = "health";
};

class TcpListener {
 public:
  // Called on the accept thread with a connection (non-blocking, close-on-exec). Must not block.
  using Handler = std::function<void(UniqueFd conn)>;

  // Binds and listens on every address `host` resolves to (numeric or a name; "[::]" as "::"),
  // at `port` (0: a free one, the same for every address). UNAVAILABLE naming the address.
  static absl::StatusOr<std::unique_ptr<TcpListener>> Bind(const std::string& host, int port,
                                                           TcpListenerOptions options = {});
  ~TcpListener();  // stops the accept thread (never blocks on clients)
  TcpListener(const TcpListener&) = delete;
  TcpListener& operator=(const TcpListener&) = delete;

  int port() const { return port_; }
  void Serve(Handler handler);
  void Stop();

  uint64_t accepted() const { return accepted_.load(); }
  // Connections answered with the spare descriptor while the process was out of descriptors.
  uint64_t served_with_spare() const { return served_with_spare_.load(); }
  uint64_t refused() const { return refused_.load(); }
  uint64_t accept_calls() const { return accept_calls_.load(); }

 private:
  TcpListener(std::vector<UniqueFd> fds, int port, UniqueFd wake_read, UniqueFd wake_write,
              TcpListenerOptions options);
  void AcceptLoop();
  // Hands `conn` over unless the cap is reached; false: closed.
  bool Admit(UniqueFd conn);

  std::vector<UniqueFd> fds_;
  const int port_;
  UniqueFd wake_read_;
  UniqueFd wake_write_;
  const TcpListenerOptions options_;
  AcceptReserve reserve_;
  // The connections handed over, so that the cap counts only those still open.
  ConnectionTable open_;
  Handler handler_;
  std::thread thread_;
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> served_with_spare_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> accept_calls_{0};
};

}  // namespace arfuse
