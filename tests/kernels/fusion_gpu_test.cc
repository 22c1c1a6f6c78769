// The fused kernels on a real GPU: N ranks simulated in one process on one GPU (N workspaces,
// N streams launched concurrently; peer pointers are plain device pointers). Every simulated
// rank gets SMs / N as its sm_budget so all spinning grids are co-resident.
// Run: ctest --test-dir <build> -L gpu   (needs one GPU; about a minute on an H200).
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/add_rmsnorm/add_rmsnorm.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/host/half_convert.h"
#include "kernels/host/reference_op.h"
#include "tests/kernels/fusion_gpu_util.h"

namespace arfuse {
namespace {

using namespace ::arfuse::fusion_test;  // NOLINT(build/namespaces): the simulated group

// 2 units in the last place of the dtype, relative to the value (norm_out only: its sum of
// squares is added in another order on the GPU).
double NormTolerance(DType dt, double value) {
  // fp32: the sum of squares of thousands of values in another order moves inv_rms by a few
  // 1e-7 relative, so a few fp32 ulps; bf16/fp16: one rounding step either way.
  const double ulp = dt == DType::kBF16   ? std::ldexp(1.0, -8)
                     : dt == DType::kFP16 ? std::ldexp(1.0, -11)
                                          : std::ldexp(1.0, -18);
  return 2.0 * ulp * std::max(std::fabs(value), 1e-3);
}

// Checks every rank's outputs: exact against the CPU for the sum and residual_out, within
// NormTolerance for norm_out, bit-identical across ranks, and close to the fp64 answer.
void VerifyOutputs(SimGroup& g, HostOp& op, Pattern pattern) {
  CpuOpArgs args = op.Args(pattern);
  ASSERT_TRUE(ReferenceFusedOp(args).ok());
  Fp64Result exact;
  ASSERT_TRUE(ReferenceFusedOpFp64(args, &exact).ok());
  const size_t bytes = g.Bytes(op.tokens);
  const size_t n = static_cast<size_t>(op.tokens) * op.hidden;
  std::vector<uint8_t> rank0_norm;
  for (int r = 0; r < g.world_; ++r) {
    if (pattern == Pattern::kAllReduce) {
      const auto got = Download(g.output_[r]->ptr, bytes);
      ASSERT_EQ(got.size(), bytes);
      ASSERT_TRUE(std::memcmp(got.data(), op.want_out.data(), bytes) == 0)
          << "rank " << r << ": allreduce output differs from the CPU implementation";
      continue;
    }
    const auto residual = Download(g.residual_out_[r]->ptr, bytes);
    const auto norm = Download(g.norm_out_[r]->ptr, bytes);
    ASSERT_EQ(residual.size(), bytes);
    ASSERT_EQ(norm.size(), bytes);
    ASSERT_TRUE(std::memcmp(residual.data(), op.want_residual.data(), bytes) == 0)
        << "rank " << r << ": residual_out differs from the CPU implementation";
    if (r == 0) {
      rank0_norm = norm;
    } else {
      ASSERT_TRUE(std::memcmp(norm.data(), rank0_norm.data(), bytes) == 0)
          << "rank " << r << ": norm_out differs from rank 0's";
    }
    const double unit = op.dtype == DType::kBF16   ? std::ldexp(1.0, -8)
                        : op.dtype == DType::kFP16 ? std::ldexp(1.0, -11)
                                                   : std::ldexp(1.0, -23);
    double inv_rms = 0.0;
    for (size_t i = 0; i < n; ++i) {
      if (i % op.hidden == 0) {  // the exact row's 1/rms
        double ss = 0.0;
        for (size_t j = i; j < i + op.hidden; ++j)
          ss += exact.residual_out[j] * exact.residual_out[j];
        inv_rms = 1.0 / std::sqrt(ss / op.hidden + 1e-5);
      }
      const double got = LoadAsFloat(op.dtype, norm.data(), i);
      const double cpu = LoadAsFloat(op.dtype, op.want_norm.data(), i);
      ASSERT_NEAR(got, cpu, NormTolerance(op.dtype, cpu)) << "rank " << r << " element " << i;
      // Against fp64: the roundings of the sum and of residual_out are relative to the terms'
      // magnitudes, then scaled by 1/rms and gamma; the final rounding is relative to the value.
      double terms = std::fabs(LoadAsFloat(op.dtype, op.residual.data(), i));
      for (const auto& in : op.inputs) terms += std::fabs(LoadAsFloat(op.dtype, in.data(), i));
      const double g = std::fabs(LoadAsFloat(op.dtype, op.gamma.data(), i % op.hidden));
      const double tolerance =
          4 * unit * terms * inv_rms * g + 4 * unit * std::fabs(exact.norm_out[i]) + 1e-6;
      ASSERT_NEAR(got, exact.norm_out[i], tolerance) << "rank " << r << " element " << i;
    }
  }
}

struct SweepCase {
  int world;
  FusionAlgo algo;
  DType dtype;
  Pattern pattern;
};

std::string SweepName(const ::testing::TestParamInfo<SweepCase>& info) {
  return std::string("w") + std::to_string(info.param.world) +
         (info.param.algo == FusionAlgo::kOneShot ? "_oneshot_" : "_twoshot_") +
         DTypeName(info.param.dtype) + "_" + PatternName(info.param.pattern);
}

class FusionSweep : public ::testing::TestWithParam<SweepCase> {};

TEST_P(FusionSweep, MatchesCpuAndIsIdenticalOnEveryRank) {
  const SweepCase c = GetParam();
  SimGroup g(c.world, 320, 4096, c.dtype);
  ASSERT_TRUE(g.ok());
  CUDA_OK(g.Init());
  std::mt19937 rng(42 + c.world);
  // Shapes within one workspace: one token, fewer tokens than ranks, uneven slices, and the
  // largest call; hidden shrinks for one of them.
  struct Shape {
    uint32_t tokens, hidden;
  };
  for (Shape s : {Shape{1, 4096}, Shape{3, 4096}, Shape{67, 4096}, Shape{320, 4096}}) {
    SCOPED_TRACE(::testing::Message() << "tokens " << s.tokens);
    HostOp op(g, s.tokens);
    op.FillRandom(rng);
    ASSERT_TRUE(op.Upload(g));
    CUDA_OK(g.Launch(c.algo, c.pattern, s.tokens));
    CUDA_OK(g.SyncAll());
    for (int r = 0; r < c.world; ++r) ASSERT_EQ(g.ErrorWord(r), 0u) << "rank " << r;
    VerifyOutputs(g, op, c.pattern);
  }
}

std::vector<SweepCase> SweepCases() {
  std::vector<SweepCase> cases;
  for (int w : {2, 4, 8}) {
    for (FusionAlgo a : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
      for (DType dt : {DType::kBF16, DType::kFP16, DType::kFP32}) {
        for (Pattern p : {Pattern::kAllReduce, Pattern::kAllReduceResidualRmsNorm}) {
          cases.push_back({w, a, dt, p});
        }
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(All, FusionSweep, ::testing::ValuesIn(SweepCases()), SweepName);

TEST(FusionGpu, LargeAndSmallHidden) {
  for (int world : {2, 4}) {
    for (uint32_t hidden : {8u, 16384u}) {
      for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
        SCOPED_TRACE(::testing::Message() << "world " << world << " hidden " << hidden);
        SimGroup g(world, 9, hidden, DType::kBF16);
        ASSERT_TRUE(g.ok());
        CUDA_OK(g.Init());
        std::mt19937 rng(hidden);
        HostOp op(g, 9);
        op.FillRandom(rng);
        ASSERT_TRUE(op.Upload(g));
        CUDA_OK(g.Launch(algo, Pattern::kAllReduceResidualRmsNorm, 9));
        CUDA_OK(g.SyncAll());
        VerifyOutputs(g, op, Pattern::kAllReduceResidualRmsNorm);
      }
    }
  }
}

// Integer-valued inputs: the fused op equals "allreduce, then the unfused path's add-RMSNorm
// kernel" bit for bit (what NCCL + our norm give), on every rank and for both algorithms.
TEST(FusionGpu, IntegerInputsEqualAllreduceThenAddRmsNorm) {
  for (int world : {2, 4, 8}) {
    for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
      SCOPED_TRACE(::testing::Message() << "world " << world << " algo " << static_cast<int>(algo));
      const uint32_t tokens = 48;
      SimGroup g(world, tokens, 4096, DType::kBF16);
      ASSERT_TRUE(g.ok());
      CUDA_OK(g.Init());
      std::mt19937 rng(world * 7);
      HostOp op(g, tokens);
      op.FillIntegers(rng);
      ASSERT_TRUE(op.Upload(g));
      CUDA_OK(g.Launch(algo, Pattern::kAllReduceResidualRmsNorm, tokens));
      CUDA_OK(g.SyncAll());
      VerifyOutputs(g, op, Pattern::kAllReduceResidualRmsNorm);
      // The unfused path: the exact integer sum (what NCCL returns), then LaunchAddRmsNorm.
      CpuOpArgs sum_args = op.Args(Pattern::kAllReduce);
      ASSERT_TRUE(ReferenceFusedOp(sum_args).ok());
      const size_t bytes = g.Bytes(tokens);
      DeviceBuffer sum(bytes), residual_out(bytes), norm_out(bytes);
      CUDA_OK(cudaMemcpy(sum.ptr, op.want_out.data(), bytes, cudaMemcpyHostToDevice));
      AddRmsNormParams p{};
      p.input = sum.ptr;
      p.residual_in = g.residual_in_[0]->ptr;
      p.residual_out = residual_out.ptr;
      p.norm_out = norm_out.ptr;
      p.gamma = g.gamma_->ptr;
      p.num_tokens = tokens;
      p.hidden = 4096;
      p.eps = 1e-5f;
      p.dtype = DType::kBF16;
      CUDA_OK(LaunchAddRmsNorm(p, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_EQ(Download(residual_out.ptr, bytes), Download(g.residual_out_[0]->ptr, bytes));
      EXPECT_EQ(Download(norm_out.ptr, bytes), Download(g.norm_out_[0]->ptr, bytes));
    }
  }
}

// Captures every rank's op in its own CUDA graph and replays the graphs concurrently; inputs
// change between replays. Returns after `replays` verified replays.
void CaptureAndReplay(SimGroup& g, FusionAlgo algo, uint32_t tokens, int replays, bool subnormals) {
  std::vector<cudaGraphExec_t> execs(g.world_, nullptr);
  for (int r = 0; r < g.world_; ++r) {
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamBeginCapture(g.streams_[r], cudaStreamCaptureModeThreadLocal));
    const cudaError_t launch = LaunchAllReduceFusion(
        g.Params(r, algo, Pattern::kAllReduceResidualRmsNorm, tokens), g.streams_[r]);
    CUDA_OK(cudaStreamEndCapture(g.streams_[r], &graph));
    CUDA_OK(launch);
    CUDA_OK(cudaGraphInstantiate(&execs[r], graph, 0));
    cudaGraphDestroy(graph);
  }
  std::mt19937 rng(tokens * 31 + static_cast<int>(algo));
  for (int i = 0; i < replays; ++i) {
    SCOPED_TRACE(::testing::Message() << "replay " << i);
    HostOp op(g, tokens);
    if (subnormals) {
      op.FillZerosAndSubnormals(rng);
    } else {
      op.FillRandom(rng);
    }
    ASSERT_TRUE(op.Upload(g));
    for (int r = 0; r < g.world_; ++r) CUDA_OK(cudaGraphLaunch(execs[r], g.streams_[r]));
    CUDA_OK(g.SyncAll());
    for (int r = 0; r < g.world_; ++r) ASSERT_EQ(g.ErrorWord(r), 0u) << "rank " << r;
    VerifyOutputs(g, op, Pattern::kAllReduceResidualRmsNorm);
  }
  for (cudaGraphExec_t e : execs) cudaGraphExecDestroy(e);
}

TEST(FusionGpu, GraphReplayWithChangingInputs) {
  for (int world : {2, 4, 8}) {
    for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
      SCOPED_TRACE(::testing::Message() << "world " << world << " algo " << static_cast<int>(algo));
      SimGroup g(world, 64, 2048, DType::kBF16);
      ASSERT_TRUE(g.ok());
      CUDA_OK(g.Init());
      CaptureAndReplay(g, algo, 33, 8, /*subnormals=*/false);
    }
  }
}

// The pattern that hung FlashInfer's MNNVL kernel under CUDA graphs: inputs of only +-0.0 and
// bf16 subnormals. Raw-bit sentinel checks must neither hang nor flush them.
TEST(FusionGpu, ZerosAndBf16SubnormalsUnderGraphs) {
  for (int world : {2, 4, 8}) {
    for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
      SCOPED_TRACE(::testing::Message() << "world " << world << " algo " << static_cast<int>(algo));
      SimGroup g(world, 16, 4096, DType::kBF16);
      ASSERT_TRUE(g.ok());
      CUDA_OK(g.Init());
      CaptureAndReplay(g, algo, 16, 12, /*subnormals=*/true);
    }
  }
}

// Thousands of ops with no host synchronization in between: ranks drift apart, token counts
// and algorithms change from op to op. The last op of each shape is verified.
TEST(FusionGpu, ThousandsOfBackToBackOpsWithChangingShapes) {
  for (int world : {2, 8}) {
    SCOPED_TRACE(::testing::Message() << "world " << world);
    SimGroup g(world, 128, 1024, DType::kBF16);
    ASSERT_TRUE(g.ok());
    CUDA_OK(g.Init());
    std::mt19937 rng(world);
    HostOp op(g, 128);
    op.FillRandom(rng);
    ASSERT_TRUE(op.Upload(g));
    const uint32_t token_cycle[] = {1, 128, 2, 77, 16, 5, 128, 3};
    const int iterations = 3000;
    for (int i = 0; i < iterations; ++i) {
      const FusionAlgo algo = (i % 3 == 2) ? FusionAlgo::kTwoShot : FusionAlgo::kOneShot;
      CUDA_OK(g.Launch(algo, Pattern::kAllReduceResidualRmsNorm, token_cycle[i % 8]));
    }
    CUDA_OK(g.SyncAll());
    for (int r = 0; r < world; ++r) ASSERT_EQ(g.ErrorWord(r), 0u) << "rank " << r;
    // The inputs are fixed, so the last op (tokens token_cycle[(iterations-1) % 8]) must match.
    const uint32_t last = token_cycle[(iterations - 1) % 8];
    HostOp check(g, last);
    const size_t bytes = g.Bytes(last);
    for (int r = 0; r < world; ++r)
      check.inputs[r].assign(op.inputs[r].begin(), op.inputs[r].begin() + bytes);
    check.residual.assign(op.residual.begin(), op.residual.begin() + bytes);
    check.gamma = op.gamma;
    VerifyOutputs(g, check, Pattern::kAllReduceResidualRmsNorm);
  }
}

TEST(FusionGpu, TokenCountsShrinkAndGrowWithinOneWorkspace) {
  SimGroup g(4, 256, 2048, DType::kFP16);
  ASSERT_TRUE(g.ok());
  CUDA_OK(g.Init());
  std::mt19937 rng(5);
  int i = 0;
  for (uint32_t tokens : {256u, 1u, 64u, 2u, 255u, 3u, 128u, 1u, 256u}) {
    for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
      SCOPED_TRACE(::testing::Message() << "step " << i++ << " tokens " << tokens);
      HostOp op(g, tokens);
      op.FillRandom(rng);
      ASSERT_TRUE(op.Upload(g));
      CUDA_OK(g.Launch(algo, Pattern::kAllReduceResidualRmsNorm, tokens));
      CUDA_OK(g.SyncAll());
      VerifyOutputs(g, op, Pattern::kAllReduceResidualRmsNorm);
    }
  }
}

// World size 2 with random inputs: the allreduce result is one rounding of x0 + x1 on the CPU
// and on the GPU, so the fused op must equal "CPU allreduce, then LaunchAddRmsNorm" bit for bit,
// for every row layout (row_math.cuh: 1, 2, 3-4, 5-8 vectors per thread, blocks up to 1024
// threads), one row per CTA and several rows per CTA, one-shot and two-shot.
TEST(FusionGpu, EveryRowLayoutEqualsAllreduceThenAddRmsNorm) {
  struct Case {
    uint32_t hidden, tokens;
  };
  const Case cases[] = {{4096, 1},  {4096, 5},  {4096, 200}, {7168, 1},   {7168, 18},
                        {7168, 90}, {8192, 1},  {8192, 33},  {8192, 150}, {2048, 3},
                        {2056, 7},  {12288, 2}, {16384, 9},  {24576, 2},  {40960, 3}};
  for (const Case& c : cases) {
    for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
      SCOPED_TRACE(::testing::Message() << "hidden " << c.hidden << " tokens " << c.tokens
                                        << " algo " << static_cast<int>(algo));
      SimGroup g(2, c.tokens, c.hidden, DType::kBF16);
      ASSERT_TRUE(g.ok());
      CUDA_OK(g.Init());
      std::mt19937 rng(c.hidden + c.tokens);
      HostOp op(g, c.tokens);
      op.FillRandom(rng);
      ASSERT_TRUE(op.Upload(g));
      // Twice: the second op runs on buffers the first one's reads put the sentinel back into.
      for (int round = 0; round < 2; ++round) {
        CUDA_OK(g.Launch(algo, Pattern::kAllReduceResidualRmsNorm, c.tokens));
        CUDA_OK(g.SyncAll());
        for (int r = 0; r < 2; ++r) ASSERT_EQ(g.ErrorWord(r), 0u) << "rank " << r;
      }
      CpuOpArgs sum_args = op.Args(Pattern::kAllReduce);
      ASSERT_TRUE(ReferenceFusedOp(sum_args).ok());
      const size_t bytes = g.Bytes(c.tokens);
      DeviceBuffer sum(bytes), residual_out(bytes), norm_out(bytes);
      CUDA_OK(cudaMemcpy(sum.ptr, op.want_out.data(), bytes, cudaMemcpyHostToDevice));
      AddRmsNormParams p{};
      p.input = sum.ptr;
      p.residual_in = g.residual_in_[0]->ptr;
      p.residual_out = residual_out.ptr;
      p.norm_out = norm_out.ptr;
      p.gamma = g.gamma_->ptr;
      p.num_tokens = c.tokens;
      p.hidden = c.hidden;
      p.eps = 1e-5f;
      p.dtype = DType::kBF16;
      CUDA_OK(LaunchAddRmsNorm(p, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const auto want_residual = Download(residual_out.ptr, bytes);
      const auto want_norm = Download(norm_out.ptr, bytes);
      for (int r = 0; r < 2; ++r) {
        EXPECT_EQ(Download(g.residual_out_[r]->ptr, bytes), want_residual) << "rank " << r;
        EXPECT_EQ(Download(g.norm_out_[r]->ptr, bytes), want_norm) << "rank " << r;
      }
    }
  }
}

// Ranks that pass sm_budget 0 (as with one GPU per rank) get programmatic dependent launches:
// each op may be scheduled while the one before it on the stream still runs and must wait for
// it. Back-to-back ops, then a captured graph of several ops replayed with changing inputs,
// with both algorithms interleaved. Small token counts only: two whole-GPU grids must fit the
// one GPU side by side.
TEST(FusionGpu, ProgrammaticLaunchesBackToBackAndInGraphs) {
  SimGroup g(2, 16, 4096, DType::kBF16);
  ASSERT_TRUE(g.ok());
  g.whole_gpu_ = true;
  CUDA_OK(g.Init());
  std::mt19937 rng(2024);
  const uint32_t token_cycle[] = {1, 16, 3, 8};
  for (int step = 0; step < 4; ++step) {
    const uint32_t tokens = token_cycle[step];
    SCOPED_TRACE(::testing::Message() << "tokens " << tokens);
    HostOp op(g, tokens);
    op.FillRandom(rng);
    ASSERT_TRUE(op.Upload(g));
    for (int i = 0; i < 200; ++i) {
      const FusionAlgo algo = i % 5 == 4 ? FusionAlgo::kTwoShot : FusionAlgo::kOneShot;
      CUDA_OK(g.Launch(tokens >= 2 ? algo : FusionAlgo::kOneShot,
                       Pattern::kAllReduceResidualRmsNorm, tokens));
    }
    CUDA_OK(g.SyncAll());
    for (int r = 0; r < 2; ++r) ASSERT_EQ(g.ErrorWord(r), 0u) << "rank " << r;
    VerifyOutputs(g, op, Pattern::kAllReduceResidualRmsNorm);
  }
  // A graph of 6 ops per rank (one-shot and two-shot), replayed with new inputs each time.
  const uint32_t tokens = 9;
  std::vector<cudaGraphExec_t> execs(2, nullptr);
  for (int r = 0; r < 2; ++r) {
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamBeginCapture(g.streams_[r], cudaStreamCaptureModeThreadLocal));
    cudaError_t launch = cudaSuccess;
    for (int i = 0; i < 6 && launch == cudaSuccess; ++i) {
      launch = LaunchAllReduceFusion(
          g.Params(r, i % 3 == 1 ? FusionAlgo::kTwoShot : FusionAlgo::kOneShot,
                   Pattern::kAllReduceResidualRmsNorm, tokens),
          g.streams_[r]);
    }
    CUDA_OK(cudaStreamEndCapture(g.streams_[r], &graph));
    CUDA_OK(launch);
    CUDA_OK(cudaGraphInstantiate(&execs[r], graph, 0));
    cudaGraphDestroy(graph);
  }
  for (int replay = 0; replay < 5; ++replay) {
    SCOPED_TRACE(::testing::Message() << "replay " << replay);
    HostOp op(g, tokens);
    op.FillRandom(rng);
    ASSERT_TRUE(op.Upload(g));
    for (int r = 0; r < 2; ++r) CUDA_OK(cudaGraphLaunch(execs[r], g.streams_[r]));
    CUDA_OK(g.SyncAll());
    for (int r = 0; r < 2; ++r) ASSERT_EQ(g.ErrorWord(r), 0u) << "rank " << r;
    VerifyOutputs(g, op, Pattern::kAllReduceResidualRmsNorm);
  }
  for (cudaGraphExec_t e : execs) cudaGraphExecDestroy(e);
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Runs one good op on every rank and verifies it (after a re-initialization).
void ExpectWorksAgain(SimGroup& g, FusionAlgo algo) {
  CUDA_OK(g.Init());
  for (int r = 0; r < g.world_; ++r) ASSERT_EQ(g.ErrorWord(r), 0u);
  std::mt19937 rng(99);
  HostOp op(g, 20);
  op.FillRandom(rng);
  ASSERT_TRUE(op.Upload(g));
  CUDA_OK(g.Launch(algo, Pattern::kAllReduceResidualRmsNorm, 20));
  CUDA_OK(g.SyncAll());
  for (int r = 0; r < g.world_; ++r) ASSERT_EQ(g.ErrorWord(r), 0u) << "rank " << r;
  VerifyOutputs(g, op, Pattern::kAllReduceResidualRmsNorm);
}

// Every rank but `missing` runs one op of `tokens` on a freshly initialized workspace with a 0.2 s
// spin timeout: they give up on it.
void LaunchWithoutRank(SimGroup& g, FusionAlgo algo, uint32_t tokens, int missing) {
  CUDA_OK(g.Init());
  g.timeout_ns_ = 200'000'000ull;
  CUDA_OK(g.Launch(algo, Pattern::kAllReduceResidualRmsNorm, tokens, missing));
  CUDA_OK(g.SyncAll());
}

TEST(FusionGpu, MissingRankMakesTheOthersFailWithinTheDeadline) {
  for (int world : {2, 4, 8}) {
    for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
      SCOPED_TRACE(::testing::Message() << "world " << world << " algo " << static_cast<int>(algo));
      SimGroup g(world, 64, 1024, DType::kBF16);
      ASSERT_TRUE(g.ok());
      const int missing = world - 1;
      const auto start = std::chrono::steady_clock::now();
      LaunchWithoutRank(g, algo, 40, missing);
      EXPECT_LT(SecondsSince(start), 3.0);
      int timeouts = 0;
      for (int r = 0; r < world; ++r) {
        if (r == missing) continue;
        const uint32_t code = g.ErrorWord(r);
        EXPECT_TRUE(code == static_cast<uint32_t>(FusionError::kTimeout) ||
                    code == static_cast<uint32_t>(FusionError::kPeerAbort))
            << "rank " << r << ": " << FusionErrorName(code);
        EXPECT_EQ(*g.error_mirror_[r]->host, code) << "rank " << r << " host mirror";
        timeouts += code == static_cast<uint32_t>(FusionError::kTimeout);
      }
      EXPECT_GE(timeouts, 1);
      // Poisoned: a full group launch now returns at once and runs nothing.
      g.timeout_ns_ = kNormalTimeoutNs;
      const size_t bytes = g.Bytes(40);
      CUDA_OK(cudaMemset(g.norm_out_[0]->ptr, 0x5a, bytes));
      const auto again = std::chrono::steady_clock::now();
      CUDA_OK(g.Launch(algo, Pattern::kAllReduceResidualRmsNorm, 40));
      CUDA_OK(g.SyncAll());
      EXPECT_LT(SecondsSince(again), 1.0);
      EXPECT_NE(g.ErrorWord(0), 0u);
      const auto untouched = Download(g.norm_out_[0]->ptr, bytes);
      EXPECT_EQ(untouched, std::vector<uint8_t>(bytes, 0x5a)) << "a poisoned launch wrote output";
      ExpectWorksAgain(g, algo);
    }
  }
}

// A rank that arrives after its peers gave up on the op (stalled, or stopped and continued) finds
// their data for it complete in its inbox (one-shot) or their barrier-A signal (two-shot). It
// must fail the op as its peers did (kPeerAbort), at once and storing nothing: returning OK
// would leave the ranks disagreeing on the op's outcome.
TEST(FusionGpu, RankArrivingAfterItsPeersGaveUpFailsAndStoresNothing) {
  for (int world : {2, 4}) {
    for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
      SCOPED_TRACE(::testing::Message() << "world " << world << " algo " << static_cast<int>(algo));
      SimGroup g(world, 64, 1024, DType::kBF16);
      ASSERT_TRUE(g.ok());
      const int late = world - 1;
      LaunchWithoutRank(g, algo, 16, late);
      for (int r = 0; r < world; ++r) {
        if (r != late) {
          ASSERT_NE(g.ErrorWord(r), 0u) << "rank " << r << " did not give up";
        }
      }
      ASSERT_EQ(g.ErrorWord(late), 0u);
      const size_t bytes = g.Bytes(16);
      CUDA_OK(cudaMemset(g.residual_out_[late]->ptr, 0x5a, bytes));
      CUDA_OK(cudaMemset(g.norm_out_[late]->ptr, 0x5a, bytes));
      g.timeout_ns_ = kNormalTimeoutNs;
      const auto start = std::chrono::steady_clock::now();
      CUDA_OK(LaunchAllReduceFusion(g.Params(late, algo, Pattern::kAllReduceResidualRmsNorm, 16),
                                    g.streams_[late]));
      CUDA_OK(g.SyncAll());
      EXPECT_LT(SecondsSince(start), 1.0) << "ended by the spin deadline, not the abort word";
      EXPECT_EQ(g.ErrorWord(late), static_cast<uint32_t>(FusionError::kPeerAbort))
          << FusionErrorName(g.ErrorWord(late));
      EXPECT_EQ(*g.error_mirror_[late]->host, static_cast<uint32_t>(FusionError::kPeerAbort));
      EXPECT_EQ(Download(g.residual_out_[late]->ptr, bytes), std::vector<uint8_t>(bytes, 0x5a))
          << "the late rank stored residual_out of an op its peers failed";
      EXPECT_EQ(Download(g.norm_out_[late]->ptr, bytes), std::vector<uint8_t>(bytes, 0x5a))
          << "the late rank stored norm_out of an op its peers failed";
      ExpectWorksAgain(g, algo);
    }
  }
}

// Two clients racing on one group can pair different ops across the ranks. Every rank must fail
// the call with kOpMismatch (or be aborted by a peer that did), fast (not by the spin deadline),
// and store no output; the group works again after a re-initialization.
TEST(FusionGpu, RanksRunningDifferentOpsFailFastAndStoreNothing) {
  // `tokens` for every rank but the last, which runs `odd_tokens`, `odd_hidden`, `odd_eps`. One
  // token is a one-block launch (every thread checks), more are several blocks (thread 0 checks).
  struct Mismatch {
    const char* what;
    uint32_t tokens, odd_tokens, odd_hidden;
    float odd_eps;
  };
  const Mismatch kinds[] = {
      {"tokens 4 vs 8", 4, 8, 1024, 1e-5f},
      {"tokens 4 vs 1", 4, 1, 1024, 1e-5f},
      {"hidden 1024 vs 512", 4, 4, 512, 1e-5f},
      {"eps 1e-5 vs 1e-6", 4, 4, 1024, 1e-6f},
      {"eps 1e-5 vs 1e-6, one token", 1, 1, 1024, 1e-6f},
  };
  for (int world : {2, 4}) {
    for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
      for (const Mismatch& m : kinds) {
        SCOPED_TRACE(::testing::Message()
                     << "world " << world << " algo " << static_cast<int>(algo) << " " << m.what);
        SimGroup g(world, 64, 1024, DType::kBF16);
        ASSERT_TRUE(g.ok());
        CUDA_OK(g.Init());
        const size_t bytes = g.Bytes(8);
        for (int r = 0; r < world; ++r) {
          CUDA_OK(cudaMemset(g.residual_out_[r]->ptr, 0x5a, bytes));
          CUDA_OK(cudaMemset(g.norm_out_[r]->ptr, 0x5a, bytes));
        }
        const int odd = world - 1;  // runs the other op
        const auto start = std::chrono::steady_clock::now();
        for (int r = 0; r < world; ++r) {
          FusionParams p = g.Params(r, algo, Pattern::kAllReduceResidualRmsNorm, m.tokens);
          if (r == odd) {
            p.num_tokens = m.odd_tokens;
            p.hidden = m.odd_hidden;
            p.eps = m.odd_eps;
          }
          CUDA_OK(LaunchAllReduceFusion(p, g.streams_[r]));
        }
        CUDA_OK(g.SyncAll());
        EXPECT_LT(SecondsSince(start), 2.0) << "ended by the spin deadline (5 s), not the check";
        int mismatches = 0;
        for (int r = 0; r < world; ++r) {
          const uint32_t code = g.ErrorWord(r);
          EXPECT_TRUE(code == static_cast<uint32_t>(FusionError::kOpMismatch) ||
                      code == static_cast<uint32_t>(FusionError::kPeerAbort))
              << "rank " << r << ": " << FusionErrorName(code);
          mismatches += code == static_cast<uint32_t>(FusionError::kOpMismatch);
          EXPECT_EQ(Download(g.residual_out_[r]->ptr, bytes), std::vector<uint8_t>(bytes, 0x5a))
              << "rank " << r << " stored residual_out of a mismatched op";
          EXPECT_EQ(Download(g.norm_out_[r]->ptr, bytes), std::vector<uint8_t>(bytes, 0x5a))
              << "rank " << r << " stored norm_out of a mismatched op";
        }
        EXPECT_GE(mismatches, 1);
        ExpectWorksAgain(g, algo);
      }
    }
  }
}

TEST(FusionGpu, HostAbortWordMakesSpinsExit) {
  for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
    SimGroup g(2, 64, 1024, DType::kBF16);
    ASSERT_TRUE(g.ok());
    CUDA_OK(g.Init());
    g.timeout_ns_ = 60'000'000'000ull;  // the deadline must not be what ends it
    const auto start = std::chrono::steady_clock::now();
    CUDA_OK(g.Launch(algo, Pattern::kAllReduceResidualRmsNorm, 8, /*skip_rank=*/1));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    *g.host_abort_.host = 1;
    CUDA_OK(g.SyncAll());
    EXPECT_LT(SecondsSince(start), 5.0);
    EXPECT_EQ(g.ErrorWord(0), static_cast<uint32_t>(FusionError::kHostAbort));
    *g.host_abort_.host = 0;
    g.timeout_ns_ = kNormalTimeoutNs;
    ExpectWorksAgain(g, algo);
  }
}

TEST(FusionGpu, WorkspaceAbortWordMakesSpinsExit) {
  SimGroup g(2, 64, 1024, DType::kBF16);
  ASSERT_TRUE(g.ok());
  CUDA_OK(g.Init());
  g.timeout_ns_ = 60'000'000'000ull;
  const auto start = std::chrono::steady_clock::now();
  CUDA_OK(g.Launch(FusionAlgo::kOneShot, Pattern::kAllReduceResidualRmsNorm, 8, 1));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // From another stream, as a host watchdog would (the rank's own stream is busy spinning).
  cudaStream_t side = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  const uint32_t one = 1;
  CUDA_OK(cudaMemcpyAsync(WorkspaceAbortWord(g.workspaces_[0]->ptr, g.layout_), &one, sizeof(one),
                          cudaMemcpyHostToDevice, side));
  CUDA_OK(cudaStreamSynchronize(side));
  cudaStreamDestroy(side);
  CUDA_OK(g.SyncAll());
  EXPECT_LT(SecondsSince(start), 5.0);
  EXPECT_EQ(g.ErrorWord(0), static_cast<uint32_t>(FusionError::kHostAbort));
  g.timeout_ns_ = kNormalTimeoutNs;
  ExpectWorksAgain(g, FusionAlgo::kOneShot);
}

TEST(AddRmsNormGpu, MatchesCpuForEveryDType) {
  for (DType dt : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (uint32_t hidden : {8u, 4096u, 7168u}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " hidden " << hidden);
      const uint32_t tokens = 37;
      const size_t bytes = static_cast<size_t>(tokens) * hidden * DTypeSize(dt);
      std::mt19937 rng(hidden);
      std::normal_distribution<float> dist(0.0f, 1.0f);
      std::vector<uint8_t> input(bytes), residual(bytes), gamma(hidden * DTypeSize(dt));
      for (size_t i = 0; i < static_cast<size_t>(tokens) * hidden; ++i) {
        StoreFromFloat(dt, input.data(), i, i % 17 == 0 ? -0.0f : dist(rng));
        StoreFromFloat(dt, residual.data(), i, dist(rng));
      }
      for (size_t i = 0; i < hidden; ++i) StoreFromFloat(dt, gamma.data(), i, 1.0f + dist(rng));
      DeviceBuffer d_in(bytes), d_res(bytes), d_norm(bytes), d_gamma(gamma.size());
      CUDA_OK(cudaMemcpy(d_in.ptr, input.data(), bytes, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(d_res.ptr, residual.data(), bytes, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(d_gamma.ptr, gamma.data(), gamma.size(), cudaMemcpyHostToDevice));
      AddRmsNormParams p{};
      p.input = d_in.ptr;
      p.residual_in = d_res.ptr;
      p.residual_out = d_res.ptr;  // in place, as the serving frameworks do
      p.norm_out = d_norm.ptr;
      p.gamma = d_gamma.ptr;
      p.num_tokens = tokens;
      p.hidden = hidden;
      p.eps = 1e-5f;
      p.dtype = dt;
      CUDA_OK(LaunchAddRmsNorm(p, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<uint8_t> want_res(bytes), want_norm(bytes);
      const void* inputs[1] = {input.data()};
      CpuOpArgs a;
      a.dtype = dt;
      a.world_size = 1;
      a.hidden = hidden;
      a.num_tokens = tokens;
      a.eps = 1e-5f;
      a.rank_inputs = inputs;
      a.residual_in = residual.data();
      a.residual_out = want_res.data();
      a.norm_out = want_norm.data();
      a.gamma = gamma.data();
      ASSERT_TRUE(ReferenceFusedOp(a).ok());
      EXPECT_EQ(Download(d_res.ptr, bytes), want_res);
      const auto norm = Download(d_norm.ptr, bytes);
      for (size_t i = 0; i < static_cast<size_t>(tokens) * hidden; ++i) {
        const double cpu = LoadAsFloat(dt, want_norm.data(), i);
        ASSERT_NEAR(LoadAsFloat(dt, norm.data(), i), cpu, NormTolerance(dt, cpu)) << i;
      }
    }
  }
}

}  // namespace
}  // namespace arfuse
