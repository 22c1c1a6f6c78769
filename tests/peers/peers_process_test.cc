// Multi-process peer tests: every rank is a peer_helper process (posix_spawn + exec) talking
// over real sockets. Waits are bounded by generous deadlines (a loaded 2-core machine), never
// by sleeps.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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
    // Parameterized names ("Test/Param") carry a character group names may not.
    std::replace(group_.begin(), group_.end(), '/', '.');
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

// Across nodes the TCP channel runs mutual TLS (server/peers/peer_tls.h). Two CAs, made fresh
// with openssl for every test: the group's (A) and another one (B).
class PeersTlsTest : public PeersProcessTest {
 protected:
  void SetUp() override {
    PeersProcessTest::SetUp();
    std::string script = "set -e; cd " + dir_;
    auto key = [](const std::string& name) {
      return " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout " + name + ".key";
    };
    for (const char* ca : {"ca-a", "ca-b"}) {
      absl::StrAppend(&script, "; openssl req -x509", key(ca), " -days 1 -subj /CN=", ca, " -out ",
                      ca, ".pem 2>/dev/null");
    }
    for (const auto& [leaf, ca] : std::vector<std::pair<std::string, std::string>>{
             {"rank0", "ca-a"}, {"rank1", "ca-a"}, {"stranger", "ca-b"}}) {
      absl::StrAppend(&script, "; openssl req", key(leaf), " -subj /CN=", leaf, " -out ", leaf,
                      ".csr 2>/dev/null; openssl x509 -req -in ", leaf, ".csr -CA ", ca,
                      ".pem -CAkey ", ca, ".key -CAcreateserial -days 1 -out ", leaf,
                      ".pem 2>/dev/null");
    }
    ASSERT_EQ(std::system(script.c_str()), 0) << script;
    tcp_ = absl::StrCat("--tcp=127.0.0.1:", FreeTcpPort());
  }
  // peer_helper's TLS flags: `leaf`'s certificate and key, trusting `ca`.
  std::vector<std::string> Tls(const std::string& leaf, const std::string& ca) const {
    return {"--tls_cert=" + dir_ + "/" + leaf + ".pem", "--tls_key=" + dir_ + "/" + leaf + ".key",
            "--tls_ca=" + dir_ + "/" + ca + ".pem"};
  }
  std::vector<std::string> Args(std::vector<std::string> tls) const {
    tls.push_back(tcp_);
    tls.push_back("--nnodes=2");
    return tls;
  }
  std::string tcp_;
};

TEST_F(PeersTlsTest, AGroupWithCertificatesOfItsCaForms) {
  Spawn(0, 2, "basic", Args(Tls("rank0", "ca-a")));
  Spawn(1, 2, "basic", Args(Tls("rank1", "ca-a")));
  for (auto& p : procs_) {
    EXPECT_THAT(p->Await("JOINED"), StartsWith("JOINED "));
    EXPECT_EQ(p->Await("ALLGATHER"), "ALLGATHER payload-from-0|payload-from-1");
    EXPECT_EQ(p->Await("VOTE"), "VOTE no rank 1: not enough memory");
    EXPECT_EQ(p->Await("BARRIER"), "BARRIER ok");
    EXPECT_EQ(p->Await("DONE"), "DONE");
  }
}

// Joiners that do not authenticate are refused at once, each with its reason, and the group
// still forms with the rank that does.
TEST_F(PeersTlsTest, UnauthenticatedJoinersAreRefusedWithTheReason) {
  Proc& rank0 = Spawn(0, 2, "basic", Args(Tls("rank0", "ca-a")));
  // Plain TCP: rank 0 answers in the plain protocol why it does not serve it.
  Proc& plain = Spawn(1, 2, "basic", Args({}));
  StatusLine s = ParseStatus(plain.Await("JOIN"));
  EXPECT_EQ(s.code, "UNAUTHENTICATED") << s.message;
  EXPECT_THAT(s.message, HasSubstr("accepts peers over TCP only with mutual TLS"));
  EXPECT_LT(s.elapsed_ms, 30000);  // refused, not timed out
  // A certificate of another CA (the joiner trusts the group's CA, so it accepts rank 0).
  Proc& stranger =
      Spawn(1, 2, "basic",
            Args({"--tls_cert=" + dir_ + "/stranger.pem", "--tls_key=" + dir_ + "/stranger.key",
                  "--tls_ca=" + dir_ + "/ca-a.pem"}));
  s = ParseStatus(stranger.Await("JOIN"));
  EXPECT_EQ(s.code, "UNAUTHENTICATED") << s.message;
  EXPECT_THAT(s.message, HasSubstr("rank 0 refused this sidecar's certificate"));
  EXPECT_THAT(s.message, HasSubstr("unknown ca"));
  EXPECT_THAT(s.message, HasSubstr("cannot join group"));
  // A joiner that trusts another CA does not accept rank 0 either.
  Proc& distrust = Spawn(1, 2, "basic", Args(Tls("rank1", "ca-b")));
  s = ParseStatus(distrust.Await("JOIN"));
  EXPECT_EQ(s.code, "UNAUTHENTICATED") << s.message;
  EXPECT_THAT(s.message, HasSubstr("rank 0's certificate did not verify"));
  // TLS without a certificate (openssl's own client): rank 0 ends the handshake with an alert.
  const std::string port = tcp_.substr(tcp_.rfind(':') + 1);
  const std::string probe = "sleep 2 | openssl s_client -connect 127.0.0.1:" + port +
                            " -tls1_3 -CAfile " + dir_ + "/ca-a.pem > " + dir_ +
                            "/s_client.out 2>&1";
  (void)std::system(probe.c_str());
  std::string out;
  {
    FILE* f = std::fopen((dir_ + "/s_client.out").c_str(), "r");
    ASSERT_NE(f, nullptr);
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
    std::fclose(f);
  }
  EXPECT_THAT(out, HasSubstr("certificate required")) << out;
  // The group's own rank 1 still joins: nothing above took its place.
  Proc& rank1 = Spawn(1, 2, "basic", Args(Tls("rank1", "ca-a")));
  for (Proc* p : {&rank0, &rank1}) {
    EXPECT_THAT(p->Await("JOINED"), StartsWith("JOINED "));
    EXPECT_EQ(p->Await("ALLGATHER"), "ALLGATHER payload-from-0|payload-from-1");
    EXPECT_EQ(p->Await("DONE"), "DONE");
  }
}

// Files that do not load are named before anything connects.
TEST_F(PeersTlsTest, CertificateFilesThatDoNotLoadAreNamed) {
  Proc& missing =
      Spawn(0, 2, "basic",
            Args({"--tls_cert=" + dir_ + "/nope.pem", "--tls_key=" + dir_ + "/rank0.key",
                  "--tls_ca=" + dir_ + "/ca-a.pem"}));
  StatusLine s = ParseStatus(missing.Await("JOIN"));
  EXPECT_EQ(s.code, "INVALID_ARGUMENT") << s.message;
  EXPECT_THAT(s.message, HasSubstr("cannot read the peer TLS certificate " + dir_ + "/nope.pem"));
  Proc& mismatched =
      Spawn(0, 2, "basic",
            Args({"--tls_cert=" + dir_ + "/rank0.pem", "--tls_key=" + dir_ + "/rank1.key",
                  "--tls_ca=" + dir_ + "/ca-a.pem"}));
  s = ParseStatus(mismatched.Await("JOIN"));
  EXPECT_EQ(s.code, "INVALID_ARGUMENT") << s.message;
  EXPECT_THAT(s.message, HasSubstr("does not belong to the certificate"));
  Proc& no_ca =
      Spawn(0, 2, "basic",
            Args({"--tls_cert=" + dir_ + "/rank0.pem", "--tls_key=" + dir_ + "/rank0.key"}));
  s = ParseStatus(no_ca.Await("JOIN"));
  EXPECT_EQ(s.code, "INVALID_ARGUMENT") << s.message;
  EXPECT_THAT(s.message, HasSubstr("the CA bundle is missing"));
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

// Short heartbeats keep these tests quick: a beat every 200 ms, a peer lost after 1 s of silence.
constexpr int kHeartbeatMs = 1000;
const std::vector<std::string> kHeartbeat = {absl::StrCat("--hb_ms=", kHeartbeatMs),
                                             "--hb_interval_ms=200"};

// Awaits `watcher`'s LINK line after a peer was stopped at `stopped`: UNAVAILABLE naming the
// stopped rank (`names`), once the heartbeat timeout passed and not long after. The last beat left
// about one interval before the stop, so the loss comes about one interval short of the timeout
// after it; the bounds leave slack for a loaded machine.
void ExpectStoppedAnswering(Proc& watcher, absl::Time stopped, const std::string& names) {
  StatusLine link = ParseStatus(watcher.Await("LINK ", absl::Seconds(10)));
  const absl::Duration noticed = absl::Now() - stopped;
  EXPECT_EQ(link.code, "UNAVAILABLE");
  EXPECT_THAT(link.message, HasSubstr(names));
  EXPECT_THAT(link.message, HasSubstr("stopped answering"));
  EXPECT_THAT(link.message, HasSubstr("peer heartbeat timeout"));
  EXPECT_GE(noticed, absl::Milliseconds(kHeartbeatMs / 2));
  EXPECT_LT(noticed, absl::Milliseconds(kHeartbeatMs + 2000));
}

TEST_F(PeersProcessTest, HealthyIdleGroupKeepsItsLink) {
  Proc& w0 = Spawn(0, 2, "watch", kHeartbeat);
  Proc& w1 = Spawn(1, 2, "watch", kHeartbeat);
  ASSERT_EQ(w0.Await("LINK_OK"), "LINK_OK");
  ASSERT_EQ(w1.Await("LINK_OK"), "LINK_OK");
  // Both keep checking every 20 ms for three heartbeat timeouts (15 beats each way): no loss is
  // reported while nobody leaves or stops.
  EXPECT_EQ(w0.Await("LINK ", absl::Milliseconds(3 * kHeartbeatMs)), "");
  EXPECT_EQ(w1.Await("LINK ", absl::Milliseconds(100)), "");
}

// A frozen rank keeps its socket open, so only the heartbeats tell: with no collective running,
// the other side's LinkStatus turns UNAVAILABLE naming the frozen rank once the heartbeat timeout
// passed (not before: nothing else could have noticed), well before any op deadline would.
TEST_F(PeersProcessTest, FrozenIdleRankIsNoticedByTheCoordinator) {
  Proc& watcher = Spawn(0, 2, "watch", kHeartbeat);
  Proc& victim = Spawn(1, 2, "victim", kHeartbeat);
  ASSERT_EQ(victim.Await("READY"), "READY");
  ASSERT_EQ(watcher.Await("LINK_OK"), "LINK_OK");
  ASSERT_EQ(::kill(victim.pid(), SIGSTOP), 0);
  ExpectStoppedAnswering(watcher, absl::Now(),
                         "is broken: rank 1 of group 'FrozenIdleRankIsNoticedByTheCoordinator' "
                         "went away: stopped answering: nothing heard from it for");
  ::kill(victim.pid(), SIGCONT);
  EXPECT_EQ(watcher.Await("STILL_LOST"), "STILL_LOST yes");
}

TEST_F(PeersProcessTest, FrozenIdleCoordinatorIsNoticedByTheOtherRanks) {
  Proc& coordinator = Spawn(0, 3, "victim", kHeartbeat);
  Proc& w1 = Spawn(1, 3, "watch", kHeartbeat);
  Proc& w2 = Spawn(2, 3, "watch", kHeartbeat);
  ASSERT_EQ(coordinator.Await("READY"), "READY");
  ASSERT_EQ(w1.Await("LINK_OK"), "LINK_OK");
  ASSERT_EQ(w2.Await("LINK_OK"), "LINK_OK");
  ASSERT_EQ(::kill(coordinator.pid(), SIGSTOP), 0);
  const absl::Time stopped = absl::Now();
  for (Proc* p : {&w1, &w2}) {
    ExpectStoppedAnswering(*p, stopped, "the coordinator (rank 0) of group");
    // A collective after it fails at once with the same loss instead of waiting for rank 0.
    StatusLine after = ParseStatus(p->Await("AFTER"));
    EXPECT_EQ(after.code, "UNAVAILABLE");
    EXPECT_THAT(after.message, HasSubstr("stopped answering"));
    EXPECT_LT(after.elapsed_ms, 1000);
  }
  ::kill(coordinator.pid(), SIGCONT);
}

// No false positive while a collective waits a long time (three heartbeat timeouts) for a rank
// that is busy but alive, whichever rank that is: the waiting ranks' links keep beating under
// the pending call, the late rank's link beats while idle, and the collective then completes.
class SlowRankTest : public PeersProcessTest, public ::testing::WithParamInterface<int> {};

TEST_P(SlowRankTest, CollectiveWaitingForASlowRankKeepsEveryLink) {
  const int slow = GetParam();
  std::vector<std::string> extra = kHeartbeat;
  extra.push_back(absl::StrCat("--slow_rank=", slow));
  extra.push_back(absl::StrCat("--delay_ms=", 3 * kHeartbeatMs));
  extra.push_back(absl::StrCat("--idle_ms=", 2 * kHeartbeatMs));
  Spawn(0, 2, "slow", extra);
  Spawn(1, 2, "slow", extra);
  for (auto& p : procs_) ASSERT_EQ(p->Await("READY"), "READY");
  for (int r = 0; r < 2; ++r) {
    StatusLine b = ParseStatus(procs_[r]->Await("BARRIER"));
    EXPECT_EQ(b.code, "OK") << "rank " << r << ": " << b.message;
    if (r != slow) {
      EXPECT_GE(b.elapsed_ms, 3 * kHeartbeatMs - 100) << "rank " << r;
    }
  }
  for (auto& p : procs_) EXPECT_EQ(p->Await("LINK_"), "LINK_HELD");
}

INSTANTIATE_TEST_SUITE_P(SlowRank, SlowRankTest, ::testing::Values(0, 1),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat("Rank", info.param);
                         });

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

TEST(PeerOptionsTest, HeartbeatSettingsAreChecked) {
  PeerOptions o;
  o.world_size = 1;
  o.peer_dir = "/tmp";
  o.group = absl::StrCat("hb-options-", ::getpid());
  struct Case {
    absl::Duration timeout;
    absl::Duration interval;
    const char* message;
  };
  for (const Case& c : {
           Case{absl::Seconds(-1), absl::Seconds(1), "peer heartbeat timeout -1s is out of range"},
           Case{absl::Hours(25), absl::Seconds(1), "out of range [0 (off), 24h]"},
           Case{absl::Seconds(1), absl::ZeroDuration(),
                "peer heartbeat interval 0 must be positive"},
           Case{absl::Seconds(1), absl::Milliseconds(600),
                "at most half the heartbeat timeout (1s), so one late heartbeat is not a loss"},
       }) {
    o.heartbeat_timeout = c.timeout;
    o.heartbeat_interval = c.interval;
    auto s = ConnectPeers(o);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(s.status().message(), HasSubstr(c.message));
  }
  // Off: the interval no longer matters, and this one-rank group forms.
  o.heartbeat_timeout = absl::ZeroDuration();
  EXPECT_TRUE(ConnectPeers(o).ok());
}

}  // namespace
}  // namespace arfuse
