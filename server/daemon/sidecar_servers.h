// The servers of one arfused: the main gRPC server (on the Unix socket, whose listener hands it
// each connection, and with --listen on TCP over mutual TLS), the fd channel on <socket>.fd, the
// health-only probe server on its TCP port, the health state both answer from, and the metrics.
// What they serve is given to Start; the order they stop in is Sidecar::ShutdownNow's.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/service_type.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/daemon/options.h"
#include "server/services/health/health_service.h"

namespace arfuse {

class ConnectionTable;
class FdChannelServer;
class FdTicketBroker;
class Metrics;
class TcpListener;
class TcpServerKeeper;
class UnixListener;

// The readiness entry of the health service (the main API's service name).
inline constexpr char kReadinessService[] = "arfuse.v1.Fusion";
// The most metadata one call may carry on the main server (GRPC_ARG_MAX_METADATA_SIZE).
inline constexpr int kMaxMetadataBytes = 64 << 10;

class SidecarServers {
 public:
  // `options` must outlive the servers; they read it when they start.
  explicit SidecarServers(const DaemonOptions& options);
  ~SidecarServers();
  SidecarServers(const SidecarServers&) = delete;
  SidecarServers& operator=(const SidecarServers&) = delete;

  // Prepares the paths of the main socket and of the fd channel's (a stale socket left by a dead
  // process is replaced).
  absl::Status PrepareSockets();
  // Makes the metrics (labelled with the rank, the world size and the device) and serves them
  // with --metrics-port >= 0.
  absl::Status StartMetrics();
  // Binds the health port, the Unix sockets and, with --listen, the TLS port, and starts the
  // servers: `services` (callback services, one object serving several servers) beside the
  // health service on the main ones, the health service alone on the probe port. Liveness
  // answers SERVING from here on, readiness NOT_SERVING until SetReadiness(true).
  absl::Status Start(const std::vector<grpc::Service*>& services);

  void SetReadiness(bool serving);
  bool serving() const;
  HealthState& health() { return health_; }
  Metrics& metrics() { return *metrics_; }
  // Who makes each call on the Unix sockets, and the descriptors the fd channel holds.
  ConnectionTable* connections() const { return connections_.get(); }
  FdTicketBroker* fd_tickets() const { return fd_tickets_.get(); }
  const std::string& fd_socket() const { return fd_socket_; }
  int health_port() const { return health_port_; }
  int metrics_port() const;

  // Shutdown, step by step (Sidecar::ShutdownNow interleaves them with the services' steps).
  void StopUnixListener();
  void StopFdListener();
  // Unary calls in flight on the main servers.
  int64_t unary_calls() const { return unary_calls_.load(std::memory_order_acquire); }
  bool main_running() const { return main_server_ != nullptr; }
  // Shuts the main servers down, cancelling at `deadline` what is still running.
  void ShutdownMain(std::chrono::system_clock::time_point deadline);
  // The probe port: every health entry NOT_SERVING, the listener and the server stopped.
  void ShutdownProbe();
  void ReleaseMain();
  void ReleaseProbe();

 private:
  // Server credentials for --listen: TLS that requires and verifies a client certificate.
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MutualTlsCredentials() const;
  absl::Status StartProbe();
  absl::Status StartMain(const std::vector<grpc::Service*>& services);

  const DaemonOptions& options_;
  std::string fd_socket_;
  int health_port_ = 0;
  HealthState health_;
  std::unique_ptr<HealthService> health_main_;
  std::unique_ptr<HealthService> health_probe_;
  std::unique_ptr<Metrics> metrics_;
  // Every connection accepted on the Unix sockets, with its credentials: who makes each call
  // (the Fusion service asks), and the per-uid and total connection caps.
  std::unique_ptr<ConnectionTable> connections_;
  // The fd channel (<socket>.fd): descriptors clients hand in (and, later, take out) by ticket.
  std::unique_ptr<FdTicketBroker> fd_tickets_;
  std::unique_ptr<FdChannelServer> fd_channel_;
  std::unique_ptr<UnixListener> fd_listener_;
  std::unique_ptr<UnixListener> unix_listener_;
  std::unique_ptr<grpc::Server> main_server_;
  // Unary calls in flight on main_server_ (an interceptor counts them); shutdown waits for 0.
  std::atomic<int64_t> unary_calls_{0};
  std::unique_ptr<grpc::Server> health_server_;
  // The health port: the project's own TCP listener (tcp_listener.h) hands each connection to
  // health_server_, which listens on nothing itself. Declared after it: stopped first.
  std::unique_ptr<TcpListener> health_listener_;
  // --listen: the main API over mutual TLS, on servers of its own that the keeper builds again
  // when gRPC's listener stopped accepting (tcp_server_keeper.h).
  std::unique_ptr<TcpServerKeeper> tls_servers_;
};

}  // namespace arfuse
