// Host-side contract of the fused kernels: the sizing rule and the checks that refuse a launch.
// Needs the CUDA toolkit to build, no GPU to run.
#include <cstdint>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/add_rmsnorm/add_rmsnorm.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/allreduce_fusion/fusion_control.h"
#include "kernels/quant/fp8_format.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;

TEST(WorkspaceLayout, FollowsTheWrittenSizingRule) {
  const WorkspaceLayout l = ComputeWorkspaceLayout(8, 2048, 8192, DType::kBF16);
  const uint64_t row = 8192 * 2;
  EXPECT_EQ(l.control_offset, 0u);
  EXPECT_EQ(l.lamport_offset, (sizeof(FusionControl) + 255) / 256 * 256);
  EXPECT_EQ(l.lamport_slot_bytes, 2048 * row);
  EXPECT_EQ(l.lamport_buffer_bytes, 8 * 2048 * row);
  EXPECT_EQ(l.scatter_offset, l.lamport_offset + 3 * 8 * 2048 * row);
  EXPECT_EQ(l.scatter_slot_bytes, 256 * row);
  EXPECT_EQ(l.gather_offset, l.scatter_offset + 8 * 256 * row);
  EXPECT_EQ(l.total_bytes % (2u << 20), 0u);
  EXPECT_GE(l.total_bytes, l.gather_offset + 2048 * row);
  EXPECT_LT(l.total_bytes, l.gather_offset + 2048 * row + (2u << 20));
  // 768 MiB of Lamport buffers + 32 MiB scatter + 32 MiB gather + control, rounded to 2 MiB.
  EXPECT_EQ(l.total_bytes, 834ull << 20);
  EXPECT_EQ(l.world_size, 8);
  EXPECT_EQ(l.dtype, DType::kBF16);
}

TEST(WorkspaceLayout, SliceRoundsUpForUnevenTokens) {
  const WorkspaceLayout l = ComputeWorkspaceLayout(4, 10, 64, DType::kFP32);
  EXPECT_EQ(l.scatter_slot_bytes, 256u * ((3 * 64 * 4 + 255) / 256));  // ceil(10 / 4) = 3 rows
}

TEST(WorkspaceLayout, RejectsUnsupportedShapes) {
  const char* why = nullptr;
  EXPECT_EQ(ComputeWorkspaceLayout(3, 16, 64, DType::kBF16, &why).total_bytes, 0u);
  EXPECT_THAT(why, HasSubstr("world size"));
  EXPECT_EQ(ComputeWorkspaceLayout(2, 16, 60, DType::kBF16, &why).total_bytes, 0u);
  EXPECT_THAT(why, HasSubstr("multiple of 8"));
  EXPECT_EQ(ComputeWorkspaceLayout(2, 16, MaxFusionHidden(DType::kFP32) + 8, DType::kFP32, &why)
                .total_bytes,
            0u);
  EXPECT_THAT(why, HasSubstr("largest row"));
  EXPECT_EQ(ComputeWorkspaceLayout(2, 0, 64, DType::kBF16, &why).total_bytes, 0u);
  EXPECT_THAT(why, HasSubstr("max_tokens"));
  EXPECT_EQ(ComputeWorkspaceLayout(2, 16, 64, static_cast<DType>(0), &why).total_bytes, 0u);
  EXPECT_THAT(why, HasSubstr("dtype"));
  EXPECT_GE(MaxFusionHidden(DType::kBF16), 16384u);
  EXPECT_GE(MaxFusionHidden(DType::kFP32), 16384u);
}

TEST(FusionSupport, TableCoversTheTestedCombinations) {
  for (DType dt : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (int w : {2, 4, 8, 16}) {
      for (Pattern p : {Pattern::kAllReduce, Pattern::kAllReduceResidualRmsNorm}) {
        EXPECT_TRUE(IsFusionSupported(dt, w, p, FusionAlgo::kOneShot));
        EXPECT_TRUE(IsFusionSupported(dt, w, p, FusionAlgo::kTwoShot));
      }
    }
  }
  EXPECT_FALSE(IsFusionSupported(DType::kBF16, 6, Pattern::kAllReduce, FusionAlgo::kOneShot));
  // The FP8 patterns: bf16 and fp16 input only.
  for (Pattern p :
       {Pattern::kAllReduceResidualRmsNormFp8Static, Pattern::kAllReduceResidualRmsNormFp8PerToken,
        Pattern::kAllReduceResidualRmsNormFp8PerGroup}) {
    for (FusionAlgo a : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
      EXPECT_TRUE(IsFusionSupported(DType::kBF16, 8, p, a));
      EXPECT_TRUE(IsFusionSupported(DType::kFP16, 2, p, a));
      EXPECT_FALSE(IsFusionSupported(DType::kFP32, 2, p, a));
    }
  }
  EXPECT_FALSE(IsFusionSupported(DType::kBF16, 2, static_cast<Pattern>(6), FusionAlgo::kOneShot));
  EXPECT_FALSE(IsFusionSupported(DType::kBF16, 2, static_cast<Pattern>(0), FusionAlgo::kOneShot));
  EXPECT_FALSE(IsFusionSupported(DType::kBF16, 2, Pattern::kAllReduce, static_cast<FusionAlgo>(0)));
}

class CheckParams : public ::testing::Test {
 protected:
  void SetUp() override {
    p_ = FusionParams{};
    p_.layout = ComputeWorkspaceLayout(2, 64, 1024, DType::kBF16);
    ASSERT_GT(p_.layout.total_bytes, 0u);
    // Never dereferenced: the checks only look at the values.
    p_.peer_workspace[0] = reinterpret_cast<void*>(0x10000);
    p_.peer_workspace[1] = reinterpret_cast<void*>(0x20000);
    p_.input = reinterpret_cast<void*>(0x30000);
    p_.residual_in = reinterpret_cast<void*>(0x40000);
    p_.residual_out = reinterpret_cast<void*>(0x50000);
    p_.norm_out = reinterpret_cast<void*>(0x60000);
    p_.gamma = reinterpret_cast<void*>(0x70000);
    p_.spin_timeout_ns = 1000000000ull;
    p_.num_tokens = 64;
    p_.hidden = 1024;
    p_.rank = 1;
    p_.world_size = 2;
    p_.dtype = DType::kBF16;
    p_.pattern = Pattern::kAllReduceResidualRmsNorm;
    p_.algo = FusionAlgo::kOneShot;
  }
  void ExpectRefused(const FusionParams& p, const std::string& fragment) {
    const char* why = nullptr;
    EXPECT_EQ(CheckFusionParams(p, &why), cudaErrorInvalidValue) << fragment;
    ASSERT_NE(why, nullptr) << fragment;
    EXPECT_THAT(why, HasSubstr(fragment));
    // The launcher refuses the same params before touching the device.
    EXPECT_EQ(LaunchAllReduceFusion(p, nullptr), cudaErrorInvalidValue) << fragment;
  }
  FusionParams p_;
};

TEST_F(CheckParams, AcceptsAFittingCall) {
  const char* why = "unset";
  EXPECT_EQ(CheckFusionParams(p_, &why), cudaSuccess);
  EXPECT_EQ(why, nullptr);
  FusionParams p = p_;
  p.num_tokens = 128;  // more tokens at half the hidden fit the same bytes
  p.hidden = 512;
  EXPECT_EQ(CheckFusionParams(p, nullptr), cudaSuccess);
}

TEST_F(CheckParams, RefusesACallLargerThanTheWorkspace) {
  FusionParams p = p_;
  p.num_tokens = 65;
  ExpectRefused(p, "does not fit the workspace");
  p = p_;
  p.algo = FusionAlgo::kTwoShot;
  p.num_tokens = 65;
  ExpectRefused(p, "does not fit the workspace");
}

// The FP8 patterns' own rules: quant_out and scale present and aligned, norm_out optional, the
// per-group pattern's hidden a multiple of 128 and a known scale layout.
TEST_F(CheckParams, Fp8PatternsCheckTheirTensors) {
  FusionParams p = p_;
  p.pattern = Pattern::kAllReduceResidualRmsNormFp8PerGroup;
  p.scale_layout = static_cast<uint8_t>(fp8::GroupScaleLayout::kUe8m0Packed);
  p.quant_out = reinterpret_cast<void*>(0x80008);  // 8-byte aligned is enough
  p.scale = reinterpret_cast<void*>(0x90004);
  p.norm_out = nullptr;
  const char* why = "unset";
  EXPECT_EQ(CheckFusionParams(p, &why), cudaSuccess) << why;
  FusionParams bad = p;
  bad.quant_out = nullptr;
  ExpectRefused(bad, "quant_out or scale is null");
  bad = p;
  bad.quant_out = reinterpret_cast<void*>(0x80004);
  ExpectRefused(bad, "quant_out not 8-byte");
  bad = p;
  bad.scale = reinterpret_cast<void*>(0x90002);
  ExpectRefused(bad, "scale not 4-byte aligned");
  bad = p;
  bad.scale_layout = 0;
  ExpectRefused(bad, "known scale layout");
  bad = p;
  bad.hidden = 1000;
  ExpectRefused(bad, "a multiple of 128");
  bad = p;
  bad.pattern = Pattern::kAllReduceResidualRmsNorm;  // pattern 2 still needs norm_out
  ExpectRefused(bad, "norm_out");
  bad = p;
  bad.pattern = static_cast<Pattern>(6);
  ExpectRefused(bad, "unsupported");
}

TEST_F(CheckParams, RefusesEachBadField) {
  FusionParams p = p_;
  p.world_size = 4;
  ExpectRefused(p, "world size differs");
  p = p_;
  p.world_size = 3;
  ExpectRefused(p, "unsupported");
  p = p_;
  p.dtype = DType::kFP16;
  ExpectRefused(p, "dtype differs");
  p = p_;
  p.rank = 2;
  ExpectRefused(p, "rank is outside");
  p = p_;
  p.hidden = 1020;
  ExpectRefused(p, "hidden");
  p = p_;
  p.layout = WorkspaceLayout{};
  ExpectRefused(p, "layout is empty");
  p = p_;
  p.spin_timeout_ns = 0;
  ExpectRefused(p, "spin_timeout_ns");
  p = p_;
  p.peer_workspace[0] = nullptr;
  ExpectRefused(p, "peer workspace");
  p = p_;
  p.peer_workspace[1] = reinterpret_cast<void*>(0x20008);
  ExpectRefused(p, "peer workspace");
  p = p_;
  p.input = reinterpret_cast<void*>(0x30004);
  ExpectRefused(p, "input");
  p = p_;
  p.gamma = nullptr;
  ExpectRefused(p, "gamma");
  p = p_;
  p.norm_out = reinterpret_cast<void*>(0x60002);
  ExpectRefused(p, "norm_out");
  p = p_;
  p.pattern = Pattern::kAllReduce;
  ExpectRefused(p, "output is null");
}

TEST_F(CheckParams, ZeroTokensNeedNoPointers) {
  FusionParams p = p_;
  p.num_tokens = 0;
  p.input = nullptr;
  EXPECT_EQ(CheckFusionParams(p, nullptr), cudaSuccess);
  EXPECT_EQ(LaunchAllReduceFusion(p, nullptr), cudaSuccess);  // nothing launched
}

TEST(CheckAddRmsNorm, RefusesEachBadField) {
  AddRmsNormParams p{};
  p.input = reinterpret_cast<void*>(0x1000);
  p.residual_in = reinterpret_cast<void*>(0x2000);
  p.residual_out = reinterpret_cast<void*>(0x3000);
  p.norm_out = reinterpret_cast<void*>(0x4000);
  p.gamma = reinterpret_cast<void*>(0x5000);
  p.num_tokens = 4;
  p.hidden = 4096;
  p.dtype = DType::kBF16;
  const char* why = nullptr;
  EXPECT_EQ(CheckAddRmsNormParams(p, &why), cudaSuccess);
  AddRmsNormParams bad = p;
  bad.hidden = 4092;
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("multiple of 8"));
  bad = p;
  bad.hidden = MaxAddRmsNormHidden(DType::kBF16) + 8;
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("largest"));
  bad = p;
  bad.dtype = static_cast<DType>(0);
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("dtype"));
  bad = p;
  bad.gamma = nullptr;
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("null"));
  bad = p;
  bad.residual_out = reinterpret_cast<void*>(0x3002);
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("aligned"));
  EXPECT_EQ(LaunchAddRmsNorm(bad, nullptr), cudaErrorInvalidValue);
}

// The FP8 patterns on the unfused path: quant_out and scale required, norm_out optional, the
// pattern's own rules (contract::CheckPattern) and the alignments of the fused kernels' check.
TEST(CheckAddRmsNorm, Fp8RefusesEachBadField) {
  AddRmsNormParams p{};
  p.input = reinterpret_cast<void*>(0x1000);
  p.residual_in = reinterpret_cast<void*>(0x2000);
  p.residual_out = reinterpret_cast<void*>(0x2000);  // in place
  p.norm_out = nullptr;                              // optional beside quant_out
  p.gamma = reinterpret_cast<void*>(0x5000);
  p.quant_out = reinterpret_cast<void*>(0x6008);  // 8-byte aligned is enough
  p.scale = reinterpret_cast<void*>(0x7004);
  p.num_tokens = 4;
  p.hidden = 4096;
  p.dtype = DType::kBF16;
  const char* why = nullptr;
  for (QuantKind kind : {QuantKind::kStatic, QuantKind::kPerToken, QuantKind::kPerGroup}) {
    for (DType dt : {DType::kBF16, DType::kFP16}) {
      AddRmsNormParams ok = p;
      ok.quant = kind;
      ok.dtype = dt;
      ok.scale_layout = kind == QuantKind::kPerGroup ? 3 : 0;
      EXPECT_EQ(CheckAddRmsNormParams(ok, &why), cudaSuccess) << static_cast<int>(kind);
      EXPECT_EQ(why, nullptr);
      ok.norm_out = reinterpret_cast<void*>(0x4000);
      EXPECT_EQ(CheckAddRmsNormParams(ok, &why), cudaSuccess) << static_cast<int>(kind);
    }
  }
  p.quant = QuantKind::kPerGroup;
  p.scale_layout = 1;
  AddRmsNormParams bad = p;
  bad.quant = static_cast<QuantKind>(4);
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("quant kind is not none, static, per-token or per-group"));
  bad = p;
  bad.dtype = DType::kFP32;
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("bf16 or fp16 input"));
  bad = p;
  bad.hidden = 4096 + 64;  // a multiple of 8, not of the group
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("hidden a multiple of 128"));
  bad.quant = QuantKind::kPerToken;  // no group rule for the other kinds
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaSuccess);
  for (uint8_t layout : {uint8_t{0}, uint8_t{4}}) {
    bad = p;
    bad.scale_layout = layout;
    EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaErrorInvalidValue);
    EXPECT_THAT(why, HasSubstr("known scale layout"));
  }
  bad = p;
  bad.quant_out = nullptr;
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("quant_out or scale is null"));
  bad = p;
  bad.scale = nullptr;
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("quant_out or scale is null"));
  bad = p;
  bad.quant_out = reinterpret_cast<void*>(0x6004);
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("quant_out is not 8-byte"));
  bad = p;
  bad.scale = reinterpret_cast<void*>(0x7002);
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("scale not 4-byte aligned"));
  EXPECT_EQ(LaunchAddRmsNorm(bad, nullptr), cudaErrorInvalidValue);
  bad = p;
  bad.norm_out = reinterpret_cast<void*>(0x4002);  // optional, but aligned when given
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("16-byte aligned"));
  // Without a quant kind norm_out stays required.
  bad = p;
  bad.quant = QuantKind::kNone;
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("a tensor pointer is null"));
  // Zero tokens need no pointers.
  bad = p;
  bad.num_tokens = 0;
  bad.quant_out = nullptr;
  bad.scale = nullptr;
  EXPECT_EQ(CheckAddRmsNormParams(bad, &why), cudaSuccess);
  EXPECT_EQ(LaunchAddRmsNorm(bad, nullptr), cudaSuccess);  // nothing launched
}

TEST(FusionErrors, EveryCodeHasAName) {
  EXPECT_THAT(FusionErrorName(1), HasSubstr("timeout"));
  EXPECT_THAT(FusionErrorName(2), HasSubstr("host"));
  EXPECT_THAT(FusionErrorName(3), HasSubstr("peer"));
  EXPECT_THAT(FusionErrorName(4), HasSubstr("poisoned"));
  EXPECT_THAT(FusionErrorName(5), HasSubstr("ranks disagree on the op"));
  EXPECT_THAT(FusionErrorName(6), HasSubstr("abandoned"));
  EXPECT_THAT(FusionErrorName(99), HasSubstr("unknown"));
}

}  // namespace
}  // namespace arfuse
