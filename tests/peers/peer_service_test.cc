// The gRPC Peer service in front of a Coordinator: joins and collectives from gRPC clients,
// and the refusals a client can act on.
#include "server/services/peer/peer_service.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace arfuse {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class PeerServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    address_ = absl::StrCat("unix:/tmp/arfuse-peersvc-", ::getpid(), ".sock");
    grpc::ServerBuilder b;
    b.AddListeningPort(address_, grpc::InsecureServerCredentials());
    b.RegisterService(&service_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::Peer::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }
  void TearDown() override { server_->Shutdown(std::chrono::system_clock::now()); }

  void Deadline(grpc::ClientContext& c, int seconds = 30) {
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  }

  grpc::Status Join(int rank, int world, v1::JoinResponse* out) {
    grpc::ClientContext c;
    Deadline(c);
    v1::JoinRequest req;
    req.set_rank(rank);
    req.set_world_size(world);
    req.set_nnodes(1);
    return stub_->Join(&c, req, out);
  }

  std::string address_;
  PeerService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Peer::Stub> stub_;
};

TEST_F(PeerServiceTest, WithoutCoordinatorCallsAreUnavailable) {
  v1::JoinResponse resp;
  grpc::Status s = Join(0, 2, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("does not host the peer coordinator"));
}

TEST_F(PeerServiceTest, JoinFromAnotherPeerApiMajorIsFailedPrecondition) {
  service_.SetCoordinator(std::make_shared<peers::Coordinator>("svc", 2, 1));
  grpc::ClientContext c;
  Deadline(c);
  v1::JoinRequest req;
  req.set_rank(1);
  req.set_world_size(2);
  req.set_nnodes(1);
  req.mutable_api()->set_major(2);
  req.mutable_api()->set_minor(3);
  v1::JoinResponse resp;
  grpc::Status s = stub_->Join(&c, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(),
              HasSubstr("peer API version 2.3 is not supported by this coordinator (1.x)"));
}

TEST_F(PeerServiceTest, LeaveWithAStaleEpochIsAbortedAndBreaksNothing) {
  auto coord = std::make_shared<peers::Coordinator>("svc", 2, 1);
  service_.SetCoordinator(coord);
  grpc::ClientContext c;
  Deadline(c);
  v1::LeaveRequest req;
  req.set_epoch(coord->epoch() + 7);
  req.set_rank(1);
  req.set_reason("from an older group");
  v1::LeaveResponse resp;
  grpc::Status s = stub_->Leave(&c, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(s.error_message(),
              HasSubstr(absl::StrCat("stale epoch ", coord->epoch() + 7, " (group is at epoch ",
                                     coord->epoch(), ")")));
  EXPECT_TRUE(coord->broken().ok()) << coord->broken();
}

// Leave checks the caller's API major as Join and Collective do: a sidecar of another major cannot
// take a rank out of this group.
TEST_F(PeerServiceTest, LeaveFromAnotherApiMajorIsFailedPreconditionAndBreaksNothing) {
  auto coord = std::make_shared<peers::Coordinator>("svc", 2, 1);
  service_.SetCoordinator(coord);
  grpc::ClientContext c;
  Deadline(c);
  c.AddMetadata("arfuse-api-version", "2.0");
  v1::LeaveRequest req;
  req.set_epoch(coord->epoch());
  req.set_rank(1);
  req.set_reason("from another major");
  v1::LeaveResponse resp;
  grpc::Status s = stub_->Leave(&c, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("client API version 2.0 is not supported"));
  EXPECT_TRUE(coord->broken().ok()) << coord->broken();
}

TEST_F(PeerServiceTest, TwoRanksJoinAndAllgatherThroughGrpc) {
  auto coord = std::make_shared<peers::Coordinator>("svc", 2, 1);
  service_.SetCoordinator(coord);
  std::vector<v1::JoinResponse> joined(2);
  std::vector<grpc::Status> st(2);
  {
    std::thread t1([&] { st[1] = Join(1, 2, &joined[1]); });
    st[0] = Join(0, 2, &joined[0]);
    t1.join();
  }
  ASSERT_TRUE(st[0].ok()) << st[0].error_message();
  ASSERT_TRUE(st[1].ok()) << st[1].error_message();
  EXPECT_EQ(joined[0].epoch(), coord->epoch());
  EXPECT_EQ(joined[1].members_size(), 2);

  std::vector<v1::CollectiveResponse> out(2);
  auto gather = [&](int r) {
    grpc::ClientContext c;
    Deadline(c);
    v1::CollectiveRequest req;
    req.set_epoch(coord->epoch());
    req.set_tag("ids");
    req.set_kind(v1::COLLECTIVE_KIND_ALLGATHER);
    req.set_rank(r);
    req.set_payload(absl::StrCat("id", r));
    st[r] = stub_->Collective(&c, req, &out[r]);
  };
  std::thread t1(gather, 1);
  gather(0);
  t1.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].error_message();
    EXPECT_THAT(out[r].payloads(), ElementsAre("id0", "id1"));
  }

  // Refusals: a stale epoch, an unknown kind, a client of another API major version.
  {
    grpc::ClientContext c;
    Deadline(c);
    v1::CollectiveRequest req;
    req.set_epoch(coord->epoch() + 1);
    req.set_kind(v1::COLLECTIVE_KIND_BARRIER);
    v1::CollectiveResponse r;
    grpc::Status s = stub_->Collective(&c, req, &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED);
    EXPECT_THAT(s.error_message(), HasSubstr("stale epoch"));
  }
  {
    grpc::ClientContext c;
    Deadline(c);
    v1::CollectiveRequest req;
    req.set_epoch(coord->epoch());
    req.set_kind(static_cast<v1::CollectiveKind>(42));
    v1::CollectiveResponse r;
    grpc::Status s = stub_->Collective(&c, req, &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("collective kind 42"));
  }
  {
    grpc::ClientContext c;
    Deadline(c);
    c.AddMetadata("arfuse-api-version", "2.0");
    v1::CollectiveRequest req;
    v1::CollectiveResponse r;
    grpc::Status s = stub_->Collective(&c, req, &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("2.0"));
  }
  // A barrier rank 1 never joins answers before the caller's deadline, naming rank 1.
  {
    grpc::ClientContext c;
    Deadline(c, 2);
    v1::CollectiveRequest req;
    req.set_epoch(coord->epoch());
    req.set_tag("lonely");
    req.set_kind(v1::COLLECTIVE_KIND_BARRIER);
    req.set_rank(0);
    v1::CollectiveResponse r;
    // The coordinator's deadlines are driven by Expire(); here nothing else drives it, so a
    // helper thread does what the socket server's I/O loop does.
    std::atomic<bool> done{false};
    std::thread driver([&] {
      while (!done.load()) {
        coord->Expire(absl::Now());
        absl::SleepFor(absl::Milliseconds(10));  // polling cadence, not synchronization
      }
    });
    grpc::Status s = stub_->Collective(&c, req, &r);
    done = true;
    driver.join();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_THAT(s.error_message(), HasSubstr("ranks 1 did not arrive"));
  }
  // Leave breaks the group for everyone.
  {
    grpc::ClientContext c;
    Deadline(c);
    v1::LeaveRequest req;
    req.set_epoch(coord->epoch());
    req.set_rank(1);
    req.set_reason("shutting down");
    v1::LeaveResponse r;
    ASSERT_TRUE(stub_->Leave(&c, req, &r).ok());
    EXPECT_EQ(coord->broken().code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(coord->broken().message(), HasSubstr("left: shutting down"));
  }
}

}  // namespace
}  // namespace arfuse
