// The C++ client's attach (client/cpp/instream_attach.h) against a stand-in Fusion service on a
// Unix socket: what the Attach request carries, the refusals it passes on, the descriptors it
// cannot pick up yet, and the Detach that releases an attachment that did not complete.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cpp/instream_attach.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/instream/attach_abi.h"

namespace arfuse::client {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class FakeFusion final : public v1::Fusion::Service {
 public:
  grpc::Status Session(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<v1::SessionResponse, v1::SessionRequest>* stream) override {
    v1::SessionRequest req;
    if (!stream->Read(&req)) return grpc::Status::OK;
    v1::SessionResponse resp;
    resp.set_session_token("0123456789abcdef0123456789abcdef");
    resp.set_device(v1::DEVICE_KIND_HOST);
    resp.set_world_size(2);
    stream->Write(resp);
    while (stream->Read(&req)) {
    }
    return grpc::Status::OK;
  }
  grpc::Status Attach(grpc::ServerContext*, const v1::AttachRequest* req,
                      v1::AttachResponse* resp) override {
    std::lock_guard<std::mutex> lock(mu);
    last_request = *req;
    if (!refusal.ok()) return refusal;
    *resp = response;
    return grpc::Status::OK;
  }
  grpc::Status Detach(grpc::ServerContext*, const v1::DetachRequest* req,
                      v1::DetachResponse*) override {
    std::lock_guard<std::mutex> lock(mu);
    detached.push_back(req->attach_id());
    return detach_answer;
  }

  std::mutex mu;
  v1::AttachRequest last_request;
  v1::AttachResponse response;
  grpc::Status refusal = grpc::Status::OK;
  grpc::Status detach_answer = grpc::Status::OK;
  std::vector<uint64_t> detached;
};

class AttachClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    socket_ = (std::filesystem::temp_directory_path() /
               absl::StrCat("arfuse-attach-client-", ::getpid(), ".sock"))
                  .string();
    std::filesystem::remove(socket_);
    grpc::ServerBuilder b;
    b.AddListeningPort("unix:" + socket_, grpc::InsecureServerCredentials());
    b.RegisterService(&fake_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    auto c = Client::Connect({.target = socket_, .client_name = "attach-test"});
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
  }
  void TearDown() override {
    client_.reset();
    server_->Shutdown();
    std::filesystem::remove(socket_);
  }

  std::string socket_;
  FakeFusion fake_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(AttachClientTest, TheRequestCarriesTheLibrarysVersionsAndTheHiddens) {
  fake_.response.set_attach_id(5);
  fake_.response.set_attach_blob("not a blob");
  auto ctx = AttachInStream(*client_, {4096, 8192});
  const v1::AttachRequest& req = fake_.last_request;
  EXPECT_THAT(std::vector<uint32_t>(req.hidden().begin(), req.hidden().end()),
              ElementsAre(4096u, 8192u));
  EXPECT_EQ(req.attach_abi_version(), arfuse_client_abi_version());
  EXPECT_EQ(req.launch_abi_version(), instream::kLaunchAbiVersion);
  EXPECT_EQ(req.launch_args_bytes(), instream::kLaunchArgsBytes);
  // A blob the library refuses: the library's answer, and the sidecar's attachment released.
  EXPECT_EQ(ctx.status().code(), absl::StatusCode::kInvalidArgument) << ctx.status();
  EXPECT_THAT(ctx.status().message(), HasSubstr("shorter than its header"));
  EXPECT_THAT(fake_.detached, ElementsAre(5u));
}

// The descriptors wait on the sidecar's fd channel: a channel that does not answer (here: none
// at the path) fails the attach with its error, and the sidecar's attachment is released.
TEST_F(AttachClientTest, DescriptorsComeFromTheFdChannelAndItsFailureReleasesTheAttachment) {
  fake_.response.set_attach_id(6);
  fake_.response.set_fd_count(1);
  fake_.response.set_fd_ticket("ticket");
  fake_.response.set_fd_socket("/nonexistent/arfused.sock.fd");
  fake_.response.set_memory_kind("host_shm");
  auto ctx = AttachInStream(*client_);
  EXPECT_EQ(ctx.status().code(), absl::StatusCode::kUnavailable) << ctx.status();
  EXPECT_THAT(ctx.status().message(), HasSubstr("/nonexistent/arfused.sock.fd"));
  EXPECT_THAT(fake_.detached, ElementsAre(6u));
}

TEST_F(AttachClientTest, TheSidecarsRefusalComesBackAsItSentIt) {
  fake_.refusal =
      grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "launch_abi_version 1 differs from 2");
  auto ctx = AttachInStream(*client_);
  EXPECT_EQ(ctx.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(ctx.status().message(), HasSubstr("launch_abi_version 1 differs from 2"));
  EXPECT_TRUE(fake_.detached.empty());
}

TEST_F(AttachClientTest, DetachSendsTheIdAndReturnsTheSidecarsAnswer) {
  EXPECT_TRUE(client_->Detach(9).ok());
  fake_.detach_answer = grpc::Status(grpc::StatusCode::NOT_FOUND, "no attachment 10");
  absl::Status s = client_->Detach(10);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("no attachment 10"));
  EXPECT_THAT(fake_.detached, ElementsAre(9u, 10u));
}

}  // namespace
}  // namespace arfuse::client
