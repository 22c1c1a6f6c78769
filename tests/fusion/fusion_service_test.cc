// The Fusion service over a real gRPC server on a Unix socket, host shared memory and a fake
// engine: the eager plane end to end, every bad input of docs/reliability.md ("Bad input tried")
// that reaches the service, and the faults of ops in flight (unregister, disconnect, queue full,
// shutdown, deadlines).
#include "server/services/fusion/fusion_service.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/cpp/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/fusion/fake_engine.h"
#include "tests/fusion/fusion_test_server.h"

namespace arfuse {
namespace {

using ::arfuse::client::Client;
using ::arfuse::client::ExecOptions;
using ::arfuse::client::HostShmBuffer;
using ::arfuse::client::OpDesc;
using ::arfuse::client::Region;
using ::arfuse::client::TensorLoc;
using ::arfuse::testing::FakeEngine;
using ::arfuse::testing::FusionTestServer;
using ::arfuse::testing::kHidden;
using ::arfuse::testing::kTensorBytes;
using ::arfuse::testing::kTokens;
using ::arfuse::testing::NormBuffers;
using ::testing::HasSubstr;

// An Execute in flight on the raw async stub.
struct AsyncCall {
  grpc::ClientContext ctx;
  v1::ExecuteRequest req;
  v1::ExecuteResponse resp;
  grpc::Status status;
  absl::Notification done;

  // Waits for the reply; false when none came within a minute.
  bool Wait() { return done.WaitForNotificationWithTimeout(absl::Seconds(60)); }
};

class FusionServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(FusionServiceOptions{}); }

  void Start(FusionServiceOptions options, std::unique_ptr<EventIpc> events = nullptr) {
    baseline_ = OpenMappingCount();
    options.device = MemoryKind::kHostShm;
    options.rank = 1;
    options.world_size = 2;
    // The workspace the tests' fp32 ops fit (ops beyond it are refused: OUT_OF_RANGE).
    options.dtype = DType::kFP32;
    if (options.default_deadline == absl::Seconds(30)) options.default_deadline = absl::Seconds(20);
    engine_ = std::make_unique<FakeEngine>();
    engine_ptr_ = engine_.get();
    ASSERT_NO_FATAL_FAILURE(server_.Start(
        "/tmp/arfuse-fusion-test-XXXXXX", options, [this] { return engine_ptr_.load(); },
        std::move(events)));
    channel_ = grpc::CreateChannel("unix:" + server_.socket(), grpc::InsecureChannelCredentials());
    stub_ = v1::Fusion::NewStub(channel_);
  }

  void Stop() {
    if (!server_.running()) return;
    engine_->OpenGate();  // ops held at the gate finish, so the service can end them
    server_.Stop();
  }

  void TearDown() override {
    Stop();
    EXPECT_EQ(OpenMappingCount(), baseline_);
  }

  std::unique_ptr<Client> Connect(const std::string& name = "test") {
    return server_.Connect(name);
  }

  NormBuffers MakeNorm(Client& c, const std::string& name = "buf") {
    NormBuffers b = ::arfuse::testing::RegisterNormBuffers(c, name);
    for (uint64_t i = 0; i < kTokens * kHidden; ++i) {
      b.input()[i] = 0.25f * static_cast<float>(i % 13) - 1.0f;
      b.residual()[i] = 0.5f;
    }
    for (uint32_t h = 0; h < kHidden; ++h) b.gamma()[h] = 1.0f + 0.01f * h;
    return b;
  }

  // A connected client, MakeNorm's buffers registered with it and a plan of the fused op over
  // them: where most tests start.
  struct Planned {
    std::unique_ptr<Client> c;
    NormBuffers b;
    client::Plan plan;
  };
  Planned ConnectWithPlan() {
    auto c = Connect();
    NormBuffers b = MakeNorm(*c);
    auto plan = *c->CreatePlan(b.Op());
    return Planned{std::move(c), std::move(b), std::move(plan)};
  }

  // Raw call with version and session metadata (and no deadline unless `timeout` > 0).
  void Prepare(grpc::ClientContext* ctx, const std::string& session, absl::Duration timeout) {
    ctx->AddMetadata("arfuse-api-version", "1.1");
    ctx->AddMetadata("arfuse-session", session);
    if (timeout > absl::ZeroDuration()) {
      ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    }
  }

  std::unique_ptr<AsyncCall> StartExecute(const std::string& session, const client::Plan& plan,
                                          uint32_t tokens,
                                          absl::Duration timeout = absl::Seconds(60)) {
    auto call = std::make_unique<AsyncCall>();
    Prepare(&call->ctx, session, timeout);
    call->req.set_plan_id(plan.id);
    call->req.set_plan_generation(plan.generation);
    call->req.set_num_tokens(tokens);
    AsyncCall* raw = call.get();
    stub_->async()->Execute(&raw->ctx, &raw->req, &raw->resp, [raw](grpc::Status s) {
      raw->status = std::move(s);
      raw->done.Notify();
    });
    return call;
  }

  bool WaitFor(const std::function<bool()>& cond) {
    return ::arfuse::testing::WaitFor(cond, absl::Seconds(60));
  }

  int64_t baseline_ = 0;
  std::unique_ptr<FakeEngine> engine_;
  std::atomic<Engine*> engine_ptr_{nullptr};
  FusionTestServer server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Fusion::Stub> stub_;
};

TEST_F(FusionServiceTest, SessionCarriesIdentity) {
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->session().session_token.size(), 32u);
  EXPECT_EQ(c->session().device, v1::DEVICE_KIND_HOST);
  EXPECT_EQ(c->session().rank, 1u);
  EXPECT_EQ(c->session().world_size, 2u);
  EXPECT_EQ(c->session().server_api_major, 1u);
  auto info = c->GetWorkspaceInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state(), v1::WORKSPACE_STATE_READY);
  EXPECT_EQ(info->generation(), 7u);
  EXPECT_EQ(info->device(), v1::DEVICE_KIND_HOST);
}

// The client refuses a keepalive interval outside 1 s .. 2 h before it dials.
TEST(ClientOptionsTest, KeepaliveOutsideItsRangeIsRefused) {
  for (absl::Duration bad : {absl::Milliseconds(999), absl::ZeroDuration(), absl::Hours(3)}) {
    client::ClientOptions o;
    o.target = "unix:/nonexistent/arfuse.sock";
    o.keepalive_time = bad;
    auto c = client::Client::Connect(o);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(c.status().message(), HasSubstr("keepalive_time must be within 1s..2h"));
  }
}

TEST(ClientExecPathName, EveryPathHasItsShortName) {
  EXPECT_STREQ(client::ExecPathName(v1::EXEC_PATH_ONESHOT), "oneshot");
  EXPECT_STREQ(client::ExecPathName(v1::EXEC_PATH_TWOSHOT), "twoshot");
  EXPECT_STREQ(client::ExecPathName(v1::EXEC_PATH_UNFUSED), "unfused");
  EXPECT_STREQ(client::ExecPathName(v1::EXEC_PATH_HOST), "host");
  EXPECT_STREQ(client::ExecPathName(v1::EXEC_PATH_UNSPECIFIED), "unknown");
  EXPECT_STREQ(client::ExecPathName(static_cast<v1::ExecPath>(99)), "unknown");
}

TEST_F(FusionServiceTest, ExecutePlanWritesTheOutputs) {
  auto c = Connect();
  NormBuffers b = MakeNorm(*c);
  auto plan = c->CreatePlan(b.Op());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->path, v1::EXEC_PATH_HOST);
  std::vector<float> in(b.input(), b.input() + kTokens * kHidden);
  auto r = c->Execute(*plan, 3);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->path, v1::EXEC_PATH_HOST);
  EXPECT_EQ(r->reason, "fake engine");
  EXPECT_TRUE(r->done_event.empty());
  EXPECT_EQ(r->workspace_generation, 7u);
  for (uint32_t t = 0; t < kTokens; ++t) {
    double ss = 0;
    for (uint32_t h = 0; h < kHidden; ++h) {
      double v = 2.0 * in[t * kHidden + h] + 0.5;
      ss += v * v;
    }
    for (uint32_t h = 0; h < kHidden; ++h) {
      size_t i = t * kHidden + h;
      if (t < 3) {
        double v = 2.0 * in[i] + 0.5;
        EXPECT_FLOAT_EQ(b.residual()[i], static_cast<float>(v)) << i;
        EXPECT_NEAR(b.norm()[i], v / std::sqrt(ss / kHidden + 1e-5) * (1.0 + 0.01 * h), 1e-4);
      } else {
        EXPECT_EQ(b.residual()[i], 0.5f) << "token 3 was not part of the op";
      }
    }
  }
  EXPECT_TRUE(engine_->last_ctx().synchronous);
}

TEST_F(FusionServiceTest, ExecuteExplicitAllReduceInPlace) {
  auto c = Connect();
  auto buf = *HostShmBuffer::CreateNamed(kTensorBytes);
  auto region = *c->RegisterHostShm("x", buf.shm_name(), buf.size());
  float* x = static_cast<float*>(buf.data());
  for (uint64_t i = 0; i < kTokens * kHidden; ++i) x[i] = float(i);
  OpDesc op;
  op.pattern = Pattern::kAllReduce;
  op.dtype = DType::kFP32;
  op.hidden = kHidden;
  op.input = TensorLoc{region, 0};
  op.output = op.input;
  auto r = c->ExecuteOp(op, kTokens);
  ASSERT_TRUE(r.ok()) << r.status();
  for (uint64_t i = 0; i < kTokens * kHidden; ++i) ASSERT_EQ(x[i], 2.0f * float(i));
}

TEST_F(FusionServiceTest, CallsWithoutASessionAreRefused) {
  v1::ListRegionsRequest req;
  v1::ListRegionsResponse resp;
  {
    grpc::ClientContext ctx;
    grpc::Status s = stub_->ListRegions(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("no session: open a Fusion.Session stream"));
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("arfuse-session", "12abc");
    grpc::Status s = stub_->ListRegions(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(s.error_message(), HasSubstr("names no open session of this caller"));
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("arfuse-session", "12345");
    grpc::Status s = stub_->ListRegions(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(s.error_message(), HasSubstr("names no open session of this caller"));
  }
}

TEST_F(FusionServiceTest, AnotherApiVersionIsRefusedNamingBoth) {
  auto c = Connect();
  grpc::ClientContext ctx;
  ctx.AddMetadata("arfuse-api-version", "2.0");
  ctx.AddMetadata("arfuse-session", c->session().session_token);
  v1::ExecuteRequest req;
  v1::ExecuteResponse resp;
  grpc::Status s = stub_->Execute(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("2.0"));
  EXPECT_THAT(s.error_message(), HasSubstr("1.1"));

  grpc::ClientContext sctx;
  sctx.AddMetadata("arfuse-api-version", "3.1");
  auto stream = stub_->Session(&sctx);
  v1::SessionRequest hello;
  stream->Write(hello);
  v1::SessionResponse sresp;
  EXPECT_FALSE(stream->Read(&sresp));
  grpc::Status fs = stream->Finish();
  EXPECT_EQ(fs.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(fs.error_message(), HasSubstr("3.1"));
}

TEST_F(FusionServiceTest, EngineStillInitializingIsUnavailable) {
  auto [c, b, plan] = ConnectWithPlan();
  engine_ptr_ = nullptr;
  auto r = c->Execute(plan, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("still initializing"));
  auto info = c->GetWorkspaceInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state(), v1::WORKSPACE_STATE_INITIALIZING);
  engine_ptr_ = engine_.get();
  EXPECT_TRUE(c->Execute(plan, 1).ok());
}

TEST_F(FusionServiceTest, BadInputGetsSpecificStatusesAndTheSidecarKeepsServing) {
  auto [c, b, plan] = ConnectWithPlan();
  struct Expect {
    absl::Status status;
    absl::StatusCode code;
    const char* text;
  };
  client::Plan unknown = plan;
  unknown.id += 1000;
  client::Plan stale = plan;
  stale.generation ^= 1;
  OpDesc bad_hidden = b.Op();
  bad_hidden.hidden = 60;
  OpDesc no_gamma = b.Op();
  no_gamma.gamma.reset();
  OpDesc bad_dtype = b.Op();
  bad_dtype.dtype = static_cast<DType>(9);
  OpDesc misaligned = b.Op();
  misaligned.norm_out->offset += 4;
  OpDesc past_end = b.Op();
  past_end.gamma->offset = b.buf.size() - 16;
  OpDesc stale_region = b.Op();
  stale_region.input->region.generation ^= 1;
  OpDesc unknown_region = b.Op();
  unknown_region.gamma->region.id += 1000;
  ExecOptions with_event;
  with_event.wait_event = std::string(64, 'e');
  ExecOptions stale_ws;
  stale_ws.workspace_generation = 6;
  std::vector<Expect> cases = {
      {c->Execute(unknown, 1).status(), absl::StatusCode::kPermissionDenied,
       "not held by this session"},
      {c->Execute(stale, 1).status(), absl::StatusCode::kFailedPrecondition, "stale generation"},
      {c->Execute(plan, kTokens + 1).status(), absl::StatusCode::kInvalidArgument,
       "exceeds the plan's max_tokens"},
      {c->Execute(plan, 0).status(), absl::StatusCode::kInvalidArgument, "num_tokens must be > 0"},
      {c->Execute(plan, 1, with_event).status(), absl::StatusCode::kInvalidArgument,
       "wait_event is only for --device=cuda"},
      {c->Execute(plan, 1, stale_ws).status(), absl::StatusCode::kFailedPrecondition,
       "workspace: stale generation"},
      {c->CreatePlan(bad_hidden).status(), absl::StatusCode::kInvalidArgument, "multiple of 8"},
      {c->CreatePlan(no_gamma).status(), absl::StatusCode::kInvalidArgument,
       "needs gamma, which is missing"},
      {c->CreatePlan(bad_dtype).status(), absl::StatusCode::kInvalidArgument,
       "dtype 9 is not supported"},
      {c->CreatePlan(misaligned).status(), absl::StatusCode::kInvalidArgument,
       "not a multiple of 16"},
      {c->CreatePlan(past_end).status(), absl::StatusCode::kInvalidArgument, "end past the region"},
      {c->CreatePlan(stale_region).status(), absl::StatusCode::kFailedPrecondition,
       "stale generation"},
      {c->CreatePlan(unknown_region).status(), absl::StatusCode::kNotFound,
       "not registered in this session"},
      {c->CreatePlan(b.Op(), /*doorbell=*/true).status(), absl::StatusCode::kFailedPrecondition,
       "the doorbell plane needs --device=cuda"},
      {c->RegisterHostShm("buf", b.buf.shm_name(), 64).status(), absl::StatusCode::kAlreadyExists,
       "already registered"},
      {c->RegisterHostShm("big", b.buf.shm_name(), b.buf.size() + 1).status(),
       absl::StatusCode::kInvalidArgument, "exceeds the exported allocation"},
      {c->RegisterHostShm("none", "/arfuse-does-not-exist-42", 64).status(),
       absl::StatusCode::kInvalidArgument, "could not be opened"},
      {c->RegisterCudaIpc("gpu", std::string(64, 'h'), 0, 64).status(),
       absl::StatusCode::kInvalidArgument, "serves host_shm regions, not cuda_ipc"},
      {c->Unregister(Region{999, 1, "", 0}), absl::StatusCode::kNotFound, "not registered"},
      {c->DestroyPlan(stale), absl::StatusCode::kFailedPrecondition, "stale generation"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(cases[i].status.code(), cases[i].code) << i << ": " << cases[i].status;
    EXPECT_THAT(cases[i].status.message(), HasSubstr(cases[i].text)) << i;
    EXPECT_THAT(cases[i].status.message(), ::testing::Not(HasSubstr("does-not-exist"))) << i;
  }
  // Unknown enum values from a newer client, straight through the wire.
  grpc::ClientContext ctx;
  Prepare(&ctx, c->session().session_token, absl::Seconds(30));
  v1::CreatePlanRequest req;
  req.mutable_op()->set_pattern(static_cast<v1::Pattern>(42));
  v1::CreatePlanResponse resp;
  grpc::Status s = stub_->CreatePlan(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("pattern 42 is not supported"));
  // Still serving.
  EXPECT_TRUE(c->Execute(plan, kTokens).ok());
}

TEST_F(FusionServiceTest, CreatePlanWithoutAnOpIsInvalidArgument) {
  auto c = Connect();
  grpc::ClientContext ctx;
  Prepare(&ctx, c->session().session_token, absl::Seconds(30));
  v1::CreatePlanRequest req;
  v1::CreatePlanResponse resp;
  grpc::Status s = stub_->CreatePlan(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("op is missing"));
}

// Interprocess events that are never opened: with them the service takes wait_event as
// --device=cuda does, and checks its length before opening anything.
class UnopenedEventIpc final : public EventIpc {
 public:
  absl::StatusOr<std::unique_ptr<OpEvents>> Prepare(const std::string&) override {
    return absl::InternalError("unexpected: the request should have been refused first");
  }
};

TEST_F(FusionServiceTest, WaitEventOfTheWrongLengthIsInvalidArgument) {
  Stop();
  Start(FusionServiceOptions{}, std::make_unique<UnopenedEventIpc>());
  auto [c, b, plan] = ConnectWithPlan();
  for (size_t len : {1, 63, 65}) {
    ExecOptions o;
    o.wait_event = std::string(len, 'e');
    auto r = c->Execute(plan, 1, o);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << len;
    EXPECT_THAT(r.status().message(),
                HasSubstr(absl::StrCat("wait_event must be exactly 64 bytes, got ", len)));
  }
  EXPECT_EQ(engine_->calls(), 0);
}

TEST_F(FusionServiceTest, EngineErrorsPassThrough) {
  auto [c, b, plan] = ConnectWithPlan();
  engine_->FailWith(absl::AbortedError("rank 0 did not arrive; workspace poisoned"));
  auto r = c->Execute(plan, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(r.status().message(), HasSubstr("rank 0 did not arrive"));
  // The op released its regions even though it failed.
  EXPECT_TRUE(c->Unregister(b.region).ok());
}

TEST_F(FusionServiceTest, ARequestWithoutDeadlineGetsTheDefault) {
  auto [c, b, plan] = ConnectWithPlan();
  absl::Time before = absl::Now();
  auto call = StartExecute(c->session().session_token, plan, 1, absl::ZeroDuration());
  ASSERT_TRUE(call->Wait());
  EXPECT_TRUE(call->status.ok()) << call->status.error_message();
  absl::Time deadline = engine_->last_ctx().deadline;
  EXPECT_GE(deadline, before + absl::Seconds(20) - absl::Milliseconds(200));
  EXPECT_LE(deadline, absl::Now() + absl::Seconds(20));
  // A client deadline wins.
  absl::Time before2 = absl::Now();
  auto call2 = StartExecute(c->session().session_token, plan, 1, absl::Seconds(3));
  ASSERT_TRUE(call2->Wait());
  // The service keeps a small margin before the client's deadline to send a specific error.
  EXPECT_LE(engine_->last_ctx().deadline, absl::Now() + absl::Seconds(3));
  EXPECT_GE(engine_->last_ctx().deadline, before2 + absl::Seconds(2));
}

TEST_F(FusionServiceTest, UnregisterDuringAnOpWaitsOrTimesOutCleanly) {
  auto [c, b, plan] = ConnectWithPlan();
  engine_->CloseGate();
  auto call = StartExecute(c->session().session_token, plan, 2);
  ASSERT_TRUE(engine_->WaitEntered(1));
  absl::Status s = c->Unregister(b.region, absl::Milliseconds(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("in flight; it stays registered"));
  engine_->OpenGate();
  ASSERT_TRUE(call->Wait());
  EXPECT_TRUE(call->status.ok()) << call->status.error_message();
  EXPECT_TRUE(c->Unregister(b.region).ok());
  EXPECT_TRUE(c->ListRegions()->empty());
}

TEST_F(FusionServiceTest, FullQueueIsRefusedCleanly) {
  Stop();
  FusionServiceOptions o;
  o.max_queued_ops = 1;
  Start(o);
  auto [c, b, plan] = ConnectWithPlan();
  engine_->CloseGate();
  auto first = StartExecute(c->session().session_token, plan, 1);
  ASSERT_TRUE(engine_->WaitEntered(1));
  auto second = StartExecute(c->session().session_token, plan, 1);
  ASSERT_TRUE(WaitFor([&] { return server_.service()->queued_ops() == 1; }));
  auto third = c->Execute(plan, 1);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("already wait for this workspace"));
  engine_->OpenGate();
  ASSERT_TRUE(first->Wait());
  ASSERT_TRUE(second->Wait());
  EXPECT_TRUE(first->status.ok());
  EXPECT_TRUE(second->status.ok());
  EXPECT_EQ(engine_->calls(), 2);
}

TEST_F(FusionServiceTest, AnOpQueuedPastItsDeadlineDoesNotRun) {
  auto [c, b, plan] = ConnectWithPlan();
  engine_->CloseGate();
  auto first = StartExecute(c->session().session_token, plan, 1);
  ASSERT_TRUE(engine_->WaitEntered(1));
  auto late = StartExecute(c->session().session_token, plan, 1, absl::Milliseconds(200));
  ASSERT_TRUE(late->Wait());
  EXPECT_EQ(late->status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  engine_->OpenGate();
  ASSERT_TRUE(first->Wait());
  // The late op was dequeued without reaching the engine; a later op proves the queue moved on.
  EXPECT_TRUE(c->Execute(plan, 1).ok());
  EXPECT_EQ(engine_->calls(), 2);
}

TEST_F(FusionServiceTest, ShutdownEndsQueuedOpsWithUnavailable) {
  auto [c, b, plan] = ConnectWithPlan();
  engine_->CloseGate();
  auto first = StartExecute(c->session().session_token, plan, 1);
  ASSERT_TRUE(engine_->WaitEntered(1));
  auto queued = StartExecute(c->session().session_token, plan, 1);
  ASSERT_TRUE(WaitFor([&] { return server_.service()->queued_ops() == 1; }));
  server_.service()->Shutdown();
  ASSERT_TRUE(queued->Wait());
  EXPECT_EQ(queued->status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(queued->status.error_message(), HasSubstr("shutting down; the op did not run"));
  engine_->OpenGate();
  ASSERT_TRUE(first->Wait());
  EXPECT_TRUE(first->status.ok());
  auto after = c->Execute(plan, 1);
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(FusionServiceTest, AClientThatDisconnectsMidOpHasItsRegionsReleased) {
  auto keeper = Connect("keeper");
  NormBuffers kb = MakeNorm(*keeper, "keep");
  auto kplan = *keeper->CreatePlan(kb.Op());
  const int64_t with_keeper = OpenMappingCount();

  auto leaver = Connect("leaver");
  NormBuffers lb = MakeNorm(*leaver, "leave");
  auto extra = *HostShmBuffer::CreateNamed(4096);
  ASSERT_TRUE(leaver->RegisterHostShm("extra", extra.shm_name(), 4096).ok());
  auto lplan = *leaver->CreatePlan(lb.Op());
  EXPECT_EQ(OpenMappingCount(), with_keeper + 2);
  engine_->CloseGate();
  auto call = StartExecute(leaver->session().session_token, lplan, 2);
  ASSERT_TRUE(engine_->WaitEntered(1));
  leaver.reset();  // the session stream ends while its op runs
  // "extra" is unmapped at once; the op's region stays mapped while the op runs.
  ASSERT_TRUE(WaitFor([&] { return OpenMappingCount() == with_keeper + 1; }));
  EXPECT_EQ(server_.service()->registry().session_count(), 1u);
  engine_->OpenGate();
  ASSERT_TRUE(call->Wait());
  EXPECT_TRUE(call->status.ok()) << call->status.error_message();
  EXPECT_TRUE(WaitFor([&] { return OpenMappingCount() == with_keeper; }));
  // The other client is unaffected.
  EXPECT_TRUE(keeper->Execute(kplan, 1).ok());
}

TEST_F(FusionServiceTest, SessionEndReleasesEverything) {
  {
    auto c = Connect();
    NormBuffers b = MakeNorm(*c);
    ASSERT_TRUE(c->CreatePlan(b.Op()).ok());
    EXPECT_EQ(OpenMappingCount(), baseline_ + 1);
  }
  EXPECT_TRUE(WaitFor([&] { return server_.service()->registry().session_count() == 0; }));
  EXPECT_TRUE(WaitFor([&] { return OpenMappingCount() == baseline_; }));
}

TEST_F(FusionServiceTest, RegionsAreListedWithInFlightCounts) {
  auto [c, b, plan] = ConnectWithPlan();
  engine_->CloseGate();
  auto call = StartExecute(c->session().session_token, plan, 1);
  ASSERT_TRUE(engine_->WaitEntered(1));
  auto list = c->ListRegions();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].name(), "buf");
  EXPECT_EQ((*list)[0].in_flight(), 1u);  // one op, whatever its tensor count
  EXPECT_EQ((*list)[0].device(), v1::DEVICE_KIND_HOST);
  engine_->OpenGate();
  ASSERT_TRUE(call->Wait());
}

// ---- host memory by descriptor (docs/security.md): the service claims the ticket ----

// Nobody's credentials are known (a TCP client).
class NoCredentials final : public CallerCredentials {
 public:
  std::optional<SocketCredentials> ForPeer(absl::string_view) const override {
    return std::nullopt;
  }
};

class FusionFdTest : public ::testing::Test {
 protected:
  void Start(FdTicketBroker* broker, const CallerCredentials* callers = nullptr) {
    FusionServiceOptions o;
    o.device = MemoryKind::kHostShm;
    o.dtype = DType::kFP32;
    o.fd_tickets = broker;
    o.callers = callers;
    ASSERT_NO_FATAL_FAILURE(server_.Start("/tmp/arfuse-fusion-fd-XXXXXX", o,
                                          [] { return static_cast<Engine*>(nullptr); }));
    client_ = server_.Connect("fd");
    ASSERT_NE(client_, nullptr);
  }

  // A sealed memfd of `bytes`, deposited as this process's user: the ticket.
  std::string Deposit(int fds = 1, uint64_t bytes = 4096) {
    std::vector<UniqueFd> v;
    for (int i = 0; i < fds; ++i) {
      UniqueFd fd(memfd_create("arfuse-svc-test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
      EXPECT_EQ(ftruncate(fd.get(), static_cast<off_t>(bytes)), 0);
      EXPECT_EQ(fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0);
      v.push_back(std::move(fd));
    }
    return *broker_.Deposit(::geteuid(), std::move(v), absl::Seconds(30));
  }

  absl::Status Register(const std::string& ticket, const std::string& name = "r") {
    v1::RegisterRegionRequest req;
    req.set_name(name);
    req.set_byte_size(4096);
    req.mutable_host_fd()->set_fd_ticket(ticket);
    v1::RegisterRegionResponse resp;
    grpc::ClientContext ctx;
    client_->PrepareContext(&ctx, absl::Seconds(10));
    grpc::Status s = client_->stub().RegisterRegion(&ctx, req, &resp);
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  }

  FdTicketBroker broker_;
  FusionTestServer server_;
  std::unique_ptr<Client> client_;
};

TEST_F(FusionFdTest, ADepositedMemfdRegistersOnceByTicket) {
  ASSERT_NO_FATAL_FAILURE(Start(&broker_));
  const std::string ticket = Deposit();
  EXPECT_TRUE(Register(ticket).ok());
  EXPECT_EQ(broker_.pending(), 0u);
  absl::Status again = Register(ticket, "again");
  EXPECT_EQ(again.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(again.message(), HasSubstr("fd ticket unknown, expired or not the caller's"));
  EXPECT_THAT(std::string(again.message()), ::testing::Not(HasSubstr(ticket)));
}

TEST_F(FusionFdTest, ATicketOfSeveralDescriptorsIsRefused) {
  ASSERT_NO_FATAL_FAILURE(Start(&broker_));
  absl::Status s = Register(Deposit(2));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("the ticket holds 2 descriptors; a region takes exactly one"));
}

TEST_F(FusionFdTest, WithoutAnFdChannelHostFdIsRefused) {
  ASSERT_NO_FATAL_FAILURE(Start(nullptr));
  absl::Status s = Register(NewFdTicket());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("host_fd: this sidecar serves no fd channel"));
}

TEST_F(FusionFdTest, ACallerWhoseCredentialsAreUnknownCannotClaim) {
  NoCredentials none;
  ASSERT_NO_FATAL_FAILURE(Start(&broker_, &none));
  const std::string ticket = Deposit();
  absl::Status s = Register(ticket);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("claimed only over the sidecar's Unix socket"));
  EXPECT_EQ(broker_.pending(), 1u);  // not consumed
  // Memory by name is refused the same way.
  auto named = HostShmBuffer::CreateNamed(4096);
  ASSERT_TRUE(named.ok());
  auto r = client_->RegisterHostShm("n", named->shm_name(), 4096);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(r.status().message(), HasSubstr("only over the sidecar's Unix socket"));
}

// CreatePlan through the service: the workspace's limits come from the options.
TEST_F(FusionServiceTest, PlansTheWorkspaceCannotServeAreOutOfRange) {
  auto c = Connect();
  NormBuffers b = MakeNorm(*c);
  OpDesc op = b.Op();
  op.dtype = DType::kBF16;
  auto dtype = c->CreatePlan(op);
  EXPECT_EQ(dtype.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(dtype.status().message(),
              HasSubstr("fusion unavailable for this op: dtype bf16 is not the workspace's fp32"));
}

}  // namespace
}  // namespace arfuse
