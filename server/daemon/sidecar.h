// One arfused process: the main gRPC server on a Unix socket, the fd channel on a second one
// (<socket>.fd), the health-only server on a TCP port, metrics, and the group supervisor (peers,
// the config decision and its vote, the engine, recovery after a poisoning, the live backend
// switch) and shutdown.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/service_type.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/config/fusion_config.h"
#include "server/daemon/device_probe.h"
#include "server/daemon/gated_engine.h"
#include "server/daemon/options.h"
#include "server/services/admin/admin_service.h"
#include "server/services/health/health_service.h"

namespace arfuse {

class ConnectionTable;
class Exchange;
class FdChannelServer;
class FdTicketBroker;
class TcpListener;
class TcpServerKeeper;
class FusionService;
class Metrics;
class UnixListener;

// The readiness entry of the health service (the main API's service name).
inline constexpr char kReadinessService[] = "arfuse.v1.Fusion";
// The most metadata one call may carry on the main server (GRPC_ARG_MAX_METADATA_SIZE).
inline constexpr int kMaxMetadataBytes = 64 << 10;

// Why host mode without --sm does not fuse: logged at start-up, and the group decision's reason
// that GetWorkspaceInfo, Negotiate (`arfusectl info`) and the Python client's warning show.
inline constexpr char kNoGpuArchitectureReason[] =
    "host mode without --sm has no GPU architecture to decide for, so fusion is off and "
    "allreduce_fusion returns None (the caller's own path runs); give --sm=90 or --sm=100 to "
    "decide as that GPU would";

class Sidecar final : public AdminControl {
 public:
  explicit Sidecar(DaemonOptions options);
  ~Sidecar() override;
  Sidecar(const Sidecar&) = delete;
  Sidecar& operator=(const Sidecar&) = delete;

  // Binds the Unix socket, the health port and the metrics port, starts the servers, and starts
  // the group supervisor in the background (readiness stays NOT_SERVING until the group is
  // complete). INVALID_ARGUMENT / ALREADY_EXISTS / UNAVAILABLE / FAILED_PRECONDITION name the
  // problem; the caller exits with 2.
  absl::Status Start();

  int health_port() const { return health_port_; }
  int metrics_port() const;
  const std::string& socket_path() const { return options_.socket; }

  // Begins a graceful shutdown (readiness NOT_SERVING, in-flight calls get the grace period).
  // Safe to call from any thread, more than once.
  void RequestShutdown(const std::string& why);

  // Blocks until shutdown completes; returns the process exit code. The group supervisor may
  // still be waiting for peers (bounded by --peer-timeout); the caller exits without joining it.
  int Wait();

  // AdminControl.
  v1::GetStatsResponse Stats() override;
  absl::StatusOr<uint32_t> Drain(absl::Duration timeout) override;
  absl::StatusOr<v1::SetBackendResponse> SetBackend(const std::string& backend,
                                                    const std::optional<std::string>& collective_id,
                                                    absl::Time deadline) override;
  absl::StatusOr<v1::ReinitializeResponse> Reinitialize(absl::Time deadline) override;

 private:
  // The supervisor: forms the group, serves, and re-forms it after a poisoning or on request.
  void SuperviseGroup();
  // CUDA mode: when the device reports a sticky error (a lost context, or work that can never
  // finish), reports NOT_SERVING, sets exit code 1 and requests shutdown so the process is
  // restarted; returns whether it did.
  bool StopOnLostDevice();
  absl::Status FormGroup();
  // Collective (over exchange_): the highest workspace generation any rank has served, which the
  // new engine's generations are counted on from.
  absl::StatusOr<uint64_t> AgreeGenerationBase(absl::Time deadline);
  // Builds and initializes an engine for `decision` (collective over exchange_).
  absl::StatusOr<std::unique_ptr<Engine>> BuildEngine(const config::Decision& decision,
                                                      absl::Time deadline);
  config::Topology OwnTopology() const;
  config::FusionFlags OwnFlags() const;
  void Publish(const config::Decision& decision, bool ready);
  void SetReadiness(bool serving);
  bool ShutdownRequested();
  // Sleeps up to `d`, returning early on shutdown or a re-initialization request.
  void WaitFor(absl::Duration d);
  void ShutdownNow();
  // Server credentials for --listen: TLS that requires and verifies a client certificate.
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MutualTlsCredentials() const;

  DaemonOptions options_;
  GpuProbe gpu_;
  bool mps_detected_ = false;
  int health_port_ = 0;
  absl::Time started_ = absl::Now();
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
  std::unique_ptr<FusionService> fusion_;
  std::vector<std::unique_ptr<grpc::Service>> services_;
  GatedEngine gate_;
  std::unique_ptr<Exchange> exchange_;
  std::thread supervisor_;

  // The group's decision and state, read by the Config service and Stats.
  mutable std::mutex state_mu_;
  config::FusionFlags flags_;
  config::Decision decision_;
  bool decided_ = false;
  std::string not_ready_reason_ = "the group is forming";
  uint64_t poisonings_ = 0;
  uint64_t reinitializations_ = 0;
  uint64_t backend_switches_ = 0;
  // The highest workspace generation this process has served (what clients saw); carried into
  // every engine that replaces the current one, so generations never repeat within the group.
  uint64_t served_generation_ = 0;
  // A collective admin call without a collective id failed on this rank only: the counted tags
  // of such calls differ across ranks until the group re-forms.
  bool admin_exchange_diverged_ = false;

  // One admin operation (switch, re-init, drain) at a time.
  std::mutex admin_mu_;
  std::atomic<bool> reinit_requested_{false};

  std::mutex mu_;
  std::condition_variable cv_;
  bool shutdown_requested_ = false;
  std::string shutdown_reason_;
  int exit_code_ = 0;
};

}  // namespace arfuse
