// Registry: sessions, regions, plans, generations, in-flight holds and caps, over a fake opener
// (no real handle is opened). HostShmOpener is tested over shm objects this test creates.
#include "server/registry/registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/random_id.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/registry/host_shm_opener.h"
#include "tests/registry/fake_opener.h"

namespace arfuse {
namespace {

using ::arfuse::testing::FakeOpener;
using ::arfuse::testing::HostSpec;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr uint64_t kNonce = 0x1234;

std::unique_ptr<Registry> MakeRegistry(RegistryLimits limits = {}, uint64_t nonce = kNonce,
                                       uint64_t alloc = 0) {
  return std::make_unique<Registry>(
      limits, std::make_unique<FakeOpener>(MemoryKind::kHostShm, 0, alloc), nonce);
}

// A norm op over one region: input | residual | norm_out | gamma, each 64 KiB apart.
OpRequest NormOpOn(RegionHandle h, uint32_t hidden = 64, uint32_t max_tokens = 8) {
  OpRequest op;
  op.pattern = 2;
  op.dtype = 1;
  op.hidden = hidden;
  op.max_tokens = max_tokens;
  op.input = {true, h.region_id, h.generation, 0};
  op.residual_in = {true, h.region_id, h.generation, 65536};
  op.residual_out = op.residual_in;
  op.norm_out = {true, h.region_id, h.generation, 131072};
  op.gamma = {true, h.region_id, h.generation, 196608};
  return op;
}

class RegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    baseline_ = OpenMappingCount();
    reg_ = MakeRegistry();
    auto s = reg_->OpenSession("test-client");
    ASSERT_TRUE(s.ok()) << s.status();
    session_ = *s;
  }
  void TearDown() override {
    reg_.reset();
    EXPECT_EQ(OpenMappingCount(), baseline_);
  }
  RegionHandle Register(const std::string& name, uint64_t bytes = 262144) {
    auto h = reg_->RegisterRegion(session_, HostSpec(name, bytes));
    EXPECT_TRUE(h.ok()) << h.status();
    return h.ok() ? *h : RegionHandle{};
  }

  int64_t baseline_ = 0;
  std::unique_ptr<Registry> reg_;
  uint64_t session_ = 0;
};

TEST_F(RegistryTest, RegisterListUnregister) {
  RegionHandle h = Register("a", 4096);
  EXPECT_NE(h.generation, 0u);
  EXPECT_EQ(OpenMappingCount(), baseline_ + 1);
  auto list = reg_->ListRegions(session_);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].name, "a");
  EXPECT_EQ((*list)[0].byte_size, 4096u);
  EXPECT_EQ((*list)[0].generation, h.generation);
  ASSERT_TRUE(
      reg_->UnregisterRegion(session_, h.region_id, h.generation, absl::Now() + absl::Seconds(5))
          .ok());
  EXPECT_EQ(OpenMappingCount(), baseline_);
  EXPECT_TRUE(reg_->ListRegions(session_)->empty());
}

TEST_F(RegistryTest, DuplicateNameIsAlreadyExists) {
  Register("dup");
  auto again = reg_->RegisterRegion(session_, HostSpec("dup", 4096));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(again.status().message(), HasSubstr("already registered in this session"));
  EXPECT_THAT(again.status().message(), Not(HasSubstr("dup")));
}

TEST_F(RegistryTest, SameNameInAnotherSessionIsFine) {
  Register("shared-name");
  auto other = reg_->OpenSession("other");
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(reg_->RegisterRegion(*other, HostSpec("shared-name", 4096)).ok());
}

TEST_F(RegistryTest, ByteSizeAboveTheRealAllocationIsRefused) {
  reg_ = MakeRegistry({}, kNonce, /*alloc=*/4096);
  session_ = *reg_->OpenSession("c");
  auto r = reg_->RegisterRegion(session_, HostSpec("big", 8192));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("byte_size 8192 exceeds the exported allocation"));
  EXPECT_EQ(OpenMappingCount(), baseline_);  // the opened mapping was closed again
}

TEST_F(RegistryTest, ValidationRunsBeforeOpening) {
  RegionSpec spec = HostSpec("x", 4096);
  spec.shm_name = "/a/b";
  auto r = reg_->RegisterRegion(session_, spec);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("shm_name"));
  EXPECT_THAT(r.status().message(), Not(HasSubstr("/a/b")));
}

TEST_F(RegistryTest, OpenerErrorsPassThrough) {
  RegionSpec spec = HostSpec("x", 4096);
  spec.shm_name = "/fail-open";
  auto r = reg_->RegisterRegion(session_, spec);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("could not be opened"));
}

TEST_F(RegistryTest, RegionCountCapIsResourceExhausted) {
  RegistryLimits limits;
  limits.max_regions_per_session = 2;
  reg_ = MakeRegistry(limits);
  session_ = *reg_->OpenSession("c");
  Register("a", 64);
  Register("b", 64);
  auto r = reg_->RegisterRegion(session_, HostSpec("c", 64));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("session has 2 regions; the limit is 2"));
}

TEST_F(RegistryTest, ByteCapIsResourceExhausted) {
  RegistryLimits limits;
  limits.max_bytes_per_session = 10000;
  reg_ = MakeRegistry(limits);
  session_ = *reg_->OpenSession("c");
  Register("a", 8192);
  auto r = reg_->RegisterRegion(session_, HostSpec("b", 4096));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("the limit is 10000"));
}

TEST_F(RegistryTest, SessionCapIsResourceExhausted) {
  RegistryLimits limits;
  limits.max_sessions = 1;
  reg_ = MakeRegistry(limits);
  ASSERT_TRUE(reg_->OpenSession("one").ok());
  auto r = reg_->OpenSession("two");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("too many sessions"));
}

TEST_F(RegistryTest, UnknownSessionIsFailedPrecondition) {
  auto r = reg_->RegisterRegion(session_ + 1, HostSpec("a", 64));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("unknown session"));
  EXPECT_EQ(reg_->ListRegions(session_ + 1).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(RegistryTest, ASessionIsFoundByItsTokenOnlyForItsOwner) {
  const SessionOwner alice{1000, ""};
  const SessionOwner bob{1001, ""};
  const SessionOwner alice_over_tls{1000, "x509:CN=alice"};
  auto opened = reg_->OpenOwnedSession("alice", alice);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_TRUE(IsWellFormedSessionToken(opened->token)) << opened->token;
  auto found = reg_->FindSession(opened->token, alice);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, opened->id);

  // Another uid, the same uid with another identity, a guess, a malformed token: one answer.
  const absl::Status reference = reg_->FindSession(NewSessionToken(), alice).status();
  EXPECT_EQ(reference.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(reference.message(), HasSubstr("names no open session of this caller"));
  for (const absl::Status& s : {reg_->FindSession(opened->token, bob).status(),
                                reg_->FindSession(opened->token, alice_over_tls).status(),
                                reg_->FindSession(opened->token, SessionOwner{}).status(),
                                reg_->FindSession(opened->token.substr(1), alice).status(),
                                reg_->FindSession(absl::StrCat(opened->id), alice).status()}) {
    EXPECT_EQ(s, reference);
    EXPECT_THAT(s.message(), Not(HasSubstr(opened->token)));
  }
  // Ended: the same answer again, also to its owner.
  reg_->CloseSession(opened->id);
  EXPECT_EQ(reg_->FindSession(opened->token, alice).status(), reference);
}

TEST_F(RegistryTest, SessionTokensAreDistinctAndNotDerivedFromEachOther) {
  std::set<std::string> tokens;
  RegistryLimits limits;
  limits.max_sessions = 64;
  reg_ = MakeRegistry(limits);
  for (int i = 0; i < 64; ++i) {
    auto s = reg_->OpenOwnedSession("c", SessionOwner{1000, ""});
    ASSERT_TRUE(s.ok()) << s.status();
    tokens.insert(s->token);
  }
  EXPECT_EQ(tokens.size(), 64u);
  // Two registries with the same boot nonce (what a fixed nonce gave before) share no token.
  auto twin = MakeRegistry(limits);
  for (int i = 0; i < 64; ++i) {
    auto s = twin->OpenOwnedSession("c", SessionOwner{1000, ""});
    ASSERT_TRUE(s.ok());
    EXPECT_FALSE(tokens.contains(s->token));
  }
}

TEST_F(RegistryTest, UnknownRegionIsNotFound) {
  absl::Status s = reg_->UnregisterRegion(session_, 999, 1, absl::Now() + absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("region 999 is not registered in this session"));
}

TEST_F(RegistryTest, AnotherSessionsRegionIsNotFoundAndNotNamed) {
  auto other = *reg_->OpenSession("other");
  auto h = reg_->RegisterRegion(other, HostSpec("secret-name", 262144));
  ASSERT_TRUE(h.ok());
  absl::Status s =
      reg_->UnregisterRegion(session_, h->region_id, h->generation, absl::Now() + absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), Not(HasSubstr("secret")));
  auto op = reg_->ResolveOp(session_, NormOpOn(*h), 1);
  EXPECT_EQ(op.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(op.status().message(), Not(HasSubstr("secret")));
}

TEST_F(RegistryTest, StaleGenerationAfterReRegistration) {
  RegionHandle first = Register("a");
  ASSERT_TRUE(reg_->UnregisterRegion(session_, first.region_id, first.generation,
                                     absl::Now() + absl::Seconds(1))
                  .ok());
  RegionHandle second = Register("a");
  EXPECT_NE(first.generation, second.generation);
  // A reference built from the first registration but aimed at the new id is stale.
  RegionHandle mixed{second.region_id, first.generation};
  auto op = reg_->ResolveOp(session_, NormOpOn(mixed), 1);
  EXPECT_EQ(op.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(op.status().message(), HasSubstr("stale generation"));
  absl::Status s = reg_->UnregisterRegion(session_, second.region_id, first.generation,
                                          absl::Now() + absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("stale generation"));
}

TEST(RegistryRestart, GenerationsDifferAcrossBootNonces) {
  auto a = MakeRegistry({}, 1);
  auto b = MakeRegistry({}, 2);
  auto ha = a->RegisterRegion(*a->OpenSession("c"), HostSpec("r", 64));
  auto hb = b->RegisterRegion(*b->OpenSession("c"), HostSpec("r", 64));
  ASSERT_TRUE(ha.ok() && hb.ok());
  // Same id sequence, different restart: the old generation must not validate.
  EXPECT_EQ(ha->region_id, hb->region_id);
  EXPECT_NE(ha->generation, hb->generation);
}

TEST(RegistryRestart, RandomNonceIsNonZeroAndVaries) {
  uint64_t a = RandomBootNonce(), b = RandomBootNonce();
  EXPECT_NE(a, 0u);
  EXPECT_NE(a, b);
}

TEST_F(RegistryTest, ResolvePlanGivesPointersInsideTheRegion) {
  RegionHandle h = Register("buf");
  auto plan = reg_->CreatePlan(session_, NormOpOn(h));
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto op = reg_->ResolvePlan(session_, plan->plan_id, plan->generation, 3);
  ASSERT_TRUE(op.ok()) << op.status();
  const char* input = static_cast<const char*>(op->args().input);
  EXPECT_EQ(static_cast<const char*>(op->args().residual_in), input + 65536);
  EXPECT_EQ(op->args().residual_out, op->args().residual_in);
  EXPECT_EQ(static_cast<const char*>(op->args().norm_out), input + 131072);
  EXPECT_EQ(static_cast<const char*>(op->args().gamma), input + 196608);
  EXPECT_EQ(op->args().num_tokens, 3u);
  EXPECT_EQ(op->args().hidden, 64u);
  EXPECT_EQ((*reg_->ListRegions(session_))[0].in_flight, 1u);  // one op, five tensors
  op->Release();
  EXPECT_EQ((*reg_->ListRegions(session_))[0].in_flight, 0u);
}

TEST_F(RegistryTest, PlanTokensAboveMaxAreRefused) {
  RegionHandle h = Register("buf");
  auto plan = *reg_->CreatePlan(session_, NormOpOn(h));
  auto op = reg_->ResolvePlan(session_, plan.plan_id, plan.generation, 9);
  EXPECT_EQ(op.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(op.status().message(), HasSubstr("num_tokens 9 exceeds the plan's max_tokens 8"));
}

TEST_F(RegistryTest, PlanThatDoesNotFitAtMaxTokensIsRefused) {
  RegionHandle h = Register("buf");
  // 8 tokens x 16384 hidden x bf16 = 256 KiB: residual_in at 64 KiB runs past the region.
  auto plan = reg_->CreatePlan(session_, NormOpOn(h, 16384, 8));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("end past the region"));
}

TEST_F(RegistryTest, ShapeThatDoesNotMatchTheRegionIsRefused) {
  RegionHandle h = Register("small", 1024);
  OpRequest op = NormOpOn(h);
  op.input.offset = 0;
  auto r = reg_->ResolveOp(session_, op, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("end past the region's 1024 bytes"));
}

TEST_F(RegistryTest, UnknownAndStalePlans) {
  RegionHandle h = Register("buf");
  auto plan = *reg_->CreatePlan(session_, NormOpOn(h));
  auto r = reg_->ResolvePlan(session_, plan.plan_id + 100, plan.generation, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(r.status().message(), HasSubstr("not held by this session"));
  r = reg_->ResolvePlan(session_, plan.plan_id, plan.generation + 1, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("stale generation"));
  absl::Status d = reg_->DestroyPlan(session_, plan.plan_id, plan.generation + 1);
  EXPECT_THAT(d.message(), HasSubstr("stale generation"));
  ASSERT_TRUE(reg_->DestroyPlan(session_, plan.plan_id, plan.generation).ok());
  d = reg_->DestroyPlan(session_, plan.plan_id, plan.generation);
  EXPECT_EQ(d.code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(RegistryTest, PlanOverAnUnregisteredRegionIsFailedPrecondition) {
  RegionHandle h = Register("buf");
  auto plan = *reg_->CreatePlan(session_, NormOpOn(h));
  ASSERT_TRUE(
      reg_->UnregisterRegion(session_, h.region_id, h.generation, absl::Now() + absl::Seconds(1))
          .ok());
  auto r = reg_->ResolvePlan(session_, plan.plan_id, plan.generation, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("was unregistered; create the plan again"));
}

TEST_F(RegistryTest, PlanCapIsResourceExhausted) {
  RegistryLimits limits;
  limits.max_plans_per_session = 1;
  reg_ = MakeRegistry(limits);
  session_ = *reg_->OpenSession("c");
  RegionHandle h = Register("buf");
  ASSERT_TRUE(reg_->CreatePlan(session_, NormOpOn(h)).ok());
  auto r = reg_->CreatePlan(session_, NormOpOn(h));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("plans; the limit is 1"));
}

TEST_F(RegistryTest, UnregisterWaitsForTheOpInFlight) {
  RegionHandle h = Register("buf");
  auto op = reg_->ResolveOp(session_, NormOpOn(h), 2);
  ASSERT_TRUE(op.ok());
  std::atomic<bool> released{false};
  std::thread worker([&] {
    absl::SleepFor(absl::Milliseconds(100));
    released = true;
    op->Release();
  });
  absl::Status s =
      reg_->UnregisterRegion(session_, h.region_id, h.generation, absl::Now() + absl::Seconds(30));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(released.load());  // it returned only after the op let go
  worker.join();
  EXPECT_EQ(OpenMappingCount(), baseline_);
}

TEST_F(RegistryTest, UnregisterDuringAnOpTimesOutAndKeepsTheRegion) {
  RegionHandle h = Register("buf");
  auto op = reg_->ResolveOp(session_, NormOpOn(h), 2);
  ASSERT_TRUE(op.ok());
  absl::Status s = reg_->UnregisterRegion(session_, h.region_id, h.generation,
                                          absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("still used by 1 op(s) in flight; it stays registered"));
  EXPECT_EQ(reg_->ListRegions(session_)->size(), 1u);
  op->Release();
  EXPECT_TRUE(
      reg_->UnregisterRegion(session_, h.region_id, h.generation, absl::Now() + absl::Seconds(1))
          .ok());
}

TEST_F(RegistryTest, NewOpsAreRefusedWhileUnregistering) {
  RegionHandle h = Register("buf");
  auto op = reg_->ResolveOp(session_, NormOpOn(h), 1);
  ASSERT_TRUE(op.ok());
  std::thread unreg([&] {
    reg_->UnregisterRegion(session_, h.region_id, h.generation, absl::Now() + absl::Seconds(30))
        .IgnoreError();
  });
  // Wait (bounded) until the unregister has started, observed through the refusal itself.
  absl::Status seen;
  for (int i = 0; i < 3000; ++i) {
    auto second = reg_->ResolveOp(session_, NormOpOn(h), 1);
    if (!second.ok()) {
      seen = second.status();
      break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(seen.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(seen.message(), HasSubstr("is being unregistered"));
  op->Release();
  unreg.join();
  EXPECT_TRUE(reg_->ListRegions(session_)->empty());
}

TEST_F(RegistryTest, SessionEndReleasesEverythingAfterOpsInFlight) {
  RegionHandle h = Register("a");
  Register("b");
  auto op = reg_->ResolveOp(session_, NormOpOn(h), 1);
  ASSERT_TRUE(op.ok());
  EXPECT_EQ(OpenMappingCount(), baseline_ + 2);
  reg_->CloseSession(session_);
  // "b" is closed at once; "a" stays mapped while the op runs, and not a moment longer.
  EXPECT_EQ(OpenMappingCount(), baseline_ + 1);
  op->Release();
  EXPECT_EQ(OpenMappingCount(), baseline_);
  EXPECT_EQ(reg_->CheckSession(session_).code(), absl::StatusCode::kFailedPrecondition);
  reg_->CloseSession(session_);  // a second end is harmless
}

TEST_F(RegistryTest, SessionEndWakesAWaitingUnregister) {
  RegionHandle h = Register("a");
  auto op = reg_->ResolveOp(session_, NormOpOn(h), 1);
  ASSERT_TRUE(op.ok());
  std::thread unreg([&] {
    EXPECT_TRUE(
        reg_->UnregisterRegion(session_, h.region_id, h.generation, absl::Now() + absl::Seconds(60))
            .ok());
  });
  absl::SleepFor(absl::Milliseconds(50));
  absl::Time start = absl::Now();
  reg_->CloseSession(session_);
  unreg.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  op->Release();
}

TEST_F(RegistryTest, ExplicitOpSizedByNumTokens) {
  RegionHandle h = Register("buf");
  OpRequest op = NormOpOn(h);
  op.max_tokens = 0;
  auto r = reg_->ResolveOp(session_, op, 8);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->shape().max_tokens, 8u);
  auto zero = reg_->ResolveOp(session_, op, 0);
  EXPECT_THAT(zero.status().message(), HasSubstr("num_tokens must be > 0"));
}

TEST_F(RegistryTest, OverlappingOutputsAreRefused) {
  RegionHandle h = Register("buf");
  OpRequest op = NormOpOn(h);
  op.norm_out.offset = op.residual_out.offset + 16;
  auto r = reg_->ResolveOp(session_, op, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("overlap"));
}

TEST_F(RegistryTest, ExplicitOpRefusalsNameTheirRule) {
  RegionHandle h = Register("buf");
  OpRequest op = NormOpOn(h);
  op.gamma.region_id = h.region_id + 100;
  auto r = reg_->ResolveOp(session_, op, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat("gamma: region ", h.region_id + 100,
                                                           " is not registered in this session")));
  auto zero = reg_->ResolveOp(session_, NormOpOn(h), 0);
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(zero.status().message(), HasSubstr("num_tokens must be > 0"));
}

TEST_F(RegistryTest, SecondUnregisterWhileTheFirstWaitsIsAborted) {
  RegionHandle h = Register("buf");
  auto op = reg_->ResolveOp(session_, NormOpOn(h), 1);
  ASSERT_TRUE(op.ok());
  absl::Status first;
  std::thread unreg([&] {
    first = reg_->UnregisterRegion(session_, h.region_id, h.generation,
                                   absl::Now() + absl::Seconds(30));
  });
  // Wait (bounded) until the first unregister has started, observed through the refusal of new
  // ops it causes.
  bool started = false;
  for (int i = 0; i < 3000 && !started; ++i) {
    started = !reg_->ResolveOp(session_, NormOpOn(h), 1).ok();
    if (!started) absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(started);
  absl::Status second =
      reg_->UnregisterRegion(session_, h.region_id, h.generation, absl::Now() + absl::Seconds(1));
  EXPECT_EQ(second.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(second.message(),
              HasSubstr(absl::StrCat("region ", h.region_id,
                                     " is already being unregistered by another call")));
  op->Release();
  unreg.join();
  EXPECT_TRUE(first.ok()) << first;
  EXPECT_TRUE(reg_->ListRegions(session_)->empty());
}

// An opener that runs `hook` once, inside the first Open: what another call can do while the
// registry opens a region outside its lock.
class HookOpener final : public MemoryOpener {
 public:
  explicit HookOpener(std::function<void()> hook) : hook_(std::move(hook)) {}
  MemoryKind kind() const override { return MemoryKind::kHostShm; }
  int32_t device_id() const override { return 0; }
  absl::StatusOr<std::unique_ptr<Mapping>> Open(const RegionSpec& spec) override {
    std::function<void()> hook = std::move(hook_);
    hook_ = nullptr;
    if (hook) hook();
    return std::unique_ptr<Mapping>(new ::arfuse::testing::FakeMapping(spec.byte_size));
  }

 private:
  std::function<void()> hook_;
};

// A mapping that starts 8 bytes past a 16-byte boundary (no real opener returns one).
class MisalignedMapping final : public Mapping {
 public:
  explicit MisalignedMapping(uint64_t size)
      : buf_(static_cast<char*>(std::aligned_alloc(64, (size + 8 + 63) / 64 * 64))), size_(size) {}
  ~MisalignedMapping() override { std::free(buf_); }
  void* base() const override { return buf_ + 8; }
  uint64_t allocation_size() const override { return size_; }

 private:
  char* buf_;
  uint64_t size_;
};

class MisalignedOpener final : public MemoryOpener {
 public:
  MemoryKind kind() const override { return MemoryKind::kHostShm; }
  int32_t device_id() const override { return 0; }
  absl::StatusOr<std::unique_ptr<Mapping>> Open(const RegionSpec& spec) override {
    return std::unique_ptr<Mapping>(new MisalignedMapping(spec.byte_size));
  }
};

TEST(RegistryOpening, MisalignedMappingIsRefused) {
  const int64_t baseline = OpenMappingCount();
  Registry reg({}, std::make_unique<MisalignedOpener>(), kNonce);
  uint64_t sid = *reg.OpenSession("c");
  auto r = reg.RegisterRegion(sid, HostSpec("odd", 4096));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("region does not start on a 16-byte boundary"));
  EXPECT_EQ(OpenMappingCount(), baseline);
  EXPECT_TRUE(reg.ListRegions(sid)->empty());
}

TEST(RegistryOpening, SessionEndedWhileOpeningIsFailedPrecondition) {
  const int64_t baseline = OpenMappingCount();
  Registry* reg_ptr = nullptr;
  uint64_t sid = 0;
  Registry reg({}, std::make_unique<HookOpener>([&] { reg_ptr->CloseSession(sid); }), kNonce);
  reg_ptr = &reg;
  sid = *reg.OpenSession("c");
  auto r = reg.RegisterRegion(sid, HostSpec("a", 4096));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("session ended while the region was being opened"));
  EXPECT_EQ(OpenMappingCount(), baseline);
}

TEST(RegistryOpening, NameTakenWhileOpeningIsAlreadyExists) {
  const int64_t baseline = OpenMappingCount();
  Registry* reg_ptr = nullptr;
  uint64_t sid = 0;
  Registry reg({}, std::make_unique<HookOpener>([&] {
                 ASSERT_TRUE(reg_ptr->RegisterRegion(sid, HostSpec("a", 4096)).ok());
               }),
               kNonce);
  reg_ptr = &reg;
  sid = *reg.OpenSession("c");
  auto r = reg.RegisterRegion(sid, HostSpec("a", 4096));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(r.status().message(), HasSubstr("already registered in this session"));
  // The registration that won keeps its mapping; the loser's was closed.
  EXPECT_EQ(reg.ListRegions(sid)->size(), 1u);
  EXPECT_EQ(OpenMappingCount(), baseline + 1);
}

TEST(RegistryOpening, CapsReachedWhileOpeningAreResourceExhausted) {
  const int64_t baseline = OpenMappingCount();
  RegistryLimits limits;
  limits.max_regions_per_session = 1;
  Registry* reg_ptr = nullptr;
  uint64_t sid = 0;
  Registry reg(limits, std::make_unique<HookOpener>([&] {
                 ASSERT_TRUE(reg_ptr->RegisterRegion(sid, HostSpec("b", 4096)).ok());
               }),
               kNonce);
  reg_ptr = &reg;
  sid = *reg.OpenSession("c");
  auto r = reg.RegisterRegion(sid, HostSpec("a", 4096));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("session reached its region caps meanwhile"));
  EXPECT_EQ(reg.ListRegions(sid)->size(), 1u);
  EXPECT_EQ(OpenMappingCount(), baseline + 1);
}

TEST_F(RegistryTest, ConcurrentClientsKeepCountsConsistent) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto sid = reg_->OpenSession(absl::StrCat("c", t));
      if (!sid.ok()) {
        ++failures;
        return;
      }
      for (int i = 0; i < 50; ++i) {
        auto h = reg_->RegisterRegion(*sid, HostSpec(absl::StrCat("r", i), 262144));
        if (!h.ok()) {
          ++failures;
          continue;
        }
        auto op = reg_->ResolveOp(*sid, NormOpOn(*h), 4);
        if (!op.ok()) ++failures;
        if (i % 2 == 0) {
          op = absl::InternalError("drop");  // release before unregistering
          if (!reg_->UnregisterRegion(*sid, h->region_id, h->generation,
                                      absl::Now() + absl::Seconds(30))
                   .ok()) {
            ++failures;
          }
        }
      }
      reg_->CloseSession(*sid);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(reg_->session_count(), 1u);  // the fixture's own
}

// ---- totals (Admin.GetStats, the region gauges) ----

// Records every report of the totals observer.
struct TotalsLog {
  std::mutex mu;
  std::vector<RegistryTotals> seen;
  Registry::TotalsObserver Observer() {
    return [this](const RegistryTotals& t) {
      std::lock_guard<std::mutex> lock(mu);
      seen.push_back(t);
    };
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return seen.size();
  }
  RegistryTotals last() {
    std::lock_guard<std::mutex> lock(mu);
    return seen.empty() ? RegistryTotals{} : seen.back();
  }
};

RegistryTotals Totals(uint64_t sessions, uint64_t regions, uint64_t bytes, uint64_t plans) {
  return RegistryTotals{sessions, regions, bytes, plans};
}

TEST_F(RegistryTest, TotalsFollowRegionsPlansAndSessionEnd) {
  TotalsLog log;
  reg_->SetTotalsObserver(log.Observer());
  // Setting the observer reports the current totals at once: the fixture's empty session.
  ASSERT_EQ(log.size(), 1u);
  EXPECT_EQ(log.last(), Totals(1, 0, 0, 0));

  RegionHandle a = Register("a", 262144);
  Register("b", 4096);
  EXPECT_EQ(log.last(), Totals(1, 2, 266240, 0));
  auto plan = reg_->CreatePlan(session_, NormOpOn(a));
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto plan2 = reg_->CreatePlan(session_, NormOpOn(a, 64, 4));
  ASSERT_TRUE(plan2.ok()) << plan2.status();
  EXPECT_EQ(log.last(), Totals(1, 2, 266240, 2));
  EXPECT_EQ(reg_->totals(), log.last());

  // Another session's holdings add up with the first's.
  auto other = reg_->OpenSession("other");
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(reg_->RegisterRegion(*other, HostSpec("c", 8192)).ok());
  EXPECT_EQ(log.last(), Totals(2, 3, 274432, 2));

  ASSERT_TRUE(reg_->DestroyPlan(session_, plan2->plan_id, plan2->generation).ok());
  EXPECT_EQ(log.last(), Totals(2, 3, 274432, 1));
  // Unregistering a region leaves the plan over it (it fails when used, not before).
  ASSERT_TRUE(
      reg_->UnregisterRegion(session_, a.region_id, a.generation, absl::Now() + absl::Seconds(5))
          .ok());
  EXPECT_EQ(log.last(), Totals(2, 2, 12288, 1));

  // A session's end releases all it held.
  reg_->CloseSession(*other);
  EXPECT_EQ(log.last(), Totals(1, 1, 4096, 1));
  reg_->CloseSession(session_);
  EXPECT_EQ(log.last(), Totals(0, 0, 0, 0));
  EXPECT_EQ(reg_->totals(), Totals(0, 0, 0, 0));
}

TEST_F(RegistryTest, RefusedChangesLeaveTotalsAlone) {
  RegionHandle a = Register("a", 262144);
  TotalsLog log;
  reg_->SetTotalsObserver(log.Observer());
  const RegistryTotals before = reg_->totals();
  EXPECT_EQ(before, Totals(1, 1, 262144, 0));

  auto dup = reg_->RegisterRegion(session_, HostSpec("a", 4096));
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists);
  auto plan = reg_->CreatePlan(session_, NormOpOn(a, 64, 1u << 14));  // past the region's end
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("end past the region"));
  absl::Status stale = reg_->UnregisterRegion(session_, a.region_id, a.generation + 1, absl::Now());
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(stale.message(), HasSubstr("stale generation"));
  absl::Status unknown = reg_->DestroyPlan(session_, 999, 1);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(unknown.message(), HasSubstr("not held by this session"));

  EXPECT_EQ(reg_->totals(), before);
  // Only the report made when the observer was set: refusals change nothing and report nothing.
  EXPECT_EQ(log.size(), 1u);
  EXPECT_EQ(log.last(), before);
}

TEST_F(RegistryTest, RacingChangesLeaveTheObserverWithTheCurrentTotals) {
  TotalsLog log;
  reg_->SetTotalsObserver(log.Observer());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto sid = reg_->OpenSession(absl::StrCat("c", t));
      ASSERT_TRUE(sid.ok());
      for (int i = 0; i < 40; ++i) {
        auto h = reg_->RegisterRegion(*sid, HostSpec(absl::StrCat("r", i), 4096 * (t + 1)));
        ASSERT_TRUE(h.ok()) << h.status();
        // Every other region is given back; thread t keeps 20 regions of 4096 * (t + 1) bytes.
        if (i % 2 == 0) {
          ASSERT_TRUE(reg_->UnregisterRegion(*sid, h->region_id, h->generation,
                                             absl::Now() + absl::Seconds(30))
                          .ok());
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  // 20 regions per thread: 20 * 4096 * (1 + 2 + 3 + 4) bytes, 5 sessions with the fixture's.
  const RegistryTotals want = Totals(5, 80, 20 * 4096 * 10, 0);
  EXPECT_EQ(reg_->totals(), want);
  EXPECT_EQ(log.last(), want);
  // 1 (set) + 4 opens + 4 * 40 registrations + 4 * 20 unregistrations.
  EXPECT_EQ(log.size(), 1u + 4 + 160 + 80);
}

TEST_F(RegistryTest, ClearedObserverIsNotCalled) {
  TotalsLog log;
  reg_->SetTotalsObserver(log.Observer());
  reg_->SetTotalsObserver(nullptr);
  Register("a", 4096);
  EXPECT_EQ(log.size(), 1u);
  EXPECT_EQ(reg_->totals(), Totals(1, 1, 4096, 0));
}

// ---- HostShmOpener over shm objects made here ----

class ShmObject {
 public:
  ShmObject(uint64_t size) : name_(absl::StrCat("/arfuse-regtest-", getpid(), "-", ++seq_)) {
    int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    map_ = static_cast<char*>(mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    size_ = size;
    close(fd);
  }
  ~ShmObject() {
    munmap(map_, size_);
    shm_unlink(name_.c_str());
  }
  const std::string& name() const { return name_; }
  char* data() { return map_; }

 private:
  static inline int seq_ = 0;
  std::string name_;
  char* map_ = nullptr;
  uint64_t size_ = 0;
};

TEST(HostShmOpener, MapsTheObjectSharedAndMeasuresIt) {
  int64_t baseline = OpenMappingCount();
  ShmObject obj(8192);
  std::memcpy(obj.data(), "hello", 5);
  HostShmOpener opener;
  RegionSpec spec = HostSpec("r", 4096);
  spec.shm_name = obj.name();
  auto m = opener.Open(spec);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->allocation_size(), 8192u);
  EXPECT_EQ(std::memcmp((*m)->base(), "hello", 5), 0);
  static_cast<char*>((*m)->base())[100] = 'x';
  EXPECT_EQ(obj.data()[100], 'x');
  EXPECT_EQ(OpenMappingCount(), baseline + 1);
  m->reset();
  EXPECT_EQ(OpenMappingCount(), baseline);
}

TEST(HostShmOpener, RefusesSizeAboveTheObject) {
  ShmObject obj(4096);
  HostShmOpener opener;
  RegionSpec spec = HostSpec("r", 4097);
  spec.shm_name = obj.name();
  auto m = opener.Open(spec);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("exceeds the exported allocation of 4096"));
}

TEST(HostShmOpener, MissingObjectDoesNotEchoItsName) {
  HostShmOpener opener;
  RegionSpec spec = HostSpec("r", 64);
  spec.shm_name = "/arfuse-no-such-object-xyz";
  auto m = opener.Open(spec);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("could not be opened"));
  EXPECT_THAT(m.status().message(), Not(HasSubstr("no-such-object")));
}

TEST(HostShmOpener, RechecksTheNameItself) {
  HostShmOpener opener;
  RegionSpec spec = HostSpec("r", 64);
  spec.shm_name = "/../etc/passwd";
  auto m = opener.Open(spec);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("host_shm.shm_name may only contain"));
}

TEST(HostShmOpener, RefusesAnEmptyObject) {
  const std::string name = absl::StrCat("/arfuse-regtest-empty-", getpid());
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  close(fd);
  HostShmOpener opener;
  RegionSpec spec = HostSpec("r", 64);
  spec.shm_name = name;
  auto m = opener.Open(spec);
  shm_unlink(name.c_str());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("host shared-memory object is empty"));
}

TEST(HostShmOpener, RefusesANameThatIsNotASharedMemoryObject) {
  // A FIFO where a shared-memory object would be: it opens read-write, but is not one.
  const std::string name = absl::StrCat("/arfuse-regtest-fifo-", getpid());
  const std::string path = "/dev/shm" + name;
  ASSERT_EQ(mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  HostShmOpener opener;
  RegionSpec spec = HostSpec("r", 64);
  spec.shm_name = name;
  auto m = opener.Open(spec);
  unlink(path.c_str());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(),
              HasSubstr("host shared-memory name is not a shared-memory object"));
  EXPECT_THAT(m.status().message(), Not(HasSubstr("regtest-fifo")));
}

TEST(HostShmOpener, OutOfDescriptorsIsResourceExhausted) {
  ShmObject obj(4096);
  HostShmOpener opener;
  RegionSpec spec = HostSpec("r", 4096);
  spec.shm_name = obj.name();
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit none = saved;
  none.rlim_cur = 0;  // no descriptor can be opened until it is restored below
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &none), 0);
  auto m = opener.Open(spec);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(m.status().message(), HasSubstr("sidecar is out of file descriptors"));
}

// A registry over the real opener, one session, and a 256 KiB named object registered in it.
struct RealRegistry {
  RealRegistry() {
    RegionSpec spec = HostSpec("r", 262144);
    spec.shm_name = obj.name();
    region = reg.RegisterRegion(sid, spec);
  }
  ~RealRegistry() {
    reg.CloseSession(sid);
    EXPECT_EQ(OpenMappingCount(), baseline);
  }
  const int64_t baseline = OpenMappingCount();
  ShmObject obj{262144};
  Registry reg{{}, std::make_unique<HostShmOpener>(), kNonce};
  const uint64_t sid = *reg.OpenSession("c");
  absl::StatusOr<RegionHandle> region;
};

TEST(HostShmOpener, RealRegistryRoundTrip) {
  RealRegistry r;
  ASSERT_TRUE(r.region.ok()) << r.region.status();
  auto op = r.reg.ResolveOp(r.sid, NormOpOn(*r.region), 1);
  ASSERT_TRUE(op.ok()) << op.status();
  static_cast<char*>(op->args().norm_out)[0] = 'n';
  EXPECT_EQ(r.obj.data()[131072], 'n');
  op->Release();
}

// ---- who may have memory opened on their behalf (docs/security.md) ----

struct stat StatOf(uid_t uid, gid_t gid, mode_t mode) {
  struct stat st {};
  st.st_uid = uid;
  st.st_gid = gid;
  st.st_mode = S_IFREG | mode;
  return st;
}

SocketCredentials Caller(uid_t uid, gid_t gid, std::vector<gid_t> groups = {}) {
  SocketCredentials c;
  c.uid = uid;
  c.gid = gid;
  c.groups = std::move(groups);
  return c;
}

// The kernel's permission classes: the owner's bits for the owner (even when the group's would
// allow more), the group's for members, the others' otherwise; root always.
TEST(CallerMayReadWrite, FollowsTheOwnerGroupOtherClasses) {
  EXPECT_TRUE(CallerMayReadWrite(StatOf(10, 20, 0600), Caller(10, 99)));
  EXPECT_FALSE(CallerMayReadWrite(StatOf(10, 20, 0400), Caller(10, 99)));
  EXPECT_FALSE(CallerMayReadWrite(StatOf(10, 20, 0066), Caller(10, 20)));  // owner class wins
  EXPECT_FALSE(CallerMayReadWrite(StatOf(10, 20, 0600), Caller(11, 20)));
  EXPECT_TRUE(CallerMayReadWrite(StatOf(10, 20, 0660), Caller(11, 20)));
  EXPECT_TRUE(CallerMayReadWrite(StatOf(10, 20, 0660), Caller(11, 5, {7, 20})));
  EXPECT_FALSE(CallerMayReadWrite(StatOf(10, 20, 0640), Caller(11, 20)));
  EXPECT_FALSE(CallerMayReadWrite(StatOf(10, 20, 0606), Caller(11, 20)));  // group class wins
  EXPECT_TRUE(CallerMayReadWrite(StatOf(10, 20, 0606), Caller(11, 21)));
  EXPECT_FALSE(CallerMayReadWrite(StatOf(10, 20, 0604), Caller(11, 21)));
  EXPECT_TRUE(CallerMayReadWrite(StatOf(10, 20, 0000), Caller(0, 0)));
}

// docs/security.md (what the daemon opens): memory another user owns is not opened for a caller who
// could not open it, whatever the sidecar's own rights. The object here is this process's, mode
// 0600; the caller is another uid.
TEST(HostShmOpener, NamedMemoryTheCallerCouldNotOpenIsPermissionDenied) {
  ShmObject obj(4096);
  HostShmOpener opener;
  RegionSpec spec = HostSpec("r", 4096);
  spec.shm_name = obj.name();
  spec.caller = Caller(::geteuid() == 65534 ? 65533 : 65534, 65534);
  auto m = opener.Open(spec);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(m.status().message(), HasSubstr("may not open it read-write itself"));
  EXPECT_THAT(m.status().message(), HasSubstr("register a sealed memfd as host_fd"));
  EXPECT_THAT(m.status().message(), Not(HasSubstr(obj.name())));
  EXPECT_THAT(m.status().message(), Not(HasSubstr("/dev/shm")));
}

TEST(HostShmOpener, NamedMemoryForAnUnknownCallerIsPermissionDenied) {
  ShmObject obj(4096);
  HostShmOpener opener;
  RegionSpec spec = HostSpec("r", 4096);
  spec.shm_name = obj.name();
  spec.caller.reset();
  auto m = opener.Open(spec);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(m.status().message(), HasSubstr("only over the sidecar's Unix socket"));
}

// A memfd of `size` bytes with `seals` added; the caller owns the descriptor.
UniqueFd Memfd(uint64_t size, int seals, bool allow_sealing = true) {
  UniqueFd fd(
      memfd_create("arfuse-regtest", MFD_CLOEXEC | (allow_sealing ? MFD_ALLOW_SEALING : 0)));
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(ftruncate(fd.get(), static_cast<off_t>(size)), 0);
  if (seals != 0) {
    EXPECT_EQ(fcntl(fd.get(), F_ADD_SEALS, seals), 0);
  }
  return fd;
}

RegionSpec FdSpec(UniqueFd fd, uint64_t bytes) {
  RegionSpec spec = HostSpec("fd", bytes);
  spec.shm_name.clear();
  spec.host_by_fd = true;
  spec.host_fd = std::make_shared<const UniqueFd>(std::move(fd));
  return spec;
}

TEST(HostShmOpener, SealedMemfdIsMappedSharedAndNeedsNoDescriptorAfterwards) {
  UniqueFd fd = Memfd(8192, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  char* client =
      static_cast<char*>(mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0));
  ASSERT_NE(client, MAP_FAILED);
  std::memcpy(client, "sealed", 6);
  HostShmOpener opener;
  auto m = opener.Open(FdSpec(std::move(fd), 4096));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->allocation_size(), 8192u);
  EXPECT_EQ(std::memcmp((*m)->base(), "sealed", 6), 0);
  static_cast<char*>((*m)->base())[7] = '!';
  EXPECT_EQ(client[7], '!');
  EXPECT_TRUE((*m)->CheckIntact(8192).ok());
  munmap(client, 8192);
}

// docs/security.md (what the daemon opens): memory handed over by descriptor must be sealed against
// shrinking.
TEST(HostShmOpener, UnsealedMemfdIsRefusedNamingTheSeal) {
  for (bool sealable : {true, false}) {
    HostShmOpener opener;
    auto m = opener.Open(FdSpec(Memfd(4096, 0, sealable), 4096));
    EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition) << sealable;
    EXPECT_THAT(m.status().message(), HasSubstr("not sealed against shrinking (F_SEAL_SHRINK)"));
  }
  HostShmOpener opener;
  auto grow_only = opener.Open(FdSpec(Memfd(4096, F_SEAL_GROW), 4096));
  EXPECT_EQ(grow_only.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(HostShmOpener, WriteSealedMemfdIsRefused) {
  HostShmOpener opener;
  auto m = opener.Open(FdSpec(Memfd(4096, F_SEAL_SHRINK | F_SEAL_FUTURE_WRITE), 4096));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(m.status().message(), HasSubstr("sealed against writes"));
}

TEST(HostShmOpener, ReadOnlyOrNonMemoryDescriptorsAreRefused) {
  UniqueFd rw = Memfd(4096, F_SEAL_SHRINK);
  const std::string self = absl::StrCat("/proc/self/fd/", rw.get());
  UniqueFd ro(open(self.c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(ro.valid());
  HostShmOpener opener;
  auto m = opener.Open(FdSpec(std::move(ro), 4096));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(m.status().message(), HasSubstr("not open read-write"));
  int p[2];
  ASSERT_EQ(pipe(p), 0);
  close(p[1]);
  auto pipe_fd = opener.Open(FdSpec(UniqueFd(p[0]), 64));
  EXPECT_EQ(pipe_fd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pipe_fd.status().message(), HasSubstr("not a memory file"));
  auto small = opener.Open(FdSpec(Memfd(4096, F_SEAL_SHRINK), 4097));
  EXPECT_EQ(small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(small.status().message(), HasSubstr("exceeds the exported allocation of 4096"));
}

// docs/security.md (what the daemon opens): a named object the client shrinks after registering is
// measured again before each op, and the op is refused instead of faulting.
TEST(HostShmOpener, AShrunkNamedObjectIsRefusedAtTheNextOp) {
  RealRegistry r;
  ASSERT_TRUE(r.region.ok()) << r.region.status();
  auto plan = r.reg.CreatePlan(r.sid, NormOpOn(*r.region));
  ASSERT_TRUE(plan.ok()) << plan.status();
  int fd = shm_open(r.obj.name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 0), 0);
  close(fd);
  auto op = r.reg.ResolvePlan(r.sid, plan->plan_id, plan->generation, 1);
  EXPECT_EQ(op.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(op.status().message(), HasSubstr("shrank to 0 bytes, below the region's 262144"));
  EXPECT_THAT(op.status().message(), Not(HasSubstr(r.obj.name())));
}

// ---- ops the workspace cannot serve ----

TEST(RegistryWorkspace, OpsBeyondTheWorkspaceAreOutOfRangeMalformedOnesInvalid) {
  RegistryLimits limits;
  limits.workspace = WorkspaceCapacity{/*max_tokens=*/4, /*hidden=*/64, DType::kFP32};
  auto reg = MakeRegistry(limits);
  uint64_t sid = *reg->OpenSession("c");
  RegionSpec spec = HostSpec("r", 1 << 20);
  auto h = reg->RegisterRegion(sid, spec);
  ASSERT_TRUE(h.ok()) << h.status();
  auto op = [&](uint32_t hidden, uint32_t tokens, int32_t dtype) {
    OpRequest o = NormOpOn(*h);
    o.hidden = hidden;
    o.max_tokens = tokens;
    o.dtype = dtype;
    return o;
  };
  struct Case {
    OpRequest req;
    absl::StatusCode code;
    const char* text;
  };
  const int32_t fp32 = static_cast<int32_t>(DType::kFP32);
  const std::vector<Case> cases = {
      {op(128, 1, fp32), absl::StatusCode::kOutOfRange,
       "fusion unavailable for this op: hidden 128 exceeds the workspace's hidden 64"},
      {op(64, 5, fp32), absl::StatusCode::kOutOfRange,
       "fusion unavailable for this op: 5 tokens x hidden 64 exceed the workspace's 4 tokens x "
       "hidden 64"},
      {op(64, 1, static_cast<int32_t>(DType::kBF16)), absl::StatusCode::kOutOfRange,
       "fusion unavailable for this op: dtype bf16 is not the workspace's fp32"},
      {op(0, 1, fp32), absl::StatusCode::kInvalidArgument, "hidden 0 must be a positive multiple"},
      {op(12, 1, fp32), absl::StatusCode::kInvalidArgument,
       "hidden 12 must be a positive multiple"},
      {op(64, 1, 9), absl::StatusCode::kInvalidArgument, "dtype 9 is not supported"},
  };
  for (const Case& c : cases) {
    auto plan = reg->CreatePlan(sid, c.req);
    EXPECT_EQ(plan.status().code(), c.code) << c.text;
    EXPECT_THAT(plan.status().message(), HasSubstr(c.text));
    // An explicit op (Execute without a plan) is held to the same rules.
    auto resolved = reg->ResolveOp(sid, c.req, c.req.max_tokens);
    EXPECT_EQ(resolved.status().code(), c.code) << c.text;
    EXPECT_THAT(resolved.status().message(), HasSubstr(c.text));
  }
  // Fewer tokens at a smaller hidden fit the same bytes.
  EXPECT_TRUE(reg->CreatePlan(sid, op(32, 8, fp32)).ok());
  EXPECT_TRUE(reg->CreatePlan(sid, op(64, 4, fp32)).ok());
}

}  // namespace
}  // namespace arfuse
