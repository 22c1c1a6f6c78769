#include "server/daemon/sidecar.h"

#include <sys/stat.h>

#include <chrono>


#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/core/status_macros.h"
#include "server/daemon/unix_socket.h"
#include "server/engine/engine.h"
#include "server/peers/exchange.h"
#include "server/services/health/health_service.h"
#include "server/core/log.h"
#include "spdlog/spdlog.h"

namespace arfuse {

Sidecar::Sidecar(DaemonOptions options) : options_(std::move(options)) {}

Sidecar::~Sidecar() {
  RequestShutdown("destroyed");
  if (init_thread_.joinable()) init_thread_.join();
}

absl::Status Sidecar::Start() {
  const bool default_socket = options_.sources["socket"] == "default";
  ARFUSE_RETURN_IF_ERROR(PrepareUnixSocketPath(options_.socket, default_socket));

  gpu_ = ProbeGpu(options_.gpu >= 0 ? options_.gpu : 0);
  if (options_.device.empty()) options_.device = gpu_.device_count > 0 ? "cuda" : "host";
  if (options_.device == "cuda" && gpu_.device_count == 0) {
    return absl::FailedPreconditionError(
        "--device=cuda but no GPU is visible (use --device=host on machines without a GPU)");
  }
  if (options_.device == "cuda" && options_.gpu < 0) {
    options_.gpu = options_.rank % gpu_.device_count;
    gpu_ = ProbeGpu(options_.gpu);
  }

  health_main_ = std::make_unique<HealthService>(&health_);
  health_probe_ = std::make_unique<HealthService>(&health_);
  // Liveness answers as soon as the process serves; readiness waits for the group.
  health_.Set("", true);
  health_.Set(kReadinessService, false);

  // The health-only server: plaintext TCP for Kubernetes probes, nothing but grpc.health.v1.
  {
    grpc::ServerBuilder builder;
    // gRPC sets SO_REUSEPORT by default, which would let a second process share a port in use.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.AddListeningPort(absl::StrCat(options_.health_host, ":", options_.health_port),
                             grpc::InsecureServerCredentials(), &health_port_);
    builder.RegisterService(health_probe_.get());
    health_server_ = builder.BuildAndStart();
    if (health_server_ == nullptr || health_port_ == 0) {
      health_server_.reset();
      return absl::UnavailableError(absl::StrCat("cannot listen on health port ",
                                                 options_.health_host, ":", options_.health_port,
                                                 " (in use or not permitted)"));
    }
  }

  {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("unix:", options_.socket),
                             grpc::InsecureServerCredentials());
    // Requests are small (handles, shapes, ids); nothing legitimate comes near 1 MiB.
    builder.SetMaxReceiveMessageSize(1 << 20);
    builder.RegisterService(health_main_.get());
    for (auto& service : services_) builder.RegisterService(service.get());
    main_server_ = builder.BuildAndStart();
    if (main_server_ == nullptr) {
      health_server_->Shutdown();
      return absl::UnavailableError(absl::StrCat("cannot listen on unix:", options_.socket));
    }
    // Owner and group only: whoever can reach the socket can hand us device memory to write.
    ::chmod(options_.socket.c_str(), 0660);
  }

  spdlog::info("event=listening socket={} health_port={} device={} rank={} world_size={} sm={}",
               options_.socket, health_port_, options_.device, options_.rank,
               options_.world_size, gpu_.sm);
  init_thread_ = std::thread([this] { InitializeGroup(); });
  return absl::OkStatus();
}

void Sidecar::SetReadiness(bool serving) { health_.Set(kReadinessService, serving); }

void Sidecar::RequestShutdown(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (shutdown_requested_) return;
  shutdown_requested_ = true;
  shutdown_reason_ = why;
  cv_.notify_all();
}

int Sidecar::Wait() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return shutdown_requested_; });
  }
  ShutdownNow();
  return exit_code_;
}

void Sidecar::ShutdownNow() {
  spdlog::info("event=shutdown_begin reason=\"{}\" grace_s={}", shutdown_reason_,
               options_.grace_period_s);
  SetReadiness(false);
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(options_.grace_period_s * 1e3));
  // In-flight calls get the grace period; after it gRPC cancels them. Spins are then aborted so
  // no handler stays blocked on a peer that will never come.
  std::thread aborter([this, deadline] {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [this] { return main_server_ == nullptr; });
    if (Engine* engine = engine_ptr_.load()) engine->Abort();
  });
  if (main_server_ != nullptr) main_server_->Shutdown(deadline);
  if (Engine* engine = engine_ptr_.load()) engine->Abort();
  health_.Shutdown();
  if (health_server_ != nullptr) health_server_->Shutdown(std::chrono::system_clock::now());
  {
    std::lock_guard<std::mutex> lock(mu_);
    main_server_.reset();
    cv_.notify_all();
  }
  aborter.join();
  if (init_thread_.joinable()) init_thread_.join();
  health_server_.reset();
  spdlog::info("event=shutdown_done exit_code={}", exit_code_);
}

}  // namespace arfuse
