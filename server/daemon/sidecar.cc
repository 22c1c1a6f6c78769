#include "server/daemon/sidecar.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
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
#include "server/daemon/tcp_listener.h"
#include "server/daemon/tcp_server_keeper.h"
#include "server/daemon/unix_listener.h"
#include "server/daemon/unix_socket.h"
#include "server/doorbell/doorbell_report.h"
#include "server/fdpass/connection_table.h"
#include "server/fdpass/fd_channel_client.h"
#include "server/fdpass/fd_channel_server.h"
#include "server/fdpass/ticket_broker.h"
#include "server/gpu/mps.h"
#include "server/host/host_engine.h"
#include "server/instream/divergence_watch.h"
#include "server/metrics/metrics.h"
#include "server/peers/exchange.h"
#include "server/peers/local_exchange.h"
#include "server/peers/peer_exchange.h"
#include "server/services/config/config_service.h"
#include "server/services/fusion/fusion_service.h"
#include "spdlog/spdlog.h"
#if ARFUSE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "server/cuda_engine/cuda_engine.h"
#include "server/doorbell/self_test.h"
#include "server/gpu/cuda_status.h"
#include "server/gpu/device_error.h"
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

config::FusionFlags Sidecar::OwnFlags() const { return options_.fusion; }

absl::Status Sidecar::Start() {
  // The TCP peer channel (--peer-addr) authenticates with these every time the group forms: a
  // certificate that cannot load stops the sidecar now instead of leaving a group that never
  // forms.
  if (!options_.peer_addr.empty()) {
    absl::StatusOr<std::shared_ptr<const peers::PeerTls>> tls =
        peers::PeerTls::Load(options_.peer_tls_files());
    if (!tls.ok()) return tls.status();
  }

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
  // Pending descriptors are budgeted inside the reserve the connection caps leave.
  fd_tickets_ = std::make_unique<FdTicketBroker>(
      PendingFdBudget(NofileSoftLimit(), static_cast<size_t>(options_.max_pending_fds),
                      static_cast<size_t>(options_.max_pending_fds_per_uid)));
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

  // The health-only server: plaintext TCP for Kubernetes probes, nothing but grpc.health.v1. The
  // project accepts its connections (TcpListener): gRPC 1.51's own TCP listener stops for good
  // after an accept that fails with EMFILE, and the port would never answer again.
  {
    absl::StatusOr<std::unique_ptr<TcpListener>> listener =
        TcpListener::Bind(options_.health_host, options_.health_port);
    if (!listener.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "cannot listen on health port ", options_.health_host, ":", options_.health_port,
          " (in use or not permitted): ", listener.status().message()));
    }
    grpc::ServerBuilder builder;
    builder.SetOption(std::make_unique<ReflectionOption>(false));
    builder.RegisterService(health_probe_.get());
    health_server_ = builder.BuildAndStart();
    if (health_server_ == nullptr) return absl::UnavailableError("cannot start the health server");
    health_listener_ = *std::move(listener);
    health_port_ = health_listener_->port();
    health_listener_->Serve([server = health_server_.get()](UniqueFd conn) {
      grpc::AddInsecureChannelFromFd(server, conn.release());
    });
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
    // The fd channel: the same users, its own socket and thread, and its own per-uid cap, so that
    // idle fd-channel connections never lock a user out of the main socket.
    absl::StatusOr<std::unique_ptr<FdChannelServer>> fd_channel =
        FdChannelServer::Start(fd_tickets_.get(), FdChannelServerOptions{});
    UnixListenerOptions fd_listen = listen;
    fd_listen.channel = ConnectionTable::Channel::kFd;
    fd_listen.label = "fd";
    fd_listen.max_connections_per_uid = static_cast<size_t>(options_.max_fd_connections_per_uid);
    fd_listen.per_uid_flag = "--max-fd-connections-per-uid";
    absl::StatusOr<std::unique_ptr<UnixListener>> fd_listener =
        fd_channel.ok() ? UnixListener::Bind(fd_socket, fd_listen)
                        : absl::StatusOr<std::unique_ptr<UnixListener>>(fd_channel.status());
    if (!fd_listener.ok()) {
      health_server_->Shutdown();
      return fd_listener.status();
    }
    fd_channel_ = *std::move(fd_channel);
    fd_listener_ = *std::move(fd_listener);
    std::shared_ptr<grpc::ServerCredentials> tls;
    if (!options_.listen.empty()) {
      absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = MutualTlsCredentials();
      if (!creds.ok()) {
        health_server_->Shutdown();
        return creds.status();
      }
      tls = *std::move(creds);
    }
    // What every server of the main API has: the Unix sockets' (which listens on nothing: the
    // listeners hand it their connections) and, with --listen, the TLS servers.
    auto configure = [this](grpc::ServerBuilder& builder) {
      // Requests are small (handles, shapes, ids); nothing legitimate comes near 1 MiB.
      builder.SetMaxReceiveMessageSize(1 << 20);
      // Metadata: gRPC 1.51 closes the whole connection (not just the call) when a call's
      // metadata exceeds this limit, and with it the caller's session, regions and plans. Its
      // default of 8 KiB is within reach of a client's own tracing headers; 64 KiB is not, and
      // still bounds what one header block may make the sidecar hold (docs/security.md).
      builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, kMaxMetadataBytes);
      // Clients ping every 10 s (at most every 1 s) to keep an idle session stream open. gRPC's
      // default ping policy (one ping per 5 min while the server sends no data, three strikes)
      // closes such a connection after ~30 s of idleness, and with it the session and every
      // region the client registered. A sidecar thawed after a stall (SIGSTOP, a debugger, a
      // frozen cgroup) also reads every ping queued meanwhile at once. So: pings as often as the
      // clients may send them, also with no call open, and no strike limit. Callers are
      // authenticated (SO_PEERCRED on the socket, mTLS on TCP), so unlimited pings are no abuse
      // vector.
      builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
      builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
      builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
      std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> counters;
      counters.push_back(std::make_unique<UnaryCallCounterFactory>(&unary_calls_));
      builder.experimental().SetInterceptorCreators(std::move(counters));
      builder.SetOption(std::make_unique<ReflectionOption>(true));
      // Callback services only: one service object serves several servers.
      builder.RegisterService(health_main_.get());
      builder.RegisterService(fusion_.get());
      for (auto& service : services_) builder.RegisterService(service.get());
    };
    grpc::ServerBuilder builder;
    configure(builder);
    main_server_ = builder.BuildAndStart();
    if (main_server_ == nullptr) {
      health_server_->Shutdown();
      return absl::UnavailableError("cannot start the main gRPC server");
    }
    int tcp_port = 0;
    if (tls != nullptr) {
      absl::StatusOr<std::unique_ptr<TcpServerKeeper>> keeper = TcpServerKeeper::Start(
          options_.listen, [configure, tls](const std::string& address, int* bound) {
            grpc::ServerBuilder b;
            // gRPC sets SO_REUSEPORT by default, which would let a second process share the port.
            b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
            b.AddListeningPort(address, tls, bound);
            configure(b);
            return b.BuildAndStart();
          });
      if (!keeper.ok()) {
        health_server_->Shutdown();
        main_server_->Shutdown();
        main_server_.reset();
        return keeper.status();
      }
      tls_servers_ = *std::move(keeper);
      tcp_port = tls_servers_->port();
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
      "rank={} world_size={} nnodes={} sm={} max_connections={} max_pending_fds={} "
      "max_pending_fds_per_uid={}",
      options_.socket, fd_socket, health_port_, metrics_port(), options_.device, options_.gpu,
      options_.rank, options_.world_size, options_.nnodes, OwnTopology().sm, ConnectionBudget(),
      fd_tickets_->options().max_fds, fd_tickets_->options().max_fds_per_uid);
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
    const auto soon =
        std::min(deadline, std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    if (tls_servers_ != nullptr) tls_servers_->Shutdown(soon);
    main_server_->Shutdown(soon);
  }
  if (fusion_ != nullptr) fusion_->Shutdown();
  gate_.Abort();
  health_.Shutdown();
  if (health_listener_ != nullptr) health_listener_->Stop();
  if (health_server_ != nullptr) health_server_->Shutdown(std::chrono::system_clock::now());
  {
    std::lock_guard<std::mutex> lock(mu_);
    tls_servers_.reset();
    main_server_.reset();
    cv_.notify_all();
  }
  aborter.join();
  health_server_.reset();
  spdlog::info("event=shutdown_done exit_code={}", exit_code_);
}

// ---- the group supervisor ----
// Peers, the config decision and its vote, the engine; recovery after a poisoning; the live
// backend switch. Every rank runs the same steps in the same order, so the collectives (tags)
// line up across ranks.

namespace {

v1::WorkspaceState ToProtoState(WorkspaceState s) {
  return static_cast<v1::WorkspaceState>(static_cast<int>(s));
}

}  // namespace

void Sidecar::Publish(const config::Decision& decision, bool ready) {
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    decision_ = decision;
    decided_ = true;
    not_ready_reason_ = ready ? "" : not_ready_reason_;
  }
  metrics_->SetBackend(decision.backend, decision.fusion_enabled);
  SetReadiness(ready);
}

absl::StatusOr<std::unique_ptr<Engine>> Sidecar::BuildEngine(const config::Decision& decision,
                                                             absl::Time deadline) {
  EngineOptions eo;
  eo.rank = options_.rank;
  eo.world_size = options_.world_size;
  eo.nnodes = options_.nnodes;
  eo.backend = decision.fusion_enabled ? decision.backend : "none";
  eo.max_tokens = options_.max_tokens;
  eo.max_hidden = options_.hidden;
  eo.dtype = options_.dtype == "fp32"   ? DType::kFP32
             : options_.dtype == "fp16" ? DType::kFP16
                                        : DType::kBF16;
  eo.spin_timeout = absl::Seconds(options_.spin_timeout_s);
  if (!decision.fusion_enabled) eo.unfused_reason = absl::StrJoin(decision.reasons, "; ");
  std::unique_ptr<Engine> engine;
  if (options_.device == "host") {
    ARFUSE_ASSIGN_OR_RETURN(engine, MakeHostEngine(eo));
  } else {
#if ARFUSE_HAVE_CUDA
    // The engine's stream, workspace and events live on this rank's GPU (the supervisor thread's
    // current device is not it in general).
    CudaEngineOptions cuda_options;
    cuda_options.device = options_.gpu;
    cuda_options.doorbell_serve_blocks = static_cast<uint32_t>(options_.doorbell_serve_blocks);
    cuda_options.sm_budget = static_cast<uint32_t>(options_.sm_budget);
    ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<CudaEngine> cuda, MakeCudaEngine(eo, cuda_options));
    engine = std::move(cuda);
#else
    return absl::FailedPreconditionError("this arfused was built without CUDA");
#endif
  }
  // Collective: builds the workspace and votes, so all ranks fuse or none do.
  ARFUSE_RETURN_IF_ERROR(engine->Initialize(*exchange_, deadline));
  return engine;
}

absl::Status Sidecar::FormGroup() {
  const absl::Time join_deadline = absl::Now() + absl::Seconds(options_.peer_timeout_s);
  if (options_.world_size == 1) {
    exchange_ = std::move(LocalExchangeGroup::Create(1)[0]);
  } else {
    PeerOptions po;
    po.rank = options_.rank;
    po.world_size = options_.world_size;
    po.nnodes = options_.nnodes;
    po.peer_dir = options_.peer_dir.empty()
                      ? std::filesystem::path(options_.socket).parent_path().string()
                      : options_.peer_dir;
    po.rank0_address = options_.peer_addr;
    // Read again at every formation, so a renewed certificate counts from the next one on.
    if (!options_.peer_addr.empty()) po.tls = options_.peer_tls_files();
    po.group = options_.group;
    po.timeout = absl::Seconds(options_.peer_timeout_s);
    // A frozen peer keeps its connection open: heartbeats let the watch below notice it while no
    // op runs. Five per timeout, so a late one or two are no loss.
    po.heartbeat_timeout = absl::Seconds(options_.peer_heartbeat_timeout_s);
    po.heartbeat_interval = po.heartbeat_timeout / 5;
    ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<PeerExchange> peers, ConnectPeers(po));
    exchange_ = std::move(peers);
  }
  metrics_->SetPeersReady(options_.world_size);
  spdlog::info("event=group_joined rank={} world_size={}", options_.rank, options_.world_size);

  // Every rank decides alike: each resolves locally, then the group takes one decision (or none
  // for all, with every dissenting rank's reason).
  config::RankReport report;
  report.rank = options_.rank;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    report.flags = flags_;
  }
  report.topology = OwnTopology();
  if (report.topology.sm == 0) {
    // Host mode without --sm: there is no GPU architecture to resolve a backend for.
    config::Decision none;
    none.rules = report.flags.rules;
    none.reasons.push_back(kNoGpuArchitectureReason);
    report.decision = none;
  } else {
    absl::StatusOr<config::Decision> local = config::ResolveBackend(report.flags, report.topology);
    if (local.ok()) {
      report.decision = *local;
    } else {
      report.failure = std::string(local.status().message());
    }
  }
  ARFUSE_ASSIGN_OR_RETURN(
      std::vector<std::string> payloads,
      exchange_->Allgather("config-vote", config::EncodeRankReport(report), join_deadline));
  std::vector<config::RankReport> reports;
  for (const auto& p : payloads) {
    ARFUSE_ASSIGN_OR_RETURN(config::RankReport r, config::DecodeRankReport(p));
    reports.push_back(std::move(r));
  }
  ARFUSE_ASSIGN_OR_RETURN(config::Decision decision, config::Consensus(reports));
  for (const auto& w : decision.warnings) spdlog::warn("event=config_warning warning=\"{}\"", w);
  LogNoticesOncePerProcess(decision);
  spdlog::info("event=config_decided backend={} fusion_enabled={} reasons=\"{}\"", decision.backend,
               decision.fusion_enabled, absl::StrJoin(decision.reasons, "; "));

  ARFUSE_ASSIGN_OR_RETURN(const uint64_t generation_base, AgreeGenerationBase(join_deadline));
  ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, BuildEngine(decision, join_deadline));
  EngineStatus es = engine->Status();
  if (!es.fusion_enabled && decision.fusion_enabled) {
    // The workspace vote turned fusion off on every rank: report it with the engine's reason.
    decision.fusion_enabled = false;
    decision.reasons.push_back(es.reason);
  }
  metrics_->SetWorkspaceBytes(es.workspace_bytes);
  ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<Engine> previous,
                          gate_.Swap(std::move(engine), generation_base));
  previous.reset();
  const uint64_t generation = generation_base + es.generation;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    served_generation_ = std::max(served_generation_, generation);
  }
  metrics_->SetGeneration(generation);
  gate_.Resume();
  Publish(decision, true);
  if (decision.fusion_enabled) {
    spdlog::info("event=ready backend={} fusion_enabled=true generation={} workspace_bytes={}",
                 es.backend, generation, es.workspace_bytes);
  } else {
    // Every fused call of a client now answers "unavailable" (allreduce_fusion returns None):
    // say why where the user looks first.
    spdlog::warn(
        "event=ready backend={} fusion_enabled=false generation={} workspace_bytes={} "
        "reasons=\"{}\"",
        es.backend, generation, es.workspace_bytes, absl::StrJoin(decision.reasons, "; "));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Sidecar::AgreeGenerationBase(absl::Time deadline) {
  // Every engine counts its generations from 1, so without this a re-formed group would hand out
  // generation 1 again and an op stamped before the re-form would pass as current. Every rank
  // offers the highest generation it has served (0 for a process that just started, such as a
  // restarted peer) and all take the maximum: the ranks agree, and the generation only grows.
  uint64_t served = 0;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    served = served_generation_;
  }
  ARFUSE_ASSIGN_OR_RETURN(
      std::vector<std::string> offered,
      exchange_->Allgather("workspace-generation", absl::StrCat(served), deadline));
  return AgreedGenerationBase(served, offered);
}

bool Sidecar::StopOnLostDevice() {
#if ARFUSE_HAVE_CUDA
  if (options_.device != "cuda") return false;
  // A sticky error (illegal address, ...) has broken this process's CUDA context, the device
  // holds a kernel that can never finish, or this process cannot get a client of the GPU (held
  // elsewhere, or MPS refusing it: IsRestartOnlyCudaError): nothing on it can be trusted again,
  // and only a new process recovers.
  absl::Status health = DeviceHealth();
  if (!IsStickyDeviceError(health)) return false;
  spdlog::critical("event=sticky_device_error error=\"{}\"", health.message());
  SetReadiness(false);
  {
    std::lock_guard<std::mutex> lock(mu_);
    exit_code_ = 1;
  }
  // The orderly shutdown may itself wait on the device (freeing memory synchronizes with a
  // kernel that never ends): the process exits at the latest this long after the grace period,
  // whatever blocks.
  constexpr double kLostDeviceExitSlackS = 5;
  const auto overdue = std::chrono::milliseconds(
      static_cast<int64_t>((options_.grace_period_s + kLostDeviceExitSlackS) * 1e3));
  std::thread([overdue] {
    std::this_thread::sleep_for(overdue);
    spdlog::critical("event=shutdown_overdue action=exit code=1");
    spdlog::default_logger()->flush();
    std::fflush(nullptr);
    std::_Exit(1);
  }).detach();
  RequestShutdown("sticky CUDA error");
  return true;
#else
  return false;
#endif
}

void Sidecar::SuperviseGroup() {
#if ARFUSE_HAVE_CUDA
  // This thread's device: DeviceHealth() inspects the current device's context.
  if (options_.device == "cuda") cudaSetDevice(options_.gpu);
#endif
  // The in-stream workspace the last re-form dropped (0: none yet), and the one serving now.
  uint64_t dropped_instream = 0;
  auto instream_generation = [this]() -> uint64_t {
    absl::StatusOr<InStreamCounters> c = gate_.InStreamStatus();
    return c.ok() ? c->generation : 0;
  };
  // The ranks compare their in-stream decisions while the group serves (divergence_watch.h).
  InStreamDivergenceWatch divergence(
      options_.world_size, fusion_ != nullptr ? &fusion_->instream() : nullptr,
      [this](const std::string& p, absl::Time d) {
        return exchange_->Allgather("instream-decisions", p, d);
      },
      [this](const DivergenceFinding& f) { metrics_->IncInStreamDivergence(f.rank); });
  while (!ShutdownRequested()) {
    reinit_requested_ = false;
    absl::Status formed = FormGroup();
    if (formed.ok() && fusion_ != nullptr) {
      // Attachments to the dropped workspace hear REINITIALIZED now, after the POISONED queued
      // before it was dropped (generations only grow, so the dropped one's successor is newer).
      const uint64_t serving =
          std::max(instream_generation(), dropped_instream == 0 ? 0 : dropped_instream + 1);
      if (serving != 0) fusion_->instream().Reinitialized(serving);
    }
    if (!formed.ok()) {
      {
        std::lock_guard<std::mutex> lock(state_mu_);
        not_ready_reason_ = std::string(formed.message());
      }
      SetReadiness(false);
      spdlog::warn("event=group_not_ready error=\"{}\"", formed.message());
      exchange_.reset();
      // Forming the group failed on a device this process cannot use (engine creation, say): no
      // retry here can succeed, exit for a restart.
      if (StopOnLostDevice()) break;
      WaitFor(absl::Seconds(1));
      continue;
    }
    // Serving. Watch for a poisoned workspace (a peer died or stalled mid-op), a lost peer link
    // (a peer died or froze, or the group was re-formed without this rank, while no op ran) or a
    // request to re-initialize; each re-forms the group, which also waits for a restarted peer.
    absl::Status link = absl::OkStatus();
    while (!ShutdownRequested() && !reinit_requested_) {
      if (StopOnLostDevice()) break;
      if (gate_.Status().state == WorkspaceState::kPoisoned) {
        std::lock_guard<std::mutex> lock(state_mu_);
        ++poisonings_;
        not_ready_reason_ = "workspace poisoned; re-forming the group";
        break;
      }
      // A non-blocking look at what the peer link's own thread found (a closed connection, or a
      // peer silent for --peer-heartbeat-timeout): the 50 ms tick adds little to how long an idle
      // group serves with a member gone or frozen.
      link = exchange_->LinkStatus();
      if (!link.ok()) {
        // The workspace is shared with a rank that is gone: as unusable as a poisoned one, and
        // counted as a poisoning (a peer fault), whether or not an op was running.
        std::lock_guard<std::mutex> lock(state_mu_);
        ++poisonings_;
        not_ready_reason_ =
            absl::StrCat("peer link lost (", link.message(), "); re-forming the group");
        break;
      }
      if (fusion_ != nullptr) {
        InStreamAttachments& a = fusion_->instream();
        metrics_->SetInStream(a.size(), a.launches(), a.stale());
        metrics_->SetInStreamOps(a.op_counts());
      }
      divergence.Tick(absl::Now());
      WaitFor(absl::Milliseconds(50));
    }
    if (ShutdownRequested()) break;
    const bool poisoned = gate_.Status().state == WorkspaceState::kPoisoned;
    std::string cause = "a re-initialization request";
    if (poisoned) {
      cause = "a poisoned workspace";
      metrics_->IncPoisonings();
      spdlog::warn("event=group_reform reason=poisoned");
    } else if (!link.ok()) {
      cause = absl::StrCat("a lost peer link (", link.message(), ")");
      metrics_->IncPoisonings();
      spdlog::warn("event=group_reform reason=peer_lost error=\"{}\"", link.message());
    } else {
      spdlog::warn("event=group_reform reason=requested");
    }
    // Recorded while the workspace and its error word still exist, so that the attached clients
    // hear POISONED with its cause however soon the group re-forms.
    dropped_instream = instream_generation();
    if (fusion_ != nullptr && (poisoned || !link.ok())) {
      fusion_->instream().Poisoned(
          dropped_instream,
          poisoned ? gate_.Status().reason : absl::StrCat("peer link lost (", link.message(), ")"));
    }
    SetReadiness(false);
    // The group is gone until it re-forms: no rank counts as joined meanwhile.
    metrics_->SetPeersReady(0);
    gate_.Abort();
    (void)gate_.Drain(absl::Now() + absl::Seconds(options_.grace_period_s));
    // An op still in flight must end before its engine, and the exchange an unfused op agrees
    // over, go. Every op's waits are bounded (the spin timeout; an unfused op's two agreement
    // steps), so this ends.
    absl::StatusOr<std::unique_ptr<Engine>> dropped = gate_.Swap(nullptr);
    while (!dropped.ok()) {
      spdlog::warn("event=group_reform_waits_for_op error=\"{}\"", dropped.status().message());
      (void)gate_.Drain(absl::Now() + absl::Seconds(1));
      dropped = gate_.Swap(nullptr);
    }
    dropped->reset();
    // Dropping the engine may have found an NCCL kernel that can never finish (its peer died
    // after agreeing to the op): only a restart frees the device.
    if (StopOnLostDevice()) break;
    // Ops refused until the group serves again say why (UNAVAILABLE: retry).
    gate_.SetClosedReason(absl::StrCat("the group is re-forming after ", cause));
    exchange_.reset();
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      ++reinitializations_;
      admin_exchange_diverged_ = false;  // a new epoch starts every tag's count afresh
    }
    metrics_->IncReinitializations();
  }
}

v1::GetStatsResponse Sidecar::Stats() {
  v1::GetStatsResponse out;
  EngineStatus es = gate_.Status();
  std::lock_guard<std::mutex> lock(state_mu_);
  out.set_state(ToProtoState(es.state));
  out.set_backend(decided_ ? decision_.backend : "none");
  out.set_poisonings(poisonings_);
  out.set_reinitializations(reinitializations_);
  FillUsageStats(fusion_->registry().totals(), metrics_->op_totals(), &out);
  out.set_uptime_seconds(static_cast<uint64_t>(absl::ToInt64Seconds(absl::Now() - started_)));
  out.set_version(kVersion);
  return out;
}

absl::StatusOr<uint32_t> Sidecar::Drain(absl::Duration timeout) {
  std::lock_guard<std::mutex> admin(admin_mu_);
  SetReadiness(false);
  return gate_.Drain(absl::Now() + timeout);
}

absl::StatusOr<v1::ReinitializeResponse> Sidecar::Reinitialize(absl::Time deadline) {
  std::lock_guard<std::mutex> admin(admin_mu_);
  uint64_t before;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    before = reinitializations_;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    reinit_requested_ = true;
    cv_.notify_all();
  }
  // Done when the group has re-formed and serves again (every rank must be asked, or be
  // re-forming after a poisoning, for that to happen).
  while (absl::Now() < deadline) {
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      if (reinitializations_ > before &&
          health_.Get(kReadinessService) == grpc::health::v1::HealthCheckResponse::SERVING) {
        v1::ReinitializeResponse out;
        EngineStatus es = gate_.Status();
        out.set_generation(es.generation);
        out.set_state(ToProtoState(es.state));
        return out;
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(
      "re-initialization did not complete before the deadline (every rank must re-initialize)");
}

absl::StatusOr<v1::SetBackendResponse> Sidecar::SetBackend(
    const std::string& backend, const std::optional<std::string>& collective_id,
    absl::Time deadline) {
  std::lock_guard<std::mutex> admin(admin_mu_);
  config::Decision previous;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (!decided_ || exchange_ == nullptr ||
        health_.Get(kReadinessService) != grpc::health::v1::HealthCheckResponse::SERVING) {
      return absl::FailedPreconditionError(
          absl::StrCat("the group is not serving; backend unchanged (", not_ready_reason_, ")"));
    }
    previous = decision_;
    if (admin_exchange_diverged_ && !collective_id) {
      return absl::FailedPreconditionError(
          "an earlier collective admin call did not complete on every rank; run `arfusectl "
          "reinitialize` on every rank first; backend unchanged");
    }
    ++backend_switches_;
  }
  // The rank's own flags with the backend replaced: the rule set, the architecture, DP attention
  // and the MoE all-to-all backend still apply.
  config::FusionFlags flags = flags_;
  flags.backend.reset();
  flags.enable_deprecated = false;
  flags.enforce_disable = false;
  if (backend == "none") {
    flags.enforce_disable = true;
  } else {
    flags.backend = backend;
  }
  // Every rank is asked for the same backend; the vote refuses the switch when they disagree or
  // when any rank cannot build it, and the previous backend keeps serving.
  config::RankReport report;
  report.rank = options_.rank;
  report.flags = flags;
  report.topology = OwnTopology();
  absl::StatusOr<config::Decision> local = config::ResolveBackend(flags, report.topology);
  if (local.ok()) {
    report.decision = *local;
  } else {
    report.failure = std::string(local.status().message());
  }
  // The exchange matches calls by tag and count. With a collective id the tag is used once, so a
  // call that failed on this rank alone leaves nothing a later switch could pair with. Without
  // one, the k-th "set-backend" of every rank meet, and a call that fails on one rank only leaves
  // the counts apart until the group re-forms.
  const std::string tag =
      collective_id ? absl::StrCat("set-backend/", *collective_id) : std::string("set-backend");
  absl::StatusOr<std::vector<std::string>> gathered =
      exchange_->Allgather(tag, config::EncodeRankReport(report), deadline);
  if (!gathered.ok()) {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (!collective_id) admin_exchange_diverged_ = true;
    // ABORTED, not the exchange's DEADLINE_EXCEEDED: the sidecar answered, before the caller's
    // deadline, that the switch did not happen because other ranks were not asked in time.
    return absl::AbortedError(
        absl::StrCat("backend switch vote failed (every rank of the group must be asked at once, "
                     "e.g. arfusectl set-backend --all): ",
                     gathered.status().message(), "; backend unchanged: ", previous.backend));
  }
  std::vector<std::string> payloads = *std::move(gathered);
  std::vector<config::RankReport> reports;
  std::vector<std::string> disagreements;
  for (const auto& p : payloads) {
    ARFUSE_ASSIGN_OR_RETURN(config::RankReport r, config::DecodeRankReport(p));
    if (!(r.flags == flags)) {
      disagreements.push_back(absl::StrCat(
          "rank ", r.rank, " asked for ",
          r.flags.enforce_disable ? std::string("none") : r.flags.backend.value_or("unset")));
    }
    reports.push_back(std::move(r));
  }
  if (!disagreements.empty()) {
    return absl::AbortedError(absl::StrCat("ranks disagree on the backend (",
                                           absl::StrJoin(disagreements, "; "),
                                           "); backend unchanged: ", previous.backend));
  }
  ARFUSE_ASSIGN_OR_RETURN(config::Decision decision, config::Consensus(reports));
  LogNoticesOncePerProcess(decision);
  if (backend != "none" && !decision.fusion_enabled) {
    // Agreeing on a backend that cannot fuse here is refused rather than silently unfused.
    // Every rank reaches this same answer from the same reports, so none builds an engine.
    return absl::FailedPreconditionError(absl::StrCat(
        "backend ", backend, " is not feasible: ", absl::StrJoin(decision.reasons, "; "),
        "; backend unchanged: ", previous.backend));
  }
  absl::StatusOr<std::unique_ptr<Engine>> built = BuildEngine(decision, deadline);
  std::string failure = built.ok() ? "" : std::string(built.status().message());
  absl::StatusOr<VoteResult> voted = exchange_->Vote(tag + "-built", built.ok(), failure, deadline);
  if (!voted.ok()) {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (!collective_id) admin_exchange_diverged_ = true;
    return voted.status();
  }
  const VoteResult& vote = *voted;
  if (!vote.all_yes) {
    return absl::AbortedError(absl::StrCat("the new backend could not be built on every rank (",
                                           absl::StrJoin(vote.reasons, "; "),
                                           "); backend unchanged: ", previous.backend));
  }
  // Swap: drain the old engine's ops, install the new one, serve again. Clients launching
  // in-stream on the old workspace stop first (they answer on their session streams); any that
  // do not answer in time see the old workspace's abort when it is dropped.
  SetReadiness(false);
  if (fusion_ != nullptr) {
    fusion_->DrainInStream(absl::StrCat("backend switch to ", decision.backend),
                           absl::Now() + absl::Seconds(options_.grace_period_s));
  }
  absl::StatusOr<uint32_t> drained =
      gate_.Drain(absl::Now() + absl::Seconds(options_.grace_period_s));
  if (!drained.ok()) {
    gate_.Resume();
    SetReadiness(true);
    return drained.status();
  }
  // The new engine counts generations from 1 again: continue from the one served so far (the
  // same on every rank, as the group formed with one agreed base and switches together).
  uint64_t generation_base = 0;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    generation_base = served_generation_;
  }
  ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<Engine> old,
                          gate_.Swap(*std::move(built), generation_base));
  old.reset();
  gate_.Resume();
  EngineStatus es = gate_.Status();
  metrics_->SetWorkspaceBytes(es.workspace_bytes);
  {
    // A group that re-forms later (after a poisoning) keeps the switched backend.
    std::lock_guard<std::mutex> lock(state_mu_);
    flags_ = flags;
    served_generation_ = std::max(served_generation_, es.generation);
  }
  metrics_->SetGeneration(es.generation);
  Publish(decision, true);
  spdlog::info("event=backend_switched from={} to={} fusion_enabled={} generation={}",
               previous.backend, decision.backend, decision.fusion_enabled, es.generation);
  v1::SetBackendResponse out;
  out.set_previous_backend(previous.backend);
  out.set_backend(decision.backend);
  out.set_fusion_enabled(decision.fusion_enabled);
  for (const auto& r : decision.reasons) out.add_reasons(r);
  out.set_generation(es.generation);
  return out;
}

}  // namespace arfuse
