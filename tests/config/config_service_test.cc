// arfuse.v1.Config over a real in-process gRPC server on a temporary Unix socket: Resolve gives
// the library's answers (the whole table, and SGLang's rules case by case under both rule sets),
// Negotiate answers for the snapshot per phase, errors keep their codes and messages.
#include "server/services/config/config_service.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "config/config_convert.h"
#include "config/fusion_config.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/config/upstream_cases.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;

bool AnyContains(const std::vector<std::string>& lines, const std::string& part) {
  for (const std::string& l : lines) {
    if (l.find(part) != std::string::npos) return true;
  }
  return false;
}

// Owns a server with one ConfigService on a Unix socket in a fresh temporary directory.
class TestServer {
 public:
  explicit TestServer(ConfigServiceOptions options) : service_(std::move(options)) {
    char tmpl[] = "/tmp/arfuse-config-test-XXXXXX";
    dir_ = mkdtemp(tmpl);
    addr_ = absl::StrCat("unix:", dir_, "/config.sock");
    grpc::ServerBuilder builder;
    builder.AddListeningPort(addr_, grpc::InsecureServerCredentials());
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    channel_ = grpc::CreateChannel(addr_, grpc::InsecureChannelCredentials());
    stub_ = v1::Config::NewStub(channel_);
  }
  ~TestServer() {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    unlink((dir_ + "/config.sock").c_str());
    rmdir(dir_.c_str());
  }

  bool started() const { return server_ != nullptr; }
  v1::Config::Stub& stub() { return *stub_; }

  // Generous deadline: the machine running the tests may be loaded.
  static std::unique_ptr<grpc::ClientContext> Context(const char* api_version = "1.0") {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    if (api_version != nullptr) c->AddMetadata("arfuse-api-version", api_version);
    return c;
  }

 private:
  ConfigService service_;
  std::string dir_;
  std::string addr_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Config::Stub> stub_;
};

ConfigServiceOptions DefaultOptions() {
  ConfigServiceOptions o;
  o.topology = config::Topology{90, 2, 1};
  o.flags.backend = "trtllm";
  return o;
}

TEST(ConfigService, ResolveGivesTheLibrarysAnswersForTheWholeTable) {
  TestServer server(DefaultOptions());
  ASSERT_TRUE(server.started());
  const config::CudaGraphMode modes[] = {config::CudaGraphMode::kNone,
                                         config::CudaGraphMode::kPiecewise,
                                         config::CudaGraphMode::kFull};
  int calls = 0;
  for (int sm : {80, 89, 90, 100, 103, 110, 120}) {
    for (int nnodes : {1, 2}) {
      for (int tp : {1, 2, 3, 8}) {
        for (const char* value : {static_cast<const char*>(nullptr), "auto", "trtllm", "mnnvl"}) {
          for (int bits = 0; bits < 8; ++bits) {
            config::FusionFlags flags;
            if (value != nullptr) flags.backend = value;
            flags.enable_deprecated = bits & 1;
            flags.enforce_disable = bits & 2;
            flags.deterministic = bits & 4;
            config::CaptureRequest capture{modes[calls % 3], (calls / 3) % 2 == 0, std::nullopt};
            if (calls % 5 == 0) capture.mnnvl_capture_safe = false;
            const config::Topology topology{sm, tp, nnodes};
            ++calls;

            v1::ResolveRequest request;
            *request.mutable_flags() = config::FlagsToProto(flags);
            *request.mutable_topology() = config::TopologyToProto(topology);
            *request.mutable_capture() = config::CaptureToProto(capture);
            v1::ResolveResponse response;
            grpc::Status status =
                server.stub().Resolve(TestServer::Context().get(), request, &response);
            absl::StatusOr<config::Decision> expected = config::Resolve(flags, topology, capture);
            if (!expected.ok()) {
              // The library refuses (more nodes than ranks): the service with the same words.
              EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
              EXPECT_EQ(status.error_message(), expected.status().message());
              continue;
            }
            ASSERT_TRUE(status.ok()) << status.error_message();
            absl::StatusOr<config::Decision> got = config::DecisionFromProto(response.decision());
            ASSERT_TRUE(got.ok()) << got.status();
            EXPECT_EQ(*got, *expected)
                << "sm=" << sm << " nnodes=" << nnodes << " tp=" << tp
                << " backend=" << (value ? value : "unset") << " bits=" << bits;
            EXPECT_EQ(*config::TopologyFromProto(response.topology()), topology);
          }
        }
      }
    }
  }
  EXPECT_EQ(calls, 7 * 2 * 4 * 4 * 8);
}

// SGLang's rules case by case, both rule sets, through the gRPC service: the same answers, codes
// and messages as the library (upstream_cases.h names each case's upstream source).
TEST(ConfigService, UpstreamCasesGiveTheLibrarysAnswers) {
  TestServer server(DefaultOptions());
  ASSERT_TRUE(server.started());
  for (const testing::UpstreamCase& c : testing::UpstreamCases()) {
    SCOPED_TRACE(testing::CaseName(c));
    v1::ResolveRequest request;
    *request.mutable_flags() = config::FlagsToProto(c.flags);
    *request.mutable_topology() = config::TopologyToProto(c.topology);
    v1::ResolveResponse response;
    grpc::Status status = server.stub().Resolve(TestServer::Context().get(), request, &response);
    absl::StatusOr<config::Decision> expected =
        config::Resolve(c.flags, c.topology, config::CaptureRequest{});
    if (c.where == testing::Where::kError) {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_THAT(status.error_message(), HasSubstr(c.text));
      EXPECT_EQ(status.error_message(), expected.status().message());
      continue;
    }
    ASSERT_TRUE(status.ok()) << status.error_message();
    absl::StatusOr<config::Decision> got = config::DecisionFromProto(response.decision());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, *expected);
    EXPECT_EQ(response.decision().backend(), c.backend);
    EXPECT_EQ(response.decision().fusion_enabled(), c.fused);
    EXPECT_EQ(response.decision().fusion_rules(), config::RuleSetName(c.flags.rules));
    EXPECT_EQ(response.decision().max_tokens_per_batch(), c.fused ? 2048u : 0u);
  }
}

TEST(ConfigService, ResolveTakesTheServersRuleSetWhenTheRequestLeavesItUnset) {
  ConfigServiceOptions o = DefaultOptions();
  o.flags.rules = config::RuleSet::kSglang29063;
  TestServer server(o);
  v1::ResolveRequest request;
  request.mutable_flags()->set_flashinfer_allreduce_fusion_backend("auto");
  request.mutable_topology()->set_sm(90);
  request.mutable_topology()->set_tp_size(2);
  request.mutable_topology()->set_nnodes(1);
  v1::ResolveResponse response;
  ASSERT_TRUE(server.stub().Resolve(TestServer::Context().get(), request, &response).ok());
  EXPECT_EQ(response.decision().backend(), "trtllm");  // sglang-29063: SM90 auto is trtllm
  EXPECT_EQ(response.decision().fusion_rules(), "sglang-29063");
  request.mutable_flags()->set_fusion_rules("sglang-23402");
  ASSERT_TRUE(server.stub().Resolve(TestServer::Context().get(), request, &response).ok());
  EXPECT_EQ(response.decision().backend(), "mnnvl");
  EXPECT_EQ(response.decision().fusion_rules(), "sglang-23402");
}

TEST(ConfigService, ResolveUsesTheServersTopologyAndFlagsWhenAbsent) {
  TestServer server(DefaultOptions());
  v1::ResolveRequest request;  // no flags, no topology, no capture
  v1::ResolveResponse response;
  ASSERT_TRUE(server.stub().Resolve(TestServer::Context().get(), request, &response).ok());
  EXPECT_EQ(response.decision().backend(), "trtllm");  // the server's own flag
  EXPECT_TRUE(response.decision().fusion_enabled());
  EXPECT_EQ(response.topology().sm(), 90u);
  EXPECT_EQ(response.topology().tp_size(), 2u);
  EXPECT_EQ(response.topology().nnodes(), 1u);

  // Flags present but empty are the request's own (no flag: SM90 does not auto-enable).
  request.mutable_flags();
  ASSERT_TRUE(server.stub().Resolve(TestServer::Context().get(), request, &response).ok());
  EXPECT_EQ(response.decision().backend(), "none");
}

TEST(ConfigService, ResolveTakesTheServersCaptureSafetyWhenTheRequestLeavesItUnset) {
  ConfigServiceOptions o = DefaultOptions();
  o.topology = config::Topology{100, 2, 1};
  o.capture.mnnvl_capture_safe = false;
  TestServer server(o);
  v1::ResolveRequest request;
  request.mutable_flags()->set_flashinfer_allreduce_fusion_backend("mnnvl");
  request.mutable_capture()->set_cuda_graph_mode(v1::CUDA_GRAPH_MODE_PIECEWISE);
  v1::ResolveResponse response;
  ASSERT_TRUE(server.stub().Resolve(TestServer::Context().get(), request, &response).ok());
  EXPECT_EQ(response.decision().cuda_graph_mode(), v1::CUDA_GRAPH_MODE_NONE);
  // An explicit value in the what-if request wins.
  request.mutable_capture()->set_mnnvl_capture_safe(true);
  ASSERT_TRUE(server.stub().Resolve(TestServer::Context().get(), request, &response).ok());
  EXPECT_EQ(response.decision().cuda_graph_mode(), v1::CUDA_GRAPH_MODE_PIECEWISE);
}

void ExpectResolveError(TestServer& server, const v1::ResolveRequest& request,
                        grpc::StatusCode code, const std::string& part) {
  v1::ResolveResponse response;
  grpc::Status status = server.stub().Resolve(TestServer::Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), code) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr(part));
}

TEST(ConfigService, ResolveRejectsInvalidInputWithTheLibrarysMessages) {
  TestServer server(DefaultOptions());
  v1::ResolveRequest tp0;
  tp0.mutable_topology()->set_sm(90);
  tp0.mutable_topology()->set_nnodes(1);
  ExpectResolveError(server, tp0, grpc::StatusCode::INVALID_ARGUMENT, "tp must be >= 1, got 0");

  v1::ResolveRequest nnodes0;
  nnodes0.mutable_topology()->set_sm(90);
  nnodes0.mutable_topology()->set_tp_size(2);
  ExpectResolveError(server, nnodes0, grpc::StatusCode::INVALID_ARGUMENT,
                     "nnodes must be >= 1, got 0");

  v1::ResolveRequest huge;
  huge.mutable_topology()->set_sm(4000000000u);
  huge.mutable_topology()->set_tp_size(2);
  huge.mutable_topology()->set_nnodes(1);
  ExpectResolveError(server, huge, grpc::StatusCode::INVALID_ARGUMENT, "topology.sm");

  v1::ResolveRequest backend;
  backend.mutable_flags()->set_flashinfer_allreduce_fusion_backend("nccl");
  ExpectResolveError(server, backend, grpc::StatusCode::INVALID_ARGUMENT,
                     "unknown --flashinfer-allreduce-fusion-backend value \"nccl\"");

  v1::ResolveRequest mode;
  mode.mutable_capture()->set_cuda_graph_mode(static_cast<v1::CudaGraphMode>(9));
  ExpectResolveError(server, mode, grpc::StatusCode::INVALID_ARGUMENT,
                     "capture.cuda_graph_mode 9 is not a known mode");

  // The world-size and rule-set fields (docs/config.md), each with a bad value.
  v1::ResolveRequest prefill;
  prefill.mutable_capture()->set_prefill_cuda_graph_mode(static_cast<v1::CudaGraphMode>(7));
  ExpectResolveError(server, prefill, grpc::StatusCode::INVALID_ARGUMENT,
                     "capture.prefill_cuda_graph_mode 7 is not a known mode");
  v1::ResolveRequest decode;
  decode.mutable_capture()->set_decode_cuda_graph_mode(static_cast<v1::CudaGraphMode>(-1));
  ExpectResolveError(server, decode, grpc::StatusCode::INVALID_ARGUMENT,
                     "capture.decode_cuda_graph_mode -1 is not a known mode");
  v1::ResolveRequest rules;
  rules.mutable_flags()->set_fusion_rules("sglang-99999");
  ExpectResolveError(server, rules, grpc::StatusCode::INVALID_ARGUMENT,
                     "flags.fusion_rules: unknown --fusion-rules value \"sglang-99999\"");
  v1::ResolveRequest arch;
  arch.mutable_flags()->set_model_architecture("Deepseek V3");
  ExpectResolveError(server, arch, grpc::StatusCode::INVALID_ARGUMENT,
                     "--model-architecture \"Deepseek V3\" is not an architecture name");
  v1::ResolveRequest a2a;
  a2a.mutable_flags()->set_moe_a2a_backend("nccl");
  ExpectResolveError(server, a2a, grpc::StatusCode::INVALID_ARGUMENT,
                     "unknown --moe-a2a-backend value \"nccl\"");
  v1::ResolveRequest nodes;
  nodes.mutable_topology()->set_sm(100);
  nodes.mutable_topology()->set_tp_size(4);
  nodes.mutable_topology()->set_nnodes(8);
  ExpectResolveError(server, nodes, grpc::StatusCode::INVALID_ARGUMENT,
                     "nnodes 8 is more than tp 4");
  // sglang-29063's refusals carry upstream's ValueError text.
  v1::ResolveRequest refused;
  refused.mutable_flags()->set_fusion_rules("sglang-29063");
  refused.mutable_flags()->set_flashinfer_allreduce_fusion_backend("trtllm");
  *refused.mutable_topology() = config::TopologyToProto({90, 4, 2});
  ExpectResolveError(server, refused, grpc::StatusCode::INVALID_ARGUMENT,
                     "FlashInfer allreduce fusion trtllm backend supports single-node only.");
}

TEST(ConfigService, ChecksTheClientApiVersion) {
  TestServer server(DefaultOptions());
  v1::ResolveRequest request;
  v1::ResolveResponse response;
  grpc::Status wrong = server.stub().Resolve(TestServer::Context("2.0").get(), request, &response);
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(wrong.error_message(), HasSubstr("client API version 2.0 is not supported"));
  v1::NegotiateResponse negotiated;
  grpc::Status neg = server.stub().Negotiate(TestServer::Context("0.9").get(), {}, &negotiated);
  EXPECT_EQ(neg.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  // Same major, any minor; and older clients that send nothing.
  EXPECT_TRUE(server.stub().Resolve(TestServer::Context("1.7").get(), request, &response).ok());
  EXPECT_TRUE(server.stub().Resolve(TestServer::Context(nullptr).get(), request, &response).ok());
}

// A group decision as the daemon would hold it.
config::Decision GroupDecision(const char* backend, int sm, int nnodes = 1) {
  config::FusionFlags f;
  f.backend = backend;
  return *config::ResolveBackend(f, config::Topology{sm, 2, nnodes});
}

TEST(ConfigService, NegotiateAnswersForTheSnapshot) {
  ConfigServiceOptions o = DefaultOptions();
  ConfigSnapshot snap;
  snap.decision = GroupDecision("trtllm", 90);
  snap.device = v1::DEVICE_KIND_CUDA;
  snap.rank = 1;
  snap.world_size = 2;
  snap.mps_detected = false;
  snap.doorbell_hop_us = 286;
  o.snapshot = [&snap]() -> absl::StatusOr<ConfigSnapshot> { return snap; };
  TestServer server(o);

  v1::NegotiateRequest request;
  request.mutable_capture()->set_cuda_graph_mode(v1::CUDA_GRAPH_MODE_FULL);
  request.mutable_capture()->set_fused_op_in_graph(true);
  v1::NegotiateResponse response;
  ASSERT_TRUE(server.stub().Negotiate(TestServer::Context().get(), request, &response).ok());
  EXPECT_EQ(response.decision().backend(), "trtllm");
  EXPECT_EQ(response.decision().cuda_graph_mode(), v1::CUDA_GRAPH_MODE_FULL);
  EXPECT_EQ(response.decision().data_plane(), v1::DATA_PLANE_DOORBELL);
  EXPECT_TRUE(
      AnyContains({response.decision().warnings().begin(), response.decision().warnings().end()},
                  "MPS not detected"));
  EXPECT_EQ(response.device(), v1::DEVICE_KIND_CUDA);
  EXPECT_EQ(response.rank(), 1u);
  EXPECT_EQ(response.world_size(), 2u);
  EXPECT_FALSE(response.mps_detected());
  EXPECT_DOUBLE_EQ(response.doorbell_hop_us(), 286);
  EXPECT_EQ(response.server_api().major(), 1u);

  // Host mode has no doorbell: full graphs with the op inside become piecewise + eager.
  snap.device = v1::DEVICE_KIND_HOST;
  ASSERT_TRUE(server.stub().Negotiate(TestServer::Context().get(), request, &response).ok());
  EXPECT_EQ(response.decision().cuda_graph_mode(), v1::CUDA_GRAPH_MODE_PIECEWISE);
  EXPECT_EQ(response.decision().data_plane(), v1::DATA_PLANE_EAGER);
  EXPECT_TRUE(
      AnyContains({response.decision().reasons().begin(), response.decision().reasons().end()},
                  "host device mode has no CUDA doorbell"));
  EXPECT_EQ(response.device(), v1::DEVICE_KIND_HOST);
}

TEST(ConfigService, NegotiatesPerPhaseAndReportsTheTokensPerBatch) {
  ConfigServiceOptions o = DefaultOptions();
  o.capture.mnnvl_capture_safe = false;  // an older build: mnnvl not capture-safe
  ConfigSnapshot snap;
  snap.decision = GroupDecision("mnnvl", 100);
  snap.device = v1::DEVICE_KIND_CUDA;
  snap.mps_detected = true;
  snap.workspace_max_tokens = 1024;
  o.snapshot = [snap]() -> absl::StatusOr<ConfigSnapshot> { return snap; };
  TestServer server(o);
  v1::NegotiateRequest request;
  request.mutable_capture()->set_prefill_cuda_graph_mode(v1::CUDA_GRAPH_MODE_PIECEWISE);
  request.mutable_capture()->set_decode_cuda_graph_mode(v1::CUDA_GRAPH_MODE_FULL);
  request.mutable_capture()->set_fused_op_in_graph(true);
  v1::NegotiateResponse response;
  ASSERT_TRUE(server.stub().Negotiate(TestServer::Context().get(), request, &response).ok());
  const v1::Decision& d = response.decision();
  EXPECT_EQ(d.prefill_cuda_graph_mode(), v1::CUDA_GRAPH_MODE_NONE);
  EXPECT_EQ(d.prefill_data_plane(), v1::DATA_PLANE_EAGER);
  EXPECT_EQ(d.decode_cuda_graph_mode(), v1::CUDA_GRAPH_MODE_FULL);
  EXPECT_EQ(d.decode_data_plane(), v1::DATA_PLANE_DOORBELL);
  // Old clients read one mode: the one that holds for both phases.
  EXPECT_EQ(d.cuda_graph_mode(), v1::CUDA_GRAPH_MODE_NONE);
  EXPECT_EQ(d.data_plane(), v1::DATA_PLANE_EAGER);
  // Upstream's 2048, capped by this sidecar's workspace.
  EXPECT_EQ(d.max_tokens_per_batch(), 1024u);
  EXPECT_TRUE(
      AnyContains({d.reasons().begin(), d.reasons().end()}, "the workspace holds 1024 tokens"));
}

// The group decision can be unfused by upstream's runtime gate: Negotiate says so, with no
// per-batch limit.
TEST(ConfigService, NegotiateUnderDpAttentionIsUnfused) {
  ConfigServiceOptions o = DefaultOptions();
  config::FusionFlags f;
  f.backend = "trtllm";
  f.dp_attention = true;
  ConfigSnapshot snap;
  snap.decision = *config::ResolveBackend(f, config::Topology{90, 2, 1});
  snap.device = v1::DEVICE_KIND_CUDA;
  snap.workspace_max_tokens = 2048;
  o.snapshot = [snap]() -> absl::StatusOr<ConfigSnapshot> { return snap; };
  TestServer server(o);
  v1::NegotiateResponse response;
  ASSERT_TRUE(server.stub().Negotiate(TestServer::Context().get(), {}, &response).ok());
  EXPECT_EQ(response.decision().backend(), "trtllm");
  EXPECT_FALSE(response.decision().fusion_enabled());
  EXPECT_EQ(response.decision().max_tokens_per_batch(), 0u);
  EXPECT_EQ(response.decision().data_plane(), v1::DATA_PLANE_EAGER);
}

TEST(ConfigService, NegotiateTakesTheMoreCarefulCaptureSafety) {
  struct Case {
    std::optional<bool> server;
    std::optional<bool> client;
    v1::CudaGraphMode expected;
  };
  const Case cases[] = {
      {std::nullopt, std::nullopt, v1::CUDA_GRAPH_MODE_PIECEWISE},
      {std::nullopt, false, v1::CUDA_GRAPH_MODE_NONE},
      {false, std::nullopt, v1::CUDA_GRAPH_MODE_NONE},
      {false, true, v1::CUDA_GRAPH_MODE_NONE},  // a client cannot declare our kernels safe
      {true, true, v1::CUDA_GRAPH_MODE_PIECEWISE},
  };
  for (const Case& c : cases) {
    ConfigServiceOptions o = DefaultOptions();
    o.capture.mnnvl_capture_safe = c.server;
    ConfigSnapshot snap;
    snap.decision = GroupDecision("mnnvl", 100);
    snap.device = v1::DEVICE_KIND_CUDA;
    snap.mps_detected = true;
    o.snapshot = [snap]() -> absl::StatusOr<ConfigSnapshot> { return snap; };
    TestServer server(o);
    v1::NegotiateRequest request;
    request.mutable_capture()->set_cuda_graph_mode(v1::CUDA_GRAPH_MODE_PIECEWISE);
    request.mutable_capture()->set_fused_op_in_graph(true);
    if (c.client) request.mutable_capture()->set_mnnvl_capture_safe(*c.client);
    v1::NegotiateResponse response;
    ASSERT_TRUE(server.stub().Negotiate(TestServer::Context().get(), request, &response).ok());
    EXPECT_EQ(response.decision().cuda_graph_mode(), c.expected)
        << "server=" << (c.server ? (*c.server ? "true" : "false") : "unset")
        << " client=" << (c.client ? (*c.client ? "true" : "false") : "unset");
  }
}

TEST(ConfigService, NegotiateWithoutRequestCaptureUsesTheServerDefaults) {
  ConfigServiceOptions o = DefaultOptions();
  o.capture.mode = config::CudaGraphMode::kFull;
  o.capture.fused_op_in_graph = true;
  ConfigSnapshot snap;
  snap.decision = GroupDecision("trtllm", 90);
  snap.device = v1::DEVICE_KIND_CUDA;
  snap.mps_detected = true;
  o.snapshot = [snap]() -> absl::StatusOr<ConfigSnapshot> { return snap; };
  TestServer server(o);
  v1::NegotiateResponse response;
  ASSERT_TRUE(server.stub().Negotiate(TestServer::Context().get(), {}, &response).ok());
  EXPECT_EQ(response.decision().cuda_graph_mode(), v1::CUDA_GRAPH_MODE_FULL);
  EXPECT_EQ(response.decision().data_plane(), v1::DATA_PLANE_DOORBELL);
}

TEST(ConfigService, NegotiateBeforeTheGroupDecidedIsUnavailable) {
  ConfigServiceOptions o = DefaultOptions();
  o.snapshot = []() -> absl::StatusOr<ConfigSnapshot> {
    return absl::UnavailableError("waiting for rank 1 to join");
  };
  TestServer server(o);
  v1::NegotiateResponse response;
  grpc::Status status = server.stub().Negotiate(TestServer::Context().get(), {}, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("waiting for rank 1 to join"));

  TestServer no_snapshot(DefaultOptions());
  status = no_snapshot.stub().Negotiate(TestServer::Context().get(), {}, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("no group decision yet"));

  ConfigSnapshot snap;
  snap.device = v1::DEVICE_KIND_CUDA;
  ConfigServiceOptions bad = DefaultOptions();
  bad.snapshot = [snap]() -> absl::StatusOr<ConfigSnapshot> { return snap; };
  TestServer bad_capture(bad);
  v1::NegotiateRequest request;
  request.mutable_capture()->set_cuda_graph_mode(static_cast<v1::CudaGraphMode>(42));
  status = bad_capture.stub().Negotiate(TestServer::Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("capture.cuda_graph_mode 42"));
}

TEST(ConfigConvert, RoundTripsAndRejectsUnknownValues) {
  config::Decision d;
  d.backend = "mnnvl";
  d.fusion_enabled = true;
  d.cuda_graph_mode = config::CudaGraphMode::kPiecewise;
  d.data_plane = config::DataPlane::kDoorbell;
  d.warnings = {"w"};
  d.reasons = {"a", "b"};
  EXPECT_EQ(*config::DecisionFromProto(config::DecisionToProto(d)), d);
  d.rules = config::RuleSet::kSglang29063;
  d.max_tokens_per_batch = 2048;
  d.prefill = {config::CudaGraphMode::kNone, config::DataPlane::kEager};
  d.decode = {config::CudaGraphMode::kFull, config::DataPlane::kDoorbell};
  d.notices = {"n"};
  EXPECT_EQ(*config::DecisionFromProto(config::DecisionToProto(d)), d);
  config::FusionFlags f;
  f.backend = "auto";
  f.deterministic = true;
  f.rules = config::RuleSet::kSglang29063;
  f.model_architecture = "Glm4MoeForCausalLM";
  f.dp_attention = true;
  f.moe_a2a_backend = "deepep";
  EXPECT_EQ(*config::FlagsFromProto(config::FlagsToProto(f)), f);
  EXPECT_FALSE(config::FlagsFromProto(v1::FusionFlags{})->backend.has_value());
  // Unset fields: the given default rule set, MoE all-to-all "none".
  EXPECT_EQ(config::FlagsFromProto(v1::FusionFlags{}, config::RuleSet::kSglang29063)->rules,
            config::RuleSet::kSglang29063);
  EXPECT_EQ(config::FlagsFromProto(v1::FusionFlags{})->moe_a2a_backend, "none");
  config::CaptureRequest c{config::CudaGraphMode::kFull, true, false};
  EXPECT_EQ(*config::CaptureFromProto(config::CaptureToProto(c)), c);
  c.prefill_mode = config::CudaGraphMode::kPiecewise;
  c.decode_mode = config::CudaGraphMode::kNone;
  EXPECT_EQ(*config::CaptureFromProto(config::CaptureToProto(c)), c);

  // A decision from a server that predates the per-phase fields: both phases are the one mode.
  v1::Decision old = config::DecisionToProto(d);
  old.clear_prefill_cuda_graph_mode();
  old.clear_prefill_data_plane();
  old.clear_decode_cuda_graph_mode();
  old.clear_decode_data_plane();
  old.clear_fusion_rules();
  absl::StatusOr<config::Decision> from_old = config::DecisionFromProto(old);
  ASSERT_TRUE(from_old.ok()) << from_old.status();
  EXPECT_EQ(from_old->prefill, (config::PhaseCapture{config::CudaGraphMode::kPiecewise,
                                                     config::DataPlane::kDoorbell}));
  EXPECT_EQ(from_old->decode, from_old->prefill);
  EXPECT_EQ(from_old->rules, config::RuleSet::kSglang23402);

  v1::Decision bad = config::DecisionToProto(d);
  bad.set_backend("auto");
  absl::Status status = config::DecisionFromProto(bad).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("decision.backend \"auto\""));
  bad = config::DecisionToProto(d);
  bad.set_data_plane(v1::DATA_PLANE_UNSPECIFIED);
  status = config::DecisionFromProto(bad).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("decision.data_plane 0"));
  bad = config::DecisionToProto(d);
  bad.set_decode_data_plane(static_cast<v1::DataPlane>(5));
  status = config::DecisionFromProto(bad).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("decision.decode_data_plane 5"));
  bad = config::DecisionToProto(d);
  bad.set_prefill_cuda_graph_mode(static_cast<v1::CudaGraphMode>(8));
  status = config::DecisionFromProto(bad).status();
  EXPECT_THAT(std::string(status.message()), HasSubstr("decision.prefill_cuda_graph_mode 8"));
  bad = config::DecisionToProto(d);
  bad.set_fusion_rules("newest");
  status = config::DecisionFromProto(bad).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("decision.fusion_rules: unknown --fusion-rules value \"newest\""));
  v1::FusionFlags bad_flags;
  bad_flags.set_fusion_rules("");
  status = config::FlagsFromProto(bad_flags).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("flags.fusion_rules: unknown"));
}

// Upstream logs its mnnvl-to-trtllm fallback at INFO once per process: so does the daemon,
// however often the group re-forms.
TEST(ConfigNotices, LoggedAtInfoOncePerProcess) {
  std::ostringstream captured;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(captured);
  auto logger = std::make_shared<spdlog::logger>("notices", sink);
  logger->set_level(spdlog::level::info);
  logger->set_pattern("%l %v");
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(logger);
  config::FusionFlags f;
  f.backend = "mnnvl";
  const config::Decision d = *config::ResolveBackend(f, config::Topology{90, 4, 2});
  ASSERT_EQ(d.notices.size(), 1u);
  for (int i = 0; i < 3; ++i) LogNoticesOncePerProcess(d);
  spdlog::set_default_logger(previous);
  const std::string log = captured.str();
  EXPECT_THAT(log, HasSubstr("info event=config_notice notice=\"FlashInfer allreduce fusion: "
                             "forcing trtllm backend ("));
  size_t count = 0;
  for (size_t at = log.find("config_notice"); at != std::string::npos;
       at = log.find("config_notice", at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 1u);
}

}  // namespace
}  // namespace arfuse
