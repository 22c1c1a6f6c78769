// The live backend switch, re-initialization, drain and stats through arfusectl against two
// host-mode sidecars (--sm makes them resolve backends as a GPU of that architecture would), and
// GetStats' usage figures against one sidecar driven by the C++ client.
#include <grpcpp/grpcpp.h>

#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "arfuse/v1/admin.grpc.pb.h"
#include "client/cpp/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/daemon_process.h"
#include "tests/support/subprocess.h"

namespace arfuse {
namespace {

using ::arfuse::testing::BinaryPath;
using ::arfuse::testing::MakeTempDir;
using ::arfuse::testing::RunToCompletion;
using ::arfuse::testing::Subprocess;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

class AdminTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir();
    for (int r = 0; r < 2; ++r) {
      // arfused's default names: rank 0's socket, and ".rank<r>" next to it for rank r (what
      // arfusectl's --rank/--ranks/--all address).
      sockets_.push_back(dir_ + "/arfused.sock" + (r > 0 ? ".rank" + std::to_string(r) : ""));
      daemons_.push_back(std::make_unique<Subprocess>(std::vector<std::string>{
          BinaryPath("server/daemon/arfused"), "--device=host", "--sm=" + sm_,
          "--rank=" + std::to_string(r), "--world-size=2", "--peer-dir=" + dir_,
          "--socket=" + sockets_[r], "--health-port=0", "--max-tokens=16", "--hidden=256",
          "--flashinfer-allreduce-fusion-backend=trtllm", "--peer-timeout=20"}));
    }
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(daemons_[r]->WaitForOutput("event=ready", 60s)) << daemons_[r]->Stderr();
    }
  }

  std::pair<int, std::string> Ctl(std::vector<std::string> args) {
    args.insert(args.begin(), BinaryPath("tools/arfusectl/arfusectl"));
    return RunToCompletion(args, {}, 60s);
  }
  std::string Addr(int r) { return "unix:" + sockets_[r]; }
  std::string Both() { return Addr(0) + "," + Addr(1); }

  // Admin.SetBackend on rank r's socket, as a client other than arfusectl sends it.
  grpc::Status RawSetBackend(int r, const std::string& backend, std::optional<std::string> id,
                             std::chrono::seconds deadline, v1::SetBackendResponse* resp) {
    auto channel = grpc::CreateChannel(Addr(r), grpc::InsecureChannelCredentials());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + deadline);
    v1::SetBackendRequest req;
    req.set_backend(backend);
    if (id) req.set_collective_id(*id);
    return v1::Admin::NewStub(channel)->SetBackend(&ctx, req, resp);
  }

  std::string sm_ = "90";
  std::string dir_;
  std::vector<std::string> sockets_;
  std::vector<std::unique_ptr<Subprocess>> daemons_;
};

TEST_F(AdminTest, SwitchOnEveryRankThenBack) {
  auto [code, out] = Ctl({"set-backend", "--backend=mnnvl", "--addr=" + Both()});
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr(Addr(0) + ": backend trtllm -> mnnvl, fusion enabled"));
  EXPECT_THAT(out, HasSubstr(Addr(1) + ": backend trtllm -> mnnvl, fusion enabled"));
  auto [scode, stats] = Ctl({"stats", "--addr=" + Addr(1), "--json"});
  ASSERT_EQ(scode, 0) << stats;
  EXPECT_THAT(stats, HasSubstr("\"backend\":\"mnnvl\""));
  auto [hcode, health] = Ctl({"health", "--addr=" + Addr(0), "--service=arfuse.v1.Fusion"});
  EXPECT_EQ(hcode, 0) << health;
  // "none": the unfused path for all.
  auto [ncode, nout] = Ctl({"set-backend", "--backend=none", "--addr=" + Both()});
  ASSERT_EQ(ncode, 0) << nout;
  EXPECT_THAT(nout, HasSubstr("mnnvl -> none, fusion disabled"));
}

// The runbook's form: the backend as the first argument, every rank of the group found next to
// rank 0's socket (--all is the default of a collective command).
TEST_F(AdminTest, PositionalBackendSwitchesEveryLocalRank) {
  auto [code, out] = Ctl({"set-backend", "mnnvl", "--addr=" + Addr(0), "--all"});
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr(Addr(0) + ": backend trtllm -> mnnvl, fusion enabled"));
  EXPECT_THAT(out, HasSubstr(Addr(1) + ": backend trtllm -> mnnvl, fusion enabled"));
  auto [rcode, rout] = Ctl({"set-backend", "trtllm", "--addr=" + Addr(0), "--ranks=0,1"});
  ASSERT_EQ(rcode, 0) << rout;
  EXPECT_THAT(rout, HasSubstr(Addr(1) + ": backend mnnvl -> trtllm"));
  auto [scode, stats] = Ctl({"stats", "--addr=" + Addr(0), "--rank=1", "--json"});
  ASSERT_EQ(scode, 0) << stats;
  EXPECT_THAT(stats, HasSubstr("\"addr\":\"" + Addr(1) + "\""));
  EXPECT_THAT(stats, HasSubstr("\"backend\":\"trtllm\""));
  auto [hcode, health] =
      Ctl({"health", "--addr=" + Addr(0), "--all", "--service=arfuse.v1.Fusion"});
  EXPECT_EQ(hcode, 0) << health;
  EXPECT_EQ(health, "SERVING\nSERVING\n");
  auto [dcode, dup] = Ctl({"set-backend", "trtllm", "--backend=mnnvl", "--addr=" + Both()});
  EXPECT_EQ(dcode, 2);
  EXPECT_THAT(dup, HasSubstr("--backend given more than once"));
}

// One rank asked alone would wait for the others until its deadline and leave the switch half
// done: arfusectl asks every addressed sidecar for its group first and refuses, at once, with
// nothing changed.
TEST_F(AdminTest, ASwitchOfPartOfTheGroupIsRefusedBeforeAnythingChanges) {
  const absl::Time start = absl::Now();
  auto [code, out] = Ctl({"set-backend", "mnnvl", "--addr=" + Addr(0)});
  EXPECT_EQ(code, 2) << out;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_THAT(out, HasSubstr("set-backend is collective"));
  EXPECT_THAT(out, HasSubstr("1 of 2 ranks were addressed (missing: rank 1); nothing was changed"));
  auto [rcode, rout] = Ctl({"reinitialize", "--addr=" + Addr(1)});
  EXPECT_EQ(rcode, 2) << rout;
  EXPECT_THAT(rout, HasSubstr("missing: rank 0"));
  auto [twice, tout] = Ctl({"set-backend", "mnnvl", "--addr=" + Addr(0), "--ranks=1,1"});
  EXPECT_EQ(twice, 2);
  EXPECT_THAT(tout, HasSubstr("--ranks names rank 1 twice"));
  auto [both, bout] = Ctl({"set-backend", "mnnvl", "--rank=1", "--all"});
  EXPECT_EQ(both, 2);
  EXPECT_THAT(bout, HasSubstr("give one of --rank, --ranks and --all"));
  auto [tcp, tcpout] = Ctl({"set-backend", "mnnvl", "--addr=127.0.0.1:9", "--all"});
  EXPECT_EQ(tcp, 2);
  EXPECT_THAT(tcpout, HasSubstr("--addr must be one Unix socket"));
  // Nothing changed: every rank still serves trtllm, and a whole-group switch goes through.
  auto [ok, okout] = Ctl({"set-backend", "mnnvl", "--addr=" + Addr(0), "--all"});
  EXPECT_EQ(ok, 0) << okout;
}

// A client that asks one rank only (grpcurl by hand) hears, before its deadline, that the other
// ranks were not asked; with a collective id nothing is left behind, so the next switch works.
TEST_F(AdminTest, OneRankAloneIsAbortedAndLeavesNothingBehind) {
  v1::SetBackendResponse resp;
  grpc::Status alone = RawSetBackend(0, "mnnvl", "lonely-1", 4s, &resp);
  EXPECT_EQ(alone.error_code(), grpc::StatusCode::ABORTED) << alone.error_message();
  EXPECT_THAT(alone.error_message(), HasSubstr("every rank of the group must be asked at once"));
  EXPECT_THAT(alone.error_message(), HasSubstr("backend unchanged: trtllm"));
  auto [code, out] = Ctl({"set-backend", "mnnvl", "--addr=" + Addr(0), "--all"});
  EXPECT_EQ(code, 0) << out;
}

// Without a collective id the ranks pair their calls by count: after a call that reached one rank
// only, such calls are refused until the group re-forms; arfusectl's (with an id) are not.
TEST_F(AdminTest, OneRankAloneWithoutAnIdNeedsAReinitialize) {
  v1::SetBackendResponse resp;
  grpc::Status alone = RawSetBackend(0, "mnnvl", std::nullopt, 4s, &resp);
  EXPECT_EQ(alone.error_code(), grpc::StatusCode::ABORTED) << alone.error_message();
  std::thread t([&] {
    v1::SetBackendResponse r1;
    (void)RawSetBackend(1, "mnnvl", std::nullopt, 4s, &r1);
  });
  grpc::Status again = RawSetBackend(0, "mnnvl", std::nullopt, 4s, &resp);
  t.join();
  EXPECT_EQ(again.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << again.error_message();
  EXPECT_THAT(again.error_message(), HasSubstr("run `arfusectl reinitialize` on every rank first"));
  auto [rcode, rout] = Ctl({"reinitialize", "--addr=" + Addr(0), "--all"});
  ASSERT_EQ(rcode, 0) << rout;
  EXPECT_THAT(rout, HasSubstr("re-initialized"));
  auto [code3, out3] = Ctl({"set-backend", "mnnvl", "--addr=" + Both()});
  EXPECT_EQ(code3, 0) << out3;
}

TEST_F(AdminTest, RanksThatDisagreeAreRefusedAndKeepServing) {
  v1::SetBackendResponse ra, rb;
  grpc::Status a, b;
  std::thread t([&] { a = RawSetBackend(0, "mnnvl", "disagree-1", 20s, &ra); });
  b = RawSetBackend(1, "auto", "disagree-1", 20s, &rb);
  t.join();
  EXPECT_EQ(a.error_code(), grpc::StatusCode::ABORTED) << a.error_message();
  EXPECT_EQ(b.error_code(), grpc::StatusCode::ABORTED) << b.error_message();
  EXPECT_THAT(a.error_message(), HasSubstr("ranks disagree on the backend"));
  EXPECT_THAT(a.error_message(), HasSubstr("rank 1 asked for auto"));
  EXPECT_THAT(a.error_message(), HasSubstr("backend unchanged: trtllm"));
  auto [scode, stats] = Ctl({"stats", "--addr=" + Addr(0), "--json"});
  EXPECT_THAT(stats, HasSubstr("\"backend\":\"trtllm\""));
  EXPECT_THAT(stats, HasSubstr("\"state\":\"READY\""));
}

TEST_F(AdminTest, ABadCollectiveIdIsInvalidArgument) {
  v1::SetBackendResponse resp;
  for (const std::string& id : {std::string(), std::string(65, 'a'), std::string("a b")}) {
    grpc::Status s = RawSetBackend(0, "mnnvl", id, 10s, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << id;
    EXPECT_THAT(s.error_message(), HasSubstr("collective_id must be 1-64 characters")) << id;
  }
}

TEST_F(AdminTest, UnknownBackendIsAUsageError) {
  auto [code, out] = Ctl({"set-backend", "--backend=nccl", "--addr=" + Both()});
  EXPECT_EQ(code, 2);
  EXPECT_THAT(out, HasSubstr("unknown backend \"nccl\""));
}

// The same refusal from the sidecar itself, for a client that does not check first.
TEST_F(AdminTest, UnknownBackendOverTheWireIsInvalidArgument) {
  auto channel = grpc::CreateChannel(Addr(0), grpc::InsecureChannelCredentials());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 30s);
  v1::SetBackendRequest req;
  req.set_backend("nccl");
  v1::SetBackendResponse resp;
  grpc::Status s = v1::Admin::NewStub(channel)->SetBackend(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(),
              HasSubstr("unknown backend \"nccl\": expected auto, trtllm, mnnvl or none"));
}

// The API version is checked before the request's fields: a client of another major learns that,
// not that its backend name is unknown.
TEST_F(AdminTest, AnotherApiMajorIsFailedPreconditionBeforeTheBackendIsChecked) {
  auto channel = grpc::CreateChannel(Addr(0), grpc::InsecureChannelCredentials());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 30s);
  ctx.AddMetadata("arfuse-api-version", "2.0");
  v1::SetBackendRequest req;
  req.set_backend("nccl");
  v1::SetBackendResponse resp;
  grpc::Status s = v1::Admin::NewStub(channel)->SetBackend(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("client API version 2.0 is not supported"));
}

// SM80 has no fused backend: a switch to one is refused, and the group keeps its unfused path.
class AdminSm80Test : public AdminTest {
 protected:
  void SetUp() override {
    sm_ = "80";
    AdminTest::SetUp();
  }
};

TEST_F(AdminSm80Test, InfeasibleBackendIsRefused) {
  auto [code, out] = Ctl({"set-backend", "--backend=trtllm", "--addr=" + Both()});
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("FAILED_PRECONDITION: backend trtllm is not feasible"));
  // The group keeps its unfused path, named trtllm as SGLang #23402 names it on SM80.
  EXPECT_THAT(out, HasSubstr("sm 80: the runtime gate"));
  EXPECT_THAT(out, HasSubstr("backend unchanged: trtllm"));
  auto [hcode, h] = Ctl({"health", "--addr=" + Addr(1), "--service=arfuse.v1.Fusion"});
  EXPECT_EQ(hcode, 0) << h;
}

TEST_F(AdminTest, DrainStopsOpsAndReadinessUntilReinitialized) {
  auto [code, out] = Ctl({"drain", "--addr=" + Addr(0)});
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("drained (waited for 0 op(s))"));
  auto [hcode, h] = Ctl({"health", "--addr=" + Addr(0), "--service=arfuse.v1.Fusion"});
  EXPECT_EQ(hcode, 1) << h;
  auto [rcode, rout] = Ctl({"reinitialize", "--addr=" + Both()});
  ASSERT_EQ(rcode, 0) << rout;
  auto [h2code, h2] = Ctl({"health", "--addr=" + Addr(0), "--service=arfuse.v1.Fusion"});
  EXPECT_EQ(h2code, 0) << h2;
}

// ---- GetStats: regions, plans and op counters from the sidecar's real state ----

using ::arfuse::client::Client;
using ::arfuse::client::HostShmBuffer;
using ::arfuse::client::OpDesc;
using ::arfuse::client::Region;
using ::arfuse::client::TensorLoc;

constexpr uint32_t kHidden = 256;
constexpr uint32_t kWorkspaceTokens = 16;              // --max-tokens: the host workspace's slot
constexpr uint64_t kRowBytes = uint64_t{kHidden} * 2;  // bf16
// input | residual | norm_out, each sized for 2 * kWorkspaceTokens tokens, so a plan may ask for
// more tokens than the workspace holds (refused at CreatePlan: the region would hold them).
constexpr uint64_t kTensorBytes = 2 * kWorkspaceTokens * kRowBytes;
constexpr uint64_t kTensorsRegionBytes = 3 * kTensorBytes;
constexpr uint64_t kGammaRegionBytes = kRowBytes;

absl::StatusOr<v1::GetStatsResponse> GetStats(const std::string& socket) {
  auto channel = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  v1::GetStatsResponse out;
  grpc::Status st = v1::Admin::NewStub(channel)->GetStats(&ctx, {}, &out);
  if (!st.ok()) return absl::UnavailableError(st.error_message());
  return out;
}

OpDesc NormOp(const Region& tensors, const Region& gamma, uint32_t max_tokens) {
  OpDesc op;
  op.pattern = Pattern::kAllReduceResidualRmsNorm;
  op.dtype = DType::kBF16;
  op.hidden = kHidden;
  op.max_tokens = max_tokens;
  op.input = TensorLoc{tensors, 0};
  op.residual_in = TensorLoc{tensors, kTensorBytes};
  op.residual_out = op.residual_in;
  op.norm_out = TensorLoc{tensors, 2 * kTensorBytes};
  op.gamma = TensorLoc{gamma, 0};
  return op;
}

class AdminStatsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<::arfuse::testing::DaemonProcess>(
        std::vector<std::string>{"--max-tokens=" + std::to_string(kWorkspaceTokens),
                                 "--hidden=" + std::to_string(kHidden), "--dtype=bf16"});
    ASSERT_TRUE(daemon_->ready) << daemon_->proc->Stderr();
    // Ops need the engine, which comes after the socket accepts.
    ASSERT_TRUE(daemon_->proc->WaitForOutput("event=ready", 60s)) << daemon_->proc->Stderr();
  }

  v1::GetStatsResponse Stats() {
    absl::StatusOr<v1::GetStatsResponse> s = GetStats(daemon_->socket);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : v1::GetStatsResponse{};
  }

  std::unique_ptr<::arfuse::testing::DaemonProcess> daemon_;
};

TEST_F(AdminStatsTest, CountsRegionsPlansAndOpsAndReleasesThem) {
  v1::GetStatsResponse before = Stats();
  EXPECT_EQ(before.sessions(), 0u);
  EXPECT_EQ(before.regions(), 0u);
  EXPECT_EQ(before.region_bytes(), 0u);
  EXPECT_EQ(before.plans(), 0u);
  EXPECT_EQ(before.ops_ok(), 0u);
  EXPECT_EQ(before.ops_failed(), 0u);

  auto client = Client::Connect({.target = daemon_->socket, .client_name = "admin-stats"});
  ASSERT_TRUE(client.ok()) << client.status();
  auto tensors_buf = HostShmBuffer::Create(kTensorsRegionBytes, "tensors");
  auto gamma_buf = HostShmBuffer::Create(kGammaRegionBytes, "gamma");
  ASSERT_TRUE(tensors_buf.ok() && gamma_buf.ok());
  auto tensors = (*client)->RegisterHostBuffer("tensors", *tensors_buf);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  auto gamma = (*client)->RegisterHostBuffer("gamma", *gamma_buf);
  ASSERT_TRUE(gamma.ok()) << gamma.status();
  auto fits = (*client)->CreatePlan(NormOp(*tensors, *gamma, kWorkspaceTokens));
  ASSERT_TRUE(fits.ok()) << fits.status();
  // A plan the workspace can never serve is refused when it is made (docs/security.md), not
  // counted.
  auto too_big = (*client)->CreatePlan(NormOp(*tensors, *gamma, 2 * kWorkspaceTokens));
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(too_big.status().message(), HasSubstr("fusion unavailable for this op: "));

  // 3 ops of 4 tokens and one of 16 complete; one of 0 tokens is refused before the engine and
  // is not an op at all.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*client)->Execute(*fits, 4).ok());
  ASSERT_TRUE((*client)->Execute(*fits, kWorkspaceTokens).ok());
  auto refused = (*client)->Execute(*fits, 0);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("num_tokens"));

  v1::GetStatsResponse during = Stats();
  EXPECT_EQ(during.sessions(), 1u);
  EXPECT_EQ(during.regions(), 2u);
  EXPECT_EQ(during.region_bytes(), kTensorsRegionBytes + kGammaRegionBytes);
  EXPECT_EQ(during.plans(), 1u);
  EXPECT_EQ(during.ops_ok(), 4u);
  EXPECT_EQ(during.ops_failed(), 0u);
  // Host mode runs the CPU implementation: the unfused path, never a fused kernel.
  EXPECT_EQ(during.ops_fused(), 0u);
  EXPECT_EQ(during.ops_unfused(), 4u);
  EXPECT_EQ(during.bytes_reduced(), (3 * 4 + kWorkspaceTokens) * kRowBytes);

  ASSERT_TRUE((*client)->DestroyPlan(*fits).ok());
  ASSERT_TRUE((*client)->Unregister(*gamma).ok());
  v1::GetStatsResponse after_unregister = Stats();
  EXPECT_EQ(after_unregister.regions(), 1u);
  EXPECT_EQ(after_unregister.region_bytes(), kTensorsRegionBytes);
  EXPECT_EQ(after_unregister.plans(), 0u);

  // The client goes away: its session's end releases the rest. The sidecar notices the stream's
  // end asynchronously, hence the bounded poll.
  client->reset();
  v1::GetStatsResponse released;
  for (absl::Time until = absl::Now() + absl::Seconds(15); absl::Now() < until;) {
    released = Stats();
    if (released.sessions() == 0) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(released.sessions(), 0u);
  EXPECT_EQ(released.regions(), 0u);
  EXPECT_EQ(released.region_bytes(), 0u);
  EXPECT_EQ(released.plans(), 0u);
  // Op counters count since the start: the session's end does not take them back.
  EXPECT_EQ(released.ops_ok(), 4u);
  EXPECT_EQ(released.ops_failed(), 0u);
  EXPECT_EQ(released.bytes_reduced(), during.bytes_reduced());
}

TEST_F(AdminStatsTest, SessionsAddUpAcrossClients) {
  auto a = Client::Connect({.target = daemon_->socket, .client_name = "a"});
  auto b = Client::Connect({.target = daemon_->socket, .client_name = "b"});
  ASSERT_TRUE(a.ok() && b.ok());
  auto buf_a = HostShmBuffer::Create(4096, "a");
  auto buf_b = HostShmBuffer::Create(8192, "b");
  ASSERT_TRUE(buf_a.ok() && buf_b.ok());
  // The same name in two sessions is two regions.
  ASSERT_TRUE((*a)->RegisterHostBuffer("r", *buf_a).ok());
  ASSERT_TRUE((*b)->RegisterHostBuffer("r", *buf_b).ok());
  v1::GetStatsResponse both = Stats();
  EXPECT_EQ(both.sessions(), 2u);
  EXPECT_EQ(both.regions(), 2u);
  EXPECT_EQ(both.region_bytes(), 4096u + 8192u);
  // arfusectl shows the same figures, as text and as JSON.
  auto [tcode, text] = RunToCompletion(
      {BinaryPath("tools/arfusectl/arfusectl"), "stats", "--addr=unix:" + daemon_->socket}, {},
      60s);
  ASSERT_EQ(tcode, 0) << text;
  EXPECT_THAT(text, HasSubstr("sessions 2, regions 2 (12288 bytes), plans 0"));
  auto [jcode, json] = RunToCompletion({BinaryPath("tools/arfusectl/arfusectl"), "stats",
                                        "--addr=unix:" + daemon_->socket, "--json"},
                                       {}, 60s);
  ASSERT_EQ(jcode, 0) << json;
  EXPECT_THAT(json, HasSubstr("\"regions\":2,\"region_bytes\":12288,\"plans\":0"));
  // A refused registration changes nothing.
  auto dup = (*a)->RegisterHostBuffer("r", *buf_a);
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(dup.status().message(), HasSubstr("already registered"));
  EXPECT_EQ(Stats().regions(), 2u);

  a->reset();
  v1::GetStatsResponse one;
  for (absl::Time until = absl::Now() + absl::Seconds(15); absl::Now() < until;) {
    one = Stats();
    if (one.sessions() == 1) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(one.sessions(), 1u);
  EXPECT_EQ(one.regions(), 1u);
  EXPECT_EQ(one.region_bytes(), 8192u);
}

}  // namespace
}  // namespace arfuse
