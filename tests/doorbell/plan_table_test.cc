// DoorbellPlanTable: the Fusion service's doorbell plans over a registry with a fake opener and a
// fake doorbell plane (CUDA-free). A plan holds its regions until the plane confirmed its removal;
// an unconfirmed removal parks it, and its regions stay held.
#include "server/doorbell/plan_table.h"

#include <memory>
#include <optional>
#include <vector>

#include "gtest/gtest.h"
#include "tests/registry/fake_opener.h"

namespace arfuse {
namespace {

using ::arfuse::testing::FakeOpener;
using ::arfuse::testing::HostSpec;

// Grants slots in order; removals answer `remove_status`.
class FakeDoorbellHost final : public DoorbellHost {
 public:
  absl::StatusOr<DoorbellGrant> AddDoorbellPlan(const OpArgs& /*op_template*/, uint32_t max_tokens,
                                                absl::Time /*deadline*/) override {
    DoorbellGrant g;
    g.plane_id = 1;
    g.slot = next_slot_++;
    g.max_tokens = max_tokens;
    return g;
  }
  absl::Status RemoveDoorbellPlan(const DoorbellGrant& grant, absl::Time /*deadline*/) override {
    removed.push_back(grant.slot);
    return remove_status;
  }

  absl::Status remove_status;
  std::vector<uint32_t> removed;

 private:
  uint32_t next_slot_ = 0;
};

class DoorbellPlanTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    session_ = *registry_.OpenSession("test-client");
    region_ = *registry_.RegisterRegion(session_, HostSpec("plan-table", 262144));
  }

  // A held plan of `session` over `region`, as CreatePlan{doorbell} makes it.
  std::shared_ptr<DoorbellPlanTable::Plan> MakePlan() { return MakePlan(session_, region_); }
  std::shared_ptr<DoorbellPlanTable::Plan> MakePlan(uint64_t session, const RegionHandle& region) {
    OpRequest op;
    op.pattern = 2;
    op.dtype = 1;
    op.hidden = 64;
    op.max_tokens = 8;
    op.input = {true, region.region_id, region.generation, 0};
    op.residual_in = {true, region.region_id, region.generation, 65536};
    op.residual_out = op.residual_in;
    op.norm_out = {true, region.region_id, region.generation, 131072};
    op.gamma = {true, region.region_id, region.generation, 196608};
    PlanInfo plan = *registry_.CreatePlan(session, op);
    ResolvedOp held = *registry_.ResolvePlan(session, plan.plan_id, plan.generation, 8);
    return std::make_shared<DoorbellPlanTable::Plan>(session, plan, std::move(held));
  }

  // Whether the region could be unregistered now (no plan holds it).
  bool RegionFree() {
    return registry_
        .UnregisterRegion(session_, region_.region_id, region_.generation,
                          absl::Now() + absl::Milliseconds(50))
        .ok();
  }

  Registry registry_{RegistryLimits{}, std::make_unique<FakeOpener>(MemoryKind::kHostShm, 0),
                     0x1234};
  FakeDoorbellHost host_;
  DoorbellPlanTable table_{registry_, [this] { return &host_; }};
  uint64_t session_ = 0;
  RegionHandle region_;
};

TEST_F(DoorbellPlanTableTest, AConfirmedRemovalReleasesThePlansRegions) {
  auto plan = MakePlan();
  ASSERT_TRUE(table_.Add(host_, plan, absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(table_.size(), 1u);
  DoorbellPlanTable::Plans taken = table_.Take(session_, plan->plan_id);
  ASSERT_EQ(taken.size(), 1u);
  EXPECT_EQ(table_.size(), 0u);
  plan.reset();
  EXPECT_TRUE(table_.Remove(taken, absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(host_.removed, std::vector<uint32_t>{0});
  EXPECT_TRUE(RegionFree());
}

TEST_F(DoorbellPlanTableTest, AnUnconfirmedRemovalParksThePlanAndKeepsItsRegionsHeld) {
  auto plan = MakePlan();
  ASSERT_TRUE(table_.Add(host_, plan, absl::Now() + absl::Seconds(5)).ok());
  host_.remove_status = absl::DeadlineExceededError("doorbell ops still running");
  DoorbellPlanTable::Plans taken = table_.Take(session_, std::nullopt);
  plan.reset();
  EXPECT_TRUE(absl::IsDeadlineExceeded(table_.Remove(taken, absl::Now() + absl::Seconds(5))));
  taken.clear();
  EXPECT_FALSE(RegionFree());
}

TEST_F(DoorbellPlanTableTest, APlanOfASessionThatEndedMeanwhileIsRemovedAgain) {
  auto plan = MakePlan();
  registry_.CloseSession(session_);
  absl::Status added = table_.Add(host_, plan, absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(absl::IsFailedPrecondition(added)) << added;
  EXPECT_EQ(table_.size(), 0u);
  EXPECT_EQ(host_.removed, std::vector<uint32_t>{0});
}

TEST_F(DoorbellPlanTableTest, TakeTakesOneSessionsPlansOnly) {
  const uint64_t other = *registry_.OpenSession("other-client");
  const RegionHandle other_region =
      *registry_.RegisterRegion(other, HostSpec("plan-table-other", 262144));
  ASSERT_TRUE(table_.Add(host_, MakePlan(), absl::Now() + absl::Seconds(5)).ok());
  auto theirs = MakePlan(other, other_region);
  ASSERT_TRUE(table_.Add(host_, theirs, absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(table_.size(), 2u);
  EXPECT_EQ(table_.Take(session_, std::nullopt).size(), 1u);
  EXPECT_EQ(table_.size(), 1u);
  EXPECT_EQ(table_.Take(other, std::nullopt).size(), 1u);
}

TEST_F(DoorbellPlanTableTest, WithoutADoorbellPlaneARemovalIsConfirmed) {
  DoorbellPlanTable no_plane(registry_, [] { return static_cast<DoorbellHost*>(nullptr); });
  auto plan = MakePlan();
  ASSERT_TRUE(no_plane.Add(host_, plan, absl::Now() + absl::Seconds(5)).ok());
  DoorbellPlanTable::Plans taken = no_plane.Take(session_, plan->plan_id);
  plan.reset();
  EXPECT_TRUE(no_plane.Remove(taken, absl::Now() + absl::Seconds(5)).ok());
  EXPECT_TRUE(host_.removed.empty());
  EXPECT_TRUE(RegionFree());
}

}  // namespace
}  // namespace arfuse
