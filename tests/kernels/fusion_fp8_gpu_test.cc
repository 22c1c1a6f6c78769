// The fused kernels' FP8 patterns on a real GPU (ranks simulated on one GPU, fusion_gpu_util.h):
// every pattern (static, per-token, per-group in its three scale layouts) x dtype (bf16, fp16) x
// algorithm x world size (2, 4, 8), with and without norm_out, against the CPU: the fp32
// normalized value recomputed from the CPU's residual_out and quantized by kernels/quant's
// reference. The GPU adds the sum of squares in another order, so a normalized value may differ
// by that sum's rounding (a relative hidden x 2^-24 at most), a code by one E4M3 step and an fp32
// scale by the same relative amount; nothing further. Every rank's bytes are the
// same. Special rows (zero, infinite, NaN), subnormal static scales and graph replays too.
// Run: ctest --test-dir <build> -L gpu -R Fp8   (needs one GPU).
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/host/reference_op.h"
#include "kernels/quant/fp8_format.h"
#include "kernels/quant/fp8_reference.h"
#include "tests/kernels/fp8_steps.h"
#include "tests/kernels/fusion_gpu_util.h"

namespace arfuse {
namespace {

using namespace ::arfuse::fusion_test;  // NOLINT(build/namespaces): the simulated group
using fp8::GroupScaleLayout;

using ::arfuse::fp8_test::E4m3Steps;

// What the FP8 epilogue quantizes, from the CPU's residual_out: x = (y * inv_rms) * gamma in fp32
// with the reference's IEEE operations (the sum of squares added in element order).
std::vector<float> NormalizedValues(const HostOp& op, float eps) {
  const size_t h = op.hidden;
  std::vector<float> x(static_cast<size_t>(op.tokens) * h);
  for (uint32_t t = 0; t < op.tokens; ++t) {
    float ss = 0.0f;
    for (size_t i = 0; i < h; ++i) {
      const float y = LoadAsFloat(op.dtype, op.want_residual.data(), t * h + i);
      ss += y * y;
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
    for (size_t i = 0; i < h; ++i) {
      const float y = LoadAsFloat(op.dtype, op.want_residual.data(), t * h + i);
      x[t * h + i] = (y * inv) * LoadAsFloat(op.dtype, op.gamma.data(), i);
    }
  }
  return x;
}

// Element i of two dtype arrays: both NaN (payloads differ between CPU and GPU), or within
// `relative` of the second's magnitude (floored at 1e-3; 0 for equal values).
bool SameValue(DType dt, const void* got, const void* want, size_t i, double relative) {
  const double a = LoadAsFloat(dt, got, i);
  const double b = LoadAsFloat(dt, want, i);
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::fabs(a - b) <= relative * std::max(std::fabs(b), 1e-3);
}

struct Fp8Want {
  std::vector<uint8_t> codes;
  std::vector<uint8_t> scales;  // the scale tensor's bytes (per-token: fp32 [tokens])
};

Fp8Want Quantize(const std::vector<float>& x, const HostOp& op, Pattern pattern,
                 GroupScaleLayout layout, float static_scale) {
  Fp8Want w;
  w.codes.assign(x.size(), 0);
  plain::Status s;
  switch (pattern) {
    case Pattern::kAllReduceResidualRmsNormFp8Static:
      s = fp8::QuantizeRowsStatic(x.data(), op.tokens, op.hidden, static_scale, w.codes.data());
      break;
    case Pattern::kAllReduceResidualRmsNormFp8PerToken:
      w.scales.assign(op.tokens * sizeof(float), 0);
      s = fp8::QuantizeRowsPerToken(x.data(), op.tokens, op.hidden, w.codes.data(),
                                    reinterpret_cast<float*>(w.scales.data()));
      break;
    default:
      w.scales.assign(fp8::GroupScaleBytes(layout, op.tokens, op.hidden / fp8::kGroupSize), 0xaa);
      s = fp8::QuantizeRowsPerGroup(x.data(), op.tokens, op.hidden, fp8::kGroupSize, layout,
                                    w.codes.data(), w.scales.data());
      break;
  }
  EXPECT_TRUE(s.ok()) << s.message();
  return w;
}

struct Fp8Got {
  std::vector<uint8_t> codes, scales, norm;
};

Fp8Got DownloadFp8(SimGroup& g, int rank, const HostOp& op, size_t scale_bytes) {
  Fp8Got got;
  got.codes = Download(g.quant_out_[rank]->ptr, static_cast<size_t>(op.tokens) * op.hidden);
  if (scale_bytes > 0) got.scales = Download(g.scale_[rank]->ptr, scale_bytes);
  if (g.fp8_norm_out_) got.norm = Download(g.norm_out_[rank]->ptr, g.Bytes(op.tokens));
  return got;
}

// Scales from x whose inv_rms comes from a sum of squares added in another order: fp32 scales
// within that sum's relative error (at most hidden x 2^-24 for fp32 adds of non-negative terms;
// inv_rms moves by half of it), UE8M0 bytes exactly (a byte moves only where amax / 448 crosses a
// power of two).
void ExpectScalesClose(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                       Pattern pattern, GroupScaleLayout layout, int rank, uint32_t hidden) {
  ASSERT_EQ(got.size(), want.size());
  if (pattern == Pattern::kAllReduceResidualRmsNormFp8PerGroup &&
      layout == GroupScaleLayout::kUe8m0Packed) {
    ASSERT_TRUE(std::memcmp(got.data(), want.data(), got.size()) == 0)
        << "rank " << rank << ": UE8M0 scales differ";
    return;
  }
  for (size_t i = 0; i + 4 <= got.size(); i += 4) {
    float a, b;
    std::memcpy(&a, got.data() + i, 4);
    std::memcpy(&b, want.data() + i, 4);
    ASSERT_NEAR(a, b, std::ldexp(std::fabs(b) * hidden, -24))
        << "rank " << rank << " scale byte " << i << " of " << got.size() << ": got 0x" << std::hex
        << *reinterpret_cast<const uint32_t*>(got.data() + i) << ", CPU 0x"
        << *reinterpret_cast<const uint32_t*>(want.data() + i);
  }
}

// Runs `pattern` over `op` on every rank and checks the codes and scales against the CPU (within
// one E4M3 step), every rank's bytes against rank 0's, and norm_out when the group writes it.
void RunAndVerify(SimGroup& g, HostOp& op, FusionAlgo algo, Pattern pattern, float static_scale) {
  ASSERT_TRUE(op.Upload(g));
  ASSERT_EQ(cudaMemcpy(g.static_scale_->ptr, &static_scale, sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  CpuOpArgs args = op.Args(Pattern::kAllReduceResidualRmsNorm);
  ASSERT_TRUE(ReferenceFusedOp(args).ok());
  const auto layout = static_cast<GroupScaleLayout>(g.scale_layout_);
  const Fp8Want want = Quantize(NormalizedValues(op, 1e-5f), op, pattern, layout, static_scale);
  // Poison the outputs so a code or scale the kernel does not write is seen.
  for (int r = 0; r < g.world_; ++r) {
    ASSERT_EQ(cudaMemset(g.quant_out_[r]->ptr, 0x5a, g.quant_out_[r]->bytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(g.scale_[r]->ptr, 0x5a, g.scale_[r]->bytes), cudaSuccess);
  }
  // The memsets ran on the legacy stream, which the ranks' non-blocking streams do not wait for.
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(g.Launch(algo, pattern, op.tokens));
  CUDA_OK(g.SyncAll());
  for (int r = 0; r < g.world_; ++r) ASSERT_EQ(g.ErrorWord(r), 0u) << "rank " << r;
  Fp8Got rank0;
  for (int r = 0; r < g.world_; ++r) {
    Fp8Got got = DownloadFp8(g, r, op, want.scales.size());
    const auto residual = Download(g.residual_out_[r]->ptr, g.Bytes(op.tokens));
    ASSERT_EQ(residual.size(), op.want_residual.size());
    for (size_t i = 0; i < residual.size() / DTypeSize(op.dtype); ++i) {
      ASSERT_TRUE(SameValue(op.dtype, residual.data(), op.want_residual.data(), i, 0.0))
          << "rank " << r << ": residual_out differs from the CPU at " << i;
    }
    if (r == 0) {
      ASSERT_EQ(got.codes.size(), want.codes.size());
      for (size_t i = 0; i < got.codes.size(); ++i) {
        ASSERT_LE(E4m3Steps(got.codes[i], want.codes[i]), 1)
            << "element " << i << ": code 0x" << std::hex << int{got.codes[i]} << ", CPU 0x"
            << int{want.codes[i]};
      }
      ExpectScalesClose(got.scales, want.scales, pattern, layout, r, op.hidden);
      if (g.fp8_norm_out_) {
        for (size_t i = 0; i < got.norm.size() / DTypeSize(op.dtype); ++i) {
          ASSERT_TRUE(SameValue(op.dtype, got.norm.data(), op.want_norm.data(), i, 0x1p-6))
              << "norm_out " << i;
        }
      }
      rank0 = std::move(got);
      continue;
    }
    ASSERT_TRUE(got.codes == rank0.codes) << "rank " << r << ": codes differ from rank 0's";
    ASSERT_TRUE(got.scales == rank0.scales) << "rank " << r << ": scales differ from rank 0's";
    ASSERT_TRUE(got.norm == rank0.norm) << "rank " << r << ": norm_out differs from rank 0's";
  }
}

struct Fp8Case {
  int world;
  FusionAlgo algo;
  DType dtype;
  Pattern pattern;
  GroupScaleLayout layout;
};

std::string Fp8Name(const ::testing::TestParamInfo<Fp8Case>& info) {
  const Fp8Case& c = info.param;
  std::string name = std::string("w") + std::to_string(c.world) +
                     (c.algo == FusionAlgo::kOneShot ? "_oneshot_" : "_twoshot_") +
                     DTypeName(c.dtype) + "_" + PatternName(c.pattern);
  if (c.pattern == Pattern::kAllReduceResidualRmsNormFp8PerGroup) {
    name += "_layout" + std::to_string(static_cast<int>(c.layout));
  }
  return name;
}

class Fp8Sweep : public ::testing::TestWithParam<Fp8Case> {};

// Hidden 4096 and 8192 (the Llama-3 8B and 70B rows), tokens from one to more than the grid, with
// and without norm_out: the codes and scales are the same either way.
TEST_P(Fp8Sweep, MatchesCpuWithinOneStepAndIsIdenticalOnEveryRank) {
  const Fp8Case c = GetParam();
  for (uint32_t hidden : {4096u, 8192u}) {
    SimGroup g(c.world, 96, hidden, c.dtype);
    ASSERT_TRUE(g.ok());
    g.scale_layout_ = static_cast<uint8_t>(c.layout);
    CUDA_OK(g.Init());
    std::mt19937 rng(7 + c.world + hidden);
    for (uint32_t tokens : {1u, 3u, 37u, 96u}) {
      for (bool norm_out : {true, false}) {
        SCOPED_TRACE(::testing::Message() << "hidden " << hidden << " tokens " << tokens
                                          << (norm_out ? " with" : " without") << " norm_out");
        g.fp8_norm_out_ = norm_out;
        HostOp op(g, tokens);
        op.FillRandom(rng);
        RunAndVerify(g, op, c.algo, c.pattern, 0.02f);
      }
    }
  }
}

std::vector<Fp8Case> Fp8Cases() {
  std::vector<Fp8Case> cases;
  for (int w : {2, 4, 8}) {
    for (FusionAlgo a : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
      for (DType dt : {DType::kBF16, DType::kFP16}) {
        cases.push_back({w, a, dt, Pattern::kAllReduceResidualRmsNormFp8Static,
                         GroupScaleLayout::kFp32RowMajor});
        cases.push_back({w, a, dt, Pattern::kAllReduceResidualRmsNormFp8PerToken,
                         GroupScaleLayout::kFp32RowMajor});
        for (GroupScaleLayout l : {GroupScaleLayout::kFp32RowMajor, GroupScaleLayout::kFp32MnMajor,
                                   GroupScaleLayout::kUe8m0Packed}) {
          cases.push_back({w, a, dt, Pattern::kAllReduceResidualRmsNormFp8PerGroup, l});
        }
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(All, Fp8Sweep, ::testing::ValuesIn(Fp8Cases()), Fp8Name);

// The smallest and largest rows: hidden 128 (one group) and 16384 (the bf16/fp16 limit).
TEST(FusionFp8Gpu, HiddenAtTheLimits) {
  for (uint32_t hidden : {128u, 16384u}) {
    for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
      for (Pattern p : {Pattern::kAllReduceResidualRmsNormFp8PerToken,
                        Pattern::kAllReduceResidualRmsNormFp8PerGroup}) {
        SCOPED_TRACE(::testing::Message() << "hidden " << hidden << " " << PatternName(p));
        SimGroup g(2, 16, hidden, DType::kBF16);
        ASSERT_TRUE(g.ok());
        g.scale_layout_ = static_cast<uint8_t>(GroupScaleLayout::kUe8m0Packed);
        CUDA_OK(g.Init());
        std::mt19937 rng(hidden);
        HostOp op(g, 16);
        op.FillRandom(rng);
        RunAndVerify(g, op, algo, p, 0.02f);
      }
    }
  }
}

// Rows whose values are all zero (amax 0: the floor scale, zero codes), hold an infinity (the
// row's inv_rms is 0: the infinity's normalized value is NaN, code 0x7f, the others 0; amax
// ignores the NaN), or a NaN (every value NaN); and static scales that are subnormal (1 / scale is
// infinite: zeros become NaN and everything else saturates to +-448) or huge. The same bytes on
// every rank, and the CPU's.
TEST(FusionFp8Gpu, ZeroInfiniteAndNanRowsAndExtremeStaticScales) {
  const uint32_t hidden = 4096, tokens = 4;
  for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
    SimGroup g(2, tokens, hidden, DType::kBF16);
    ASSERT_TRUE(g.ok());
    g.scale_layout_ = static_cast<uint8_t>(GroupScaleLayout::kFp32RowMajor);
    CUDA_OK(g.Init());
    std::mt19937 rng(99);
    HostOp op(g, tokens);
    op.FillRandom(rng);
    const size_t h = hidden;
    for (auto& in : op.inputs) {
      for (size_t i = 0; i < h; ++i) StoreFromFloat(op.dtype, in.data(), i, 0.0f);  // row 0
    }
    for (size_t i = 0; i < h; ++i) StoreFromFloat(op.dtype, op.residual.data(), i, 0.0f);
    StoreFromFloat(op.dtype, op.residual.data(), 1 * h + 17,
                   std::numeric_limits<float>::infinity());
    StoreFromFloat(op.dtype, op.residual.data(), 2 * h + 5, std::nanf(""));
    for (Pattern p : {Pattern::kAllReduceResidualRmsNormFp8Static,
                      Pattern::kAllReduceResidualRmsNormFp8PerToken,
                      Pattern::kAllReduceResidualRmsNormFp8PerGroup}) {
      for (float scale : {0.02f, 1e-39f, 1e30f}) {
        if (p != Pattern::kAllReduceResidualRmsNormFp8Static && scale != 0.02f) continue;
        SCOPED_TRACE(::testing::Message() << PatternName(p) << " scale " << scale);
        RunAndVerify(g, op, algo, p, scale);
      }
    }
  }
}

// An FP8 op captured in a CUDA graph and replayed with new inputs each time: every replay's
// codes and scales are the CPU's.
TEST(FusionFp8Gpu, GraphReplayWithChangingInputs) {
  for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
    for (Pattern p : {Pattern::kAllReduceResidualRmsNormFp8Static,
                      Pattern::kAllReduceResidualRmsNormFp8PerToken,
                      Pattern::kAllReduceResidualRmsNormFp8PerGroup}) {
      SCOPED_TRACE(PatternName(p));
      const uint32_t tokens = 24;
      SimGroup g(2, tokens, 4096, DType::kBF16);
      ASSERT_TRUE(g.ok());
      g.scale_layout_ = static_cast<uint8_t>(GroupScaleLayout::kFp32MnMajor);
      CUDA_OK(g.Init());
      std::vector<cudaGraphExec_t> execs(g.world_);
      for (int r = 0; r < g.world_; ++r) {
        cudaGraph_t graph = nullptr;
        CUDA_OK(cudaStreamBeginCapture(g.streams_[r], cudaStreamCaptureModeThreadLocal));
        CUDA_OK(LaunchAllReduceFusion(g.Params(r, algo, p, tokens), g.streams_[r]));
        CUDA_OK(cudaStreamEndCapture(g.streams_[r], &graph));
        CUDA_OK(cudaGraphInstantiate(&execs[r], graph, 0));
        cudaGraphDestroy(graph);
      }
      std::mt19937 rng(5);
      for (int replay = 0; replay < 4; ++replay) {
        HostOp op(g, tokens);
        op.FillRandom(rng);
        ASSERT_TRUE(op.Upload(g));
        const float scale = 0.01f * (replay + 1);
        ASSERT_EQ(cudaMemcpy(g.static_scale_->ptr, &scale, 4, cudaMemcpyHostToDevice), cudaSuccess);
        CpuOpArgs args = op.Args(Pattern::kAllReduceResidualRmsNorm);
        ASSERT_TRUE(ReferenceFusedOp(args).ok());
        const Fp8Want want =
            Quantize(NormalizedValues(op, 1e-5f), op, p, GroupScaleLayout::kFp32MnMajor, scale);
        for (int r = 0; r < g.world_; ++r) CUDA_OK(cudaGraphLaunch(execs[r], g.streams_[r]));
        CUDA_OK(g.SyncAll());
        for (int r = 0; r < g.world_; ++r) {
          ASSERT_EQ(g.ErrorWord(r), 0u);
          const Fp8Got got = DownloadFp8(g, r, op, want.scales.size());
          for (size_t i = 0; i < got.codes.size(); ++i) {
            ASSERT_LE(E4m3Steps(got.codes[i], want.codes[i]), 1) << "replay " << replay << " " << i;
          }
          ExpectScalesClose(got.scales, want.scales, p, GroupScaleLayout::kFp32MnMajor, r,
                            op.hidden);
        }
      }
      for (cudaGraphExec_t e : execs) cudaGraphExecDestroy(e);
    }
  }
}

// The launcher refuses what the kernels cannot run, naming it, before anything is launched.
TEST(FusionFp8Gpu, LauncherRefusesBadFp8Arguments) {
  SimGroup g(2, 8, 4096, DType::kBF16);
  ASSERT_TRUE(g.ok());
  const char* why = nullptr;
  FusionParams p =
      g.Params(0, FusionAlgo::kOneShot, Pattern::kAllReduceResidualRmsNormFp8Static, 8);
  p.quant_out = nullptr;
  EXPECT_EQ(CheckFusionParams(p, &why), cudaErrorInvalidValue);
  EXPECT_NE(std::string(why).find("quant_out or scale is null"), std::string::npos) << why;
  p = g.Params(0, FusionAlgo::kOneShot, Pattern::kAllReduceResidualRmsNormFp8PerToken, 8);
  p.scale = static_cast<char*>(p.scale) + 2;
  EXPECT_EQ(CheckFusionParams(p, &why), cudaErrorInvalidValue);
  EXPECT_NE(std::string(why).find("scale not 4-byte aligned"), std::string::npos) << why;
  p = g.Params(0, FusionAlgo::kOneShot, Pattern::kAllReduceResidualRmsNormFp8PerGroup, 8);
  p.scale_layout = 9;
  EXPECT_EQ(CheckFusionParams(p, &why), cudaErrorInvalidValue);
  EXPECT_NE(std::string(why).find("known scale layout"), std::string::npos) << why;
  p = g.Params(0, FusionAlgo::kOneShot, Pattern::kAllReduceResidualRmsNormFp8PerGroup, 8);
  p.hidden = 4000;
  EXPECT_EQ(CheckFusionParams(p, &why), cudaErrorInvalidValue);
  EXPECT_NE(std::string(why).find("multiple of 128"), std::string::npos) << why;
  EXPECT_FALSE(IsFusionSupported(DType::kFP32, 2, Pattern::kAllReduceResidualRmsNormFp8Static,
                                 FusionAlgo::kOneShot));
  EXPECT_FALSE(IsFusionSupported(DType::kBF16, 2, static_cast<Pattern>(6), FusionAlgo::kOneShot));
}

}  // namespace
}  // namespace arfuse
