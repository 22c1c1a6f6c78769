// Faults injected into real `arfused` groups (docs/reliability.md, "Faults injected and survived"
// and "Nothing lost"; --device=host here, --device=cuda in the gpu-labelled build,
// device_config.h): a peer sidecar killed or frozen mid-op, a client killed mid-op and while
// holding regions, a sidecar restarted under a live client, two clients racing on one workspace,
// SIGTERM under load. Every call is bounded; every outcome is either OK with outputs equal to the
// CPU reference, or a specific error code.
#include <dirent.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/mman.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "arfuse/v1/admin.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/reliability/device_config.h"
#include "tests/reliability/harness.h"

namespace arfuse::reliability {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;

constexpr absl::Duration kOpTimeout = absl::Seconds(10);

// Client mappings are observable from outside only for host shared memory (/proc/PID/maps);
// with CUDA the count reads 0 and only sessions are compared.
constexpr bool kCountsMappings = kDevice == Device::kHost;
int Mappings(pid_t pid) { return kCountsMappings ? ClientShmMappings(pid) : 0; }
constexpr int kPerRegion = kCountsMappings ? 1 : 0;

std::string Str(const absl::Status& s) { return s.ToString(); }

// Runs `n` ops on every rank at once (one thread per rank, no barrier: the sidecars pair them).
// Returns "" when every op was OK and correct, else what went wrong.
std::string Lockstep(std::vector<RankClient*> clients, int n, uint64_t seed) {
  std::mutex mu;
  std::string failure;
  std::vector<std::thread> threads;
  for (RankClient* c : clients) {
    threads.emplace_back([&, c] {
      for (int i = 0; i < n; ++i) {
        c->Prepare(seed + i);
        auto r = c->Run(kOpTimeout);
        std::string why;
        if (!r.ok() || !c->Check(&why)) {
          std::lock_guard<std::mutex> lock(mu);
          if (failure.empty()) {
            failure = absl::StrCat("op ", i, " on ", c->socket(), ": ",
                                   r.ok() ? "wrong result: " + why : Str(r.status()));
          }
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  return failure;
}

// After a fault: every rank retries (bounded) until one op is OK, then runs `n` more in
// lockstep. Errors on the way must be clean fault codes. Returns "" on success.
std::string RecoverAndRun(std::vector<RankClient*> clients, int n, absl::Duration timeout) {
  std::mutex mu;
  std::string failure;
  std::vector<std::thread> threads;
  const absl::Time until = absl::Now() + timeout;
  for (RankClient* c : clients) {
    threads.emplace_back([&, c] {
      for (uint64_t attempt = 0;; ++attempt) {
        c->Prepare(1000 + attempt);
        auto r = c->Run(kOpTimeout);
        if (r.ok()) {
          std::string why;
          if (!c->Check(&why)) {
            std::lock_guard<std::mutex> lock(mu);
            failure = "wrong result while recovering: " + why;
          }
          return;
        }
        if (!IsCleanFaultCode(r.status().code())) {
          std::lock_guard<std::mutex> lock(mu);
          failure = "unclean error while recovering: " + Str(r.status());
          return;
        }
        if (absl::Now() > until) {
          std::lock_guard<std::mutex> lock(mu);
          // Every rank's last answer: which rank could not get an op in says why.
          absl::StrAppend(&failure, failure.empty() ? "" : "; ", "rank ", c->rank(),
                          " did not recover in time, last: ", Str(r.status()));
          return;
        }
        // Wait for readiness rather than hammering a re-forming group.
        WaitReadiness(c->socket(), true, absl::Seconds(2));
      }
    });
  }
  for (auto& t : threads) t.join();
  if (!failure.empty()) return failure;
  return Lockstep(clients, n, 5000);
}

std::vector<RankClient*> Ptrs(std::vector<std::unique_ptr<RankClient>>& v) {
  std::vector<RankClient*> out;
  for (auto& c : v) out.push_back(c.get());
  return out;
}

// Removes the shared-memory objects a killed client process left behind (it could not unlink
// them itself); HostShmBuffer names them /arfuse-<pid>-<n>-<tag>.
void UnlinkShmOf(pid_t pid) {
  const std::string prefix = absl::StrCat("arfuse-", pid, "-");
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      std::string name = e->d_name;
      if (absl::StartsWith(name, prefix)) shm_unlink(("/" + name).c_str());
    }
    closedir(d);
  }
}

// ------------------------------------------------------------------ (a) peer killed / frozen

struct PeerFault {
  const char* name;
  int victim;
  int signal;
};

void PrintTo(const PeerFault& f, std::ostream* os) { *os << f.name; }

class PeerFaultTest : public ::testing::TestWithParam<PeerFault> {};

TEST_P(PeerFaultTest, SurvivorFailsWithinDeadlineGoesNotServingAndGroupReforms) {
  const PeerFault f = GetParam();
  SidecarConfig cfg = Config();
  cfg.spin_timeout_s = 2;
  cfg.peer_timeout_s = 3;
  Group g(2, cfg);
  ASSERT_TRUE(g.StartAll()) << g.Logs();
  ASSERT_TRUE(g.WaitAllReady(kFormTimeout)) << g.Logs();
  std::vector<std::unique_ptr<RankClient>> c;
  for (int r = 0; r < 2; ++r) {
    auto rc = NewClient(g[r].socket(), r, 2, ShapeConfig{});
    ASSERT_TRUE(rc.ok()) << rc.status();
    c.push_back(std::move(*rc));
  }
  ASSERT_EQ(Lockstep(Ptrs(c), 5, 1), "") << g.Logs();
  const int v = f.victim, s = 1 - f.victim;
  auto info_before = c[s]->client().GetWorkspaceInfo();
  ASSERT_TRUE(info_before.ok()) << info_before.status();

  // The victim's client starts an op; its sidecar waits in it for the survivor.
  absl::Status victim_status;
  absl::Duration victim_took;
  c[v]->Prepare(50);
  std::thread victim_call([&] {
    absl::Time t0 = absl::Now();
    auto r = c[v]->Run(absl::Seconds(20));
    victim_took = absl::Now() - t0;
    victim_status = r.status();
    std::string why;
    if (r.ok() && !c[v]->Check(&why)) victim_status = absl::DataLossError("wrong result: " + why);
  });
  ASSERT_TRUE(WaitUntil(
      [&] {
        auto list = c[v]->client().ListRegions();
        return list.ok() && !list->empty() && (*list)[0].in_flight() > 0;
      },
      absl::Seconds(10)));
  g[v].Signal(f.signal);

  // The survivor: at most one more op can complete (with the slot the victim wrote before it
  // went); the next one fails with a specific code, within the spin timeout, never hanging.
  absl::Status first_failure;
  absl::Duration failed_after;
  bool survivor_completed_the_victims_op = false;
  for (int i = 0; i < 3 && first_failure.ok(); ++i) {
    c[s]->Prepare(60 + i);
    absl::Time t0 = absl::Now();
    auto r = c[s]->Run(kOpTimeout);
    absl::Duration took = absl::Now() - t0;
    EXPECT_LT(took, kOpTimeout) << "an op outlived its deadline";
    if (r.ok() && i == 0) survivor_completed_the_victims_op = true;
    if (r.ok()) {
      std::string why;
      EXPECT_TRUE(c[s]->Check(&why)) << why;
    } else {
      first_failure = r.status();
      failed_after = took;
    }
  }
  ASSERT_FALSE(first_failure.ok()) << "the survivor never noticed its peer was gone";
  EXPECT_THAT(first_failure.code(),
              AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kAborted,
                    absl::StatusCode::kDeadlineExceeded))
      << first_failure;
  EXPECT_LT(failed_after, absl::Seconds(cfg.spin_timeout_s) + absl::Seconds(3)) << first_failure;
  std::printf("[fault] %s: survivor rank %d failed after %s with %s\n", f.name, s,
              absl::FormatDuration(failed_after).c_str(), first_failure.ToString().c_str());

  // Readiness goes NOT_SERVING on the survivor; ops are refused cleanly meanwhile.
  EXPECT_TRUE(WaitReadiness(g[s].socket(), false, absl::Seconds(10))) << g.Logs();
  {
    absl::Time t0 = absl::Now();
    auto r = c[s]->Run(absl::Seconds(5));
    EXPECT_FALSE(r.ok());
    EXPECT_TRUE(IsCleanFaultCode(r.status().code())) << r.status();
    EXPECT_LT(absl::Now() - t0, absl::Seconds(5) + absl::Seconds(1));
  }
  auto stats = GetStats(g[s].socket());
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GE(stats->poisonings(), 1u);

  // Bring the victim back.
  const absl::Time back = absl::Now();
  if (f.signal == SIGSTOP) {
    g[v].Signal(SIGCONT);
    victim_call.join();
    // Its op ends in exactly one status, before its deadline: OK (correct) or a clean error.
    EXPECT_LT(victim_took, absl::Seconds(20) + absl::Seconds(1));
    EXPECT_TRUE(victim_status.ok() || IsCleanFaultCode(victim_status.code())) << victim_status;
    // Both ranks had each other's input for that op and the survivor completed it: the
    // continued rank completes it too (the ranks agree on its outcome; the abort that followed
    // concerns a later op).
    if (survivor_completed_the_victims_op && f.victim == 1) {
      EXPECT_TRUE(victim_status.ok()) << "the ranks disagree on one op: " << victim_status;
    }
  } else {
    victim_call.join();
    EXPECT_EQ(victim_status.code(), absl::StatusCode::kUnavailable) << victim_status;
    EXPECT_LT(victim_took, absl::Seconds(5));
    auto code = g[v].Wait(10000ms);
    ASSERT_TRUE(code.has_value());
    EXPECT_EQ(*code, 128 + SIGKILL);
    ASSERT_TRUE(g[v].Start()) << g.Logs();
    // A new process: a new session, regions registered again.
    ASSERT_TRUE(c[v]->Reconnect().ok());
  }
  std::printf("[fault] %s: victim's own op ended with %s after %s\n", f.name,
              victim_status.ToString().c_str(), absl::FormatDuration(victim_took).c_str());
  EXPECT_EQ(RecoverAndRun(Ptrs(c), 5, absl::Seconds(90)), "") << g.Logs();
  std::printf(
      "[fault] %s: group re-formed; 6 checked ops on every rank done %s after the "
      "victim was %s\n",
      f.name, absl::FormatDuration(absl::Now() - back).c_str(),
      f.signal == SIGSTOP ? "continued" : "restarted");
  EXPECT_TRUE(g.WaitAllReady(absl::Seconds(10))) << g.Logs();
  auto info_after = c[s]->client().GetWorkspaceInfo();
  ASSERT_TRUE(info_after.ok()) << info_after.status();
  std::printf("[fault] %s: survivor's workspace generation %llu -> %llu\n", f.name,
              static_cast<unsigned long long>(info_before->generation()),
              static_cast<unsigned long long>(info_after->generation()));
}

INSTANTIATE_TEST_SUITE_P(Faults, PeerFaultTest,
                         ::testing::Values(PeerFault{"sigkill_rank1", 1, SIGKILL},
                                           PeerFault{"sigkill_rank0", 0, SIGKILL},
                                           PeerFault{"sigstop_rank1", 1, SIGSTOP}),
                         [](const auto& info) { return std::string(info.param.name); });

// A peer frozen while idle (no op of its own in flight): the survivor poisons and re-forms, and
// the continued peer notices that its group is gone (its link to the coordinator closed: the
// supervisor's watch loop checks it every 50 ms) and re-forms too, without waiting for its
// client's next op.
TEST(PeerFault, IdlePeerFrozenThenContinuedReformsWithoutAnOp) {
  SidecarConfig cfg = Config();
  Group g(2, cfg);
  ASSERT_TRUE(g.StartAll()) << g.Logs();
  ASSERT_TRUE(g.WaitAllReady(kFormTimeout)) << g.Logs();
  std::vector<std::unique_ptr<RankClient>> c;
  for (int r = 0; r < 2; ++r) {
    auto rc = NewClient(g[r].socket(), r, 2, ShapeConfig{});
    ASSERT_TRUE(rc.ok()) << rc.status();
    c.push_back(std::move(*rc));
  }
  ASSERT_EQ(Lockstep(Ptrs(c), 3, 1), "") << g.Logs();
  auto gen_before = c[1]->client().GetWorkspaceInfo();
  ASSERT_TRUE(gen_before.ok());
  g[1].Signal(SIGSTOP);
  c[0]->Prepare(9);
  auto r = c[0]->Run(kOpTimeout);
  ASSERT_FALSE(r.ok());
  ASSERT_TRUE(WaitReadiness(g[0].socket(), false, absl::Seconds(10)));
  g[1].Signal(SIGCONT);
  // Without any op: both ranks re-form under a new workspace generation and serve.
  EXPECT_TRUE(WaitUntil(
      [&] {
        auto info = c[1]->client().GetWorkspaceInfo();
        return info.ok() && info->generation() != gen_before->generation() &&
               info->state() == v1::WORKSPACE_STATE_READY;
      },
      absl::Seconds(30)))
      << g.Logs();
  EXPECT_TRUE(g.WaitAllReady(absl::Seconds(30))) << g.Logs();
}

// A peer killed while idle and restarted: the survivor's link to it closed, so the survivor
// goes NOT_SERVING (counting a peer fault) and re-forms with the new process without waiting for
// an op.
TEST(PeerFault, IdlePeerKilledAndRestartedReformsWithoutAnOp) {
  SidecarConfig cfg = Config();
  Group g(2, cfg);
  ASSERT_TRUE(g.StartAll()) << g.Logs();
  ASSERT_TRUE(g.WaitAllReady(kFormTimeout)) << g.Logs();
  g[1].Signal(SIGKILL);
  ASSERT_TRUE(g[1].Wait(10000ms).has_value());
  EXPECT_TRUE(WaitReadiness(g[0].socket(), false, absl::Seconds(10)))
      << "the survivor still reports SERVING with its peer gone";
  auto stats = GetStats(g[0].socket());
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GE(stats->poisonings(), 1u);
  EXPECT_THAT(g[0].Log(), HasSubstr("reason=peer_lost"));
  ASSERT_TRUE(g[1].Start()) << g.Logs();
  EXPECT_TRUE(g.WaitAllReady(absl::Seconds(30))) << g.Logs();
}

// After a collective re-initialization the workspace generation must change, so that an op
// stamped with the old one (workspace_generation) is refused as stale (docs/reliability.md,
// "Nothing lost"). Each re-form builds a fresh engine; the ranks agree on the highest generation
// any of them served and count on from it, so the generation grows and is the same on every rank.
TEST(PeerFault, ReinitializationChangesTheWorkspaceGeneration) {
  Group g(2, Config());
  ASSERT_TRUE(g.StartAll()) << g.Logs();
  ASSERT_TRUE(g.WaitAllReady(kFormTimeout)) << g.Logs();
  std::vector<std::unique_ptr<RankClient>> c;
  for (int r = 0; r < 2; ++r) {
    auto rc = NewClient(g[r].socket(), r, 2);
    ASSERT_TRUE(rc.ok()) << rc.status();
    c.push_back(std::move(*rc));
  }
  ASSERT_EQ(Lockstep(Ptrs(c), 2, 1), "") << g.Logs();
  auto before = c[0]->client().GetWorkspaceInfo();
  ASSERT_TRUE(before.ok());
  std::vector<std::thread> t;
  for (int r = 0; r < 2; ++r) {
    t.emplace_back([&, r] {
      auto stub = v1::Admin::NewStub(
          grpc::CreateChannel("unix:" + g[r].socket(), grpc::InsecureChannelCredentials()));
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + 60s);
      v1::ReinitializeRequest req;
      v1::ReinitializeResponse resp;
      grpc::Status st = stub->Reinitialize(&ctx, req, &resp);
      EXPECT_TRUE(st.ok()) << st.error_message();
    });
  }
  for (auto& th : t) th.join();
  ASSERT_TRUE(g.WaitAllReady(kFormTimeout)) << g.Logs();
  auto after = c[0]->client().GetWorkspaceInfo();
  ASSERT_TRUE(after.ok());
  EXPECT_GT(after->generation(), before->generation());
  // Every rank agrees on the new generation.
  auto after1 = c[1]->client().GetWorkspaceInfo();
  ASSERT_TRUE(after1.ok());
  EXPECT_EQ(after1->generation(), after->generation());
  std::printf("[fault] reinitialize: workspace generation %llu -> %llu\n",
              static_cast<unsigned long long>(before->generation()),
              static_cast<unsigned long long>(after->generation()));
  client::ExecOptions eo;
  eo.synchronous = true;
  eo.workspace_generation = before->generation();
  c[0]->Prepare(3);
  auto r = c[0]->client().Execute(c[0]->plan(), c[0]->shape().tokens, eo);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("stale generation"));
  // The current generation (and the same plan and regions) still serve, on every rank.
  EXPECT_EQ(Lockstep(Ptrs(c), 2, 40), "") << g.Logs();
}

// ------------------------------------------------------------------ (b) client killed

class ClientKilledTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SidecarConfig cfg = Config();
    cfg.spin_timeout_s = 5;  // the orphaned op below must still be waiting when rank 1 comes
    group_ = std::make_unique<Group>(2, cfg);
    ASSERT_TRUE(group_->StartAll()) << group_->Logs();
    ASSERT_TRUE(group_->WaitAllReady(kFormTimeout)) << group_->Logs();
    auto o = NewClient((*group_)[0].socket(), 0, 2, ShapeConfig{}, 0, "observer");
    ASSERT_TRUE(o.ok()) << o.status();
    observer_ = std::move(*o);
    auto p = NewClient((*group_)[1].socket(), 1, 2, ShapeConfig{}, 0, "peer");
    ASSERT_TRUE(p.ok()) << p.status();
    peer_ = std::move(*p);
    ASSERT_EQ(Lockstep({observer_.get(), peer_.get()}, 3, 1), "") << group_->Logs();
    auto st = GetStats((*group_)[0].socket());
    ASSERT_TRUE(st.ok()) << st.status();
    base_sessions_ = st->sessions();
    base_mappings_ = Mappings((*group_)[0].pid());
    ASSERT_EQ(base_sessions_, 1u);
    ASSERT_EQ(base_mappings_, kPerRegion);
  }

  std::unique_ptr<testing::Subprocess> StartVictim(const std::string& mode, int regions) {
    return std::make_unique<testing::Subprocess>(std::vector<std::string>{
        testing::BinaryPath("tests/reliability/reliability_client"),
        "--socket=" + (*group_)[0].socket(), "--rank=0", "--world=2", "--mode=" + mode,
        absl::StrCat("--regions=", regions), std::string("--device=") + DeviceName(kDevice)});
  }

  bool BackToBaseline(absl::Duration timeout) {
    return WaitUntil(
        [&] {
          auto st = GetStats((*group_)[0].socket());
          return st.ok() && st->sessions() == base_sessions_ &&
                 Mappings((*group_)[0].pid()) == base_mappings_;
        },
        timeout);
  }

  std::unique_ptr<Group> group_;
  std::unique_ptr<RankClient> observer_, peer_;
  uint32_t base_sessions_ = 0;
  int base_mappings_ = 0;
};

TEST_F(ClientKilledTest, HoldingRegionsReleasesThemAndOthersKeepServing) {
  auto victim = StartVictim("hold", 4);
  ASSERT_TRUE(victim->WaitForOutput("holding 4 regions", 30s))
      << victim->Stdout() << victim->Stderr();
  auto st = GetStats((*group_)[0].socket());
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->sessions(), base_sessions_ + 1);
  EXPECT_EQ(Mappings((*group_)[0].pid()), base_mappings_ + 4 * kPerRegion);
  victim->Signal(SIGKILL);
  ASSERT_TRUE(victim->Wait(10s).has_value());
  UnlinkShmOf(victim->pid());
  EXPECT_TRUE(BackToBaseline(absl::Seconds(15))) << "sessions/mappings did not return to baseline\n"
                                                 << group_->Logs();
  // The other client's region is untouched and it keeps serving.
  auto list = observer_->client().ListRegions();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->size(), 1u);
  EXPECT_EQ(Lockstep({observer_.get(), peer_.get()}, 3, 10), "") << group_->Logs();
}

TEST_F(ClientKilledTest, MidOpReleasesRegionWhenTheOpEndsAndOthersKeepServing) {
  auto victim = StartVictim("execute", 1);
  ASSERT_TRUE(victim->WaitForOutput("in-flight", 30s)) << victim->Stdout() << victim->Stderr();
  EXPECT_EQ(Mappings((*group_)[0].pid()), base_mappings_ + kPerRegion);
  victim->Signal(SIGKILL);
  ASSERT_TRUE(victim->Wait(10s).has_value());
  // The orphaned op still runs to its end on rank 0: rank 1 pairs with it and is served
  // correctly (the victim wrote its input before it died).
  peer_->Prepare(77);
  auto r = peer_->Run(kOpTimeout);
  ASSERT_TRUE(r.ok()) << r.status() << group_->Logs();
  std::string why;
  EXPECT_TRUE(peer_->Check(&why)) << why;
  UnlinkShmOf(victim->pid());
  // Then the dead session's mapping closes (the op held it until it ended).
  EXPECT_TRUE(BackToBaseline(absl::Seconds(15))) << "sessions/mappings did not return to baseline\n"
                                                 << group_->Logs();
  EXPECT_EQ(Lockstep({observer_.get(), peer_.get()}, 3, 20), "") << group_->Logs();
}

// ------------------------------------------------------------------ (c) sidecar restarted

TEST(SidecarRestart, ClientSeesUnavailableReRegistersAndStaleReferencesAreRefused) {
  Group g(1, Config());
  ASSERT_TRUE(g.StartAll()) << g.Logs();
  ASSERT_TRUE(g.WaitAllReady(kFormTimeout)) << g.Logs();
  auto rc = NewClient(g[0].socket(), 0, 1, ShapeConfig{});
  ASSERT_TRUE(rc.ok()) << rc.status();
  RankClient& c = **rc;
  ASSERT_EQ(Lockstep({&c}, 3, 1), "");
  auto info = c.client().GetWorkspaceInfo();
  ASSERT_TRUE(info.ok());
  const uint64_t old_ws_generation = info->generation();

  g[0].Signal(SIGKILL);
  ASSERT_TRUE(g[0].Wait(10000ms).has_value());
  // Down: UNAVAILABLE at once (the call is not left waiting for a sidecar that is gone).
  c.Prepare(2);
  absl::Time t0 = absl::Now();
  auto down = c.Run(kOpTimeout);
  EXPECT_EQ(down.status().code(), absl::StatusCode::kUnavailable) << down.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));

  ASSERT_TRUE(g[0].Start()) << g.Logs();
  ASSERT_TRUE(g.WaitAllReady(kFormTimeout)) << g.Logs();
  // The old session died with the old process: once the channel is back, calls on it are
  // refused (retry UNAVAILABLE while gRPC reconnects).
  absl::Status old_session;
  ASSERT_TRUE(WaitUntil(
      [&] {
        old_session = c.Run(absl::Seconds(2)).status();
        return old_session.code() != absl::StatusCode::kUnavailable;
      },
      absl::Seconds(30)))
      << old_session;
  // The new process holds no session of that token: the answer any token nobody holds gets.
  EXPECT_EQ(old_session.code(), absl::StatusCode::kPermissionDenied) << old_session;
  EXPECT_THAT(old_session.message(), HasSubstr("names no open session of this caller"));

  // Re-register: a new generation.
  ASSERT_TRUE(c.Reconnect().ok());
  EXPECT_NE(c.region().generation, c.stale_region().generation);
  EXPECT_NE(c.plan().generation, c.stale_plan().generation);
  // Stale references are refused, never resolved to the new registration.
  {
    client::OpDesc stale = c.op();
    stale.input->region = c.stale_region();
    stale.residual_in->region = c.stale_region();
    stale.residual_out->region = c.stale_region();
    stale.norm_out->region = c.stale_region();
    stale.gamma->region = c.stale_region();
    auto r = c.client().ExecuteOp(stale, c.shape().tokens);
    EXPECT_THAT(r.status().code(),
                AnyOf(absl::StatusCode::kFailedPrecondition, absl::StatusCode::kNotFound))
        << r.status();
    if (c.stale_region().id == c.region().id) {
      EXPECT_THAT(r.status().message(), HasSubstr("stale generation"));
    }
    std::printf("[fault] restart: stale region ref -> %s\n", r.status().ToString().c_str());
  }
  {
    // Plan ids are random: the restarted sidecar holds none of the old ones.
    auto r = c.client().Execute(c.stale_plan(), c.shape().tokens);
    EXPECT_THAT(r.status().code(),
                AnyOf(absl::StatusCode::kFailedPrecondition, absl::StatusCode::kPermissionDenied))
        << r.status();
    std::printf("[fault] restart: stale plan -> %s\n", r.status().ToString().c_str());
  }
  {
    absl::Status st = c.client().Unregister(c.stale_region());
    EXPECT_THAT(st.code(),
                AnyOf(absl::StatusCode::kFailedPrecondition, absl::StatusCode::kNotFound))
        << st;
  }
  {
    auto now = c.client().GetWorkspaceInfo();
    ASSERT_TRUE(now.ok());
    std::printf("[fault] restart: workspace generation %llu -> %llu\n",
                static_cast<unsigned long long>(old_ws_generation),
                static_cast<unsigned long long>(now->generation()));
    if (now->generation() != old_ws_generation) {
      client::ExecOptions eo;
      eo.synchronous = true;
      eo.workspace_generation = old_ws_generation;
      auto r = c.client().Execute(c.plan(), c.shape().tokens, eo);
      EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
      EXPECT_THAT(r.status().message(), HasSubstr("stale generation"));
    }
  }
  // The new registration serves.
  EXPECT_EQ(Lockstep({&c}, 3, 30), "") << g.Logs();
}

// ------------------------------------------------------------------ (d) two clients racing

TEST(Racing, TwoClientsOnOneWorkspaceAreSerializedAndCorrect) {
  Group g(1, Config());
  ASSERT_TRUE(g.StartAll()) << g.Logs();
  ASSERT_TRUE(g.WaitAllReady(kFormTimeout)) << g.Logs();
  std::vector<std::unique_ptr<RankClient>> c;
  for (uint64_t salt : {1u, 2u}) {
    ShapeConfig shape;
    shape.tokens = salt == 1 ? 4 : 8;  // different shapes on one workspace
    auto rc = NewClient(g[0].socket(), 0, 1, shape, salt, absl::StrCat("c", salt));
    ASSERT_TRUE(rc.ok()) << rc.status();
    c.push_back(std::move(*rc));
  }
  std::atomic<int> ok{0}, wrong{0}, failed{0};
  std::vector<std::thread> threads;
  for (auto& cl : c) {
    threads.emplace_back([&, p = cl.get()] {
      for (int i = 0; i < 60; ++i) {
        p->Prepare(i);
        auto r = p->Run(kOpTimeout);
        std::string why;
        if (!r.ok()) {
          ++failed;
          ADD_FAILURE() << r.status();
        } else if (!p->Check(&why)) {
          ++wrong;
          ADD_FAILURE() << why;
        } else {
          ++ok;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  std::printf("[fault] racing, one rank: ok=%d wrong=%d failed=%d\n", ok.load(), wrong.load(),
              failed.load());
  EXPECT_EQ(ok, 120);
  EXPECT_EQ(wrong, 0);
}

TEST(Racing, TwoClientPairsOnOneGroupGetCorrectResultsOrCleanErrors) {
  SidecarConfig cfg = Config();
  cfg.spin_timeout_s = 3;
  Group g(2, cfg);
  ASSERT_TRUE(g.StartAll()) << g.Logs();
  ASSERT_TRUE(g.WaitAllReady(kFormTimeout)) << g.Logs();
  // Client pairs A and B, one client of each on each rank, racing. The sidecars pair ops by
  // arrival; a pairing of A with B must be refused (different shapes: "ranks disagree on the
  // op"), never computed into a wrong result.
  std::vector<std::unique_ptr<RankClient>> a, b;
  for (int r = 0; r < 2; ++r) {
    ShapeConfig sa, sb;
    sa.tokens = 4;
    sb.tokens = 8;
    auto ca = NewClient(g[r].socket(), r, 2, sa, 1, "A");
    auto cb = NewClient(g[r].socket(), r, 2, sb, 2, "B");
    ASSERT_TRUE(ca.ok() && cb.ok());
    a.push_back(std::move(*ca));
    b.push_back(std::move(*cb));
  }
  std::mutex mu;
  std::map<std::string, int> outcomes;
  std::atomic<int> wrong{0};
  absl::Duration slowest;
  std::vector<std::thread> threads;
  for (RankClient* p : {a[0].get(), a[1].get(), b[0].get(), b[1].get()}) {
    threads.emplace_back([&, p] {
      for (int i = 0; i < 30; ++i) {
        p->Prepare(i);
        absl::Time t0 = absl::Now();
        auto r = p->Run(kOpTimeout);
        absl::Duration took = absl::Now() - t0;
        std::string key = r.ok() ? "OK" : absl::StatusCodeToString(r.status().code());
        std::string why;
        if (r.ok() && !p->Check(&why)) {
          ++wrong;
          key = "WRONG";
        }
        if (!r.ok()) {
          EXPECT_TRUE(r.status().code() == absl::StatusCode::kInvalidArgument ||
                      IsCleanFaultCode(r.status().code()))
              << r.status();
          // Host mode compares the ranks' ops on the CPU; CUDA in the fused kernels (the peer
          // of the rank that refused gets ABORTED, later ops FAILED_PRECONDITION until re-init).
          if (r.status().code() == absl::StatusCode::kInvalidArgument) {
            EXPECT_THAT(r.status().message(), HasSubstr("ranks disagree on the op"));
          }
        }
        std::lock_guard<std::mutex> lock(mu);
        outcomes[key]++;
        slowest = std::max(slowest, took);
      }
    });
  }
  for (auto& t : threads) t.join();
  std::string summary;
  int total = 0;
  for (auto& [k, n] : outcomes) {
    absl::StrAppend(&summary, k, "=", n, " ");
    total += n;
  }
  std::printf("[fault] racing, two ranks, two client pairs: %s(slowest %s)\n", summary.c_str(),
              absl::FormatDuration(slowest).c_str());
  EXPECT_EQ(total, 120);  // every call ended in exactly one status
  EXPECT_EQ(wrong, 0);
  EXPECT_LT(slowest, kOpTimeout);
  // The group still serves a properly paired client afterwards.
  EXPECT_EQ(RecoverAndRun({a[0].get(), a[1].get()}, 3, absl::Seconds(60)), "") << g.Logs();
}

// ------------------------------------------------------------------ (e) SIGTERM under load

TEST(SigtermUnderLoad, EveryCallEndsInOneStatusNoneHangsExitZero) {
  SidecarConfig cfg = Config();
  cfg.grace_period_s = 4;
  Group g(2, cfg);
  ASSERT_TRUE(g.StartAll()) << g.Logs();
  ASSERT_TRUE(g.WaitAllReady(kFormTimeout)) << g.Logs();
  std::vector<std::unique_ptr<RankClient>> ops, ctl;
  for (int r = 0; r < 2; ++r) {
    auto o = NewClient(g[r].socket(), r, 2, ShapeConfig{}, 0, "ops");
    auto k = NewClient(g[r].socket(), r, 2, ShapeConfig{}, 0, "ctl");
    ASSERT_TRUE(o.ok() && k.ok());
    ops.push_back(std::move(*o));
    ctl.push_back(std::move(*k));
  }
  struct Tally {
    std::mutex mu;
    std::map<std::string, int> by_code;
    int issued = 0;
    int wrong = 0;
    absl::Duration slowest;
    std::vector<std::string> notable;  // every non-OK outcome, with what and how long
    void Add(const absl::Status& s, absl::Duration took, bool wrong_result,
             const char* what = "Execute") {
      std::lock_guard<std::mutex> lock(mu);
      by_code[wrong_result ? "WRONG" : absl::StatusCodeToString(s.code())]++;
      if (!s.ok() || wrong_result) {
        notable.push_back(absl::StrCat(what, " after ", absl::FormatDuration(took), ": ",
                                       s.ToString().substr(0, 160)));
      }
      if (wrong_result) ++wrong;
      slowest = std::max(slowest, took);
    }
  } tally;
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  // The op clients: until their sidecar is gone (a few refusals in a row after SIGTERM).
  for (auto& p : ops) {
    threads.emplace_back([&, c = p.get()] {
      int refused_in_a_row = 0;
      for (uint64_t i = 0; refused_in_a_row < 3 && !stop; ++i) {
        c->Prepare(i);
        {
          std::lock_guard<std::mutex> lock(tally.mu);
          ++tally.issued;
        }
        absl::Time t0 = absl::Now();
        auto r = c->Run(kOpTimeout);
        std::string why;
        bool wrong = r.ok() && !c->Check(&why);
        tally.Add(r.status(), absl::Now() - t0, wrong);
        refused_in_a_row = r.ok() ? 0 : refused_in_a_row + 1;
        if (!r.ok()) absl::SleepFor(absl::Milliseconds(20));
      }
    });
  }
  // Control-plane clients: registrations, listings and info calls racing the shutdown.
  for (auto& p : ctl) {
    threads.emplace_back([&, c = p.get()] {
      int refused_in_a_row = 0;
      for (uint64_t i = 0; refused_in_a_row < 3 && !stop; ++i) {
        absl::Status s;
        const char* what = i % 3 == 0   ? "ListRegions"
                           : i % 3 == 1 ? "GetWorkspaceInfo"
                                        : "CreatePlan";
        absl::Time t0 = absl::Now();
        {
          std::lock_guard<std::mutex> lock(tally.mu);
          ++tally.issued;
        }
        switch (i % 3) {
          case 0:
            s = c->client().ListRegions().status();
            break;
          case 1:
            s = c->client().GetWorkspaceInfo().status();
            break;
          case 2: {
            auto p2 = c->client().CreatePlan(c->op());
            s = p2.status();
            if (p2.ok()) c->client().DestroyPlan(*p2).IgnoreError();
            break;
          }
        }
        tally.Add(s, absl::Now() - t0, false, what);
        refused_in_a_row = s.ok() ? 0 : refused_in_a_row + 1;
        absl::SleepFor(absl::Milliseconds(s.ok() ? 2 : 20));
      }
    });
  }
  // Load for a moment, then SIGTERM both sidecars at once.
  ASSERT_TRUE(WaitUntil(
      [&] {
        std::lock_guard<std::mutex> lock(tally.mu);
        return tally.by_code["OK"] >= 100;
      },
      absl::Seconds(60)))
      << g.Logs();
  absl::Time term = absl::Now();
  g[0].Signal(SIGTERM);
  g[1].Signal(SIGTERM);
  std::optional<int> code0 = g[0].Wait(30000ms), code1 = g[1].Wait(30000ms);
  absl::Duration exit_took = absl::Now() - term;
  // Clients stop after their sidecar refused them; bound the wait in case one did not notice.
  bool threads_done = WaitUntil(
      [&] {
        std::lock_guard<std::mutex> lock(tally.mu);
        int ended = 0;
        for (auto& [k, n] : tally.by_code) ended += n;
        return ended == tally.issued;
      },
      absl::Seconds(30));
  stop = true;
  for (auto& t : threads) t.join();

  std::string summary;
  int ended = 0;
  for (auto& [k, n] : tally.by_code) {
    absl::StrAppend(&summary, k, "=", n, " ");
    ended += n;
  }
  std::printf("[fault] SIGTERM under load: issued=%d ended=%d %s slowest=%s exit=%s\n",
              tally.issued, ended, summary.c_str(), absl::FormatDuration(tally.slowest).c_str(),
              absl::FormatDuration(exit_took).c_str());
  for (const std::string& n : tally.notable) std::printf("[fault]   %s\n", n.c_str());
  EXPECT_TRUE(threads_done);
  EXPECT_EQ(ended, tally.issued) << "a call did not end in exactly one status";
  EXPECT_EQ(tally.wrong, 0);
  EXPECT_LT(tally.slowest, kOpTimeout) << "a call outlived its deadline";
  for (auto& [k, n] : tally.by_code) {
    EXPECT_THAT(k, AnyOf("OK", "UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION",
                         "CANCELLED"))
        << n << " call(s) ended with " << k;
  }
  ASSERT_TRUE(code0.has_value() && code1.has_value()) << "a sidecar did not exit after SIGTERM";
  EXPECT_EQ(*code0, 0) << g.Logs();
  EXPECT_EQ(*code1, 0) << g.Logs();
  EXPECT_LT(exit_took, absl::Seconds(cfg.grace_period_s) + absl::Seconds(10));
  EXPECT_THAT(g[0].Log(), HasSubstr("event=shutdown_done exit_code=0"));
  EXPECT_THAT(g[1].Log(), HasSubstr("event=shutdown_done exit_code=0"));
}

// ------------------------------------------------------------------ (f) idle and stalled links

// One sidecar and one client that has run one checked op (host mode: what these tests look at,
// the gRPC link, is the same on every device).
class IdleLink : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kDevice != Device::kHost) GTEST_SKIP() << "device-independent; runs in the host-mode build";
    ASSERT_TRUE(group_.StartAll()) << group_.Logs();
    ASSERT_TRUE(group_.WaitAllReady(kFormTimeout)) << group_.Logs();
    auto rc = NewClient(group_[0].socket(), 0, 1, ShapeConfig{});
    ASSERT_TRUE(rc.ok()) << rc.status();
    client_ = std::move(*rc);
    ASSERT_EQ(Lockstep({client_.get()}, 1, 1), "");
  }
  // Two more checked ops on the same session, and the sidecar never closed a session.
  void ExpectTheSessionStillServes() {
    EXPECT_EQ(Lockstep({client_.get()}, 2, 2), "") << group_.Logs();
    auto regions = client_->client().ListRegions();
    ASSERT_TRUE(regions.ok()) << regions.status();
    EXPECT_EQ(regions->size(), 1u);
    EXPECT_THAT(group_[0].Log(), Not(HasSubstr("event=session_close")));
  }

  Group group_{1, Config()};
  std::unique_ptr<RankClient> client_;
};

// A client idle for longer than three keepalive intervals keeps its session: the sidecar accepts
// its keepalive pings (gRPC's default policy, one ping per 5 minutes while the server sends no
// data, answered the third early ping with GOAWAY "too_many_pings" after ~35 s of idleness,
// ending the session and releasing every region the client had registered).
TEST_F(IdleLink, ClientIdlePastThreeKeepaliveIntervalsKeepsItsSession) {
  absl::SleepFor(absl::Seconds(45));  // keepalive pings every 10-15 s, no call, no data
  ExpectTheSessionStillServes();
}

// A sidecar stalled for a few seconds (SIGSTOP: a debugger, a frozen cgroup) reads the pings
// queued meanwhile all at once when it runs again; its clients' sessions survive that.
TEST_F(IdleLink, SidecarThawedAfterAStallKeepsItsSessions) {
  // Shorter than the client's keepalive timeout (20 s): beyond that the client rightly gives the
  // sidecar up for dead.
  group_[0].Signal(SIGSTOP);
  absl::SleepFor(absl::Seconds(12));
  group_[0].Signal(SIGCONT);
  ExpectTheSessionStillServes();
}

}  // namespace
}  // namespace arfuse::reliability
