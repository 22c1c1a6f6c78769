// The C++ client's answer when the fused path cannot run an op (docs/config.md, "Fallback
// honesty"): the sidecar refuses it with OUT_OF_RANGE ("fusion unavailable for this op: ...") and
// TryExecute/TryExecuteOp give nullopt, so the framework runs its own path, as FlashInfer's
// callers do when its fused op returns nothing. Against a fake Fusion service on a Unix socket.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "arfuse/v1/fusion.grpc.pb.h"
#include "client/cpp/client.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;

// Opens sessions and answers Execute with the status a test sets.
class FakeFusion final : public v1::Fusion::Service {
 public:
  grpc::Status Session(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::SessionResponse, v1::SessionRequest>* stream) override {
    v1::SessionRequest hello;
    if (!stream->Read(&hello)) return grpc::Status::OK;
    v1::SessionResponse opened;
    opened.set_session_token("0123456789abcdef0123456789abcdef");
    opened.set_world_size(2);
    stream->Write(opened);
    // Held open until the client ends the session.
    while (stream->Read(&hello)) {
    }
    static_cast<void>(context);
    return grpc::Status::OK;
  }
  grpc::Status Execute(grpc::ServerContext*, const v1::ExecuteRequest*,
                       v1::ExecuteResponse* response) override {
    ++calls;
    if (!answer.ok()) return answer;
    response->set_path(v1::EXEC_PATH_HOST);
    return grpc::Status::OK;
  }

  grpc::Status answer;
  std::atomic<int> calls{0};
};

class FakeSidecar {
 public:
  FakeSidecar() {
    char tmpl[] = "/tmp/arfuse-client-unavailable-XXXXXX";
    dir_ = mkdtemp(tmpl);
    socket_ = dir_ + "/fusion.sock";
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket_, grpc::InsecureServerCredentials());
    builder.RegisterService(&fusion);
    server_ = builder.BuildAndStart();
  }
  ~FakeSidecar() {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    unlink(socket_.c_str());
    rmdir(dir_.c_str());
  }
  const std::string& socket() const { return socket_; }

  FakeFusion fusion;

 private:
  std::string dir_;
  std::string socket_;
  std::unique_ptr<grpc::Server> server_;
};

TEST(ClientFusionUnavailable, OutOfRangeIsNulloptAndOtherErrorsStay) {
  FakeSidecar sidecar;
  client::ClientOptions options;
  options.target = sidecar.socket();
  absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(options);
  ASSERT_TRUE(c.ok()) << c.status();
  client::Plan plan;
  plan.id = 1;
  plan.generation = 1;

  sidecar.fusion.answer = grpc::Status(grpc::StatusCode::OUT_OF_RANGE,
                                       "fusion unavailable for this op: 4096 tokens exceed the "
                                       "workspace's 2048");
  absl::StatusOr<std::optional<client::ExecResult>> skipped = (*c)->TryExecute(plan, 4096);
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_FALSE(skipped->has_value());
  // Execute itself reports the status as it came, and IsFusionUnavailableForOp recognizes it.
  absl::StatusOr<client::ExecResult> raw = (*c)->Execute(plan, 4096);
  EXPECT_EQ(raw.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(raw.status().message()), HasSubstr("fusion unavailable for this op: "));
  EXPECT_TRUE(client::IsFusionUnavailableForOp(raw.status()));
  client::OpDesc op;
  op.hidden = 4096;
  absl::StatusOr<std::optional<client::ExecResult>> skipped_op = (*c)->TryExecuteOp(op, 4096);
  ASSERT_TRUE(skipped_op.ok());
  EXPECT_FALSE(skipped_op->has_value());

  // Other refusals are errors, not "unavailable".
  sidecar.fusion.answer = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "hidden 12");
  absl::StatusOr<std::optional<client::ExecResult>> bad = (*c)->TryExecute(plan, 1);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(client::IsFusionUnavailableForOp(bad.status()));
  EXPECT_FALSE(client::IsFusionUnavailableForOp(absl::UnavailableError("initializing")));

  // An op that runs gives its result.
  sidecar.fusion.answer = grpc::Status::OK;
  absl::StatusOr<std::optional<client::ExecResult>> ran = (*c)->TryExecute(plan, 1);
  ASSERT_TRUE(ran.ok());
  ASSERT_TRUE(ran->has_value());
  EXPECT_EQ((*ran)->path, v1::EXEC_PATH_HOST);
  EXPECT_EQ(sidecar.fusion.calls.load(), 5);
}

}  // namespace
}  // namespace arfuse
