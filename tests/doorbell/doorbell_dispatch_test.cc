// The doorbell plane's algorithm threshold and its refusal of shapes the dispatcher sends to the
// unfused path (server/doorbell/doorbell_dispatch.h). CUDA-free: runs in CI.
#include "server/doorbell/doorbell_dispatch.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;

DispatchRequest AtMax(int sm, int ws, uint32_t max_tokens, uint32_t hidden,
                      DType dtype = DType::kBF16) {
  DispatchRequest r;
  r.sm = sm;
  r.world_size = ws;
  r.num_tokens = max_tokens;
  r.hidden = hidden;
  r.dtype = dtype;
  r.fused_available = true;
  r.twoshot_available = true;
  r.nccl_available = true;
  r.nccl_symmetric_available = true;
  return r;
}

TEST(DoorbellServeBlocks, CappedOnlyWhenRanksShareTheGpu) {
  EXPECT_EQ(DoorbellServeBlocksFor(128, false), 128u);
  EXPECT_EQ(DoorbellServeBlocksFor(128, true), kSharedGpuDoorbellServeBlocks);
  EXPECT_EQ(DoorbellServeBlocksFor(16, true), 16u);
  EXPECT_EQ(DoorbellServeBlocksFor(0, true), 0u) << "0 keeps in-place serving off";
  EXPECT_EQ(DoorbellServeBlocksFor(0, false), 0u);
}

// The shared-GPU budget leaves room for every rank's resident doorbell blocks: a serving launch
// of one rank stays resident while another rank's fused grid runs (eager prefill ops of 512
// tokens timed out at 8-12 layers with doorbell plans active, two ranks on one H200).
TEST(SharedGpuSmBudget, LeavesRoomForEveryRanksServingBlocks) {
  // 132 SMs, 2 ranks, 16 serving blocks each: (132 - 2 x (16 + 2) - 2) / 2.
  EXPECT_EQ(SharedGpuSmBudget(132, 2, true, 16), 47u);
  // Serving off: the waiter and the ring only.
  EXPECT_EQ(SharedGpuSmBudget(132, 2, true, 0), 63u);
  EXPECT_EQ(SharedGpuSmBudget(132, 2, false, 16), 66u);
  EXPECT_EQ(SharedGpuSmBudget(132, 4, true, 16), 14u);  // (132 - 4 x 18 - 2) / 4
  EXPECT_EQ(SharedGpuSmBudget(8, 4, true, 16), 1u);     // never 0
  EXPECT_EQ(SharedGpuSmBudget(132, 0, false, 0), 132u);
}

TEST(DoorbellDispatch, OneShotPlanNeverRunsTwoShot) {
  // SM90 TP2: one-shot up to 32 MiB, no two-shot range.
  auto d = ChooseDoorbellDispatch(DispatchTable::Published(), AtMax(90, 2, 128, 4096));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->twoshot_min_tokens, kDoorbellNeverTwoShot);
  EXPECT_EQ(d->path_at_max, ExecPath::kOneShot);
  EXPECT_THAT(d->reason, HasSubstr("one-shot up to 128 tokens"));
}

TEST(DoorbellDispatch, AShapeThatRunsUnfusedIsRefusedNamingTheEagerPlane) {
  // 2049 x 8192 bf16 is above SM90 TP2's 32 MiB fused limit.
  auto d = ChooseDoorbellDispatch(DispatchTable::Published(), AtMax(90, 2, 2049, 8192));
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(d.status().message(), HasSubstr("runs unfused at max_tokens"));
  EXPECT_THAT(d.status().message(), HasSubstr("above the fused limits"));
  EXPECT_THAT(d.status().message(), HasSubstr("use the eager plane"));
  EXPECT_THAT(d.status().message(), HasSubstr("2049 tokens x 8192 hidden"));
  // One token less fits.
  EXPECT_TRUE(ChooseDoorbellDispatch(DispatchTable::Published(), AtMax(90, 2, 2048, 8192)).ok());
}

TEST(DoorbellDispatch, WithoutNcclTheFusedKernelsRunEveryShape) {
  // Ranks sharing one GPU have no NCCL: the dispatcher keeps the fused path, so does the plane.
  DispatchRequest r = AtMax(90, 2, 4096, 8192);
  r.nccl_available = false;
  auto d = ChooseDoorbellDispatch(DispatchTable::Published(), r);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->path_at_max, ExecPath::kOneShot);
}

TEST(DoorbellDispatch, TwoShotRangeGivesTheFirstTwoShotTokenCount) {
  // SM100 TP4: one-shot up to 8 MiB, two-shot up to 32 MiB; 8192 bf16 is 16 KiB a token.
  auto d = ChooseDoorbellDispatch(DispatchTable::Published(), AtMax(100, 4, 2048, 8192));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->twoshot_min_tokens, 513u);
  EXPECT_EQ(d->path_at_max, ExecPath::kTwoShot);
  EXPECT_THAT(d->reason, HasSubstr("one-shot below 513 tokens, two-shot from 513"));
  // Above the two-shot range: unfused, refused.
  d = ChooseDoorbellDispatch(DispatchTable::Published(), AtMax(100, 4, 2049, 8192));
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  // The two-shot kernel unavailable in its range: the dispatcher goes unfused, so refused.
  DispatchRequest r = AtMax(100, 4, 1024, 8192);
  r.twoshot_available = false;
  d = ChooseDoorbellDispatch(DispatchTable::Published(), r);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(d.status().message(), HasSubstr("two-shot kernel cannot run"));
}

TEST(DoorbellDispatch, NoFusedWorkspaceOrForcedUnfusedIsRefused) {
  DispatchRequest r = AtMax(90, 2, 16, 4096);
  r.fused_available = false;
  auto d = ChooseDoorbellDispatch(DispatchTable::Published(), r);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(d.status().message(), HasSubstr("no usable fused workspace"));
  EXPECT_THAT(d.status().message(), HasSubstr("use the eager plane"));
  r = AtMax(90, 2, 16, 4096);
  r.forced = ForcedPath::kUnfused;
  d = ChooseDoorbellDispatch(DispatchTable::Published(), r);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(d.status().message(), HasSubstr("forced to unfused"));
}

TEST(DoorbellDispatch, ForcedAlgorithmsAndBadArguments) {
  DispatchRequest r = AtMax(90, 2, 16, 4096);
  r.forced = ForcedPath::kOneShot;
  auto d = ChooseDoorbellDispatch(DispatchTable::Published(), r);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->twoshot_min_tokens, kDoorbellNeverTwoShot);
  r.forced = ForcedPath::kTwoShot;
  d = ChooseDoorbellDispatch(DispatchTable::Published(), r);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->twoshot_min_tokens, 1u);
  EXPECT_EQ(d->path_at_max, ExecPath::kTwoShot);
  r.twoshot_available = false;
  EXPECT_EQ(ChooseDoorbellDispatch(DispatchTable::Published(), r).status().code(),
            absl::StatusCode::kFailedPrecondition);
  r = AtMax(90, 2, 0, 4096);
  EXPECT_EQ(ChooseDoorbellDispatch(DispatchTable::Published(), r).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Every accepted plan: for each token count the device's choice (one-shot below the threshold,
// two-shot from it) is exactly the dispatcher's choice for an eager op of that many tokens; every
// refused plan has some token count the dispatcher runs unfused.
TEST(DoorbellDispatch, AgreesWithTheDispatcherAtEveryTokenCount) {
  auto custom = DispatchTable::Parse(
      "sm=90 ws=2 oneshot_max=65536 twoshot_max=1048576 sym=0-16385 source=test\n"
      "sm=90 ws=4 oneshot_max=0 twoshot_max=524288 sym= source=test\n");
  ASSERT_TRUE(custom.ok()) << custom.status();
  const DispatchTable published = DispatchTable::Published();
  int accepted = 0, refused = 0;
  const std::vector<const DispatchTable*> tables = {&published, &*custom};
  for (const DispatchTable* table : tables) {
    for (int sm : {90, 100}) {
      for (int ws : {2, 4, 8}) {
        for (DType dt : {DType::kBF16, DType::kFP32}) {
          for (uint32_t hidden : {1024u, 8192u}) {
            for (uint32_t max_tokens : {1u, 7u, 64u, 300u, 2048u}) {
              for (bool nccl : {true, false}) {
                DispatchRequest r = AtMax(sm, ws, max_tokens, hidden, dt);
                r.nccl_available = nccl;
                auto d = ChooseDoorbellDispatch(*table, r);
                bool any_unfused = false;
                for (uint32_t n = 1; n <= max_tokens; ++n) {
                  DispatchRequest at = r;
                  at.num_tokens = n;
                  auto c = ChooseExecPath(*table, at);
                  ASSERT_TRUE(c.ok()) << c.status();
                  if (c->path == ExecPath::kUnfused) any_unfused = true;
                  if (!d.ok()) continue;
                  const ExecPath want =
                      n >= d->twoshot_min_tokens ? ExecPath::kTwoShot : ExecPath::kOneShot;
                  ASSERT_EQ(c->path, want) << "sm=" << sm << " ws=" << ws << " hidden=" << hidden
                                           << " max=" << max_tokens << " n=" << n;
                }
                if (d.ok()) {
                  ++accepted;
                  EXPECT_FALSE(any_unfused);
                } else {
                  ++refused;
                  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
                  EXPECT_TRUE(any_unfused) << d.status();
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(accepted, 0);
  EXPECT_GT(refused, 0);
}

}  // namespace
}  // namespace arfuse
