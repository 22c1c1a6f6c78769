// The Fusion service's doorbell wiring (docs/doorbell.md) over a real gRPC server, host shared
// memory and a fake engine with a doorbell plane: CreatePlan{doorbell} fills the Doorbell
// message from the engine's grant, the engine's refusals (a shape that runs unfused, no fused
// workspace) pass through with their reason, DestroyPlan and the end of the session remove the
// plan from the engine before its regions are released, and host mode is refused with
// FAILED_PRECONDITION. Also the GatedEngine's forwarding of the doorbell calls.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "client/cpp/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/daemon/gated_engine.h"
#include "server/engine_api/doorbell_host.h"
#include "server/services/fusion/fusion_service.h"
#include "tests/fusion/fusion_test_server.h"

namespace arfuse {
namespace {

using ::arfuse::client::Client;
using ::arfuse::client::Region;
using ::arfuse::testing::kHidden;
using ::arfuse::testing::kTensorBytes;
using ::arfuse::testing::kTokens;
using ::arfuse::testing::NormBuffers;
using ::arfuse::testing::RegisterNormBuffers;
using ::testing::HasSubstr;

// An engine that is always ready and whose ops do nothing but answer `outcome`: what the tests
// of the doorbell wiring need of an engine besides its doorbell plane.
class ReadyEngine : public Engine {
 public:
  explicit ReadyEngine(OpOutcome outcome) : outcome_(std::move(outcome)) {}
  absl::Status Initialize(Exchange&, absl::Time) override { return absl::OkStatus(); }
  absl::StatusOr<OpOutcome> Execute(const OpArgs&, const ExecContext&) override { return outcome_; }
  void Abort() override {}
  EngineStatus Status() const override {
    EngineStatus st;
    st.state = WorkspaceState::kReady;
    return st;
  }

 private:
  const OpOutcome outcome_;
};

// An engine with a doorbell plane that records what it is asked: slots are handed out in order,
// the grant carries recognisable values, and AddDoorbellPlan can be made to refuse.
class FakeDoorbellEngine final : public ReadyEngine, public DoorbellHost {
 public:
  FakeDoorbellEngine() : ReadyEngine(OpOutcome{ExecPath::kOneShot, "fake"}) {}
  EngineStatus Status() const override {
    EngineStatus st = ReadyEngine::Status();
    st.generation = 3;
    st.backend = "trtllm";
    st.fusion_enabled = true;
    return st;
  }
  DoorbellHost* doorbell_host() override { return this; }

  absl::StatusOr<DoorbellGrant> AddDoorbellPlan(const OpArgs& op, uint32_t max_tokens,
                                                absl::Time) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++adds_;
    last_op_ = op;
    last_max_tokens_ = max_tokens;
    if (!refuse_.ok()) return refuse_;
    DoorbellGrant g;
    g.plane_id = 11;
    g.slot = next_slot_++;
    g.ipc_handle = std::string(64, 'H');
    g.offset = uint64_t{g.slot} * 384;
    g.request_value = 0x52494e47u;
    g.complete_value = 0x444f4e45u;
    g.reset_value = 0;
    g.max_tokens = max_tokens;
    g.twoshot_min_tokens = 3;
    g.path_at_max = ExecPath::kTwoShot;
    g.reason = "doorbell plane: one-shot below 3 tokens, two-shot from 3 tokens (fake)";
    active_.push_back(g.slot);
    return g;
  }
  absl::Status RemoveDoorbellPlan(const DoorbellGrant& grant, absl::Time) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++removes_;
    removed_.push_back(grant.slot);
    if (grant.plane_id != 11) return absl::OkStatus();
    std::erase(active_, grant.slot);
    return absl::OkStatus();
  }

  void Refuse(absl::Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    refuse_ = std::move(s);
  }
  int adds() const {
    std::lock_guard<std::mutex> lock(mu_);
    return adds_;
  }
  int removes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return removes_;
  }
  std::vector<uint32_t> active() const {
    std::lock_guard<std::mutex> lock(mu_);
    return active_;
  }
  std::vector<uint32_t> removed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return removed_;
  }
  OpArgs last_op() const {
    std::lock_guard<std::mutex> lock(mu_);
    return last_op_;
  }
  uint32_t last_max_tokens() const {
    std::lock_guard<std::mutex> lock(mu_);
    return last_max_tokens_;
  }

 private:
  mutable std::mutex mu_;
  absl::Status refuse_;
  int adds_ = 0, removes_ = 0;
  uint32_t next_slot_ = 0;
  std::vector<uint32_t> active_, removed_;
  OpArgs last_op_;
  uint32_t last_max_tokens_ = 0;
};

// An engine without a doorbell plane (as the host engine).
class PlainEngine final : public ReadyEngine {
 public:
  PlainEngine() : ReadyEngine(OpOutcome{ExecPath::kHost, "plain"}) {}
};

// An engine whose doorbell plane is there only for the next `set_planes(n)` looks: the plane of
// an engine re-formed between the service's first look and the queued registration.
class VanishingPlaneEngine final : public ReadyEngine, public DoorbellHost {
 public:
  VanishingPlaneEngine() : ReadyEngine(OpOutcome{ExecPath::kOneShot, "vanishing"}) {}
  DoorbellHost* doorbell_host() override { return planes_.fetch_sub(1) > 0 ? this : nullptr; }
  absl::StatusOr<DoorbellGrant> AddDoorbellPlan(const OpArgs&, uint32_t, absl::Time) override {
    ++adds_;
    return absl::InternalError("unexpected: the plane was gone");
  }
  absl::Status RemoveDoorbellPlan(const DoorbellGrant&, absl::Time) override {
    return absl::OkStatus();
  }
  void set_planes(int n) { planes_ = n; }
  int adds() const { return adds_.load(); }

 private:
  std::atomic<int> planes_{0};
  std::atomic<int> adds_{0};
};

// An engine whose AddDoorbellPlan holds until the test releases it: time for the session to end
// while the plan is being registered.
class SlowDoorbellEngine final : public ReadyEngine, public DoorbellHost {
 public:
  SlowDoorbellEngine() : ReadyEngine(OpOutcome{ExecPath::kOneShot, "slow"}) {}
  DoorbellHost* doorbell_host() override { return this; }
  absl::StatusOr<DoorbellGrant> AddDoorbellPlan(const OpArgs&, uint32_t max_tokens,
                                                absl::Time deadline) override {
    entered.Notify();
    release.WaitForNotificationWithDeadline(deadline);
    DoorbellGrant g;
    g.plane_id = 12;
    g.ipc_handle = std::string(64, 'S');
    g.max_tokens = max_tokens;
    return g;
  }
  absl::Status RemoveDoorbellPlan(const DoorbellGrant&, absl::Time) override {
    ++removes;
    return absl::OkStatus();
  }

  absl::Notification entered, release;
  std::atomic<int> removes{0};
};

class FusionDoorbellTest : public ::testing::Test {
 protected:
  // `device`: kCudaIpc makes the service behave as --device=cuda (the opener still serves host
  // shared memory, so no GPU is needed).
  void Start(MemoryKind device) {
    FusionServiceOptions options;
    options.device = device;
    options.rank = 0;
    options.world_size = 2;
    options.default_deadline = absl::Seconds(20);
    options.doorbell_hop_us = 2.5;
    options.mps_detected = true;
    options.dtype = DType::kFP32;
    server_.Start("/tmp/arfuse-doorbell-svc-XXXXXX", options,
                  [this] { return engine_ptr_.load(); });
  }

  // Start, then connects client_ and registers buffers_ with it: where the tests begin.
  void StartConnected(MemoryKind device) {
    ASSERT_NO_FATAL_FAILURE(Start(device));
    client_ = Connect();
    ASSERT_NE(client_, nullptr);
    buffers_.emplace(RegisterNormBuffers(*client_));
  }

  void TearDown() override {
    // The client leaves first, as it would at the end of a test body, then the service stops.
    buffers_.reset();
    client_.reset();
    server_.Stop();
  }

  std::unique_ptr<Client> Connect() { return server_.Connect("doorbell-test"); }

  static void Ref(v1::RegionRef* ref, const Region& r, uint64_t offset) {
    ref->set_region_id(r.id);
    ref->set_generation(r.generation);
    ref->set_offset(offset);
  }

  // CreatePlan{doorbell} on the raw stub (the Doorbell message as sent).
  grpc::Status CreateDoorbellPlan(Client& c, const Region& r, uint32_t max_tokens,
                                  v1::CreatePlanResponse* resp) {
    v1::CreatePlanRequest req;
    req.set_doorbell(true);
    v1::OpSpec* op = req.mutable_op();
    op->set_pattern(v1::PATTERN_ALLREDUCE_RESIDUAL_RMSNORM);
    op->set_dtype(v1::DTYPE_FP32);
    op->set_hidden(kHidden);
    op->set_max_tokens(max_tokens);
    Ref(op->mutable_input(), r, 0);
    Ref(op->mutable_residual_in(), r, kTensorBytes);
    Ref(op->mutable_residual_out(), r, kTensorBytes);
    Ref(op->mutable_norm_out(), r, 2 * kTensorBytes);
    Ref(op->mutable_gamma(), r, 3 * kTensorBytes);
    grpc::ClientContext ctx;
    c.PrepareContext(&ctx, absl::Seconds(30));
    return c.stub().CreatePlan(&ctx, req, resp);
  }

  // The region's in-flight count as the sidecar lists it.
  uint32_t InFlight(Client& c, const Region& r) {
    auto regions = c.ListRegions();
    EXPECT_TRUE(regions.ok()) << regions.status();
    if (!regions.ok()) return 0;
    for (const auto& info : *regions) {
      if (info.region_id() == r.id) return info.in_flight();
    }
    return 0;
  }

  FakeDoorbellEngine engine_;
  std::atomic<Engine*> engine_ptr_{&engine_};
  ::arfuse::testing::FusionTestServer server_;
  std::unique_ptr<Client> client_;
  std::optional<NormBuffers> buffers_;
};

TEST_F(FusionDoorbellTest, HostModeRefusesTheDoorbellWithFailedPrecondition) {
  ASSERT_NO_FATAL_FAILURE(StartConnected(MemoryKind::kHostShm));
  v1::CreatePlanResponse resp;
  grpc::Status s = CreateDoorbellPlan(*client_, buffers_->region, kTokens, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("the doorbell plane needs --device=cuda"));
  EXPECT_THAT(s.error_message(), HasSubstr("use Execute (eager plane)"));
  EXPECT_EQ(engine_.adds(), 0);
  // No plan was left behind: the region unregisters at once.
  EXPECT_TRUE(client_->Unregister(buffers_->region, absl::Seconds(5)).ok());
}

TEST_F(FusionDoorbellTest, CreatePlanFillsTheDoorbellFromTheEnginesGrant) {
  ASSERT_NO_FATAL_FAILURE(StartConnected(MemoryKind::kCudaIpc));
  v1::CreatePlanResponse resp;
  grpc::Status s = CreateDoorbellPlan(*client_, buffers_->region, kTokens, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_NE(resp.plan_id(), 0u);
  ASSERT_TRUE(resp.has_doorbell());
  EXPECT_EQ(resp.doorbell().ipc_handle(), std::string(64, 'H'));
  EXPECT_EQ(resp.doorbell().offset(), 0u);
  EXPECT_EQ(resp.doorbell().request_value(), 0x52494e47u);
  EXPECT_EQ(resp.doorbell().complete_value(), 0x444f4e45u);
  EXPECT_EQ(resp.doorbell().reset_value(), 0u);
  EXPECT_EQ(resp.path(), v1::EXEC_PATH_TWOSHOT);
  EXPECT_THAT(resp.reason(), HasSubstr("two-shot from 3 tokens"));
  // The engine got the plan's tensors resolved at max_tokens.
  EXPECT_EQ(engine_.last_max_tokens(), kTokens);
  const OpArgs op = engine_.last_op();
  EXPECT_EQ(op.hidden, kHidden);
  EXPECT_EQ(op.dtype, DType::kFP32);
  EXPECT_EQ(op.pattern, Pattern::kAllReduceResidualRmsNorm);
  EXPECT_NE(op.input, nullptr);
  EXPECT_NE(op.gamma, nullptr);
  EXPECT_EQ(static_cast<const char*>(op.residual_in) - static_cast<const char*>(op.input),
            static_cast<ptrdiff_t>(kTensorBytes));
  // While the plane may write them, the plan's regions are held.
  EXPECT_EQ(InFlight(*client_, buffers_->region), 1u);
  // A second plan gets the next slot.
  v1::CreatePlanResponse second;
  ASSERT_TRUE(CreateDoorbellPlan(*client_, buffers_->region, 2, &second).ok());
  EXPECT_EQ(second.doorbell().offset(), 384u);
  EXPECT_EQ(engine_.active(), (std::vector<uint32_t>{0, 1}));

  // DestroyPlan removes it from the engine, then releases the regions.
  client::Plan plan;
  plan.id = resp.plan_id();
  plan.generation = resp.generation();
  ASSERT_TRUE(client_->DestroyPlan(plan).ok());
  EXPECT_EQ(engine_.active(), (std::vector<uint32_t>{1}));
  EXPECT_EQ(engine_.removed(), (std::vector<uint32_t>{0}));
  // Destroying it again is the registry's PERMISSION_DENIED and removes nothing more.
  EXPECT_EQ(client_->DestroyPlan(plan).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(engine_.removes(), 1);
  // The second plan still holds the region.
  EXPECT_EQ(InFlight(*client_, buffers_->region), 1u);
  client::Plan plan2;
  plan2.id = second.plan_id();
  plan2.generation = second.generation();
  ASSERT_TRUE(client_->DestroyPlan(plan2).ok());
  EXPECT_EQ(InFlight(*client_, buffers_->region), 0u);
  EXPECT_TRUE(engine_.active().empty());
  EXPECT_TRUE(client_->Unregister(buffers_->region, absl::Seconds(5)).ok());

  auto info = client_->GetWorkspaceInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_DOUBLE_EQ(info->doorbell_hop_us(), 2.5);
  EXPECT_TRUE(info->mps_detected());
}

TEST_F(FusionDoorbellTest, TheEnginesRefusalPassesThroughAndLeavesNoPlan) {
  ASSERT_NO_FATAL_FAILURE(StartConnected(MemoryKind::kCudaIpc));
  engine_.Refuse(absl::FailedPreconditionError(
      "a plan of 4096 tokens x 8192 hidden bf16 runs unfused at max_tokens (payload above the "
      "fused limits); the doorbell plane runs only the fused kernels: use the eager plane"));
  v1::CreatePlanResponse resp;
  grpc::Status s = CreateDoorbellPlan(*client_, buffers_->region, kTokens, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("runs unfused"));
  EXPECT_THAT(s.error_message(), HasSubstr("use the eager plane"));
  EXPECT_EQ(engine_.adds(), 1);
  // The plan and its hold are gone: the region is free and unregisters at once.
  EXPECT_EQ(InFlight(*client_, buffers_->region), 0u);
  EXPECT_TRUE(client_->Unregister(buffers_->region, absl::Seconds(5)).ok());
}

TEST_F(FusionDoorbellTest, AnEngineWithoutADoorbellPlaneIsRefused) {
  PlainEngine plain;
  engine_ptr_ = &plain;
  ASSERT_NO_FATAL_FAILURE(StartConnected(MemoryKind::kCudaIpc));
  v1::CreatePlanResponse resp;
  grpc::Status s = CreateDoorbellPlan(*client_, buffers_->region, kTokens, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("no doorbell plane"));
  // Engine still initializing: UNAVAILABLE (retry).
  engine_ptr_ = nullptr;
  s = CreateDoorbellPlan(*client_, buffers_->region, kTokens, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("engine is still initializing"));
  engine_ptr_ = &engine_;
}

TEST_F(FusionDoorbellTest, APlaneGoneBeforeTheQueuedRegistrationIsRefused) {
  VanishingPlaneEngine vanishing;
  engine_ptr_ = &vanishing;
  ASSERT_NO_FATAL_FAILURE(StartConnected(MemoryKind::kCudaIpc));
  vanishing.set_planes(1);  // the service's first look finds the plane, the queued one does not
  v1::CreatePlanResponse resp;
  grpc::Status s = CreateDoorbellPlan(*client_, buffers_->region, kTokens, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(),
              HasSubstr("engine has no doorbell plane; use the eager plane (Execute)"));
  EXPECT_EQ(vanishing.adds(), 0);
  // No plan and no hold were left behind.
  EXPECT_EQ(InFlight(*client_, buffers_->region), 0u);
  EXPECT_TRUE(client_->Unregister(buffers_->region, absl::Seconds(5)).ok());
  engine_ptr_ = &engine_;
}

TEST_F(FusionDoorbellTest, ASessionThatEndsDuringTheRegistrationGetsNoPlan) {
  SlowDoorbellEngine slow;
  engine_ptr_ = &slow;
  ASSERT_NO_FATAL_FAILURE(StartConnected(MemoryKind::kCudaIpc));
  v1::CreatePlanResponse resp;
  grpc::Status s;
  std::thread call([&] { s = CreateDoorbellPlan(*client_, buffers_->region, kTokens, &resp); });
  EXPECT_TRUE(slow.entered.WaitForNotificationWithTimeout(absl::Seconds(30)));
  // The session ends (as when its stream breaks) while the engine registers the plan.
  absl::StatusOr<uint64_t> session = server_.service()->registry().FindSession(
      client_->session().session_token, SessionOwner{::geteuid(), ""});
  ASSERT_TRUE(session.ok()) << session.status();
  server_.service()->registry().CloseSession(*session);
  slow.release.Notify();
  call.join();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("the session ended; the plan was removed"));
  // The plane's registration was taken back.
  EXPECT_EQ(slow.removes.load(), 1);
  engine_ptr_ = &engine_;
}

TEST_F(FusionDoorbellTest, SessionEndRemovesItsDoorbellPlans) {
  ASSERT_NO_FATAL_FAILURE(StartConnected(MemoryKind::kCudaIpc));
  v1::CreatePlanResponse resp;
  ASSERT_TRUE(CreateDoorbellPlan(*client_, buffers_->region, kTokens, &resp).ok());
  ASSERT_TRUE(CreateDoorbellPlan(*client_, buffers_->region, 1, &resp).ok());
  EXPECT_EQ(engine_.active().size(), 2u);
  // The client goes away with its plans.
  buffers_.reset();
  client_.reset();
  EXPECT_TRUE(
      ::arfuse::testing::WaitFor([&] { return engine_.active().empty(); }, absl::Seconds(30)));
  EXPECT_EQ(engine_.removes(), 2);
  // Another session's plans are untouched by that.
  auto c2 = Connect();
  ASSERT_NE(c2, nullptr);
  auto b2 = RegisterNormBuffers(*c2, "other");
  ASSERT_TRUE(CreateDoorbellPlan(*c2, b2.region, kTokens, &resp).ok());
  EXPECT_EQ(engine_.active().size(), 1u);
}

// ---- GatedEngine forwarding ----

TEST(GatedEngineDoorbellTest, ForwardsThroughTheGate) {
  GatedEngine gate;
  ASSERT_NE(gate.doorbell_host(), nullptr);
  OpArgs op;
  // Empty: UNAVAILABLE to add, nothing to remove.
  auto added = gate.AddDoorbellPlan(op, 4, absl::Now() + absl::Seconds(1));
  EXPECT_EQ(added.status().code(), absl::StatusCode::kUnavailable);
  DoorbellGrant stale;
  stale.plane_id = 5;
  EXPECT_TRUE(gate.RemoveDoorbellPlan(stale, absl::Now() + absl::Seconds(1)).ok());

  auto owned = std::make_unique<FakeDoorbellEngine>();
  FakeDoorbellEngine* fake = owned.get();
  ASSERT_TRUE(gate.Swap(std::move(owned)).ok());
  // Installed but closed: still UNAVAILABLE.
  EXPECT_EQ(gate.AddDoorbellPlan(op, 4, absl::Now() + absl::Seconds(1)).status().code(),
            absl::StatusCode::kUnavailable);
  gate.Resume();
  added = gate.AddDoorbellPlan(op, 4, absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(added.ok()) << added.status();
  EXPECT_EQ(fake->adds(), 1);
  EXPECT_EQ(gate.ops_in_flight(), 0u);
  // Removal reaches the engine even while the gate is drained (a client leaving mid re-form).
  ASSERT_TRUE(gate.Drain(absl::Now() + absl::Seconds(1)).ok());
  EXPECT_TRUE(gate.RemoveDoorbellPlan(*added, absl::Now() + absl::Seconds(1)).ok());
  EXPECT_EQ(fake->removes(), 1);
  EXPECT_TRUE(fake->active().empty());

  // An engine without a doorbell plane: FAILED_PRECONDITION to add, OK to remove.
  ASSERT_TRUE(gate.Swap(std::make_unique<PlainEngine>()).ok());
  gate.Resume();
  added = gate.AddDoorbellPlan(op, 4, absl::Now() + absl::Seconds(1));
  EXPECT_EQ(added.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(added.status().message(), HasSubstr("--device=cuda"));
  EXPECT_TRUE(gate.RemoveDoorbellPlan(stale, absl::Now() + absl::Seconds(1)).ok());
}

}  // namespace
}  // namespace arfuse
