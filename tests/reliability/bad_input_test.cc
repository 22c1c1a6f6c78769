// Bad input over the wire to a real `arfused --device=host` (docs/reliability.md, "Bad input
// tried"): malformed protobuf bytes, an oversized message, a newer client's unknown enum values and
// fields, a client of another API version, and every data-path refusal. Each asserts the code and
// part of the message, and after each the sidecar must still serve a correct op.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "arfuse/v1/config.grpc.pb.h"
#include "common/version.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/reliability/harness.h"

namespace arfuse::reliability {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// Counts every case tried, for the summary line (docs/reliability.md quotes it).
int g_cases = 0;

class BadInputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    group_ = new Group(1);
    ASSERT_TRUE(group_->StartAll()) << group_->Logs();
    ASSERT_TRUE(group_->WaitAllReady(absl::Seconds(60))) << group_->Logs();
    auto c = RankClient::Create((*group_)[0].socket(), 0, 1, ShapeConfig{}, 0, "good");
    ASSERT_TRUE(c.ok()) << c.status();
    good_ = c->release();
    channel_ = new std::shared_ptr<grpc::Channel>(
        grpc::CreateChannel("unix:" + (*group_)[0].socket(), grpc::InsecureChannelCredentials()));
  }
  static void TearDownTestSuite() {
    std::printf(
        "[bad-input] %d bad inputs tried; the sidecar served a checked op after each "
        "test\n",
        g_cases);
    delete channel_;
    delete good_;
    delete group_;
  }

  // After every case: alive, ready, and a correct op.
  void TearDown() override {
    auto live = Serving((*group_)[0].socket(), "");
    ASSERT_TRUE(live.ok() && *live) << "liveness lost\n" << group_->Logs();
    good_->Prepare(++seq_);
    auto r = good_->Run();
    ASSERT_TRUE(r.ok()) << r.status() << group_->Logs();
    std::string why;
    EXPECT_TRUE(good_->Check(&why)) << why;
  }

  // A raw unary call with `payload` as the request bytes.
  static grpc::Status Raw(const std::string& method, const std::string& payload,
                          const std::vector<std::pair<std::string, std::string>>& md = {}) {
    grpc::GenericStub stub(*channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    for (const auto& [k, v] : md) ctx.AddMetadata(k, v);
    grpc::Slice slice(payload.data(), payload.size());
    grpc::ByteBuffer request(&slice, 1);
    grpc::CompletionQueue cq;
    auto call = stub.PrepareUnaryCall(&ctx, method, request, &cq);
    call->StartCall();
    grpc::ByteBuffer response;
    grpc::Status status;
    call->Finish(&response, &status, reinterpret_cast<void*>(1));
    void* tag = nullptr;
    bool ok = false;
    cq.Next(&tag, &ok);
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    return status;
  }

  // A context with this client's session, API version and a deadline.
  static void Prepare(grpc::ClientContext* ctx) {
    good_->client().PrepareContext(ctx, absl::Seconds(10));
  }

  static v1::Fusion::Stub& Stub() { return good_->client().stub(); }

  absl::Status CreatePlan(const v1::OpSpec& op) {
    ++g_cases;
    v1::CreatePlanRequest req;
    *req.mutable_op() = op;
    v1::CreatePlanResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    return FromGrpc(Stub().CreatePlan(&ctx, req, &resp));
  }

  absl::Status Register(const v1::RegisterRegionRequest& req) {
    ++g_cases;
    v1::RegisterRegionResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    return FromGrpc(Stub().RegisterRegion(&ctx, req, &resp));
  }

  absl::Status Execute(const v1::ExecuteRequest& req) {
    ++g_cases;
    v1::ExecuteResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    return FromGrpc(Stub().Execute(&ctx, req, &resp));
  }

  // The good client's plan as an explicit OpSpec (edit it to make it bad).
  static v1::OpSpec GoodOp() {
    client::OpDesc d = good_->op();
    v1::OpSpec op;
    op.set_pattern(client::ToProto(d.pattern));
    op.set_dtype(client::ToProto(d.dtype));
    op.set_hidden(d.hidden);
    op.set_max_tokens(d.max_tokens);
    op.set_eps(*d.eps);
    auto set = [](const client::TensorLoc& l, v1::RegionRef* r) {
      r->set_region_id(l.region.id);
      r->set_generation(l.region.generation);
      r->set_offset(l.offset);
    };
    set(*d.input, op.mutable_input());
    set(*d.residual_in, op.mutable_residual_in());
    set(*d.residual_out, op.mutable_residual_out());
    set(*d.norm_out, op.mutable_norm_out());
    set(*d.gamma, op.mutable_gamma());
    return op;
  }

  static inline Group* group_ = nullptr;
  static inline RankClient* good_ = nullptr;
  static inline std::shared_ptr<grpc::Channel>* channel_ = nullptr;
  uint64_t seq_ = 0;
};

// ---------------------------------------------------------------- malformed bytes

TEST_F(BadInputTest, MalformedProtobufIsRefusedOnEveryServiceAndNoHandlerRuns) {
  // A length-delimited field claiming 2^31 bytes, then an invalid wire type: no parser accepts it.
  const std::string garbage("\x0a\xff\xff\xff\xff\x07\x0f\xff\xff", 9);
  auto before = good_->client().ListRegions();
  ASSERT_TRUE(before.ok());
  for (const char* method : {"/arfuse.v1.Fusion/RegisterRegion", "/arfuse.v1.Fusion/Execute",
                             "/arfuse.v1.Fusion/CreatePlan", "/arfuse.v1.Fusion/UnregisterRegion",
                             "/arfuse.v1.Fusion/GetWorkspaceInfo", "/arfuse.v1.Admin/GetStats",
                             "/arfuse.v1.Admin/SetBackend", "/arfuse.v1.Config/Resolve",
                             "/grpc.health.v1.Health/Check"}) {
    ++g_cases;
    // With the session, so a handler that ran anyway would act for a real session.
    std::vector<std::pair<std::string, std::string>> md;
    md.emplace_back(kApiVersionMetadataKey, "1.0");
    md.emplace_back("arfuse-session", good_->client().session().session_token);
    grpc::Status s = Raw(method, garbage, md);
    // gRPC 1.51's callback API fails a request it cannot deserialize with UNIMPLEMENTED and an
    // empty message, before any handler runs (the synchronous API would say INTERNAL).
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED)
        << method << ": " << s.error_code() << " " << s.error_message();
    EXPECT_EQ(s.error_message(), "") << method;
  }
  // Nothing happened on the session's behalf.
  auto after = good_->client().ListRegions();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->size(), before->size());
}

TEST_F(BadInputTest, UnknownMethodIsUnimplemented) {
  ++g_cases;
  grpc::Status s = Raw("/arfuse.v1.Fusion/NoSuchMethod", "");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED) << s.error_message();
}

TEST_F(BadInputTest, OversizedMessageIsRefusedBeforeParsing) {
  // Above the 1 MiB receive limit: refused by the transport, no handler runs.
  v1::RegisterRegionRequest big;
  big.set_name(std::string(2 << 20, 'x'));
  big.set_byte_size(1);
  big.mutable_host_shm()->set_shm_name("/x");
  absl::Status s = Register(big);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("larger than max"));
  // Just below it: parsed, then refused by validation with a message that does not echo it.
  big.set_name(std::string(900 << 10, 'x'));
  s = Register(big);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s.ToString().substr(0, 200);
  EXPECT_THAT(s.message(), HasSubstr("region name is"));
  EXPECT_LT(s.message().size(), 300u);
}

// ---------------------------------------------------------------- newer clients

TEST_F(BadInputTest, UnknownEnumValuesFromANewerClientAreInvalidArgument) {
  v1::OpSpec op = GoodOp();
  op.set_pattern(static_cast<v1::Pattern>(7));
  absl::Status s = CreatePlan(op);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("pattern"));
  EXPECT_THAT(s.message(), HasSubstr("7"));

  op = GoodOp();
  op.set_dtype(static_cast<v1::DType>(42));
  s = CreatePlan(op);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("dtype"));

  // The same through Execute with an explicit op.
  v1::ExecuteRequest ex;
  *ex.mutable_op() = GoodOp();
  ex.mutable_op()->set_pattern(static_cast<v1::Pattern>(-3));
  ex.set_num_tokens(1);
  s = Execute(ex);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("pattern"));

  // Config: an unknown CUDA-graph mode.
  auto stub = v1::Config::NewStub(*channel_);
  v1::ResolveRequest rr;
  rr.mutable_capture()->set_cuda_graph_mode(static_cast<v1::CudaGraphMode>(9));
  rr.mutable_topology()->set_sm(90);
  rr.mutable_topology()->set_tp_size(2);
  rr.mutable_topology()->set_nnodes(1);
  v1::ResolveResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  ++g_cases;
  s = FromGrpc(stub->Resolve(&ctx, rr, &resp));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("cuda_graph_mode"));
}

TEST_F(BadInputTest, UnknownFieldsFromANewerClientAreIgnored) {
  // GetWorkspaceInfoRequest{} plus field 99 (varint 1) and field 100 (bytes "hi"): a newer
  // client's additions. proto3 keeps them as unknown fields; the call succeeds.
  const std::string payload("\x98\x06\x01\xa2\x06\x02hi", 8);
  ++g_cases;
  grpc::Status s =
      Raw("/arfuse.v1.Fusion/GetWorkspaceInfo", payload, {{kApiVersionMetadataKey, "1.9"}});
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(BadInputTest, AnotherApiMajorVersionIsFailedPreconditionNamingBoth) {
  const std::string ours = absl::StrCat(kApiMajor, ".", kApiMinor);
  for (const char* method : {"/arfuse.v1.Fusion/GetWorkspaceInfo", "/arfuse.v1.Fusion/ListRegions",
                             "/arfuse.v1.Admin/GetStats", "/arfuse.v1.Config/Resolve"}) {
    ++g_cases;
    grpc::Status s = Raw(method, "", {{kApiVersionMetadataKey, "2.0"}});
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << method;
    EXPECT_THAT(s.error_message(), HasSubstr("2.0")) << method;
    EXPECT_THAT(s.error_message(), HasSubstr(ours)) << method;
  }
  // The Session stream too: a 2.0 client never gets a session.
  {
    ++g_cases;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    ctx.AddMetadata(kApiVersionMetadataKey, "2.0");
    auto stream = Stub().Session(&ctx);
    v1::SessionRequest hello;
    hello.set_client_name("from-the-future");
    stream->Write(hello);
    v1::SessionResponse resp;
    EXPECT_FALSE(stream->Read(&resp));
    grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("2.0"));
    EXPECT_THAT(s.error_message(), HasSubstr(ours));
  }
  // Not MAJOR.MINOR: garbage, a major alone, a minor that is no number, three parts.
  grpc::Status s;
  for (const char* bad : {"banana", "1", "1.x", "1.0.3", "", "."}) {
    ++g_cases;
    s = Raw("/arfuse.v1.Fusion/GetWorkspaceInfo", "", {{kApiVersionMetadataKey, bad}});
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << bad;
    EXPECT_THAT(s.error_message(), HasSubstr("not MAJOR.MINOR")) << bad;
  }
  // A newer minor of our major is served.
  ++g_cases;
  s = Raw("/arfuse.v1.Fusion/GetWorkspaceInfo", "", {{kApiVersionMetadataKey, "1.7"}});
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// ---------------------------------------------------------------- sessions

TEST_F(BadInputTest, SessionMetadataMissingMalformedOrUnknown) {
  v1::ListRegionsRequest req;
  v1::ListRegionsResponse resp;
  struct Case {
    std::optional<std::string> session;
    absl::StatusCode code;
    const char* text;
  };
  for (const Case& c :
       {Case{std::nullopt, absl::StatusCode::kFailedPrecondition, "no session"},
        Case{"abc", absl::StatusCode::kPermissionDenied, "names no open session of this caller"},
        Case{"18446744073709551616", absl::StatusCode::kPermissionDenied,
             "names no open session of this caller"},
        Case{"12345", absl::StatusCode::kPermissionDenied, "names no open session of this caller"},
        Case{std::string(32, 'a'), absl::StatusCode::kPermissionDenied,
             "names no open session of this caller"}}) {
    ++g_cases;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (c.session) ctx.AddMetadata("arfuse-session", *c.session);
    absl::Status s = FromGrpc(Stub().ListRegions(&ctx, req, &resp));
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.text));
  }
}

// ---------------------------------------------------------------- regions

TEST_F(BadInputTest, RegionRegistrationRefusals) {
  auto buf = client::HostShmBuffer::CreateNamed(4096, "bad");
  ASSERT_TRUE(buf.ok());
  const std::string shm = buf->shm_name();
  auto req = [&](const std::string& name, uint64_t size, const std::string& shm_name) {
    v1::RegisterRegionRequest r;
    r.set_name(name);
    r.set_byte_size(size);
    r.mutable_host_shm()->set_shm_name(shm_name);
    return r;
  };
  struct Case {
    v1::RegisterRegionRequest req;
    absl::StatusCode code;
    const char* text;
  };
  v1::RegisterRegionRequest cuda;
  cuda.set_name("cuda");
  cuda.set_byte_size(4096);
  cuda.mutable_cuda_ipc()->set_handle(std::string(64, '\x01'));
  v1::RegisterRegionRequest none;
  none.set_name("none");
  none.set_byte_size(4096);
  std::vector<Case> cases = {
      {req("", 4096, shm), absl::StatusCode::kInvalidArgument, "region name is empty"},
      {req("tab\there", 4096, shm), absl::StatusCode::kInvalidArgument, "printable"},
      {req("zero", 0, shm), absl::StatusCode::kInvalidArgument, "byte_size must be > 0"},
      {req("big", 4097, shm), absl::StatusCode::kInvalidArgument, "4097"},
      // The per-session byte cap is checked before anything is opened.
      {req("huge", std::numeric_limits<uint64_t>::max(), shm), absl::StatusCode::kResourceExhausted,
       "the limit is"},
      {req("dots", 4096, "/../../etc/passwd"), absl::StatusCode::kInvalidArgument, "shm_name"},
      {req("slash", 4096, "/a/b"), absl::StatusCode::kInvalidArgument, "shm_name"},
      {req("rel", 4096, "noslash"), absl::StatusCode::kInvalidArgument, "shm_name"},
      {req("gone", 4096, "/arfuse-no-such-object-4242"), absl::StatusCode::kInvalidArgument,
       "could not be opened"},
      {cuda, absl::StatusCode::kInvalidArgument, "cuda"},
      {none, absl::StatusCode::kInvalidArgument, "set cuda_ipc, host_fd or host_shm"},
  };
  for (const Case& c : cases) {
    absl::Status s = Register(c.req);
    EXPECT_EQ(s.code(), c.code) << c.req.name() << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(c.text)) << c.req.name();
    // Never echo a memory object's name.
    if (c.req.has_host_shm() && c.req.host_shm().shm_name().size() > 3) {
      EXPECT_THAT(std::string(s.message()), Not(HasSubstr(c.req.host_shm().shm_name())));
    }
  }
  // Duplicate name in the session.
  ASSERT_TRUE(Register(req("dup", 4096, shm)).ok());
  absl::Status dup = Register(req("dup", 4096, shm));
  EXPECT_EQ(dup.code(), absl::StatusCode::kAlreadyExists) << dup;
  EXPECT_THAT(dup.message(), HasSubstr("already registered"));
  // Unregister of something never registered, and with a wrong generation.
  auto list = good_->client().ListRegions();
  ASSERT_TRUE(list.ok());
  uint64_t dup_id = 0, dup_gen = 0;
  for (const auto& r : *list) {
    if (r.name() == "dup") dup_id = r.region_id(), dup_gen = r.generation();
  }
  ++g_cases;
  absl::Status never = good_->client().Unregister(client::Region{999999, 1, "x", 1});
  EXPECT_EQ(never.code(), absl::StatusCode::kNotFound) << never;
  ++g_cases;
  absl::Status stale = good_->client().Unregister(client::Region{dup_id, dup_gen + 1, "dup", 1});
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition) << stale;
  EXPECT_THAT(stale.message(), HasSubstr("stale generation"));
  EXPECT_TRUE(good_->client().Unregister(client::Region{dup_id, dup_gen, "dup", 1}).ok());
}

// ---------------------------------------------------------------- ops

TEST_F(BadInputTest, OpRefusals) {
  const uint64_t region_size = good_->region().byte_size;
  struct Case {
    const char* what;
    std::function<void(v1::OpSpec&)> edit;
    absl::StatusCode code;
    const char* text;
  };
  const std::vector<Case> cases = {
      {"hidden not a multiple of 8", [](v1::OpSpec& o) { o.set_hidden(250); },
       absl::StatusCode::kInvalidArgument, "hidden"},
      {"hidden 0", [](v1::OpSpec& o) { o.set_hidden(0); }, absl::StatusCode::kInvalidArgument,
       "hidden"},
      {"max_tokens 0", [](v1::OpSpec& o) { o.set_max_tokens(0); },
       absl::StatusCode::kInvalidArgument, "max_tokens"},
      {"max_tokens too many", [](v1::OpSpec& o) { o.set_max_tokens(4000000000u); },
       absl::StatusCode::kInvalidArgument, "max_tokens"},
      {"eps NaN", [](v1::OpSpec& o) { o.set_eps(std::nanf("")); },
       absl::StatusCode::kInvalidArgument, "eps"},
      {"eps negative", [](v1::OpSpec& o) { o.set_eps(-1); }, absl::StatusCode::kInvalidArgument,
       "eps"},
      {"eps infinite", [](v1::OpSpec& o) { o.set_eps(INFINITY); },
       absl::StatusCode::kInvalidArgument, "eps"},
      {"missing gamma", [](v1::OpSpec& o) { o.clear_gamma(); }, absl::StatusCode::kInvalidArgument,
       "gamma"},
      {"missing residual_in", [](v1::OpSpec& o) { o.clear_residual_in(); },
       absl::StatusCode::kInvalidArgument, "residual_in"},
      {"missing input", [](v1::OpSpec& o) { o.clear_input(); }, absl::StatusCode::kInvalidArgument,
       "input"},
      {"misaligned offset", [](v1::OpSpec& o) { o.mutable_input()->set_offset(8); },
       absl::StatusCode::kInvalidArgument, "offset"},
      {"offset + size overflows", [](v1::OpSpec& o) { o.mutable_input()->set_offset(~0ull - 31); },
       absl::StatusCode::kInvalidArgument, "input"},
      {"past the region", [=](v1::OpSpec& o) { o.mutable_gamma()->set_offset(region_size - 16); },
       absl::StatusCode::kInvalidArgument, "gamma"},
      {"shape larger than the region", [](v1::OpSpec& o) { o.set_max_tokens(64); },
       absl::StatusCode::kInvalidArgument, "region"},
      {"unknown region", [](v1::OpSpec& o) { o.mutable_input()->set_region_id(987654); },
       absl::StatusCode::kNotFound, "not registered"},
      {"stale region generation",
       [](v1::OpSpec& o) { o.mutable_input()->set_generation(o.input().generation() + 1); },
       absl::StatusCode::kFailedPrecondition, "stale generation"},
      {"generation missing", [](v1::OpSpec& o) { o.mutable_input()->set_generation(0); },
       absl::StatusCode::kInvalidArgument, "generation"},
      {"output overlaps an input", [](v1::OpSpec& o) { *o.mutable_norm_out() = o.input(); },
       absl::StatusCode::kInvalidArgument, "overlap"},
  };
  for (const Case& c : cases) {
    v1::OpSpec op = GoodOp();
    c.edit(op);
    absl::Status s = CreatePlan(op);
    EXPECT_EQ(s.code(), c.code) << c.what << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(c.text)) << c.what;
    // Errors name numbers and fields, never pointers.
    EXPECT_THAT(std::string(s.message()), Not(HasSubstr("0x"))) << c.what;
  }
  // Doorbell plane (not in host mode).
  {
    ++g_cases;
    v1::CreatePlanRequest req;
    *req.mutable_op() = GoodOp();
    req.set_doorbell(true);
    v1::CreatePlanResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    absl::Status s = FromGrpc(Stub().CreatePlan(&ctx, req, &resp));
    EXPECT_TRUE(s.code() == absl::StatusCode::kFailedPrecondition ||
                s.code() == absl::StatusCode::kUnimplemented)
        << s;
    EXPECT_THAT(s.message(), HasSubstr("doorbell"));
  }
}

TEST_F(BadInputTest, ExecuteRefusals) {
  const client::Plan plan = good_->plan();
  auto by_plan = [&](uint32_t tokens) {
    v1::ExecuteRequest r;
    r.set_plan_id(plan.id);
    r.set_plan_generation(plan.generation);
    r.set_num_tokens(tokens);
    return r;
  };
  struct Case {
    const char* what;
    v1::ExecuteRequest req;
    absl::StatusCode code;
    const char* text;
  };
  v1::ExecuteRequest unknown_plan = by_plan(1);
  unknown_plan.set_plan_id(424242);
  v1::ExecuteRequest stale_plan = by_plan(1);
  stale_plan.set_plan_generation(plan.generation + 1);
  v1::ExecuteRequest wait_event = by_plan(1);
  wait_event.set_wait_event(std::string(64, '\x02'));
  v1::ExecuteRequest stale_ws = by_plan(1);
  stale_ws.set_workspace_generation(123456789);
  v1::ExecuteRequest nothing;
  nothing.set_num_tokens(1);
  const std::vector<Case> cases = {
      {"zero tokens", by_plan(0), absl::StatusCode::kInvalidArgument, "num_tokens"},
      {"above the plan's max_tokens", by_plan(good_->shape().tokens + 1),
       absl::StatusCode::kInvalidArgument, "num_tokens"},
      {"unknown plan", unknown_plan, absl::StatusCode::kPermissionDenied,
       "not held by this session"},
      {"stale plan generation", stale_plan, absl::StatusCode::kFailedPrecondition,
       "stale generation"},
      {"wait_event in host mode", wait_event, absl::StatusCode::kInvalidArgument, "wait_event"},
      {"stale workspace generation", stale_ws, absl::StatusCode::kFailedPrecondition,
       "stale generation"},
      {"neither plan nor op", nothing, absl::StatusCode::kInvalidArgument, "plan_id or op"},
  };
  for (const Case& c : cases) {
    absl::Status s = Execute(c.req);
    EXPECT_EQ(s.code(), c.code) << c.what << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(c.text)) << c.what;
  }
}

// Failed ops are logged for the operator (code and message), at most once a second per code:
// a client retrying in a tight loop does not flood the log, and the next line says how many
// were held back.
TEST_F(BadInputTest, FailedExecutesAreLoggedOncePerSecondPerCode) {
  const client::Plan plan = good_->plan();
  v1::ExecuteRequest zero;
  zero.set_plan_id(plan.id);
  zero.set_plan_generation(plan.generation);
  zero.set_num_tokens(0);
  const std::string line = "event=execute_failed code=INVALID_ARGUMENT";
  auto count_lines = [&] {
    const std::string log = (*group_)[0].Log();
    size_t n = 0;
    for (size_t at = log.find(line); at != std::string::npos; at = log.find(line, at + 1)) ++n;
    return n;
  };
  const size_t before = count_lines();
  const absl::Time start = absl::Now();
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(Execute(zero).code(), absl::StatusCode::kInvalidArgument);
  }
  const absl::Duration burst = absl::Now() - start;
  absl::SleepFor(absl::Milliseconds(1100));
  EXPECT_EQ(Execute(zero).code(), absl::StatusCode::kInvalidArgument);
  // The sidecar writes its log asynchronously to the harness: wait for the last line.
  std::string last;
  ASSERT_TRUE(WaitUntil(
      [&] {
        const std::string log = (*group_)[0].Log();
        const size_t at = log.rfind(line + " held_back=");
        if (at == std::string::npos) return false;
        last = log.substr(at, log.find('\n', at) - at);
        return count_lines() > before;
      },
      absl::Seconds(5)))
      << (*group_)[0].Log();
  // One line for the burst at most per second it took, one after the pause.
  EXPECT_LE(count_lines() - before, 2u + static_cast<size_t>(absl::ToInt64Seconds(burst)));
  uint64_t held_back = 0;
  const size_t eq = last.find("held_back=");
  ASSERT_NE(eq, std::string::npos) << last;
  ASSERT_TRUE(absl::SimpleAtoi(last.substr(eq + 10, last.find(' ', eq) - eq - 10), &held_back))
      << last;
  if (burst < absl::Seconds(1)) {
    EXPECT_GE(held_back, 49u) << last;
  }
  EXPECT_THAT(last, HasSubstr("num_tokens")) << "the line says why";
}

// A call without a deadline gets the sidecar's default, and ends with the sidecar's own
// specific error before it (rank 1's client never comes, so the op cannot complete).
TEST(BadInputDeadline, CallWithoutDeadlineGetsTheDefault) {
  SidecarConfig cfg;
  cfg.spin_timeout_s = 60;
  cfg.default_deadline_s = 1.5;
  Group g(2, cfg);
  ASSERT_TRUE(g.StartAll()) << g.Logs();
  ASSERT_TRUE(g.WaitAllReady(absl::Seconds(60))) << g.Logs();
  auto c = RankClient::Create(g[0].socket(), 0, 2, ShapeConfig{});
  ASSERT_TRUE(c.ok()) << c.status();
  (*c)->Prepare(1);
  v1::ExecuteRequest req;
  req.set_plan_id((*c)->plan().id);
  req.set_plan_generation((*c)->plan().generation);
  req.set_num_tokens((*c)->shape().tokens);
  v1::ExecuteResponse resp;
  grpc::ClientContext ctx;  // no deadline
  ctx.AddMetadata(kApiVersionMetadataKey, "1.0");
  ctx.AddMetadata("arfuse-session", (*c)->client().session().session_token);
  absl::Time t0 = absl::Now();
  absl::Status s = FromGrpc((*c)->client().stub().Execute(&ctx, req, &resp));
  absl::Duration took = absl::Now() - t0;
  ++g_cases;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("deadline"));
  EXPECT_LT(took, absl::Seconds(5));
  EXPECT_GE(took, absl::Seconds(1));
  std::printf("[bad-input] no client deadline: %s after %s\n", s.ToString().c_str(),
              absl::FormatDuration(took).c_str());
}

}  // namespace
}  // namespace arfuse::reliability
