// arfuse.v1.Config over a real in-process gRPC server on a temporary Unix socket: Resolve gives
// the library's answers, Negotiate answers for the snapshot, errors keep their codes.
#include "server/services/config/config_service.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/config/fusion_config.h"
#include "server/services/config/config_convert.h"

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
            ASSERT_TRUE(status.ok()) << status.error_message();

            absl::StatusOr<config::Decision> expected = config::Resolve(flags, topology, capture);
            ASSERT_TRUE(expected.ok());
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
  config::FusionFlags f;
  f.backend = "auto";
  f.deterministic = true;
  EXPECT_EQ(config::FlagsFromProto(config::FlagsToProto(f)), f);
  EXPECT_FALSE(config::FlagsFromProto(v1::FusionFlags{}).backend.has_value());
  config::CaptureRequest c{config::CudaGraphMode::kFull, true, false};
  EXPECT_EQ(*config::CaptureFromProto(config::CaptureToProto(c)), c);

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
}

}  // namespace
}  // namespace arfuse
