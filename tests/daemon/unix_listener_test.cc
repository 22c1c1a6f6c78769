// arfused's Unix listener in process: what gRPC names a connection handed over by descriptor
// (the key of the caller's credentials), the per-uid and total connection caps, and an accept
// loop that sheds instead of spinning when the process is out of descriptors.
#include "server/daemon/unix_listener.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/server_posix.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cstring>
#include <filesystem>
#include <mutex>
#include <regex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/support/server_interceptor.h"
#include "gtest/gtest.h"
#include "server/daemon/tcp_listener.h"
#include "server/services/health/health_service.h"
#include "tests/support/out_of_descriptors.h"

namespace arfuse {
namespace {

using ::testing::MatchesRegex;

std::string TempSocket(const std::string& tag) {
  std::string dir = absl::StrCat("/tmp/arfuse-listen-", tag, "-", ::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir + "/a.sock";
}

// A client connection to `path` (blocking); invalid when connect failed.
UniqueFd ConnectTo(const std::string& path) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) fd.reset();
  return fd;
}

// True when the server closed `fd` within `timeout` (EOF).
bool ClosedByServer(int fd, absl::Duration timeout) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) <= 0) return false;
  char c;
  return ::recv(fd, &c, 1, MSG_DONTWAIT) == 0;
}

// Records ServerContext::peer() of every call.
class PeerRecorder final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    std::lock_guard<std::mutex> lock(mu_);
    peers_.push_back(info->server_context()->peer());
    return nullptr;
  }
  std::vector<std::string> peers() {
    std::lock_guard<std::mutex> lock(mu_);
    return peers_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> peers_;
};

// gRPC 1.51 names a connection given to AddInsecureChannelFromFd "fd:<descriptor>": the key under
// which the listener recorded the connection's SO_PEERCRED, so a call's credentials are found.
TEST(UnixListener, GrpcNamesAnAdoptedConnectionByItsDescriptor) {
  HealthState state;
  state.Set("", true);
  HealthService health(&state);
  grpc::ServerBuilder builder;
  builder.RegisterService(&health);
  auto* recorder = new PeerRecorder;
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> f;
  f.emplace_back(recorder);
  builder.experimental().SetInterceptorCreators(std::move(f));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);

  ConnectionTable table;
  UnixListenerOptions o;
  o.table = &table;
  const std::string path = TempSocket("peer");
  auto listener = UnixListener::Bind(path, o);
  ASSERT_TRUE(listener.ok()) << listener.status();
  std::vector<int> adopted;
  (*listener)->Serve([&](UniqueFd conn, const SocketCredentials&) {
    adopted.push_back(conn.get());
    grpc::AddInsecureChannelFromFd(server.get(), conn.release());
  });
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel("unix:" + path, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::health::v1::HealthCheckResponse resp;
  ASSERT_TRUE(stub->Check(&ctx, {}, &resp).ok());
  std::vector<std::string> peers = recorder->peers();
  ASSERT_EQ(peers.size(), 1u);
  EXPECT_THAT(peers[0], MatchesRegex("fd:[0-9]+"));
  ASSERT_EQ(adopted.size(), 1u);
  EXPECT_EQ(peers[0], absl::StrCat("fd:", adopted[0]));
  std::optional<SocketCredentials> who = table.ForPeer(peers[0]);
  ASSERT_TRUE(who.has_value());
  EXPECT_EQ(who->uid, ::geteuid());
  EXPECT_EQ(who->pid, ::getpid());
  (*listener)->Stop();
  server->Shutdown(std::chrono::system_clock::now());
}

// Connections held by a test "owner" (the handler keeps the server's end open).
class HeldConnections {
 public:
  UnixListener::Handler Handler() {
    return [this](UniqueFd conn, const SocketCredentials&) {
      std::lock_guard<std::mutex> lock(mu_);
      held_.push_back(std::move(conn));
    };
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return held_.size();
  }
  void DropFirst() {
    std::lock_guard<std::mutex> lock(mu_);
    held_.erase(held_.begin());
  }
  bool WaitFor(size_t n) {
    for (int i = 0; i < 1000 && size() < n; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return size() >= n;
  }

 private:
  std::mutex mu_;
  std::vector<UniqueFd> held_;
};

// A listener on a fresh socket whose connections HeldConnections keeps.
struct HeldListener {
  HeldListener(const std::string& tag, size_t per_uid, size_t total) : path(TempSocket(tag)) {
    UnixListenerOptions o;
    o.table = &table;
    o.max_connections_per_uid = per_uid;
    o.max_connections = total;
    auto bound = UnixListener::Bind(path, o);
    EXPECT_TRUE(bound.ok()) << bound.status();
    if (!bound.ok()) return;
    listener = *std::move(bound);
    listener->Serve(held.Handler());
  }
  const std::string path;
  ConnectionTable table;
  HeldConnections held;
  std::unique_ptr<UnixListener> listener;
};

TEST(UnixListener, ConnectionsOverThePerUidCapAreClosedAtOnce) {
  HeldListener l("peruid", /*per_uid=*/2, /*total=*/0);
  ASSERT_NE(l.listener, nullptr);
  const std::string& path = l.path;
  HeldConnections& held = l.held;
  UniqueFd a = ConnectTo(path), b = ConnectTo(path);
  ASSERT_TRUE(held.WaitFor(2));
  UniqueFd c = ConnectTo(path);
  EXPECT_TRUE(ClosedByServer(c.get(), absl::Seconds(5)));
  EXPECT_EQ(l.listener->refused(), 1u);
  // A connection that closes frees its place.
  held.DropFirst();
  UniqueFd d = ConnectTo(path);
  EXPECT_TRUE(held.WaitFor(2));
  EXPECT_FALSE(ClosedByServer(d.get(), absl::Milliseconds(100)));
}

// Idle fd-channel connections of a uid never lock it out of the main socket: each channel's
// per-uid cap counts that channel's connections only.
TEST(UnixListener, FdChannelConnectionsDoNotCountAgainstTheMainSocketsPerUidCap) {
  HeldListener l("perchannel", /*per_uid=*/2, /*total=*/0);
  ASSERT_NE(l.listener, nullptr);
  std::vector<UniqueFd> fd_channel;
  for (int i = 0; i < 4; ++i) {
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    fd_channel.emplace_back(sv[0]);
    fd_channel.emplace_back(sv[1]);
    l.table.Record(sv[1], ConnectionTable::Channel::kFd, OwnCredentials());
  }
  UniqueFd a = ConnectTo(l.path), b = ConnectTo(l.path);
  ASSERT_TRUE(l.held.WaitFor(2));
  EXPECT_FALSE(ClosedByServer(a.get(), absl::Milliseconds(100)));
  EXPECT_FALSE(ClosedByServer(b.get(), absl::Milliseconds(100)));
  UniqueFd c = ConnectTo(l.path);  // the main socket's own cap still holds
  EXPECT_TRUE(ClosedByServer(c.get(), absl::Seconds(5)));
}

TEST(UnixListener, PendingDescriptorBudgetsSitInsideTheReserve) {
  FdTicketBrokerOptions b = PendingFdBudget(1024);
  EXPECT_EQ(b.max_fds, 128u);
  EXPECT_EQ(b.max_fds_per_uid, 32u);
  EXPECT_LE(b.max_fds, DescriptorReserve(1024));
  b = PendingFdBudget(128);
  EXPECT_EQ(b.max_fds, 32u);
  EXPECT_EQ(b.max_fds_per_uid, 16u);  // one full DEPOSIT
  b = PendingFdBudget(1u << 20);
  EXPECT_EQ(b.max_fds, 1u << 17);
  EXPECT_EQ(b.max_fds_per_uid, 1u << 15);
  b = PendingFdBudget(1024, 64, 20);
  EXPECT_EQ(b.max_fds, 64u);
  EXPECT_EQ(b.max_fds_per_uid, 20u);
}

TEST(UnixListener, ConnectionsOverTheTotalBudgetAreClosedAtOnce) {
  HeldListener l("total", /*per_uid=*/0, /*total=*/1);
  ASSERT_NE(l.listener, nullptr);
  UniqueFd a = ConnectTo(l.path);
  ASSERT_TRUE(l.held.WaitFor(1));
  UniqueFd b = ConnectTo(l.path);
  EXPECT_TRUE(ClosedByServer(b.get(), absl::Seconds(5)));
}

TEST(UnixListener, TheBudgetKeepsAReserveOfDescriptors) {
  EXPECT_EQ(ConnectionBudget(1024), 768u);
  EXPECT_EQ(ConnectionBudget(128), 64u);
  EXPECT_EQ(ConnectionBudget(64), 1u);
  EXPECT_EQ(ConnectionBudget(1u << 20), (1u << 20) - (1u << 18));
}

TEST(UnixListener, PolicyAllowsOwnUserRootListedUidsAndGroups) {
  PeerCredentialPolicy p;
  p.uids = {1234};
  p.gids = {4321};
  SocketCredentials c;
  c.uid = ::geteuid();
  EXPECT_TRUE(p.Allows(c));
  c.uid = 0;
  EXPECT_TRUE(p.Allows(c));
  c.uid = 1234;
  EXPECT_TRUE(p.Allows(c));
  c.uid = 999999;
  c.gid = 999999;
  EXPECT_FALSE(p.Allows(c));
  c.groups = {4321};  // a supplementary group
  EXPECT_TRUE(p.Allows(c));
}

// With the process out of descriptors, pending connections are shed with the spare descriptor
// (their clients see the connection close) and the loop backs off: a handful of accept calls,
// not the millions of a loop that spins on a listening socket that stays readable.
TEST(UnixListener, OutOfDescriptorsShedsAndDoesNotSpin) {
  HeldListener l("emfile", /*per_uid=*/0, /*total=*/0);
  ASSERT_NE(l.listener, nullptr);
  const std::string& path = l.path;
  HeldConnections& held = l.held;
  UnixListener* listener = l.listener.get();
  // Client sockets first: connecting later needs no new descriptor.
  std::vector<UniqueFd> clients;
  for (int i = 0; i < 4; ++i) {
    clients.emplace_back(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    ASSERT_TRUE(clients.back().valid());
  }
  std::optional<::arfuse::testing::OutOfDescriptors> out;
  out.emplace();
  ASSERT_TRUE(out->exhausted());
  const uint64_t calls_before = listener->accept_calls();
  for (UniqueFd& c : clients) ASSERT_TRUE(::arfuse::testing::ConnectUnix(c.get(), path));
  for (UniqueFd& c : clients) EXPECT_TRUE(ClosedByServer(c.get(), absl::Seconds(5)));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const uint64_t calls = listener->accept_calls() - calls_before;
  EXPECT_EQ(listener->shed(), clients.size());
  EXPECT_LT(calls, 100u) << "the accept loop spun";
  EXPECT_EQ(held.size(), 0u);
  out.reset();
  // Descriptors are back: connections are accepted again.
  UniqueFd later = ConnectTo(path);
  EXPECT_TRUE(held.WaitFor(1));
}

// One grpc.health.v1 Check on a fresh plaintext channel to 127.0.0.1:`port`.
bool HealthAnswers(int port, absl::Duration timeout) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::health::v1::HealthCheckResponse resp;
  return stub->Check(&ctx, {}, &resp).ok() &&
         resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

// The health port is the project's listener handing connections to gRPC: out of descriptors
// (RLIMIT_NOFILE lowered and every descriptor taken, as under prlimit) it answers a probe with
// its spare descriptor instead of stopping for good, as gRPC 1.51's own listener does, and it
// answers again within a second of descriptors coming back.
TEST(TcpListener, HealthAnswersWithinASecondOfDescriptorsComingBack) {
  HealthState state;
  state.Set("", true);
  HealthService health(&state);
  grpc::ServerBuilder builder;
  builder.RegisterService(&health);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto listener = TcpListener::Bind("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok()) << listener.status();
  const int port = (*listener)->port();
  ASSERT_GT(port, 0);
  (*listener)->Serve(
      [&](UniqueFd conn) { grpc::AddInsecureChannelFromFd(server.get(), conn.release()); });
  ASSERT_TRUE(HealthAnswers(port, absl::Seconds(10)));

  // Client sockets first: connecting later needs no new descriptor.
  std::vector<UniqueFd> probes;
  for (int i = 0; i < 3; ++i) {
    probes.emplace_back(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    ASSERT_TRUE(probes.back().valid());
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  {
    ::arfuse::testing::OutOfDescriptors out;
    ASSERT_TRUE(out.exhausted());
    const uint64_t calls_before = (*listener)->accept_calls();
    for (UniqueFd& p : probes) {
      ASSERT_EQ(::connect(p.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    EXPECT_GE((*listener)->served_with_spare(), 1u);  // one probe got the spare's place
    EXPECT_LT((*listener)->accept_calls() - calls_before, 100u) << "the accept loop spun";
  }
  probes.clear();
  const absl::Time back = absl::Now();
  bool answered = false;
  while (!answered && absl::Now() - back < absl::Seconds(5)) {
    answered = HealthAnswers(port, absl::Milliseconds(250));
  }
  const absl::Duration took = absl::Now() - back;
  EXPECT_TRUE(answered);
  EXPECT_LT(took, absl::Seconds(1)) << "health answered " << took << " after descriptors came back";
  (*listener)->Stop();
  server->Shutdown(std::chrono::system_clock::now());
}

TEST(TcpListener, ConnectionsOverTheCapAreClosedAtOnce) {
  TcpListenerOptions o;
  o.max_connections = 2;
  auto listener = TcpListener::Bind("127.0.0.1", 0, o);
  ASSERT_TRUE(listener.ok()) << listener.status();
  std::mutex mu;
  std::vector<UniqueFd> held;
  (*listener)->Serve([&](UniqueFd conn) {
    std::lock_guard<std::mutex> lock(mu);
    held.push_back(std::move(conn));
  });
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>((*listener)->port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::vector<UniqueFd> clients;
  for (int i = 0; i < 3; ++i) {
    clients.emplace_back(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    ASSERT_EQ(::connect(clients.back().get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(ClosedByServer(clients[2].get(), absl::Seconds(5)));
  EXPECT_FALSE(ClosedByServer(clients[0].get(), absl::Milliseconds(50)));
  EXPECT_EQ((*listener)->refused(), 1u);
  (*listener)->Stop();
}

TEST(TcpListener, AnAddressInUseIsRefused) {
  auto first = TcpListener::Bind("127.0.0.1", 0);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = TcpListener::Bind("127.0.0.1", (*first)->port());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(second.status().message()), ::testing::HasSubstr("cannot listen on"));
}

}  // namespace
}  // namespace arfuse
