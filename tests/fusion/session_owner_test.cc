// Sessions belong to the caller that opened them (docs/security.md): every Fusion call that names
// a session by its token is refused with PERMISSION_DENIED unless it comes from the same uid, and
// the refusal is one message whether the token is guessed, malformed, ended or another user's.
// Plan ids and attach ids are held by their session the same way. The callers' uids are faked at
// the service layer (CallerCredentials), as the daemon's listener would report them.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cpp/client.h"
#include "common/random_id.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/fdpass/ticket_broker.h"
#include "server/services/fusion/fusion_service.h"
#include "tests/fusion/fake_engine.h"
#include "tests/fusion/fusion_test_server.h"

namespace arfuse {
namespace {

using ::arfuse::client::Client;
using ::arfuse::testing::FakeEngine;
using ::arfuse::testing::FusionTestServer;
using ::arfuse::testing::kTokens;
using ::arfuse::testing::NormBuffers;
using ::testing::HasSubstr;
using ::testing::Not;

// The owner is this process's own uid, so that the victim's named memory opens for it; the other
// uid is one no process of the test runs as.
const uint32_t kOwnerUid = ::geteuid();
const uint32_t kOtherUid = kOwnerUid + 4242;

// Every connection is the uid the test says it is now: a session opened while it says kOwnerUid
// keeps that owner, and the calls made after it switched come from kOtherUid.
class SwitchableCallers final : public CallerCredentials {
 public:
  std::optional<SocketCredentials> ForPeer(absl::string_view) const override {
    SocketCredentials c;
    c.pid = 1;
    c.uid = uid.load();
    c.gid = c.uid;
    return c;
  }
  std::atomic<uint32_t> uid{kOwnerUid};
};

// What one raw call answered.
struct Answer {
  std::string rpc;
  grpc::Status status;
};

class SessionOwnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FusionServiceOptions options;
    options.device = MemoryKind::kHostShm;
    options.rank = 0;
    options.world_size = 2;
    options.dtype = DType::kFP32;
    options.callers = &callers_;
    options.fd_tickets = &broker_;
    engine_ = std::make_unique<FakeEngine>();
    ASSERT_NO_FATAL_FAILURE(
        server_.Start("/tmp/arfuse-owner-test-XXXXXX", options, [this] { return engine_.get(); }));
    stub_ = v1::Fusion::NewStub(
        grpc::CreateChannel("unix:" + server_.socket(), grpc::InsecureChannelCredentials()));
    // The victim: a session of kOwnerUid with a region and a plan over it.
    victim_ = server_.Connect("victim");
    ASSERT_NE(victim_, nullptr);
    bufs_.emplace(::arfuse::testing::RegisterNormBuffers(*victim_, "victim-region"));
    auto plan = victim_->CreatePlan(bufs_->Op());
    ASSERT_TRUE(plan.ok()) << plan.status();
    plan_ = *plan;
  }

  void TearDown() override {
    engine_->OpenGate();
    victim_.reset();
    server_.Stop();
  }

  // The victim's op, as a request message.
  v1::OpSpec VictimOp() const {
    v1::OpSpec op;
    op.set_pattern(v1::PATTERN_ALLREDUCE_RESIDUAL_RMSNORM);
    op.set_dtype(v1::DTYPE_FP32);
    op.set_hidden(::arfuse::testing::kHidden);
    op.set_max_tokens(kTokens);
    auto ref = [&](v1::RegionRef* r, uint64_t offset) {
      r->set_region_id(bufs_->region.id);
      r->set_generation(bufs_->region.generation);
      r->set_offset(offset);
    };
    ref(op.mutable_input(), 0);
    ref(op.mutable_residual_in(), ::arfuse::testing::kTensorBytes);
    ref(op.mutable_residual_out(), ::arfuse::testing::kTensorBytes);
    ref(op.mutable_norm_out(), 2 * ::arfuse::testing::kTensorBytes);
    ref(op.mutable_gamma(), 3 * ::arfuse::testing::kTensorBytes);
    return op;
  }

  // Calls every Fusion RPC that names a session, each with `token` in arfuse-session, aimed at
  // the victim's region, plan and (when given) attachment.
  std::vector<Answer> CallEverySessionRpc(const std::string& token, uint64_t attach_id = 1) {
    std::vector<Answer> out;
    auto ctx = [&](grpc::ClientContext& c) {
      c.AddMetadata("arfuse-api-version", "1.1");
      c.AddMetadata("arfuse-session", token);
      c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    };
    {
      grpc::ClientContext c;
      ctx(c);
      v1::ListRegionsResponse resp;
      out.push_back({"ListRegions", stub_->ListRegions(&c, v1::ListRegionsRequest(), &resp)});
      EXPECT_EQ(resp.regions_size(), 0);
    }
    {
      grpc::ClientContext c;
      ctx(c);
      v1::RegisterRegionRequest req;
      req.set_name("intruder");
      req.set_byte_size(bufs_->buf.size());
      req.mutable_host_shm()->set_shm_name(bufs_->buf.shm_name());
      v1::RegisterRegionResponse resp;
      out.push_back({"RegisterRegion(host_shm)", stub_->RegisterRegion(&c, req, &resp)});
    }
    {
      grpc::ClientContext c;
      ctx(c);
      v1::RegisterRegionRequest req;
      req.set_name("intruder-fd");
      req.set_byte_size(4096);
      req.mutable_host_fd()->set_fd_ticket(NewFdTicket());
      v1::RegisterRegionResponse resp;
      out.push_back({"RegisterRegion(host_fd)", stub_->RegisterRegion(&c, req, &resp)});
    }
    {
      grpc::ClientContext c;
      ctx(c);
      v1::UnregisterRegionRequest req;
      req.set_region_id(bufs_->region.id);
      req.set_generation(bufs_->region.generation);
      v1::UnregisterRegionResponse resp;
      out.push_back({"UnregisterRegion", stub_->UnregisterRegion(&c, req, &resp)});
    }
    for (bool doorbell : {false, true}) {
      grpc::ClientContext c;
      ctx(c);
      v1::CreatePlanRequest req;
      *req.mutable_op() = VictimOp();
      req.set_doorbell(doorbell);
      v1::CreatePlanResponse resp;
      out.push_back(
          {doorbell ? "CreatePlan(doorbell)" : "CreatePlan", stub_->CreatePlan(&c, req, &resp)});
    }
    {
      grpc::ClientContext c;
      ctx(c);
      v1::DestroyPlanRequest req;
      req.set_plan_id(plan_.id);
      req.set_generation(plan_.generation);
      v1::DestroyPlanResponse resp;
      out.push_back({"DestroyPlan", stub_->DestroyPlan(&c, req, &resp)});
    }
    {
      grpc::ClientContext c;
      ctx(c);
      v1::ExecuteRequest req;
      req.set_plan_id(plan_.id);
      req.set_plan_generation(plan_.generation);
      req.set_num_tokens(1);
      v1::ExecuteResponse resp;
      out.push_back({"Execute(plan)", stub_->Execute(&c, req, &resp)});
    }
    {
      grpc::ClientContext c;
      ctx(c);
      v1::ExecuteRequest req;
      *req.mutable_op() = VictimOp();
      req.set_num_tokens(1);
      v1::ExecuteResponse resp;
      out.push_back({"Execute(op)", stub_->Execute(&c, req, &resp)});
    }
    {
      grpc::ClientContext c;
      ctx(c);
      v1::AttachRequest req;
      v1::AttachResponse resp;
      out.push_back({"Attach", stub_->Attach(&c, req, &resp)});
    }
    {
      grpc::ClientContext c;
      ctx(c);
      v1::DetachRequest req;
      req.set_attach_id(attach_id);
      v1::DetachResponse resp;
      out.push_back({"Detach", stub_->Detach(&c, req, &resp)});
    }
    return out;
  }

  // The victim's session is as it was: its region listed, its plan runs.
  void ExpectVictimIntact() {
    callers_.uid = kOwnerUid;
    auto regions = victim_->ListRegions();
    ASSERT_TRUE(regions.ok()) << regions.status();
    ASSERT_EQ(regions->size(), 1u);
    EXPECT_EQ((*regions)[0].name(), "victim-region");
    auto run = victim_->Execute(plan_, 1);
    EXPECT_TRUE(run.ok()) << run.status();
  }

  // Every answer is PERMISSION_DENIED with the one message, which names nothing of the victim's.
  void ExpectAllDenied(const std::vector<Answer>& answers, const std::string& token) {
    ASSERT_FALSE(answers.empty());
    for (const Answer& a : answers) {
      EXPECT_EQ(a.status.error_code(), grpc::StatusCode::PERMISSION_DENIED)
          << a.rpc << ": " << a.status.error_message();
      EXPECT_EQ(a.status.error_message(), answers[0].status.error_message()) << a.rpc;
      if (!token.empty()) {
        EXPECT_THAT(a.status.error_message(), Not(HasSubstr(token))) << a.rpc;
      }
      EXPECT_THAT(a.status.error_message(), Not(HasSubstr(absl::StrCat(plan_.id)))) << a.rpc;
      EXPECT_THAT(a.status.error_message(), Not(HasSubstr("victim"))) << a.rpc;
      EXPECT_THAT(a.status.error_message(), Not(HasSubstr("not found"))) << a.rpc;
    }
    EXPECT_THAT(answers[0].status.error_message(),
                HasSubstr("arfuse-session names no open session of this caller"));
  }

  SwitchableCallers callers_;
  FdTicketBroker broker_;
  std::unique_ptr<FakeEngine> engine_;
  FusionTestServer server_;
  std::unique_ptr<v1::Fusion::Stub> stub_;
  std::unique_ptr<Client> victim_;
  std::optional<NormBuffers> bufs_;
  client::Plan plan_;
};

TEST_F(SessionOwnerTest, ALeakedTokenUsedByAnotherUidIsRefusedOnEveryRpc) {
  const std::string leaked = victim_->session().session_token;
  callers_.uid = kOtherUid;
  std::vector<Answer> leaked_answers = CallEverySessionRpc(leaked);
  ExpectAllDenied(leaked_answers, leaked);
  // The same answer as for a token no session has: nothing tells the two apart.
  std::vector<Answer> unknown = CallEverySessionRpc(NewSessionToken());
  ASSERT_EQ(unknown.size(), leaked_answers.size());
  for (size_t i = 0; i < unknown.size(); ++i) {
    EXPECT_EQ(unknown[i].status.error_code(), leaked_answers[i].status.error_code());
    EXPECT_EQ(unknown[i].status.error_message(), leaked_answers[i].status.error_message());
  }
  EXPECT_EQ(broker_.pending(), 0u);
  ExpectVictimIntact();
}

TEST_F(SessionOwnerTest, GuessedAndMalformedTokensAreRefusedAlikeEvenFromTheOwnersUid) {
  std::string token = victim_->session().session_token;
  std::string flipped = token;
  flipped[31] = flipped[31] == '0' ? '1' : '0';
  std::string upper = token;
  for (char& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  const std::vector<std::string> guesses = {NewSessionToken(),
                                            NewSessionToken(),
                                            flipped,
                                            token.substr(0, 31),
                                            token + "0",
                                            upper == token ? std::string(32, 'g') : upper,
                                            "0",
                                            "1",
                                            "18446744073709551615",
                                            "",
                                            " "};
  std::string first_message;
  for (const std::string& g : guesses) {
    std::vector<Answer> answers = CallEverySessionRpc(g);
    ExpectAllDenied(answers, g.size() > 2 ? g : "");
    if (first_message.empty()) first_message = answers[0].status.error_message();
    EXPECT_EQ(answers[0].status.error_message(), first_message) << "guess \"" << g << "\"";
  }
  ExpectVictimIntact();
}

TEST_F(SessionOwnerTest, AnEndedSessionsTokenIsRefusedLikeAGuess) {
  auto other = server_.Connect("short-lived");
  ASSERT_NE(other, nullptr);
  const std::string ended = other->session().session_token;
  other.reset();
  ASSERT_TRUE(::arfuse::testing::WaitFor(
      [&] { return server_.service()->registry().session_count() == 1; }, absl::Seconds(20)));
  std::vector<Answer> answers = CallEverySessionRpc(ended);
  ExpectAllDenied(answers, ended);
  EXPECT_EQ(answers[0].status.error_message(),
            CallEverySessionRpc(NewSessionToken())[0].status.error_message());
}

// Another session (its own, of another uid) naming the victim's plan id: refused as a plan id
// nobody holds, and the victim's plan stays.
TEST_F(SessionOwnerTest, AnotherSessionCannotReachThePlanByItsId) {
  callers_.uid = kOtherUid;
  auto intruder = server_.Connect("intruder");
  ASSERT_NE(intruder, nullptr);
  client::Plan theirs = plan_;
  absl::StatusOr<client::ExecResult> run = intruder->Execute(theirs, 1);
  absl::Status destroy = intruder->DestroyPlan(theirs);
  client::Plan nobodys = plan_;
  nobodys.id = RandomNonZeroId();
  absl::StatusOr<client::ExecResult> run_unknown = intruder->Execute(nobodys, 1);
  absl::Status destroy_unknown = intruder->DestroyPlan(nobodys);
  for (const absl::Status& s : {run.status(), destroy}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_THAT(s.message(), HasSubstr("the plan is not held by this session"));
    EXPECT_THAT(s.message(), Not(HasSubstr(absl::StrCat(plan_.id))));
  }
  EXPECT_EQ(run.status(), run_unknown.status());
  EXPECT_EQ(destroy, destroy_unknown);
  // The same for a session of the owner's own uid: plans are the session's, not the user's.
  callers_.uid = kOwnerUid;
  auto sibling = server_.Connect("sibling");
  ASSERT_NE(sibling, nullptr);
  EXPECT_EQ(sibling->Execute(theirs, 1).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(sibling->DestroyPlan(theirs).code(), absl::StatusCode::kPermissionDenied);
  ExpectVictimIntact();
}

// Plan ids are 64 random bits: two plans of one session are not neighbours.
TEST_F(SessionOwnerTest, PlanIdsAreRandom) {
  auto second = victim_->CreatePlan(bufs_->Op());
  ASSERT_TRUE(second.ok()) << second.status();
  const uint64_t a = plan_.id, b = second->id;
  EXPECT_NE(a, b);
  // A counter would differ by a small step; 64 random bits differ by less than 2^32 with
  // probability 2^-31.
  EXPECT_GT(a > b ? a - b : b - a, uint64_t{1} << 32) << a << " " << b;
}

}  // namespace
}  // namespace arfuse
