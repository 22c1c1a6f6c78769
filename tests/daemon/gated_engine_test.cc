// The GatedEngine's generation base and the group's agreement on it: the workspace generation a
// client sees keeps growing across the fresh engines of re-forms and backend switches.
#include "server/daemon/gated_engine.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;

// An engine that reports a fixed generation (a fresh engine reports 1 after Initialize).
class StubEngine final : public Engine {
 public:
  explicit StubEngine(uint64_t generation) : generation_(generation) {}
  absl::Status Initialize(Exchange&, absl::Time) override { return absl::OkStatus(); }
  absl::StatusOr<OpOutcome> Execute(const OpArgs&, const ExecContext&) override {
    return OpOutcome{};
  }
  void Abort() override {}
  EngineStatus Status() const override {
    EngineStatus s;
    s.state = WorkspaceState::kReady;
    s.generation = generation_;
    return s;
  }

 private:
  const uint64_t generation_;
};

TEST(GatedEngineGeneration, CountsOnFromTheBaseAcrossFreshEngines) {
  GatedEngine gate;
  ASSERT_TRUE(gate.Swap(std::make_unique<StubEngine>(1), 0).ok());
  EXPECT_EQ(gate.Status().generation, 1u);
  // Re-form: the gate empties, then a fresh engine (generation 1 again) gets the served base.
  ASSERT_TRUE(gate.Swap(nullptr).ok());
  EXPECT_EQ(gate.Status().generation, 0u);
  ASSERT_TRUE(gate.Swap(std::make_unique<StubEngine>(1), 1).ok());
  EXPECT_EQ(gate.Status().generation, 2u);
  // A backend switch swaps engines directly.
  ASSERT_TRUE(gate.Swap(std::make_unique<StubEngine>(1), 2).ok());
  EXPECT_EQ(gate.Status().generation, 3u);
}

TEST(GatedEngineGeneration, DefaultBaseReportsTheEnginesOwnGeneration) {
  GatedEngine gate;
  ASSERT_TRUE(gate.Swap(std::make_unique<StubEngine>(4)).ok());
  EXPECT_EQ(gate.Status().generation, 4u);
}

TEST(GatedEngineGeneration, EmptyGateRefusesOpsNamingWhyTheGroupReforms) {
  GatedEngine gate;
  ASSERT_TRUE(gate.Swap(std::make_unique<StubEngine>(1), 3).ok());
  gate.Resume();
  ASSERT_TRUE(gate.Drain(absl::Now() + absl::Seconds(1)).ok());
  ASSERT_TRUE(gate.Swap(nullptr).ok());
  gate.SetClosedReason("the group is re-forming after a lost peer link (rank 1 went away)");
  auto r = gate.Execute(OpArgs{}, ExecContext{});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("not serving ops: the group is re-forming after a "
                                              "lost peer link (rank 1 went away)"));
  EXPECT_EQ(gate.Status().state, WorkspaceState::kInitializing);
  EXPECT_EQ(gate.Status().generation, 0u);
  EXPECT_THAT(gate.Status().reason, HasSubstr("lost peer link"));
}

TEST(AgreedGenerationBase, TakesTheHighestOfEveryRank) {
  // A restarted rank offers 0; the survivor's generation wins, and every rank computes the same.
  auto base = AgreedGenerationBase(0, {"7", "0"});
  ASSERT_TRUE(base.ok()) << base.status();
  EXPECT_EQ(*base, 7u);
  base = AgreedGenerationBase(9, {"7", "9"});
  ASSERT_TRUE(base.ok()) << base.status();
  EXPECT_EQ(*base, 9u);
}

TEST(AgreedGenerationBase, MalformedOfferIsRefusedNamingTheRank) {
  for (const std::string& bad : {std::string("x1"), std::string(""), std::string("-3"),
                                 std::string("99999999999999999999999")}) {
    auto base = AgreedGenerationBase(1, {"1", bad});
    ASSERT_FALSE(base.ok()) << bad;
    EXPECT_EQ(base.status().code(), absl::StatusCode::kFailedPrecondition) << bad;
    EXPECT_THAT(base.status().message(),
                HasSubstr("rank 1 offered a malformed workspace generation"));
    EXPECT_THAT(base.status().message(), HasSubstr("same arfused build"));
  }
}

}  // namespace
}  // namespace arfuse
