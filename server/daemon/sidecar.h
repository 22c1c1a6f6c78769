// One arfused process: the main gRPC server on a Unix socket, the health-only server on a TCP
// port, the group's initialization (peers, config decision and vote, engine) and shutdown.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/service_type.h>

#include "absl/status/status.h"
#include "server/daemon/device_probe.h"
#include "server/daemon/options.h"
#include "server/services/health/health_service.h"

namespace arfuse {

class Engine;
class Exchange;

// The readiness entry of the health service (the main API's service name).
inline constexpr char kReadinessService[] = "arfuse.v1.Fusion";

class Sidecar {
 public:
  explicit Sidecar(DaemonOptions options);
  ~Sidecar();
  Sidecar(const Sidecar&) = delete;
  Sidecar& operator=(const Sidecar&) = delete;

  // Binds the Unix socket and the health port, starts both servers, and starts the group's
  // initialization in the background (readiness stays NOT_SERVING until it completes).
  // INVALID_ARGUMENT / ALREADY_EXISTS / UNAVAILABLE name the problem; the caller exits with 2.
  absl::Status Start();

  int health_port() const { return health_port_; }
  const std::string& socket_path() const { return options_.socket; }

  // Begins a graceful shutdown (readiness NOT_SERVING, in-flight calls get the grace period).
  // Safe to call from any thread, more than once.
  void RequestShutdown(const std::string& why);

  // Blocks until shutdown completes; returns the process exit code.
  int Wait();

 private:
  void InitializeGroup();
  void SetReadiness(bool serving);
  void ShutdownNow();

  DaemonOptions options_;
  GpuProbe gpu_;
  int health_port_ = 0;
  HealthState health_;
  std::unique_ptr<HealthService> health_main_;
  std::unique_ptr<HealthService> health_probe_;
  std::unique_ptr<grpc::Server> main_server_;
  std::unique_ptr<grpc::Server> health_server_;
  std::vector<std::unique_ptr<grpc::Service>> services_;
  std::unique_ptr<Exchange> exchange_;
  std::unique_ptr<Engine> engine_;
  std::atomic<Engine*> engine_ptr_{nullptr};
  std::thread init_thread_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool shutdown_requested_ = false;
  std::string shutdown_reason_;
  int exit_code_ = 0;
};

}  // namespace arfuse
