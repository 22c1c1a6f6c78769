#include "server/daemon/sidecar.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "server/daemon/unix_listener.h"
#include "server/fdpass/ticket_broker.h"
#include "server/peers/peer_tls.h"
#include "server/services/config/config_service.h"
#include "server/services/fusion/fusion_service.h"
#include "spdlog/spdlog.h"

namespace arfuse {

Sidecar::Sidecar(DaemonOptions options) : options_(std::move(options)) {}

Sidecar::~Sidecar() {
  // The supervisor may be blocked joining peers; the process exits without waiting for it.
  RequestShutdown("destroyed");
}

config::Topology Sidecar::OwnTopology() const {
  return config::Topology{options_.sm.value_or(gpu_.sm), options_.world_size, options_.nnodes};
}

absl::Status Sidecar::Start() {
  // The TCP peer channel (--peer-addr) authenticates with these every time the group forms: a
  // certificate that cannot load stops the sidecar now instead of leaving a group that never
  // forms.
  if (!options_.peer_addr.empty()) {
    absl::StatusOr<std::shared_ptr<const peers::PeerTls>> tls =
        peers::PeerTls::Load(options_.peer_tls_files());
    if (!tls.ok()) return tls.status();
  }
  servers_ = std::make_unique<SidecarServers>(options_);
  ARFUSE_RETURN_IF_ERROR(servers_->PrepareSockets());
  ARFUSE_ASSIGN_OR_RETURN(gpu_, SelectDevice(&options_));

  // The deprecated flag and enforce-disable are migrated once, with warnings in the log.
  config::MigratedFlags migrated = config::MigrateFlags(options_.fusion);
  for (const auto& w : migrated.warnings) spdlog::warn("event=flag_migration warning=\"{}\"", w);
  // A configuration the rules refuse (sglang-29063's ValueErrors) stops the sidecar at startup,
  // as it stops SGLang's server, instead of leaving a group that never fuses.
  if (OwnTopology().sm != 0) {
    absl::StatusOr<config::Decision> own = config::ResolveBackend(migrated.flags, OwnTopology());
    if (!own.ok()) return own.status();
  }

  ARFUSE_RETURN_IF_ERROR(servers_->StartMetrics());
  // MPS and the doorbell hop (docs/doorbell.md), once before the engine starts.
  if (std::optional<DeviceReport> report = ProbeDevice(options_)) {
    device_ = *report;
    servers_->metrics().SetMps(device_.mps_detected, device_.doorbell_hop_us * 1e-6);
  }

  // Every eager op, by backend, path and a short reason class (low-cardinality labels only).
  gate_.SetOpObserver(
      [this](const OpArgs& op, const absl::StatusOr<OpOutcome>& result, absl::Duration elapsed) {
        OpSample sample;
        sample.plane = "eager";
        supervisor_->LabelOp(result.ok(), &sample);
        sample.ok = result.ok();
        sample.path = result.ok() ? ExecPathName(result->path) : "none";
        sample.latency_s = absl::ToDoubleSeconds(elapsed);
        sample.bytes = static_cast<uint64_t>(op.num_tokens) * op.hidden * DTypeSize(op.dtype);
        servers_->metrics().RecordOp(sample);
      });
  ARFUSE_RETURN_IF_ERROR(MakeServices(migrated.flags));
  std::vector<grpc::Service*> services = {fusion_.get()};
  for (auto& service : services_) services.push_back(service.get());
  ARFUSE_RETURN_IF_ERROR(servers_->Start(services));

  spdlog::info(
      "event=listening socket={} fd_socket={} health_port={} metrics_port={} device={} gpu={} "
      "rank={} world_size={} nnodes={} sm={} max_connections={} max_pending_fds={} "
      "max_pending_fds_per_uid={}",
      options_.socket, servers_->fd_socket(), health_port(), metrics_port(), options_.device,
      options_.gpu, options_.rank, options_.world_size, options_.nnodes, OwnTopology().sm,
      ConnectionBudget(), servers_->fd_tickets()->options().max_fds,
      servers_->fd_tickets()->options().max_fds_per_uid);
  if (OwnTopology().sm == 0) {
    spdlog::warn("event=no_gpu_architecture reason=\"{}\"", kNoGpuArchitectureReason);
  }
  supervisor_->Start();
  return absl::OkStatus();
}

absl::Status Sidecar::MakeServices(const config::FusionFlags& flags) {
  ConfigServiceOptions config_options;
  config_options.topology = OwnTopology();
  config_options.flags = flags;
  {
    auto mode = config::ParseCudaGraphMode(options_.cuda_graph_mode);
    config_options.capture.mode = mode.ok() ? *mode : config::CudaGraphMode::kFull;
  }
  config_options.capture.mnnvl_capture_safe = options_.mnnvl_capture_safe;
  config_options.snapshot = [this]() -> absl::StatusOr<ConfigSnapshot> {
    ARFUSE_ASSIGN_OR_RETURN(config::Decision decision, supervisor_->Decided());
    ConfigSnapshot snap;
    snap.decision = std::move(decision);
    snap.device = options_.device == "cuda" ? v1::DEVICE_KIND_CUDA : v1::DEVICE_KIND_HOST;
    snap.rank = options_.rank;
    snap.world_size = options_.world_size;
    snap.mps_detected = device_.mps_detected;
    snap.doorbell_hop_us = device_.doorbell_hop_us;
    snap.workspace_max_tokens = static_cast<uint32_t>(options_.max_tokens);
    return snap;
  };
  services_.push_back(std::make_unique<ConfigService>(std::move(config_options)));

  FusionServiceOptions fusion_options;
  fusion_options.device = options_.device == "cuda" ? MemoryKind::kCudaIpc : MemoryKind::kHostShm;
  fusion_options.device_id = options_.device == "cuda" ? options_.gpu : 0;
  fusion_options.rank = options_.rank;
  fusion_options.world_size = options_.world_size;
  fusion_options.nnodes = options_.nnodes;
  fusion_options.default_deadline = absl::Seconds(options_.default_deadline_s);
  fusion_options.max_tokens = options_.max_tokens;
  fusion_options.max_hidden = options_.hidden;
  fusion_options.sm = OwnTopology().sm;
  fusion_options.mps_detected = device_.mps_detected;
  fusion_options.doorbell_hop_us = device_.doorbell_hop_us;
  if (options_.dtype == "fp16") fusion_options.dtype = DType::kFP16;
  if (options_.dtype == "fp32") fusion_options.dtype = DType::kFP32;
  fusion_options.callers = servers_->connections();
  fusion_options.fd_tickets = servers_->fd_tickets();
  fusion_options.fd_socket = servers_->fd_socket();
  ARFUSE_ASSIGN_OR_RETURN(fusion_,
                          FusionService::Create(fusion_options, [this] { return &gate_; }));
  // The region gauges follow the registry: register, unregister, and a client's session end.
  fusion_->registry().SetTotalsObserver([m = &servers_->metrics()](const RegistryTotals& t) {
    m->SetRegions(t.regions, t.region_bytes);
  });

  GroupSupervisorContext context;
  context.options = &options_;
  context.topology = OwnTopology();
  context.flags = flags;
  context.gate = &gate_;
  context.metrics = &servers_->metrics();
  context.fusion = fusion_.get();
  context.started = started_;
  context.set_readiness = [this](bool serving) { servers_->SetReadiness(serving); };
  context.serving = [this] { return servers_->serving(); };
  context.exit_for_restart = [this](const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      exit_code_ = 1;
    }
    RequestShutdown(why);
  };
  supervisor_ = std::make_unique<GroupSupervisor>(std::move(context));
  // No Peer service here: the peer protocol runs on the peer channel's own sockets, between
  // sidecars that prove they belong to the group; the client socket never reaches it.
  services_.push_back(std::make_unique<AdminService>(supervisor_.get(),
                                                     absl::Seconds(options_.default_deadline_s)));
  return absl::OkStatus();
}

void Sidecar::RequestShutdown(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_requested_) return;
    shutdown_requested_ = true;
    shutdown_reason_ = why;
    cv_.notify_all();
  }
  if (supervisor_ != nullptr) supervisor_->Stop();
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
  servers_->SetReadiness(false);
  const auto deadline =
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(options_.grace_period_s * 1e3));
  // Ops in flight get the grace period to finish; after it every spin is aborted so no handler
  // stays blocked on a peer that will never come, and gRPC cancels what is left.
  std::thread aborter([this, deadline] {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [this] { return !servers_->main_running(); });
    gate_.Abort();
  });
  servers_->StopUnixListener();
  // Clients launching in-stream stop first (bounded by the grace period): their launches finish
  // before the workspace's abort.
  if (fusion_ != nullptr) {
    fusion_->DrainInStream("sidecar shutting down",
                           std::min(absl::FromChrono(deadline), absl::Now() + absl::Seconds(2)));
  }
  servers_->StopFdListener();
  // Clients hold their Fusion.Session stream open for as long as they are connected, and
  // Server::Shutdown waits for every call: ending the sessions first (UNAVAILABLE, "sidecar
  // shutting down") lets the process exit as soon as the ops in flight are done instead of after
  // the whole grace period.
  if (fusion_ != nullptr) fusion_->BeginShutdown();
  // Every unary call in flight gets the grace period; once none is left (and the ended Session
  // streams are done) the server stops at once instead of draining idle connections.
  while (std::chrono::system_clock::now() < deadline &&
         (servers_->unary_calls() > 0 || (fusion_ != nullptr && fusion_->open_sessions() > 0))) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  servers_->ShutdownMain(
      std::min(deadline, std::chrono::system_clock::now() + std::chrono::milliseconds(100)));
  if (fusion_ != nullptr) fusion_->Shutdown();
  gate_.Abort();
  servers_->ShutdownProbe();
  {
    std::lock_guard<std::mutex> lock(mu_);
    servers_->ReleaseMain();
    cv_.notify_all();
  }
  aborter.join();
  servers_->ReleaseProbe();
  spdlog::info("event=shutdown_done exit_code={}", exit_code_);
}

}  // namespace arfuse
