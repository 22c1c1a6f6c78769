#include "server/daemon/sidecar.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/server_posix.h"
#include "grpcpp/support/server_interceptor.h"
#include "server/core/log.h"
#include "server/core/status_macros.h"
#include "server/core/version.h"
#include "server/daemon/unix_listener.h"
#include "server/daemon/unix_socket.h"
#include "server/doorbell/doorbell_report.h"
#include "server/fdpass/connection_table.h"
#include "server/fdpass/fd_channel_client.h"
#include "server/fdpass/fd_channel_server.h"
#include "server/fdpass/ticket_broker.h"
#include "server/gpu/mps.h"
#include "server/metrics/metrics.h"
#include "server/peers/exchange.h"
#include "server/services/config/config_service.h"
#include "server/services/fusion/fusion_service.h"
#include "spdlog/spdlog.h"
#if ARFUSE_HAVE_CUDA
#include "server/doorbell/self_test.h"
#include "server/gpu/mps_driver.h"
#endif

namespace arfuse {
namespace {

// Counts the unary calls in flight on the main server. Streams are left out: clients hold their
// Session stream for as long as they are connected (FusionService::BeginShutdown ends those) and
// health Watch streams never end by themselves. Shutdown waits for this count, not for gRPC's
// own drain, which also waits for every idle connection to answer its GOAWAY ping (seconds for a
// client that is not reading its connection).
class UnaryCallCounter final : public grpc::experimental::Interceptor {
 public:
  explicit UnaryCallCounter(std::atomic<int64_t>* calls) : calls_(calls) {
    calls_->fetch_add(1, std::memory_order_relaxed);
  }
  ~UnaryCallCounter() override { calls_->fetch_sub(1, std::memory_order_release); }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    methods->Proceed();
  }

 private:
  std::atomic<int64_t>* const calls_;
};

class UnaryCallCounterFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit UnaryCallCounterFactory(std::atomic<int64_t>* calls) : calls_(calls) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    if (info->type() != grpc::experimental::ServerRpcInfo::Type::UNARY) return nullptr;
    return new UnaryCallCounter(calls_);
  }

 private:
  std::atomic<int64_t>* const calls_;
};

// gRPC server reflection (grpc.reflection.v1alpha.ServerReflection), so that grpcurl and other
// generic clients list and call the services without the .proto files. Linking the reflection
// library registers it for every server of the process; this option decides per server: the
// main socket serves it, the health port (grpc.health.v1 only, plaintext TCP) does not.
class ReflectionOption final : public grpc::ServerBuilderOption {
 public:
  explicit ReflectionOption(bool serve) : serve_(serve) {}
  void UpdateArguments(grpc::ChannelArguments* /*args*/) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    const std::string name = grpc::reflection::ProtoServerReflectionPlugin().name();
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [&](const auto& p) { return p->name() == name; }),
                   plugins->end());
    if (serve_)
      plugins->push_back(std::make_unique<grpc::reflection::ProtoServerReflectionPlugin>());
  }

 private:
  const bool serve_;
};

}  // namespace

Sidecar::Sidecar(DaemonOptions options) : options_(std::move(options)) {}

Sidecar::~Sidecar() {
  RequestShutdown("destroyed");
  // The supervisor may be blocked joining peers; the process exits without waiting for it.
  if (supervisor_.joinable()) supervisor_.detach();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Sidecar::MutualTlsCredentials() const {
  auto read = [](const std::string& flag, const std::string& path) -> absl::StatusOr<std::string> {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    if (!in || ss.str().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read ", path));
    }
    return ss.str();
  };
  grpc::SslServerCredentialsOptions tls(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ARFUSE_ASSIGN_OR_RETURN(pair.private_key, read("tls-key", options_.tls_key));
  ARFUSE_ASSIGN_OR_RETURN(pair.cert_chain, read("tls-cert", options_.tls_cert));
  ARFUSE_ASSIGN_OR_RETURN(tls.pem_root_certs, read("tls-client-ca", options_.tls_client_ca));
  tls.pem_key_cert_pairs.push_back(std::move(pair));
  return grpc::SslServerCredentials(tls);
}

int Sidecar::metrics_port() const {
  return metrics_ == nullptr || options_.metrics_port < 0 ? -1 : metrics_->port();
}

config::Topology Sidecar::OwnTopology() const {
  return config::Topology{options_.sm.value_or(gpu_.sm), options_.world_size, options_.nnodes};
}

config::FusionFlags Sidecar::OwnFlags() const {
  config::FusionFlags flags;
  flags.backend = options_.fusion_backend;
  flags.enable_deprecated = options_.enable_flashinfer_allreduce_fusion;
  flags.enforce_disable = options_.enforce_disable_fusion;
  flags.deterministic = options_.deterministic;
  // Validated by ParseDaemonCommandLine.
  flags.rules = config::ParseRuleSet(options_.fusion_rules).value_or(config::kDefaultRuleSet);
  flags.model_architecture = options_.model_architecture;
  flags.dp_attention = options_.enable_dp_attention;
  flags.moe_a2a_backend = options_.moe_a2a_backend;
  return flags;
}

absl::Status Sidecar::Start() {
  const bool default_socket = options_.sources["socket"] == "default";
  ARFUSE_RETURN_IF_ERROR(PrepareUnixSocketPath(options_.socket, default_socket));
  const std::string fd_socket = FdChannelPath(options_.socket);
  ARFUSE_RETURN_IF_ERROR(PrepareUnixSocketPath(fd_socket, /*create_dir=*/false));

  gpu_ = ProbeGpu(options_.gpu >= 0 ? options_.gpu : 0);
  if (options_.device.empty()) options_.device = gpu_.device_count > 0 ? "cuda" : "host";
  if (options_.device == "cuda" && gpu_.device_count == 0) {
    return absl::FailedPreconditionError(
        "--device=cuda but no GPU is visible (use --device=host on machines without a GPU)");
  }
  if (options_.device == "cuda") {
    if (options_.gpu < 0) options_.gpu = options_.rank % gpu_.device_count;
    if (options_.gpu >= gpu_.device_count) {
      return absl::InvalidArgumentError(absl::StrCat("--gpu=", options_.gpu, " but only ",
                                                     gpu_.device_count, " GPU(s) are visible"));
    }
    gpu_ = ProbeGpu(options_.gpu);
  }

  // The deprecated flag and enforce-disable are migrated once, with warnings in the log.
  config::MigratedFlags migrated = config::MigrateFlags(OwnFlags());
  for (const auto& w : migrated.warnings) spdlog::warn("event=flag_migration warning=\"{}\"", w);
  flags_ = migrated.flags;
  // A configuration the rules refuse (sglang-29063's ValueErrors) stops the sidecar at startup,
  // as it stops SGLang's server, instead of leaving a group that never fuses.
  if (OwnTopology().sm != 0) {
    absl::StatusOr<config::Decision> own = config::ResolveBackend(flags_, OwnTopology());
    if (!own.ok()) return own.status();
  }

  metrics_ = std::make_unique<Metrics>(
      options_.rank, options_.world_size, options_.device,
      Metrics::BuildLabels{kVersion, kGitRevision, absl::StrCat(kApiMajor, ".", kApiMinor)});
  if (options_.metrics_port >= 0) {
    ARFUSE_RETURN_IF_ERROR(metrics_->Serve(options_.metrics_host, options_.metrics_port));
  }

  // MPS and the doorbell hop (docs/doorbell.md), once before the engine starts: negotiation
  // (Config snapshot), GetWorkspaceInfo, metrics and one log line report them.
  double doorbell_hop_us = 0;
  if (options_.device == "cuda") {
#if ARFUSE_HAVE_CUDA
    const MpsInfo mps = DetectMpsOnDevice(options_.gpu);  // the driver's answer first (mps.h)
#else
    const MpsInfo mps = DetectMps();
#endif
    mps_detected_ = mps.active();
    DoorbellHopReport hop;
#if ARFUSE_HAVE_CUDA
    DoorbellSelfTestOptions self_test;
    self_test.device = options_.gpu;
    self_test.ops = 200;
    self_test.repeats = 3;
    self_test.timeout = absl::Seconds(5);
    absl::StatusOr<DoorbellHopReport> measured = RunDoorbellSelfTest(self_test);
    if (measured.ok()) {
      hop = *measured;
    } else {
      hop.error = std::string(measured.status().message());
    }
#else
    hop.error = "this arfused was built without CUDA";
#endif
    if (hop.measured) doorbell_hop_us = hop.hop_us;
    metrics_->SetMps(mps_detected_, doorbell_hop_us * 1e-6);
    spdlog::info("event=doorbell_self_test gpu={} result=\"{}\" {}", options_.gpu,
                 DescribeDoorbell(hop, mps_detected_), mps.Describe());
  }

  // Every eager op, by backend, path and a short reason class (low-cardinality labels only).
  gate_.SetOpObserver(
      [this](const OpArgs& op, const absl::StatusOr<OpOutcome>& result, absl::Duration elapsed) {
        OpSample sample;
        sample.plane = "eager";
        {
          std::lock_guard<std::mutex> lock(state_mu_);
          sample.backend = decided_ ? decision_.backend : "none";
          sample.reason = !result.ok()                           ? "error"
                          : decided_ && decision_.fusion_enabled ? "dispatch"
                                                                 : "fusion_disabled";
        }
        sample.ok = result.ok();
        sample.path = result.ok() ? ExecPathName(result->path) : "none";
        sample.latency_s = absl::ToDoubleSeconds(elapsed);
        sample.bytes = static_cast<uint64_t>(op.num_tokens) * op.hidden * DTypeSize(op.dtype);
        metrics_->RecordOp(sample);
      });
  health_main_ = std::make_unique<HealthService>(&health_);
  health_probe_ = std::make_unique<HealthService>(&health_);
  // Liveness answers as soon as the process serves; readiness waits for the group.
  health_.Set("", true);
  health_.Set(kReadinessService, false);

  // Services of the main socket.
  ConfigServiceOptions config_options;
  config_options.topology = OwnTopology();
  config_options.flags = flags_;
  {
    auto mode = config::ParseCudaGraphMode(options_.cuda_graph_mode);
    config_options.capture.mode = mode.ok() ? *mode : config::CudaGraphMode::kFull;
  }
  config_options.capture.mnnvl_capture_safe = options_.mnnvl_capture_safe;
  config_options.snapshot = [this, doorbell_hop_us]() -> absl::StatusOr<ConfigSnapshot> {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (!decided_) {
      return absl::UnavailableError(
          absl::StrCat("the group has not decided yet: ", not_ready_reason_));
    }
    ConfigSnapshot snap;
    snap.decision = decision_;
    snap.device = options_.device == "cuda" ? v1::DEVICE_KIND_CUDA : v1::DEVICE_KIND_HOST;
    snap.rank = options_.rank;
    snap.world_size = options_.world_size;
    snap.mps_detected = mps_detected_;
    snap.doorbell_hop_us = doorbell_hop_us;
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
  fusion_options.mps_detected = mps_detected_;
  fusion_options.doorbell_hop_us = doorbell_hop_us;
  if (options_.dtype == "fp16") fusion_options.dtype = DType::kFP16;
  if (options_.dtype == "fp32") fusion_options.dtype = DType::kFP32;
  connections_ = std::make_unique<ConnectionTable>();
  fd_tickets_ = std::make_unique<FdTicketBroker>();
  fusion_options.callers = connections_.get();
  fusion_options.fd_tickets = fd_tickets_.get();
  fusion_options.fd_socket = fd_socket;
  ARFUSE_ASSIGN_OR_RETURN(fusion_,
                          FusionService::Create(fusion_options, [this] { return &gate_; }));
  // The region gauges follow the registry: register, unregister, and a client's session end.
  fusion_->registry().SetTotalsObserver(
      [m = metrics_.get()](const RegistryTotals& t) { m->SetRegions(t.regions, t.region_bytes); });
  // No Peer service here: the peer protocol runs on the peer channel's own sockets, between
  // sidecars that prove they belong to the group; the client socket never reaches it.
  services_.push_back(
      std::make_unique<AdminService>(this, absl::Seconds(options_.default_deadline_s)));

  // The health-only server: plaintext TCP for Kubernetes probes, nothing but grpc.health.v1.
  {
    grpc::ServerBuilder builder;
    // gRPC sets SO_REUSEPORT by default, which would let a second process share a port in use.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.AddListeningPort(absl::StrCat(options_.health_host, ":", options_.health_port),
                             grpc::InsecureServerCredentials(), &health_port_);
    builder.SetOption(std::make_unique<ReflectionOption>(false));
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
    UnixListenerOptions listen;
    for (const auto& uid : options_.allowed_uids) listen.policy.uids.insert(std::stoul(uid));
    for (const auto& gid : options_.allowed_gids) listen.policy.gids.insert(std::stoul(gid));
    listen.table = connections_.get();
    listen.max_connections_per_uid = static_cast<size_t>(options_.max_connections_per_uid);
    // Connections on both sockets together leave descriptors in reserve for the health port.
    listen.max_connections = ConnectionBudget();
    // Owner and group only (0660), and then only allowed users: whoever can reach the socket
    // can hand us device memory to write.
    absl::StatusOr<std::unique_ptr<UnixListener>> listener =
        UnixListener::Bind(options_.socket, listen);
    if (!listener.ok()) {
      health_server_->Shutdown();
      return listener.status();
    }
    unix_listener_ = *std::move(listener);
    // The fd channel: the same users, the same caps, its own socket and thread.
    absl::StatusOr<std::unique_ptr<FdChannelServer>> fd_channel =
        FdChannelServer::Start(fd_tickets_.get(), FdChannelServerOptions{});
    UnixListenerOptions fd_listen = listen;
    fd_listen.channel = ConnectionTable::Channel::kFd;
    fd_listen.label = "fd";
    absl::StatusOr<std::unique_ptr<UnixListener>> fd_listener =
        fd_channel.ok() ? UnixListener::Bind(fd_socket, fd_listen)
                        : absl::StatusOr<std::unique_ptr<UnixListener>>(fd_channel.status());
    if (!fd_listener.ok()) {
      health_server_->Shutdown();
      return fd_listener.status();
    }
    fd_channel_ = *std::move(fd_channel);
    fd_listener_ = *std::move(fd_listener);
    grpc::ServerBuilder builder;
    int tcp_port = 0;
    if (!options_.listen.empty()) {
      absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> tls = MutualTlsCredentials();
      if (!tls.ok()) {
        health_server_->Shutdown();
        return tls.status();
      }
      builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
      builder.AddListeningPort(options_.listen, *tls, &tcp_port);
    }
    // Requests are small (handles, shapes, ids); nothing legitimate comes near 1 MiB.
    builder.SetMaxReceiveMessageSize(1 << 20);
    // Metadata: gRPC 1.51 closes the whole connection (not just the call) when a call's metadata
    // exceeds this limit, and with it the caller's session, regions and plans. Its default of
    // 8 KiB is within reach of a client's own tracing headers; 64 KiB is not, and still bounds
    // what one header block may make the sidecar hold (docs/security.md).
    builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, kMaxMetadataBytes);
    // Clients ping every 10 s (at most every 1 s) to keep an idle session stream open. gRPC's
    // default ping policy (one ping per 5 min while the server sends no data, three strikes)
    // closes such a connection after ~30 s of idleness, and with it the session and every region
    // the client registered. A sidecar thawed after a stall (SIGSTOP, a debugger, a frozen
    // cgroup) also reads every ping queued meanwhile at once. So: pings as often as the clients
    // may send them, also with no call open, and no strike limit. Callers are authenticated
    // (SO_PEERCRED on the socket, mTLS on TCP), so unlimited pings are no abuse vector.
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
    {
      std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> counters;
      counters.push_back(std::make_unique<UnaryCallCounterFactory>(&unary_calls_));
      builder.experimental().SetInterceptorCreators(std::move(counters));
    }
    builder.SetOption(std::make_unique<ReflectionOption>(true));
    builder.RegisterService(health_main_.get());
    builder.RegisterService(fusion_.get());
    for (auto& service : services_) builder.RegisterService(service.get());
    main_server_ = builder.BuildAndStart();
    if (main_server_ == nullptr || (!options_.listen.empty() && tcp_port == 0)) {
      health_server_->Shutdown();
      if (main_server_ != nullptr) main_server_->Shutdown();
      main_server_.reset();
      return absl::UnavailableError(
          options_.listen.empty()
              ? std::string("cannot start the main gRPC server")
              : absl::StrCat("cannot listen on ", options_.listen, " (in use or not permitted)"));
    }
    unix_listener_->Serve([server = main_server_.get()](UniqueFd conn, const SocketCredentials&) {
      // gRPC owns the descriptor from here on and names the connection "fd:<n>".
      grpc::AddInsecureChannelFromFd(server, conn.release());
    });
    fd_listener_->Serve([channel = fd_channel_.get()](UniqueFd conn, const SocketCredentials& c) {
      channel->Adopt(std::move(conn), c);
    });
    if (tcp_port != 0) {
      spdlog::info("event=listening_tls address={} port={}", options_.listen, tcp_port);
    }
  }

  spdlog::info(
      "event=listening socket={} fd_socket={} health_port={} metrics_port={} device={} gpu={} "
      "rank={} world_size={} nnodes={} sm={} max_connections={}",
      options_.socket, fd_socket, health_port_, metrics_port(), options_.device, options_.gpu,
      options_.rank, options_.world_size, options_.nnodes, OwnTopology().sm, ConnectionBudget());
  if (OwnTopology().sm == 0) {
    spdlog::warn("event=no_gpu_architecture reason=\"{}\"", kNoGpuArchitectureReason);
  }
  supervisor_ = std::thread([this] { SuperviseGroup(); });
  return absl::OkStatus();
}

void Sidecar::SetReadiness(bool serving) {
  health_.Set(kReadinessService, serving);
  metrics_->SetReady(serving);
}

bool Sidecar::ShutdownRequested() {
  std::lock_guard<std::mutex> lock(mu_);
  return shutdown_requested_;
}

void Sidecar::WaitFor(absl::Duration d) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, absl::ToChronoNanoseconds(d),
               [this] { return shutdown_requested_ || reinit_requested_.load(); });
}

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
  const auto deadline =
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(options_.grace_period_s * 1e3));
  // Ops in flight get the grace period to finish; after it every spin is aborted so no handler
  // stays blocked on a peer that will never come, and gRPC cancels what is left.
  std::thread aborter([this, deadline] {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [this] { return main_server_ == nullptr; });
    gate_.Abort();
  });
  if (unix_listener_ != nullptr) unix_listener_->Stop();
  // Clients launching in-stream stop first (bounded by the grace period): their launches finish
  // before the workspace's abort.
  if (fusion_ != nullptr) {
    fusion_->DrainInStream("sidecar shutting down",
                           std::min(absl::FromChrono(deadline), absl::Now() + absl::Seconds(2)));
  }
  if (fd_listener_ != nullptr) fd_listener_->Stop();
  // Clients hold their Fusion.Session stream open for as long as they are connected, and
  // Server::Shutdown waits for every call: ending the sessions first (UNAVAILABLE, "sidecar
  // shutting down") lets the process exit as soon as the ops in flight are done instead of after
  // the whole grace period.
  if (fusion_ != nullptr) fusion_->BeginShutdown();
  // Every unary call in flight gets the grace period; once none is left (and the ended Session
  // streams are done) the server stops at once instead of draining idle connections.
  while (std::chrono::system_clock::now() < deadline &&
         (unary_calls_.load(std::memory_order_acquire) > 0 ||
          (fusion_ != nullptr && fusion_->open_sessions() > 0))) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (main_server_ != nullptr) {
    main_server_->Shutdown(
        std::min(deadline, std::chrono::system_clock::now() + std::chrono::milliseconds(100)));
  }
  if (fusion_ != nullptr) fusion_->Shutdown();
  gate_.Abort();
  health_.Shutdown();
  if (health_server_ != nullptr) health_server_->Shutdown(std::chrono::system_clock::now());
  {
    std::lock_guard<std::mutex> lock(mu_);
    main_server_.reset();
    cv_.notify_all();
  }
  aborter.join();
  health_server_.reset();
  spdlog::info("event=shutdown_done exit_code={}", exit_code_);
}

}  // namespace arfuse
