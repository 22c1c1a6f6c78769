#include "server/daemon/sidecar_servers.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/fd/fd_channel_client.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/server_posix.h"
#include "grpcpp/support/server_interceptor.h"
#include "server/daemon/tcp_listener.h"
#include "server/daemon/tcp_server_keeper.h"
#include "server/daemon/unix_listener.h"
#include "server/daemon/unix_socket.h"
#include "server/fdpass/connection_table.h"
#include "server/fdpass/fd_channel_server.h"
#include "server/fdpass/ticket_broker.h"
#include "server/metrics/metrics.h"
#include "spdlog/spdlog.h"

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

SidecarServers::SidecarServers(const DaemonOptions& options)
    : options_(options),
      fd_socket_(FdChannelPath(options.socket)),
      health_main_(std::make_unique<HealthService>(&health_)),
      health_probe_(std::make_unique<HealthService>(&health_)),
      connections_(std::make_unique<ConnectionTable>()),
      // Pending descriptors are budgeted inside the reserve the connection caps leave.
      fd_tickets_(std::make_unique<FdTicketBroker>(
          PendingFdBudget(NofileSoftLimit(), static_cast<size_t>(options.max_pending_fds),
                          static_cast<size_t>(options.max_pending_fds_per_uid)))) {
  // Liveness answers as soon as the process serves; readiness waits for the group.
  health_.Set("", true);
  health_.Set(kReadinessService, false);
}

SidecarServers::~SidecarServers() = default;

absl::Status SidecarServers::PrepareSockets() {
  const bool default_socket =
      options_.sources.count("socket") != 0 && options_.sources.at("socket") == "default";
  ARFUSE_RETURN_IF_ERROR(PrepareUnixSocketPath(options_.socket, default_socket));
  return PrepareUnixSocketPath(fd_socket_, /*create_dir=*/false);
}

absl::Status SidecarServers::StartMetrics() {
  metrics_ = std::make_unique<Metrics>(
      options_.rank, options_.world_size, options_.device,
      Metrics::BuildLabels{kVersion, kGitRevision, absl::StrCat(kApiMajor, ".", kApiMinor)});
  if (options_.metrics_port >= 0) {
    ARFUSE_RETURN_IF_ERROR(metrics_->Serve(options_.metrics_host, options_.metrics_port));
  }
  return absl::OkStatus();
}

int SidecarServers::metrics_port() const {
  return metrics_ == nullptr || options_.metrics_port < 0 ? -1 : metrics_->port();
}

void SidecarServers::SetReadiness(bool serving) {
  health_.Set(kReadinessService, serving);
  metrics_->SetReady(serving);
}

bool SidecarServers::serving() const {
  return health_.Get(kReadinessService) == grpc::health::v1::HealthCheckResponse::SERVING;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> SidecarServers::MutualTlsCredentials()
    const {
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

absl::Status SidecarServers::Start(const std::vector<grpc::Service*>& services) {
  ARFUSE_RETURN_IF_ERROR(StartProbe());
  absl::Status main = StartMain(services);
  if (!main.ok()) health_server_->Shutdown();
  return main;
}

absl::Status SidecarServers::StartProbe() {
  // The health-only server: plaintext TCP for Kubernetes probes, nothing but grpc.health.v1. The
  // project accepts its connections (TcpListener): gRPC 1.51's own TCP listener stops for good
  // after an accept that fails with EMFILE, and the port would never answer again.
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
  return absl::OkStatus();
}

absl::Status SidecarServers::StartMain(const std::vector<grpc::Service*>& services) {
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
      fd_channel.ok() ? UnixListener::Bind(fd_socket_, fd_listen)
                      : absl::StatusOr<std::unique_ptr<UnixListener>>(fd_channel.status());
  if (!fd_listener.ok()) {
    return fd_listener.status();
  }
  fd_channel_ = *std::move(fd_channel);
  fd_listener_ = *std::move(fd_listener);
  std::shared_ptr<grpc::ServerCredentials> tls;
  if (!options_.listen.empty()) {
    absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = MutualTlsCredentials();
    if (!creds.ok()) {
      return creds.status();
    }
    tls = *std::move(creds);
  }
  // What every server of the main API has: the Unix sockets' (which listens on nothing: the
  // listeners hand it their connections) and, with --listen, the TLS servers.
  auto configure = [this, services](grpc::ServerBuilder& builder) {
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
    for (grpc::Service* service : services) builder.RegisterService(service);
  };
  grpc::ServerBuilder builder;
  configure(builder);
  main_server_ = builder.BuildAndStart();
  if (main_server_ == nullptr) {
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
  return absl::OkStatus();
}

void SidecarServers::StopUnixListener() {
  if (unix_listener_ != nullptr) unix_listener_->Stop();
}

void SidecarServers::StopFdListener() {
  if (fd_listener_ != nullptr) fd_listener_->Stop();
}

void SidecarServers::ShutdownMain(std::chrono::system_clock::time_point deadline) {
  if (main_server_ == nullptr) return;
  if (tls_servers_ != nullptr) tls_servers_->Shutdown(deadline);
  main_server_->Shutdown(deadline);
}

void SidecarServers::ShutdownProbe() {
  health_.Shutdown();
  if (health_listener_ != nullptr) health_listener_->Stop();
  if (health_server_ != nullptr) health_server_->Shutdown(std::chrono::system_clock::now());
}

void SidecarServers::ReleaseMain() {
  tls_servers_.reset();
  main_server_.reset();
}

void SidecarServers::ReleaseProbe() { health_server_.reset(); }

}  // namespace arfuse
