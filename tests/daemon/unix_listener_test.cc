// arfused's Unix listener in process: what gRPC names a connection handed over by descriptor
// (the key of the caller's credentials), the per-uid and total connection caps, and an accept
// loop that sheds instead of spinning when the process is out of descriptors.
#include "server/daemon/unix_listener.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/server_posix.h>
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

}  // namespace
}  // namespace arfuse
