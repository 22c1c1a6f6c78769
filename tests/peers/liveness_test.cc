// The peer channel's liveness and version rules seen from raw sockets, the way a peer on another
// build or a frozen peer looks to the other side: rank 0's coordinator echoes heartbeats and drops
// a rank that stays silent past the timeout it announced; frames it does not understand break
// the group naming the rank; a peer on another wire version gets a refusal it can read, and a
// rank joining a coordinator on another version fails with both versions named, not a hang.
// And the Unix socket's credential rule (peer_credentials.h), seen from a process of another
// user on either side.
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "arfuse/v1/peer.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/peers/coordinator_server.h"
#include "server/peers/peer_exchange.h"
#include "server/peers/wire.h"
#include "tests/support/out_of_descriptors.h"
#include "tests/support/subprocess.h"

namespace arfuse::peers {
namespace {

using ::testing::HasSubstr;

constexpr char kGroup[] = "g";

// One frame as it came, whatever its version (RecvFrame refuses other versions).
struct RawFrame {
  FrameHeader header{};
  std::string body;
};

std::optional<RawFrame> ReadRaw(int fd, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string buf;
  for (;;) {
    if (buf.size() >= sizeof(FrameHeader)) {
      RawFrame f;
      std::memcpy(&f.header, buf.data(), sizeof(FrameHeader));
      if (buf.size() >= sizeof(FrameHeader) + f.header.body_len) {
        f.body = buf.substr(sizeof(FrameHeader), f.header.body_len);
        return f;
      }
    }
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) return std::nullopt;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left) + 1) <= 0) continue;
    char data[4096];
    const ssize_t n = ::recv(fd, data, sizeof(data), 0);
    if (n <= 0) return std::nullopt;
    buf.append(data, static_cast<size_t>(n));
  }
}

// True once the peer closed the connection (within `timeout`).
bool ClosedByPeer(int fd, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    char data[4096];
    const ssize_t n = ::recv(fd, data, sizeof(data), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return true;
  }
  return false;
}

std::string WithVersion(std::string frame, uint8_t version) {
  frame[offsetof(FrameHeader, version)] = static_cast<char>(version);
  return frame;
}

std::string JoinFrame(int rank, int world_size, uint64_t seq) {
  v1::JoinRequest req;
  req.set_rank(rank);
  req.set_world_size(world_size);
  req.set_nnodes(1);
  req.set_node_id("node");
  return EncodeFrame(FrameType::kJoin, seq, 5000, EncodeJoinBody(kGroup, req.SerializeAsString()));
}

UniqueFd ConnectTo(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) fd.reset();
  return fd;
}

bool Send(int fd, const std::string& bytes) {
  return SendAll(fd, bytes, {}, absl::Now() + absl::Seconds(5)).ok();
}

// Polls `broken()` of the coordinator until it is not OK (or `timeout`).
absl::Status WaitBroken(const Coordinator& c, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    absl::Status s = c.broken();
    if (!s.ok() || absl::Now() >= deadline) return s;
    absl::SleepFor(absl::Milliseconds(10));  // polling an observation, bounded above
  }
}

// A fresh directory for the peer socket of each test.
class InTempDir : public ::testing::Test {
 protected:
  void TearDown() override { std::filesystem::remove_all(dir_); }
  const std::string dir_ = testing::MakeTempDir();
};

class CoordinatorLiveness : public InTempDir {
 protected:
  void SetUp() override {
    CoordinatorServerOptions o;
    o.group = kGroup;
    o.world_size = 1;
    o.unix_path = dir_ + "/g-rank0.sock";
    auto server = CoordinatorServer::Start(o);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }
  void TearDown() override {
    server_.reset();
    InTempDir::TearDown();
  }
  // A raw connection that joined as rank 0 of the one-rank group.
  UniqueFd Joined() {
    UniqueFd fd = ConnectTo(dir_ + "/g-rank0.sock");
    EXPECT_TRUE(fd.valid());
    EXPECT_TRUE(Send(fd.get(), JoinFrame(0, 1, 1)));
    std::optional<RawFrame> ok = ReadRaw(fd.get(), absl::Seconds(5));
    EXPECT_TRUE(ok.has_value());
    if (ok) {
      EXPECT_EQ(ok->header.type, static_cast<uint8_t>(FrameType::kJoinOk));
    }
    return fd;
  }

  std::unique_ptr<CoordinatorServer> server_;
};

TEST_F(CoordinatorLiveness, HeartbeatIsEchoedAndASilentRankIsLostAfterItsTimeout) {
  UniqueFd fd = Joined();
  ASSERT_TRUE(Send(fd.get(), EncodeFrame(FrameType::kHeartbeat, 5, 300, "")));
  std::optional<RawFrame> echo = ReadRaw(fd.get(), absl::Seconds(5));
  const absl::Time last_sent = absl::Now();
  ASSERT_TRUE(echo.has_value());
  EXPECT_EQ(echo->header.version, kWireVersion);
  EXPECT_EQ(echo->header.type, static_cast<uint8_t>(FrameType::kHeartbeat));
  EXPECT_EQ(echo->header.seq, 5u);
  EXPECT_TRUE(echo->body.empty());
  // Silent from now on, connection open (as a frozen process's): the rank is lost once the 300 ms
  // it announced have passed, and the group is broken naming it.
  absl::Status broken = WaitBroken(*server_->coordinator(), absl::Seconds(5));
  const absl::Duration noticed = absl::Now() - last_sent;
  EXPECT_EQ(broken.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(broken.message(), HasSubstr("rank 0 of group 'g' went away: stopped answering"));
  EXPECT_THAT(broken.message(), HasSubstr("its peer heartbeat timeout is 300ms"));
  EXPECT_GE(noticed, absl::Milliseconds(250));
  EXPECT_LT(noticed, absl::Seconds(3));
  EXPECT_TRUE(ClosedByPeer(fd.get(), absl::Seconds(5)));
}

// A heartbeat's body is the rank's gossip: the echo carries every rank's latest (a
// CollectiveResponse's payloads, index = rank); an oversized one is not kept, an empty heartbeat
// is echoed empty as before.
TEST_F(CoordinatorLiveness, HeartbeatGossipIsEchoedAsEveryRanksLatest) {
  UniqueFd fd = Joined();
  auto table_of = [&](const std::string& body, uint64_t seq) -> std::vector<std::string> {
    EXPECT_TRUE(Send(fd.get(), EncodeFrame(FrameType::kHeartbeat, seq, 5000, body)));
    std::optional<RawFrame> echo = ReadRaw(fd.get(), absl::Seconds(5));
    EXPECT_TRUE(echo.has_value());
    if (!echo) return {};
    EXPECT_EQ(echo->header.type, static_cast<uint8_t>(FrameType::kHeartbeat));
    EXPECT_EQ(echo->header.seq, seq);
    if (body.empty()) {
      EXPECT_TRUE(echo->body.empty());
      return {};
    }
    std::optional<std::vector<std::string>> table = DecodeGossipTable(echo->body);
    EXPECT_TRUE(table.has_value());
    return table.value_or(std::vector<std::string>{});
  };
  EXPECT_EQ(table_of("counts 1", 1), std::vector<std::string>{"counts 1"});
  EXPECT_EQ(table_of("counts 2", 2), std::vector<std::string>{"counts 2"});
  // Larger than kMaxGossipBytes: the previous payload stays.
  EXPECT_EQ(table_of(std::string(kMaxGossipBytes + 1, 'x'), 3),
            std::vector<std::string>{"counts 2"});
  EXPECT_TRUE(table_of("", 4).empty());
  // The table's codec refuses what does not parse exactly.
  EXPECT_EQ(DecodeGossipTable(EncodeGossipTable({"a", "", "bc"})),
            (std::vector<std::string>{"a", "", "bc"}));
  const std::string good = EncodeGossipTable({"abc"});
  EXPECT_FALSE(DecodeGossipTable(good.substr(0, good.size() - 1)).has_value());
  EXPECT_FALSE(DecodeGossipTable(good + "x").has_value());
  EXPECT_FALSE(DecodeGossipTable("").has_value());
}

double CpuSecondsOfThisProcess() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// docs/security.md's class of hole ("Descriptors, connections, messages") on the peer channel: out
// of descriptors, rank 0's listener stays readable while accept() fails; the coordinator sheds the
// pending connections (their peers see the connection close) and rests instead of spinning.
TEST_F(CoordinatorLiveness, OutOfDescriptorsTheCoordinatorShedsAndDoesNotSpin) {
  std::vector<UniqueFd> clients;
  for (int i = 0; i < 3; ++i)
    clients.emplace_back(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  std::optional<testing::OutOfDescriptors> out;
  out.emplace();
  ASSERT_TRUE(out->exhausted());
  for (UniqueFd& c : clients) ASSERT_TRUE(testing::ConnectUnix(c.get(), dir_ + "/g-rank0.sock"));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const double before = CpuSecondsOfThisProcess();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const double cpu = CpuSecondsOfThisProcess() - before;
  for (UniqueFd& c : clients) {
    pollfd p{c.get(), POLLIN, 0};
    char byte;
    EXPECT_TRUE(::poll(&p, 1, 5000) == 1 && ::recv(c.get(), &byte, 1, MSG_DONTWAIT) == 0);
  }
  out.reset();
  EXPECT_LT(cpu, 0.2) << "the coordinator's loop spun";
  // Descriptors are back: ranks join again.
  UniqueFd joined = Joined();
  EXPECT_TRUE(joined.valid());
}

TEST_F(CoordinatorLiveness, HeartbeatWithoutATimeoutIsNotWatched) {
  UniqueFd fd = Joined();
  ASSERT_TRUE(Send(fd.get(), EncodeFrame(FrameType::kHeartbeat, 1, 0, "")));
  ASSERT_TRUE(ReadRaw(fd.get(), absl::Seconds(5)).has_value());
  EXPECT_TRUE(WaitBroken(*server_->coordinator(), absl::Milliseconds(800)).ok());
}

// A frame this build does not know (a newer peer's) is a clear protocol error naming the rank,
// never something to wait on.
TEST_F(CoordinatorLiveness, UnknownFrameTypeFromAJoinedRankBreaksTheGroupNamingIt) {
  UniqueFd fd = Joined();
  std::string unknown = EncodeFrame(FrameType::kHeartbeat, 2, 0, "");
  unknown[offsetof(FrameHeader, type)] = 99;
  ASSERT_TRUE(Send(fd.get(), unknown));
  absl::Status broken = WaitBroken(*server_->coordinator(), absl::Seconds(5));
  EXPECT_EQ(broken.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(broken.message(), HasSubstr("rank 0 of group 'g' went away: protocol error: "
                                          "unknown peer frame type 99"));
  EXPECT_THAT(broken.message(), HasSubstr(absl::StrCat("of wire version ", kWireVersion)));
  EXPECT_TRUE(ClosedByPeer(fd.get(), absl::Seconds(5)));
}

// A rank on an older build (wire version 1) joins: it gets an Error frame in its own framing,
// which that build decodes, naming both versions; its join then fails at once.
TEST_F(CoordinatorLiveness, OlderWireVersionJoinGetsARefusalItCanRead) {
  UniqueFd fd = ConnectTo(dir_ + "/g-rank0.sock");
  ASSERT_TRUE(fd.valid());
  ASSERT_TRUE(Send(fd.get(), WithVersion(JoinFrame(1, 2, 7), 1)));
  std::optional<RawFrame> reply = ReadRaw(fd.get(), absl::Seconds(5));
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(reply->header.magic, kFrameMagic);
  EXPECT_EQ(reply->header.version, 1);
  EXPECT_EQ(reply->header.type, static_cast<uint8_t>(FrameType::kError));
  EXPECT_EQ(reply->header.seq, 7u);
  absl::Status refusal = DecodeError(reply->body);
  EXPECT_EQ(refusal.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refusal.message(), HasSubstr(absl::StrCat("speaks peer wire version ", kWireVersion,
                                                        " but this rank sent version 1")));
  EXPECT_THAT(refusal.message(), HasSubstr("same arfused build"));
  EXPECT_TRUE(ClosedByPeer(fd.get(), absl::Seconds(5)));
  EXPECT_TRUE(server_->coordinator()->broken().ok());  // it never joined
}

// Stands where rank 0's coordinator listens and answers each connection's first frame with
// `reply`, or closes it without a word when `reply` is empty (what a coordinator on wire version
// 1 does with a version-2 join).
class FakeCoordinator {
 public:
  FakeCoordinator(const std::string& path, std::string reply) : reply_(std::move(reply)) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    listen_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (::bind(listen_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(listen_.get(), 16) != 0) {
      listen_.reset();
      return;
    }
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeCoordinator() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  bool listening() const { return listen_.valid(); }

 private:
  void Serve() {
    while (!stop_.load()) {
      pollfd p{listen_.get(), POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      UniqueFd conn(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!conn) continue;
      if (!ReadRaw(conn.get(), absl::Seconds(2))) continue;
      if (reply_.empty()) continue;  // closes it
      Send(conn.get(), reply_);
      kept_.push_back(std::move(conn));
    }
  }

  const std::string reply_;
  UniqueFd listen_;
  std::vector<UniqueFd> kept_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class WireVersion : public InTempDir {
 protected:
  PeerOptions Rank1(absl::Duration timeout) const {
    PeerOptions o;
    o.rank = 1;
    o.world_size = 2;
    o.peer_dir = dir_;
    o.group = kGroup;
    o.timeout = timeout;
    return o;
  }
};

TEST_F(WireVersion, NewerCoordinatorAnswerFailsTheJoinAtOnceNamingBothVersions) {
  FakeCoordinator fake(dir_ + "/g-rank0.sock",
                       WithVersion(EncodeFrame(FrameType::kJoinOk, 1, 0, ""), kWireVersion + 1));
  ASSERT_TRUE(fake.listening());
  const absl::Time start = absl::Now();
  auto ex = ConnectPeers(Rank1(absl::Seconds(20)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "retried instead of failing";
  ASSERT_FALSE(ex.ok());
  EXPECT_EQ(ex.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(ex.status().message(), HasSubstr("rank 1 cannot join group 'g'"));
  EXPECT_THAT(
      ex.status().message(),
      HasSubstr(absl::StrCat("peer wire version ", kWireVersion + 1,
                             " is not supported (this build speaks version ", kWireVersion, ")")));
}

TEST_F(WireVersion, OlderCoordinatorClosingTheJoinIsExplained) {
  FakeCoordinator fake(dir_ + "/g-rank0.sock", "");
  ASSERT_TRUE(fake.listening());
  auto ex = ConnectPeers(Rank1(absl::Milliseconds(600)));
  ASSERT_FALSE(ex.ok());
  EXPECT_EQ(ex.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(ex.status().message(),
              HasSubstr("rank 0 closed the connection without answering the join"));
  EXPECT_THAT(ex.status().message(), HasSubstr("every rank runs the same build"));
}

// The Unix socket's credential rule, from the other user's side. Root only: the tests act as
// uid/gid 65534 in a child process, with the directory and socket opened to everyone, so that
// only the credential check stands in the way.
constexpr uid_t kNobody = 65534;

bool BecomeNobody() {
  return ::setgroups(0, nullptr) == 0 && ::setgid(kNobody) == 0 && ::setuid(kNobody) == 0;
}

class PeerCredentials : public CoordinatorLiveness {};

TEST_F(PeerCredentials, CoordinatorClosesAProcessOfAnotherUserWithoutReadingItsJoin) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  const std::string path = dir_ + "/g-rank0.sock";
  std::filesystem::permissions(dir_, std::filesystem::perms::all);
  ASSERT_EQ(::chmod(path.c_str(), 0777), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (!BecomeNobody()) ::_exit(100);
    UniqueFd fd = ConnectTo(path);
    if (!fd.valid()) ::_exit(101);       // the filesystem refused: the test would prove nothing
    Send(fd.get(), JoinFrame(0, 1, 1));  // may fail: the coordinator may have closed already
    ::_exit(ReadRaw(fd.get(), absl::Seconds(3)).has_value() ? 102 : 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "100: could not act as uid 65534, 101: could not connect, 102: the join was answered";
  EXPECT_EQ(server_->refused_connections(), 1u);
  // The group's own user still joins.
  UniqueFd joined = Joined();
  EXPECT_TRUE(joined.valid());
  EXPECT_EQ(server_->refused_connections(), 1u);
}

class PeerSocketOwner : public InTempDir {};

TEST_F(PeerSocketOwner, RankRefusesToJoinThroughASocketHeldByAnotherUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  std::filesystem::permissions(dir_, std::filesystem::perms::all);
  absl::StatusOr<std::string> path = PeerSocketPath(dir_, kGroup);
  ASSERT_TRUE(path.ok()) << path.status();
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(ready[0]);
    if (!BecomeNobody()) ::_exit(100);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path->c_str(), sizeof(addr.sun_path) - 1);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(fd, 4) != 0 || ::chmod(path->c_str(), 0777) != 0) {
      ::_exit(101);
    }
    const char one = 1;
    if (::write(ready[1], &one, 1) != 1) ::_exit(102);
    ::pause();  // holds the path until the test kills it
    ::_exit(0);
  }
  ::close(ready[1]);
  char got = 0;
  const bool listening = ::read(ready[0], &got, 1) == 1;
  ::close(ready[0]);
  absl::StatusOr<std::unique_ptr<PeerExchange>> joined =
      absl::FailedPreconditionError("not attempted");
  const absl::Time start = absl::Now();
  if (listening) {
    PeerOptions o;
    o.rank = 1;
    o.world_size = 2;
    o.peer_dir = dir_;
    o.group = kGroup;
    o.timeout = absl::Seconds(10);
    joined = ConnectPeers(o);
  }
  const absl::Duration took = absl::Now() - start;
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  ASSERT_TRUE(listening) << "the other user's listener did not start";
  ASSERT_FALSE(joined.ok());
  EXPECT_EQ(joined.status().code(), absl::StatusCode::kPermissionDenied) << joined.status();
  EXPECT_THAT(joined.status().message(), HasSubstr("uid 65534"));
  EXPECT_LT(took, absl::Seconds(5)) << "retried as if rank 0 were not up yet";
}
}  // namespace
}  // namespace arfuse::peers
