// FusionService::BeginShutdown over a real gRPC server on a Unix socket: open Session streams end
// with UNAVAILABLE at once, new sessions and session-bound calls are refused the same way, and
// grpc::Server::Shutdown no longer waits its deadline for the streams.
#include <grpcpp/grpcpp.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/registry/host_shm_opener.h"
#include "server/services/fusion/fusion_service.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

using SessionStream = grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>;

class FusionShutdownTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/arfuse-shutdown-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    const std::string socket = dir_ + "/fusion.sock";
    FusionServiceOptions o;
    o.device = MemoryKind::kHostShm;
    o.world_size = 1;
    // No engine: sessions and region calls do not need one.
    service_ = std::make_unique<FusionService>(
        o, [] { return nullptr; }, std::make_unique<HostShmOpener>(), nullptr);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::Fusion::NewStub(
        grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
    server_.reset();
    service_.reset();
    std::filesystem::remove_all(dir_);
  }

  struct Open {
    std::unique_ptr<grpc::ClientContext> ctx;
    std::unique_ptr<SessionStream> stream;
    std::string session_token;
  };

  // Opens a Session stream and reads its first answer (session_token empty when refused).
  Open OpenSession(const std::string& name) {
    Open o;
    o.ctx = std::make_unique<grpc::ClientContext>();
    o.ctx->set_deadline(std::chrono::system_clock::now() + 30s);
    o.stream = stub_->Session(o.ctx.get());
    v1::SessionRequest req;
    req.set_client_name(name);
    o.stream->Write(req);
    v1::SessionResponse resp;
    if (o.stream->Read(&resp)) o.session_token = resp.session_token();
    return o;
  }

  bool WaitSessions(size_t n, absl::Duration timeout) {
    const absl::Time until = absl::Now() + timeout;
    while (service_->registry().session_count() != n) {
      if (absl::Now() > until) return false;
      std::this_thread::sleep_for(10ms);  // polling a counter, bounded above
    }
    return true;
  }

  std::string dir_;
  std::unique_ptr<FusionService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Fusion::Stub> stub_;
};

TEST_F(FusionShutdownTest, OpenSessionsEndWithUnavailableAndTheServerStopsPromptly) {
  Open a = OpenSession("a");
  Open b = OpenSession("b");
  ASSERT_FALSE(a.session_token.empty());
  ASSERT_FALSE(b.session_token.empty());
  ASSERT_TRUE(WaitSessions(2, absl::Seconds(10)));

  service_->BeginShutdown();
  for (Open* o : {&a, &b}) {
    v1::SessionResponse resp;
    EXPECT_FALSE(o->stream->Read(&resp));
    grpc::Status st = o->stream->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr("sidecar shutting down"));
  }
  // The sessions closed with their streams (regions and plans are released with them).
  EXPECT_TRUE(WaitSessions(0, absl::Seconds(10)));

  // With no stream left open, Server::Shutdown does not wait for its (long) deadline.
  const absl::Time t0 = absl::Now();
  server_->Shutdown(std::chrono::system_clock::now() + 30s);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
}

TEST_F(FusionShutdownTest, NewSessionsAndSessionCallsAreRefusedOnceShutdownBegan) {
  Open a = OpenSession("a");
  ASSERT_FALSE(a.session_token.empty());
  service_->BeginShutdown();
  service_->BeginShutdown();  // idempotent

  Open late = OpenSession("late");
  EXPECT_TRUE(late.session_token.empty());
  grpc::Status st = late.stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("sidecar shutting down"));

  // A call naming the session that was ended: told why, not "unknown session".
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  ctx.AddMetadata(kSessionMetadataKey, a.session_token);
  v1::ListRegionsRequest req;
  v1::ListRegionsResponse resp;
  grpc::Status list = stub_->ListRegions(&ctx, req, &resp);
  EXPECT_EQ(list.error_code(), grpc::StatusCode::UNAVAILABLE) << list.error_message();
  EXPECT_THAT(list.error_message(), HasSubstr("sidecar shutting down"));
  a.stream->Finish();
}

}  // namespace
}  // namespace arfuse
