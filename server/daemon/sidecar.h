// One arfused process: wires its parts together and shuts them down in order. The parts, each in
// its own unit: device start-up (device_startup.h: the device, the start-up self-test, the
// engine), the servers (sidecar_servers.h: the main gRPC server on a Unix socket and with
// --listen on TLS, the fd channel, the health-only probe port, health and metrics), the group
// supervisor (group_supervisor.h: formation, the vote, supervision, re-forming, the live backend
// switch, drain) and the gRPC services (Config, Fusion, Admin) they serve.
#pragma once

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/daemon/device_probe.h"
#include "server/daemon/device_startup.h"
#include "server/daemon/gated_engine.h"
#include "server/daemon/group_supervisor.h"
#include "server/daemon/options.h"
#include "server/daemon/sidecar_servers.h"

namespace arfuse {

class FusionService;

class Sidecar final {
 public:
  explicit Sidecar(DaemonOptions options);
  ~Sidecar();
  Sidecar(const Sidecar&) = delete;
  Sidecar& operator=(const Sidecar&) = delete;

  // Binds the Unix socket, the health port and the metrics port, starts the servers, and starts
  // the group supervisor in the background (readiness stays NOT_SERVING until the group is
  // complete). INVALID_ARGUMENT / ALREADY_EXISTS / UNAVAILABLE / FAILED_PRECONDITION name the
  // problem; the caller exits with 2.
  absl::Status Start();

  int health_port() const { return servers_ == nullptr ? 0 : servers_->health_port(); }
  int metrics_port() const { return servers_ == nullptr ? -1 : servers_->metrics_port(); }
  const std::string& socket_path() const { return options_.socket; }

  // Begins a graceful shutdown (readiness NOT_SERVING, in-flight calls get the grace period).
  // Safe to call from any thread, more than once.
  void RequestShutdown(const std::string& why);

  // Blocks until shutdown completes; returns the process exit code. The group supervisor may
  // still be waiting for peers (bounded by --peer-timeout); the caller exits without joining it.
  int Wait();

 private:
  config::Topology OwnTopology() const;
  // The services of the main servers: Config, Fusion (kept in fusion_) and Admin.
  absl::Status MakeServices(const config::FusionFlags& flags);
  void ShutdownNow();

  DaemonOptions options_;
  GpuProbe gpu_;
  DeviceReport device_;
  absl::Time started_ = absl::Now();
  GatedEngine gate_;
  std::unique_ptr<SidecarServers> servers_;
  std::unique_ptr<FusionService> fusion_;
  std::vector<std::unique_ptr<grpc::Service>> services_;
  std::unique_ptr<GroupSupervisor> supervisor_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool shutdown_requested_ = false;
  std::string shutdown_reason_;
  int exit_code_ = 0;
};

}  // namespace arfuse
