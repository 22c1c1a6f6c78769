// Multi-process peer tests: every rank is a peer_helper process (posix_spawn + exec) talking
// over real sockets. Waits are bounded by generous deadlines (a loaded 2-core machine), never
// by sleeps.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/peers/peer_exchange.h"
#include "tests/support/line_process.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// One rank: peer_helper with `args`; its stdout lines are what the test reads.
class Proc : public testing::LineProcess {
 public:
  explicit Proc(const std::vector<std::string>& args)
      : LineProcess("tests/peers/peer_helper", args) {}
  std::string Await(const std::string& prefix, absl::Duration timeout = absl::Seconds(60)) {
    return LineProcess::Await(prefix, timeout);
  }
};

class PeersProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/arfp-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    group_ = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  }
  void TearDown() override {
    procs_.clear();
    std::string cmd = "rm -rf " + dir_;
    ASSERT_EQ(std::system(cmd.c_str()), 0);
  }
  Proc& Spawn(int rank, int world, const std::string& mode, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {absl::StrCat("--rank=", rank), absl::StrCat("--world=", world),
                                     "--mode=" + mode, "--group=" + group_, "--join_ms=60000"};
    bool has_tcp = false;
    for (auto& e : extra) has_tcp |= e.rfind("--tcp=", 0) == 0;
    if (!has_tcp) args.push_back("--dir=" + dir_);
    for (auto& e : extra) {
      // A later --join_ms overrides the default above.
      args.push_back(e);
    }
    procs_.push_back(std::make_unique<Proc>(args));
    return *procs_.back();
  }

  std::string dir_;
  std::string group_;
  std::vector<std::unique_ptr<Proc>> procs_;
};

// Splits "KEY CODE ELAPSED_MS message" lines printed by SayStatus.
struct StatusLine {
  std::string code;
  int64_t elapsed_ms = -1;
  std::string message;
};
StatusLine ParseStatus(const std::string& line) {
  std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(' ', 3));
  StatusLine s;
  if (parts.size() >= 3) {
    s.code = parts[1];
    s.elapsed_ms = std::stoll(parts[2]);
  }
  if (parts.size() == 4) s.message = parts[3];
  return s;
}

TEST_F(PeersProcessTest, FourRanksAllgatherVoteBarrierAndFdsOverUnixSockets) {
  constexpr int kWorld = 4;
  // Rank 0 last: the others must wait for the coordinator to appear.
  for (int r = kWorld - 1; r >= 0; --r) Spawn(r, kWorld, "basic");
  for (auto& p : procs_) {
    EXPECT_THAT(p->Await("JOINED"), StartsWith("JOINED "));
    EXPECT_EQ(p->Await("ALLGATHER"),
              "ALLGATHER payload-from-0|payload-from-1|payload-from-2|payload-from-3");
    EXPECT_EQ(p->Await("VOTE"), "VOTE no rank 3: not enough memory");
    EXPECT_EQ(p->Await("BARRIER"), "BARRIER ok");
    EXPECT_EQ(p->Await("FD"), "FD fd-of-rank-0|fd-of-rank-1|fd-of-rank-2|fd-of-rank-3");
    EXPECT_EQ(p->Await("DONE"), "DONE");
  }
}

int FreeTcpPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return 0;
  }
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

TEST_F(PeersProcessTest, TwoNodesOverTcpWithoutDescriptorPassing) {
  const std::string tcp = absl::StrCat("--tcp=127.0.0.1:", FreeTcpPort());
  Spawn(0, 2, "basic", {tcp, "--nnodes=2"});
  Spawn(1, 2, "basic", {tcp, "--nnodes=2"});
  for (auto& p : procs_) {
    EXPECT_EQ(p->Await("ALLGATHER"), "ALLGATHER payload-from-0|payload-from-1");
    EXPECT_EQ(p->Await("VOTE"), "VOTE no rank 1: not enough memory");
    EXPECT_EQ(p->Await("DONE"), "DONE");
  }
}

TEST_F(PeersProcessTest, MissingRankIsNamedByEveryRankThatJoined) {
  Spawn(0, 3, "basic", {"--join_ms=2000"});
  Spawn(1, 3, "basic", {"--join_ms=2000"});
  for (auto& p : procs_) {
    StatusLine s = ParseStatus(p->Await("JOIN "));
    EXPECT_EQ(s.code, "UNAVAILABLE");
    EXPECT_THAT(s.message, HasSubstr("ranks 2 did not join before the deadline (joined: 0, 1)"));
    EXPECT_LT(s.elapsed_ms, 30000);
  }
}

TEST_F(PeersProcessTest, AbsentCoordinatorIsReportedAsMissingRankZero) {
  Proc& p = Spawn(1, 2, "basic", {"--join_ms=1000"});
  StatusLine s = ParseStatus(p.Await("JOIN "));
  EXPECT_EQ(s.code, "UNAVAILABLE");
  EXPECT_THAT(s.message, HasSubstr("was not reachable; missing ranks: 0"));
}

TEST_F(PeersProcessTest, KilledPeerFailsPendingCollectiveOnSurvivorsPromptly) {
  Proc& s0 = Spawn(0, 3, "survivor");
  Proc& s1 = Spawn(1, 3, "survivor");
  Proc& victim = Spawn(2, 3, "victim");
  ASSERT_EQ(victim.Await("READY"), "READY");
  ASSERT_EQ(s0.Await("ENTER"), "ENTER");
  ASSERT_EQ(s1.Await("ENTER"), "ENTER");
  ASSERT_EQ(::kill(victim.pid(), SIGKILL), 0);
  for (Proc* p : {&s0, &s1}) {
    StatusLine r = ParseStatus(p->Await("RESULT"));
    EXPECT_EQ(r.code, "UNAVAILABLE");
    EXPECT_THAT(r.message, HasSubstr("rank 2 of group"));
    // The op deadline is 60 s: failing well inside it means the death was noticed, not timed.
    EXPECT_LT(r.elapsed_ms, 30000);
    StatusLine after = ParseStatus(p->Await("AFTER"));
    EXPECT_EQ(after.code, "UNAVAILABLE");
    EXPECT_THAT(after.message, HasSubstr("went away"));
    EXPECT_LT(after.elapsed_ms, 10000);
  }
}

TEST_F(PeersProcessTest, KilledCoordinatorFailsTheOtherRanks) {
  Proc& coordinator = Spawn(0, 3, "victim");
  Proc& s1 = Spawn(1, 3, "survivor");
  Proc& s2 = Spawn(2, 3, "survivor");
  ASSERT_EQ(coordinator.Await("READY"), "READY");
  ASSERT_EQ(s1.Await("ENTER"), "ENTER");
  ASSERT_EQ(s2.Await("ENTER"), "ENTER");
  ASSERT_EQ(::kill(coordinator.pid(), SIGKILL), 0);
  for (Proc* p : {&s1, &s2}) {
    StatusLine r = ParseStatus(p->Await("RESULT"));
    EXPECT_EQ(r.code, "UNAVAILABLE");
    EXPECT_THAT(r.message, HasSubstr("rank 0 went away"));
    EXPECT_LT(r.elapsed_ms, 30000);
  }
}

TEST_F(PeersProcessTest, StoppedPeerTimesOutNamingIt) {
  Proc& s0 = Spawn(0, 3, "survivor", {"--op_ms=3000"});
  Proc& s1 = Spawn(1, 3, "survivor", {"--op_ms=3000"});
  Proc& victim = Spawn(2, 3, "victim");
  ASSERT_EQ(victim.Await("READY"), "READY");
  ASSERT_EQ(::kill(victim.pid(), SIGSTOP), 0);
  for (Proc* p : {&s0, &s1}) {
    StatusLine r = ParseStatus(p->Await("RESULT"));
    EXPECT_EQ(r.code, "DEADLINE_EXCEEDED");
    EXPECT_THAT(r.message, HasSubstr("ranks 2 did not arrive"));
    // Answered by the coordinator before the caller's own 3 s deadline, with slack for load.
    EXPECT_LT(r.elapsed_ms, 3000 + 5000);
  }
  ::kill(victim.pid(), SIGCONT);
}

// LinkStatus: a peer that goes away while the group is idle (no collective running) is noticed
// from the socket alone, by the coordinator's rank and by the others.
TEST_F(PeersProcessTest, IdleRankKilledIsNoticedByTheCoordinatorWithoutACollective) {
  Proc& watcher = Spawn(0, 2, "watch");
  Proc& victim = Spawn(1, 2, "victim");
  ASSERT_EQ(victim.Await("READY"), "READY");
  ASSERT_EQ(watcher.Await("LINK_OK"), "LINK_OK");
  ASSERT_EQ(::kill(victim.pid(), SIGKILL), 0);
  StatusLine link = ParseStatus(watcher.Await("LINK ", absl::Seconds(10)));
  EXPECT_EQ(link.code, "UNAVAILABLE");
  EXPECT_THAT(link.message, HasSubstr("is broken: rank 1 of group"));
  EXPECT_THAT(link.message, HasSubstr("went away"));
  EXPECT_EQ(watcher.Await("STILL_LOST"), "STILL_LOST yes");
}

TEST_F(PeersProcessTest, IdleCoordinatorKilledIsNoticedByTheOtherRanksWithoutACollective) {
  Proc& coordinator = Spawn(0, 3, "victim");
  Proc& w1 = Spawn(1, 3, "watch");
  Proc& w2 = Spawn(2, 3, "watch");
  ASSERT_EQ(coordinator.Await("READY"), "READY");
  ASSERT_EQ(w1.Await("LINK_OK"), "LINK_OK");
  ASSERT_EQ(w2.Await("LINK_OK"), "LINK_OK");
  ASSERT_EQ(::kill(coordinator.pid(), SIGKILL), 0);
  for (Proc* p : {&w1, &w2}) {
    StatusLine link = ParseStatus(p->Await("LINK ", absl::Seconds(10)));
    EXPECT_EQ(link.code, "UNAVAILABLE");
    EXPECT_THAT(link.message, HasSubstr("lost its connection to the coordinator (rank 0)"));
    EXPECT_THAT(link.message, HasSubstr("connection closed"));
    StatusLine after = ParseStatus(p->Await("AFTER"));
    EXPECT_EQ(after.code, "UNAVAILABLE");
    EXPECT_LT(after.elapsed_ms, 1000);
  }
}

// The coordinator's rank re-forms its group (closes its exchange) while alive: the other ranks
// must notice that too, or they would serve on a group that no longer exists.
TEST_F(PeersProcessTest, CoordinatorClosingTheGroupIsNoticedByIdleRanks) {
  Proc& w1 = Spawn(1, 2, "watch");
  Proc& closer = Spawn(0, 2, "close");
  ASSERT_EQ(closer.Await("CLOSED"), "CLOSED");
  StatusLine link = ParseStatus(w1.Await("LINK ", absl::Seconds(10)));
  EXPECT_EQ(link.code, "UNAVAILABLE");
  EXPECT_THAT(link.message, HasSubstr("rank 0 went away"));
}

// A rank that leaves on purpose (its sidecar re-forms) breaks the group for the coordinator too.
TEST_F(PeersProcessTest, RankLeavingOnPurposeIsNoticedByTheCoordinator) {
  Proc& watcher = Spawn(0, 2, "watch");
  Proc& closer = Spawn(1, 2, "close");
  ASSERT_EQ(closer.Await("CLOSED"), "CLOSED");
  StatusLine link = ParseStatus(watcher.Await("LINK ", absl::Seconds(10)));
  EXPECT_EQ(link.code, "UNAVAILABLE");
  EXPECT_THAT(link.message, HasSubstr("rank 1 of group"));
}

TEST_F(PeersProcessTest, HealthyIdleGroupKeepsItsLink) {
  Proc& w0 = Spawn(0, 2, "watch");
  Proc& w1 = Spawn(1, 2, "watch");
  ASSERT_EQ(w0.Await("LINK_OK"), "LINK_OK");
  ASSERT_EQ(w1.Await("LINK_OK"), "LINK_OK");
  // Both keep checking every 20 ms: no loss is reported while nobody leaves.
  EXPECT_EQ(w0.Await("LINK ", absl::Seconds(1)), "");
  EXPECT_EQ(w1.Await("LINK ", absl::Milliseconds(100)), "");
}

TEST_F(PeersProcessTest, IdleCoordinatorKilledIsNoticedOverTcp) {
  const std::string tcp = absl::StrCat("--tcp=127.0.0.1:", FreeTcpPort());
  Proc& coordinator = Spawn(0, 2, "victim", {tcp, "--nnodes=2"});
  Proc& watcher = Spawn(1, 2, "watch", {tcp, "--nnodes=2"});
  ASSERT_EQ(coordinator.Await("READY"), "READY");
  ASSERT_EQ(watcher.Await("LINK_OK"), "LINK_OK");
  ASSERT_EQ(::kill(coordinator.pid(), SIGKILL), 0);
  StatusLine link = ParseStatus(watcher.Await("LINK ", absl::Seconds(10)));
  EXPECT_EQ(link.code, "UNAVAILABLE");
  EXPECT_THAT(link.message, HasSubstr("rank 0 went away"));
}

TEST_F(PeersProcessTest, ReformedGroupGetsANewEpoch) {
  std::string first, second;
  {
    Proc& a = Spawn(0, 2, "basic");
    Proc& b = Spawn(1, 2, "basic");
    first = a.Await("JOINED");
    EXPECT_EQ(b.Await("JOINED"), first);
    EXPECT_EQ(a.Await("DONE"), "DONE");
    EXPECT_EQ(b.Await("DONE"), "DONE");
    procs_.clear();
  }
  Proc& a = Spawn(0, 2, "basic");
  Proc& b = Spawn(1, 2, "basic");
  second = a.Await("JOINED");
  EXPECT_EQ(b.Await("JOINED"), second);
  EXPECT_THAT(second, StartsWith("JOINED "));
  EXPECT_NE(first, second);
}

TEST(PeerOptionsTest, ValidationNamesTheProblem) {
  PeerOptions o;
  o.world_size = 2;
  o.rank = 2;
  o.peer_dir = "/tmp";
  auto s = ConnectPeers(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("rank 2 is out of range"));
  o.rank = 0;
  o.group = "bad/name";
  s = ConnectPeers(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("may only contain"));
  o.group = "g";
  o.peer_dir = "/tmp/" + std::string(120, 'd');
  s = ConnectPeers(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("Unix sockets allow at most 107"));
  o.peer_dir = "";
  s = ConnectPeers(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("peer directory"));
  o.peer_dir = "/tmp";
  o.nnodes = 2;
  s = ConnectPeers(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("TCP address"));
  o.nnodes = 1;
  o.peer_dir = "";
  o.rank0_address = "no-port";
  s = ConnectPeers(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("is not host:port"));
}

}  // namespace
}  // namespace arfuse
