// The host collective (kernels/host/host_collective.h) on its own, ranks as threads over a
// workspace in this process's memory: the FP8 patterns run on every rank as the CPU reference
// computes them over all ranks' inputs, and ranks that run different FP8 ops (another pattern,
// another scale layout, launchers of another program) are refused alike, without poisoning the
// workspace.
#include "kernels/host/host_collective.h"

#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/host/reference_core.h"
#include "kernels/quant/fp8_format.h"

namespace arfuse::host {
namespace {

using ::testing::HasSubstr;

void OnRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> t;
  for (int r = 0; r < n; ++r) t.emplace_back(fn, r);
  for (auto& x : t) x.join();
}

// A workspace for `world` ranks in heap memory (the collective needs no shared mapping between
// threads of one process).
struct Workspace {
  Workspace(int world, uint32_t max_tokens, uint32_t max_hidden, DType dtype)
      : world(world), slot_bytes(HostWsSlotBytes(max_tokens, max_hidden, dtype)) {
    const size_t total = HostWsTotalBytes(world, slot_bytes);
    base = static_cast<uint8_t*>(
        std::aligned_alloc(kHostWsDataAlign, AlignUp(total, kHostWsDataAlign)));
    InitHostWorkspace(base, world, /*generation=*/1, slot_bytes);
  }
  ~Workspace() { std::free(base); }
  HostCollective Rank(int r) const { return HostCollective(base, r, world, slot_bytes); }
  int world;
  size_t slot_bytes;
  uint8_t* base = nullptr;
};

size_t ScaleBytes(Pattern p, uint8_t layout, uint32_t tokens, uint32_t hidden) {
  switch (TraitsOf(p).quant) {
    case QuantKind::kPerToken:
      return size_t{tokens} * 4;
    case QuantKind::kPerGroup:
      return fp8::GroupScaleBytes(static_cast<fp8::GroupScaleLayout>(layout), tokens,
                                  hidden / fp8::kGroupSize);
    default:
      return 4;
  }
}

// One rank's tensors of an FP8 op, filled from (rank, seed); every rank shares gamma and the
// static scale, each has its own residual_in.
struct RankOp {
  RankOp(Pattern p, DType dt, int rank, uint32_t tokens, uint32_t hidden, uint8_t layout)
      : pattern(p), dtype(dt), tokens(tokens), hidden(hidden), layout(layout) {
    const size_t n = size_t{tokens} * hidden;
    input.resize(n * 2);
    residual_in.resize(n * 2);
    residual_out.resize(n * 2);
    norm_out.resize(n * 2);
    gamma.resize(hidden * 2);
    quant.assign(n, 0xcd);
    scale.assign(ScaleBytes(p, layout, tokens, hidden), 0xab);
    std::mt19937 rng(17 + rank);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (size_t i = 0; i < n; ++i) StoreFromFloat(dt, input.data(), i, d(rng));
    for (size_t i = 0; i < n; ++i) StoreFromFloat(dt, residual_in.data(), i, d(rng));
    std::mt19937 shared(5);
    for (size_t i = 0; i < hidden; ++i) StoreFromFloat(dt, gamma.data(), i, 1.0f + d(shared));
    const float s = 0.03f;
    if (TraitsOf(p).quant == QuantKind::kStatic) std::memcpy(scale.data(), &s, 4);
  }
  HostOpArgs Args(bool with_norm_out = true) {
    HostOpArgs a;
    a.pattern = pattern;
    a.dtype = dtype;
    a.hidden = hidden;
    a.num_tokens = tokens;
    a.eps = 1e-5f;
    a.input = input.data();
    a.residual_in = residual_in.data();
    a.residual_out = residual_out.data();
    a.norm_out = with_norm_out ? norm_out.data() : nullptr;
    a.gamma = gamma.data();
    a.quant_out = quant.data();
    a.scale = scale.data();
    a.scale_layout = layout;
    return a;
  }
  Pattern pattern;
  DType dtype;
  uint32_t tokens, hidden;
  uint8_t layout;
  std::vector<uint8_t> input, residual_in, residual_out, norm_out, gamma, quant, scale;
};

// The reference's answer for rank `rank` over every rank's input.
RankOp Expected(std::vector<RankOp>& ranks, int rank) {
  RankOp want = ranks[rank];
  std::vector<const void*> inputs;
  for (RankOp& r : ranks) inputs.push_back(r.input.data());
  CpuOpArgs a;
  a.pattern = want.pattern;
  a.dtype = want.dtype;
  a.world_size = static_cast<int>(ranks.size());
  a.hidden = want.hidden;
  a.num_tokens = want.tokens;
  a.eps = 1e-5f;
  a.rank_inputs = inputs.data();
  a.residual_in = want.residual_in.data();
  a.residual_out = want.residual_out.data();
  a.norm_out = want.norm_out.data();
  a.gamma = want.gamma.data();
  a.quant_out = want.quant.data();
  a.scale = want.scale.data();
  a.scale_layout = want.layout;
  EXPECT_TRUE(ReferenceFusedOpPlain(a).ok());
  return want;
}

struct Fp8Case {
  Pattern pattern;
  DType dtype;
  int world;
  uint8_t layout;
};

class HostCollectiveFp8 : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(HostCollectiveFp8, EveryRankWritesTheReferencesCodesAndScales) {
  const Fp8Case c = GetParam();
  Workspace ws(c.world, 16, 512, c.dtype);
  for (int call = 0; call < 6; ++call) {
    const uint32_t tokens = 1 + call * 3, hidden = call % 2 == 0 ? 512 : 256;
    std::vector<RankOp> ranks;
    for (int r = 0; r < c.world; ++r)
      ranks.emplace_back(c.pattern, c.dtype, r, tokens, hidden, c.layout);
    std::vector<HostOpResult> res(c.world);
    // Rank 0 leaves norm_out out: it is optional and not part of the op the ranks compare.
    OnRanks(c.world, [&](int r) {
      res[r] = ws.Rank(r).Run(ranks[r].Args(/*with_norm_out=*/r != 0), 1, HostWaitLimits{});
    });
    for (int r = 0; r < c.world; ++r) {
      ASSERT_TRUE(res[r].status.ok()) << res[r].status.message();
      RankOp want = Expected(ranks, r);
      EXPECT_EQ(ranks[r].residual_out, want.residual_out) << "call " << call << " rank " << r;
      EXPECT_EQ(ranks[r].quant, want.quant) << "call " << call << " rank " << r;
      EXPECT_EQ(ranks[r].scale, want.scale) << "call " << call << " rank " << r;
      if (r != 0) {
        EXPECT_EQ(ranks[r].norm_out, want.norm_out) << "call " << call << " rank " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Patterns, HostCollectiveFp8,
    ::testing::Values(Fp8Case{Pattern::kAllReduceResidualRmsNormFp8Static, DType::kBF16, 2, 0},
                      Fp8Case{Pattern::kAllReduceResidualRmsNormFp8PerToken, DType::kFP16, 2, 0},
                      Fp8Case{Pattern::kAllReduceResidualRmsNormFp8PerGroup, DType::kBF16, 4, 1},
                      Fp8Case{Pattern::kAllReduceResidualRmsNormFp8PerGroup, DType::kFP16, 2, 2},
                      Fp8Case{Pattern::kAllReduceResidualRmsNormFp8PerGroup, DType::kBF16, 2, 3},
                      Fp8Case{Pattern::kAllReduceResidualRmsNormFp8PerToken, DType::kBF16, 8, 0}));

// Runs one op per rank (each rank's own) and expects INVALID_ARGUMENT "ranks disagree on the op"
// with `fragments` on every rank, the workspace still healthy, and a matching op after it.
void ExpectDisagreement(std::vector<RankOp>& ranks, const std::vector<std::string>& fragments) {
  Workspace ws(2, 16, 512, DType::kBF16);
  std::vector<HostOpResult> res(2);
  OnRanks(2, [&](int r) { res[r] = ws.Rank(r).Run(ranks[r].Args(), 1, HostWaitLimits{}); });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(res[r].status.code(), plain::StatusCode::kInvalidArgument) << r;
    EXPECT_THAT(std::string(res[r].status.message()), HasSubstr("ranks disagree on the op"));
    for (const std::string& f : fragments) {
      EXPECT_THAT(std::string(res[r].status.message()), HasSubstr(f));
    }
    EXPECT_FALSE(res[r].poisoned);
  }
  EXPECT_EQ(ws.Rank(0).header()->abort_word.load(), 0u);
  // The ranks stay in step: the same op on both runs.
  OnRanks(2, [&](int r) { res[r] = ws.Rank(r).Run(ranks[0].Args(), 1, HostWaitLimits{}); });
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(res[r].status.ok()) << res[r].status.message();
}

TEST(HostCollectiveFp8Agreement, RanksRunningDifferentFp8PatternsAreRefusedAlike) {
  std::vector<RankOp> ranks;
  ranks.emplace_back(Pattern::kAllReduceResidualRmsNormFp8PerToken, DType::kBF16, 0, 2, 256, 0);
  ranks.emplace_back(Pattern::kAllReduceResidualRmsNormFp8Static, DType::kBF16, 1, 2, 256, 0);
  ExpectDisagreement(
      ranks, {"allreduce_residual_rmsnorm_fp8_per_token", "allreduce_residual_rmsnorm_fp8_static"});
}

TEST(HostCollectiveFp8Agreement, RanksWithDifferentScaleLayoutsAreRefusedAlike) {
  std::vector<RankOp> ranks;
  ranks.emplace_back(Pattern::kAllReduceResidualRmsNormFp8PerGroup, DType::kBF16, 0, 2, 256, 1);
  ranks.emplace_back(Pattern::kAllReduceResidualRmsNormFp8PerGroup, DType::kBF16, 1, 2, 256, 3);
  ExpectDisagreement(ranks, {"scale_layout=1", "scale_layout=3"});
}

TEST(HostCollectiveFp8Agreement, AnFp8RankAgainstAPattern2RankIsRefusedAlike) {
  std::vector<RankOp> ranks;
  ranks.emplace_back(Pattern::kAllReduceResidualRmsNorm, DType::kBF16, 0, 2, 256, 0);
  ranks.emplace_back(Pattern::kAllReduceResidualRmsNormFp8PerGroup, DType::kBF16, 1, 2, 256, 2);
  ExpectDisagreement(ranks, {"allreduce_residual_rmsnorm bf16", "fp8_per_group"});
}

// An op every rank runs alike but the reference refuses (no quant_out) fails on every rank with
// the reference's INVALID_ARGUMENT, after the exchange, and poisons nothing.
TEST(HostCollectiveFp8Agreement, AnOpTheReferenceRefusesFailsOnEveryRankWithoutPoisoning) {
  Workspace ws(2, 16, 512, DType::kBF16);
  std::vector<RankOp> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back(Pattern::kAllReduceResidualRmsNormFp8PerToken, DType::kBF16, r, 2, 256, 0);
  }
  std::vector<HostOpResult> res(2);
  OnRanks(2, [&](int r) {
    HostOpArgs a = ranks[r].Args();
    a.quant_out = nullptr;
    res[r] = ws.Rank(r).Run(a, 1, HostWaitLimits{});
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(res[r].status.code(), plain::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(res[r].status.message()), HasSubstr("quant_out is null"));
    EXPECT_FALSE(res[r].poisoned);
  }
}

// Launchers of two programs (program keys that differ) never pair an op, whatever else agrees:
// refused alike on every rank, the keys' values not named, the workspace not poisoned; the same
// key on every rank (0 included: no key) runs the op.
TEST(HostCollectiveProgramKey, RanksOfDifferentProgramsAreRefusedAlikeAndTheSameKeyRuns) {
  constexpr uint32_t kKeys[][2] = {{0xabcde, 0x13579}, {0, 0x13579}, {0xabcde, 0}};
  for (const auto& keys : kKeys) {
    Workspace ws(2, 16, 512, DType::kBF16);
    std::vector<RankOp> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back(Pattern::kAllReduceResidualRmsNormFp8PerToken, DType::kBF16, r, 2, 256, 0);
    }
    std::vector<HostOpResult> res(2);
    OnRanks(2, [&](int r) {
      res[r] = ws.Rank(r).Run(ranks[r].Args(), 1, HostWaitLimits{}, /*client=*/true,
                              /*copy_input=*/nullptr, /*launcher=*/10 + r, keys[r]);
    });
    for (int r = 0; r < 2; ++r) {
      const std::string m(res[r].status.message());
      EXPECT_EQ(res[r].status.code(), plain::StatusCode::kInvalidArgument) << r;
      EXPECT_THAT(m, HasSubstr("comes from another program"));
      EXPECT_THAT(m, HasSubstr("program keys differ"));
      EXPECT_THAT(m, ::testing::Not(HasSubstr(std::to_string(0xabcde))));
      EXPECT_THAT(m, ::testing::Not(HasSubstr(std::to_string(0x13579))));
      EXPECT_FALSE(res[r].poisoned);
    }
    EXPECT_EQ(ws.Rank(0).header()->abort_word.load(), 0u);
    for (uint32_t same : {keys[0], keys[1], 0u}) {
      OnRanks(2, [&](int r) {
        res[r] = ws.Rank(r).Run(ranks[r].Args(), 1, HostWaitLimits{}, true, nullptr, 10 + r, same);
      });
      for (int r = 0; r < 2; ++r) {
        ASSERT_TRUE(res[r].status.ok()) << res[r].status.message();
        RankOp want = Expected(ranks, r);
        EXPECT_EQ(ranks[r].quant, want.quant) << r;
        EXPECT_EQ(ranks[r].residual_out, want.residual_out) << r;
      }
    }
  }
}

}  // namespace
}  // namespace arfuse::host
