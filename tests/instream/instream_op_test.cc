// libarfuse_client's op rules through the C ABI, one test per rule (code and part of the
// message): the dispatch ("fusion unavailable for this op: ..." OUT_OF_RANGE), the tensor rules
// (INVALID_ARGUMENT), the disabled state (UNAVAILABLE), arfuse_supports agreeing with the ops,
// arfuse_check and the error names. A one-rank host workspace runs the ops that pass.
#include <sys/mman.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/instream/arfuse_client.hpp"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/host/reference_op.h"
#include "tests/instream/instream_test_util.h"
#if ARFUSE_TEST_CUDA
#include "client/instream/cuda_plane.h"
#endif

namespace arfuse::instream {
namespace {

using testing::AttachBlob;
using testing::AttachResult;
using testing::Blob;
using ::testing::HasSubstr;
using testing::HostExport;
using testing::RankTensors;
using ::testing::StartsWith;
using testing::TestHostWorkspace;

constexpr int kBF16 = ARFUSE_DTYPE_BF16;
constexpr int kNorm = 2;
constexpr int kSum = 1;

// `p` moved by `n` bytes (misaligned or overlapping tensors).
uint8_t* At(const void* p, int n) {
  return const_cast<uint8_t*>(static_cast<const uint8_t*>(p) + n);
}

// A one-rank bf16 workspace of 16 tokens x 256, attached with entries at hidden 256 and 64.
class OpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Attach([](InStreamExport&) {});
  }
  void TearDown() override { arfuse_detach(ctx_); }

  void Attach(const std::function<void(InStreamExport&)>& edit) {
    arfuse_detach(ctx_);
    ctx_ = nullptr;
    auto ws = TestHostWorkspace::Create(1, 16, 256, DType::kBF16, 1);
    ASSERT_TRUE(ws.ok()) << ws.status();
    ws_ = std::move(*ws);
    InStreamExport e = HostExport(*ws_, 0, {256, 64});
    edit(e);
    AttachResult r = AttachBlob(Blob(e), {ws_->fd.get()});
    ASSERT_EQ(r.rc, ARFUSE_OK) << r.message;
    ctx_ = r.ctx;
  }

  int Norm(RankTensors& t, uint32_t tokens, uint32_t hidden, int dtype = kBF16, float eps = 1e-5f) {
    return arfuse_fused_allreduce_residual_rmsnorm(ctx_, nullptr, t.input(), t.residual_in(),
                                                   t.residual_out(), t.norm_out(), t.gamma(),
                                                   tokens, hidden, dtype, eps);
  }

  // The op and arfuse_supports both answer `code` with a message containing `part`.
  void Unavailable(uint32_t tokens, uint32_t hidden, int dtype, int code, const std::string& part) {
    RankTensors t(DType::kFP32, 0, 0, tokens, hidden);  // large enough for every dtype
    EXPECT_EQ(Norm(t, tokens, hidden, dtype), code) << part;
    EXPECT_THAT(arfuse_last_error(), HasSubstr(part));
    if (code == ARFUSE_OUT_OF_RANGE) {
      EXPECT_THAT(arfuse_last_error(), StartsWith("fusion unavailable for this op: "));
    }
    EXPECT_EQ(arfuse_supports(ctx_, kNorm, tokens, hidden, dtype), code) << part;
    EXPECT_THAT(arfuse_last_error(), HasSubstr(part));
    // Nothing was written.
    EXPECT_EQ(t.bytes(2, t.tensor_bytes), std::vector<uint8_t>(t.tensor_bytes, 0xee));
  }

  // The norm op on 2 tokens x 64 with these tensors.
  int NormOp(const void* input, const void* residual_in, void* residual_out, void* norm_out,
             const void* gamma) {
    return arfuse_fused_allreduce_residual_rmsnorm(ctx_, nullptr, input, residual_in, residual_out,
                                                   norm_out, gamma, 2, 64, kBF16, 1e-5f);
  }

  void Invalid(int rc, const std::string& part) {
    EXPECT_EQ(rc, ARFUSE_INVALID_ARGUMENT) << part;
    EXPECT_THAT(arfuse_last_error(), HasSubstr(part));
  }

  std::unique_ptr<TestHostWorkspace> ws_;
  arfuse_ctx* ctx_ = nullptr;
  // Tensors of 4 tokens x 64 for the rule tests (NormOp runs 2 of them).
  RankTensors t_{DType::kBF16, 0, 0, 4, 64};
  const void* in = t_.input();
  const void* rin = t_.residual_in();
  void* rout = t_.residual_out();
  void* nout = t_.norm_out();
  const void* g = t_.gamma();
};

TEST_F(OpTest, AnOpThatPassesMatchesTheCpuReferenceBitForBit) {
  std::vector<RankTensors> ranks;
  ranks.emplace_back(DType::kBF16, 0, 3, 5, 64);
  RankTensors want(DType::kBF16, 0, 3, 5, 64);
  testing::Reference(Pattern::kAllReduceResidualRmsNorm, DType::kBF16, 5, 64, ranks, want);
  ASSERT_EQ(Norm(ranks[0], 5, 64), ARFUSE_OK) << arfuse_last_error();
  EXPECT_EQ(ranks[0].bytes(2, ranks[0].tensor_bytes), want.bytes(2, want.tensor_bytes));
  EXPECT_EQ(ranks[0].bytes(3, ranks[0].tensor_bytes), want.bytes(3, want.tensor_bytes));
  EXPECT_EQ(arfuse_supports(ctx_, kNorm, 5, 64, kBF16), ARFUSE_OK);
  EXPECT_EQ(arfuse_supports(ctx_, kSum, 16, 256, kBF16), ARFUSE_OK);
}

TEST_F(OpTest, ZeroTokensRunNothing) {
  RankTensors t(DType::kBF16, 0, 0, 1, 64);
  EXPECT_EQ(Norm(t, 0, 64), ARFUSE_OK);
  EXPECT_EQ(t.bytes(2, t.tensor_bytes), std::vector<uint8_t>(t.tensor_bytes, 0xee));
  EXPECT_EQ(arfuse_supports(ctx_, kNorm, 0, 64, kBF16), ARFUSE_OK);
}

TEST_F(OpTest, AnotherDtypeThanTheWorkspacesIsUnavailable) {
  Unavailable(4, 64, ARFUSE_DTYPE_FP16, ARFUSE_OUT_OF_RANGE,
              "dtype fp16 differs from the workspace's bf16");
}

TEST_F(OpTest, AHiddenThatIsNotAMultipleOf8IsUnavailable) {
  Unavailable(4, 12, kBF16, ARFUSE_OUT_OF_RANGE, "hidden 12 is not a positive multiple of 8");
  Unavailable(4, 0, kBF16, ARFUSE_OUT_OF_RANGE, "hidden 0 is not a positive multiple of 8");
}

TEST_F(OpTest, AHiddenAboveTheWorkspacesIsUnavailable) {
  Unavailable(1, 264, kBF16, ARFUSE_OUT_OF_RANGE, "hidden 264 exceeds the workspace's 256");
}

TEST_F(OpTest, AHiddenNotAttachedIsUnavailable) {
  Unavailable(4, 128, kBF16, ARFUSE_OUT_OF_RANGE,
              "hidden 128 was not attached (attached: 256, 64): attach with it");
}

TEST_F(OpTest, TokensBeyondTheWorkspaceAreUnavailable) {
  Unavailable(17, 256, kBF16, ARFUSE_OUT_OF_RANGE,
              "17 tokens x 256 hidden exceeds the workspace's 16 tokens x 256");
  // tokens x hidden counts, not tokens: 64 tokens of hidden 64 fit.
  EXPECT_EQ(arfuse_supports(ctx_, kNorm, 64, 64, kBF16), ARFUSE_OK);
  Unavailable(65, 64, kBF16, ARFUSE_OUT_OF_RANGE, "65 tokens x 64 hidden exceeds");
}

TEST_F(OpTest, APayloadAboveTheFusedRangeIsUnavailable) {
  Attach([](InStreamExport& e) { e.twoshot_max_bytes = e.oneshot_max_bytes = 4096; });
  EXPECT_EQ(arfuse_supports(ctx_, kNorm, 8, 256, kBF16), ARFUSE_OK);  // 4096 bytes
  Unavailable(9, 256, kBF16, ARFUSE_OUT_OF_RANGE,
              "a payload of 4608 bytes is above the fused range (twoshot_max_bytes 4096)");
}

TEST_F(OpTest, AnAlgorithmWithoutItsKernelIsUnavailable) {
  // Above 1024 bytes the dispatch picks two-shot, for which this attach has no entry.
  Attach([](InStreamExport& e) { e.oneshot_max_bytes = 1024; });
  EXPECT_EQ(arfuse_supports(ctx_, kNorm, 2, 256, kBF16), ARFUSE_OK);
  Unavailable(3, 256, kBF16, ARFUSE_OUT_OF_RANGE,
              "the sidecar has no two-shot kernel for allreduce_residual_rmsnorm bf16 at hidden "
              "256");
}

TEST_F(OpTest, UnknownEnumsAreInvalid) {
  RankTensors t(DType::kBF16, 0, 0, 1, 64);
  Invalid(Norm(t, 1, 64, 7), "dtype 7 is not ARFUSE_DTYPE_BF16 (1)");
  Invalid(Norm(t, 1, 64, -1), "dtype -1 is not");
  Invalid(arfuse_supports(ctx_, 6, 1, 64, kBF16),
          "pattern 6 is not 1 (allreduce), 2 (allreduce + residual + RMSNorm) or 3 to 5");
  Invalid(arfuse_supports(ctx_, 0, 1, 64, kBF16), "pattern 0 is not 1 (allreduce)");
  Invalid(arfuse_supports(ctx_, kNorm, 1, 64, 0), "dtype 0 is not");
}

TEST_F(OpTest, NullArguments) {
  Invalid(arfuse_fused_allreduce_residual_rmsnorm(nullptr, nullptr, in, rin, rout, nout, g, 2, 64,
                                                  kBF16, 1e-5f),
          "ctx is NULL");
  Invalid(arfuse_supports(nullptr, kNorm, 1, 64, kBF16), "ctx is NULL");
  Invalid(arfuse_check(nullptr, nullptr), "ctx is NULL");
  Invalid(arfuse_disable(nullptr, "x"), "ctx is NULL");
  Invalid(arfuse_ctx_get_info(nullptr, nullptr), "ctx is NULL");
  Invalid(NormOp(nullptr, rin, rout, nout, g), "input is NULL");
  Invalid(NormOp(in, nullptr, rout, nout, g), "residual_in is NULL");
  Invalid(NormOp(in, rin, rout, nout, nullptr), "gamma is NULL");
  Invalid(NormOp(in, rin, nullptr, nout, g), "residual_out is NULL");
  Invalid(NormOp(in, rin, rout, nullptr, g), "norm_out is NULL");
  Invalid(arfuse_fused_allreduce(ctx_, nullptr, in, nullptr, 2, 64, kBF16), "output is NULL");
  Invalid(arfuse_fused_allreduce(ctx_, nullptr, nullptr, t_.output(), 2, 64, kBF16),
          "input is NULL");
}

TEST_F(OpTest, MisalignedTensors) {
  Invalid(NormOp(At(in, 8), rin, rout, nout, g), "input is not 16-byte aligned");
  Invalid(NormOp(in, At(rin, 2), rout, nout, g), "residual_in is not 16-byte aligned");
  Invalid(NormOp(in, rin, rout, nout, At(g, 4)), "gamma is not 16-byte aligned");
  Invalid(NormOp(in, rin, At(rout, 8), nout, g), "residual_out is not 16-byte aligned");
  Invalid(NormOp(in, rin, rout, At(nout, 8), g), "norm_out is not 16-byte aligned");
  Invalid(arfuse_fused_allreduce(ctx_, nullptr, in, At(t_.output(), 8), 2, 64, kBF16),
          "output is not 16-byte aligned");
}

TEST_F(OpTest, ATensorWrappingTheAddressSpace) {
  RankTensors t(DType::kBF16, 0, 0, 2, 64);
  const void* top = reinterpret_cast<const void*>(std::numeric_limits<uintptr_t>::max() - 15);
  Invalid(arfuse_fused_allreduce(ctx_, nullptr, top, t.output(), 2, 64, kBF16),
          "input's 256 bytes wrap the address space");
}

TEST_F(OpTest, OverlappingTensors) {
  Invalid(NormOp(in, rin, const_cast<void*>(in), nout, g), "residual_out overlaps input");
  Invalid(NormOp(in, rin, At(in, 128), nout, g), "residual_out overlaps input");
  Invalid(NormOp(in, rin, At(rin, 16), nout, g),
          "residual_out overlaps residual_in partially (it may only equal it)");
  Invalid(NormOp(in, rin, rout, nout, rout), "residual_out overlaps gamma");
  Invalid(NormOp(in, rin, rout, const_cast<void*>(in), g), "norm_out overlaps input");
  Invalid(NormOp(in, rin, rout, At(rin, 16), g), "norm_out overlaps residual_in");
  Invalid(NormOp(in, rin, rout, nout, nout), "norm_out overlaps gamma");
  Invalid(NormOp(in, rin, rout, At(rout, 64), g), "norm_out overlaps residual_out");
  Invalid(arfuse_fused_allreduce(ctx_, nullptr, in, At(in, 16), 2, 64, kBF16),
          "output partially overlaps input (it may only equal it)");
  // Tensors that only touch (one ends where the next begins) do not overlap.
  EXPECT_EQ(NormOp(in, rin, At(in, 256), nout, g), ARFUSE_OK) << arfuse_last_error();
}

TEST_F(OpTest, InPlaceIsAllowedAndMatchesTheReference) {
  std::vector<RankTensors> ranks;
  ranks.emplace_back(DType::kBF16, 0, 1, 4, 64);
  RankTensors want(DType::kBF16, 0, 1, 4, 64);
  testing::Reference(Pattern::kAllReduceResidualRmsNorm, DType::kBF16, 4, 64, ranks, want);
  RankTensors& t = ranks[0];
  ASSERT_EQ(arfuse_fused_allreduce_residual_rmsnorm(ctx_, nullptr, t.input(), t.residual_in(),
                                                    t.residual_in(), t.norm_out(), t.gamma(), 4, 64,
                                                    kBF16, 1e-5f),
            ARFUSE_OK)
      << arfuse_last_error();
  EXPECT_EQ(t.bytes(1, t.tensor_bytes), want.bytes(2, want.tensor_bytes));
  EXPECT_EQ(t.bytes(3, t.tensor_bytes), want.bytes(3, want.tensor_bytes));

  RankTensors sum_want(DType::kBF16, 0, 1, 4, 64);
  testing::Reference(Pattern::kAllReduce, DType::kBF16, 4, 64, ranks, sum_want);
  ASSERT_EQ(arfuse_fused_allreduce(ctx_, nullptr, t.input(), t.input(), 4, 64, kBF16), ARFUSE_OK)
      << arfuse_last_error();
  EXPECT_EQ(t.bytes(0, t.tensor_bytes), sum_want.bytes(4, sum_want.tensor_bytes));
}

TEST_F(OpTest, Eps) {
  RankTensors t(DType::kBF16, 0, 0, 2, 64);
  Invalid(Norm(t, 2, 64, kBF16, -1e-6f), "must be finite and non-negative");
  Invalid(Norm(t, 2, 64, kBF16, std::nanf("")), "must be finite and non-negative");
  Invalid(Norm(t, 2, 64, kBF16, std::numeric_limits<float>::infinity()),
          "must be finite and non-negative");
  EXPECT_EQ(Norm(t, 2, 64, kBF16, 0.0f), ARFUSE_OK) << arfuse_last_error();
}

TEST_F(OpTest, ADisabledContextIsUnavailableWithTheReason) {
  ASSERT_EQ(arfuse_disable(ctx_, "drained for a backend switch"), ARFUSE_OK);
  Unavailable(2, 64, kBF16, ARFUSE_UNAVAILABLE,
              "the in-stream plane is disabled: drained for a backend switch");
  RankTensors t(DType::kBF16, 0, 0, 2, 64);
  EXPECT_EQ(arfuse_fused_allreduce(ctx_, nullptr, t.input(), t.output(), 2, 64, kBF16),
            ARFUSE_UNAVAILABLE);
  // Before any other rule: even a bad dtype reads as disabled.
  EXPECT_EQ(Norm(t, 2, 64, 9), ARFUSE_UNAVAILABLE);
  ASSERT_EQ(arfuse_disable(ctx_, nullptr), ARFUSE_OK);
  EXPECT_EQ(Norm(t, 2, 64), ARFUSE_UNAVAILABLE);
  EXPECT_THAT(arfuse_last_error(), HasSubstr("the in-stream plane is disabled: disabled"));
}

TEST_F(OpTest, CheckIsOkWhileHealthy) {
  uint32_t code = 99;
  EXPECT_EQ(arfuse_check(ctx_, &code), ARFUSE_OK);
  EXPECT_EQ(code, 0u);
  EXPECT_EQ(arfuse_check(ctx_, nullptr), ARFUSE_OK);
}

// ---- arfuse_fused_allreduce_residual_rmsnorm_fp8 ----

// The FP8 op's own tensors: codes and a scale tensor big enough for every quant at 4 x 256.
struct Fp8Out {
  std::vector<uint64_t> quant = std::vector<uint64_t>(4 * 256 / 8 + 4, 0);
  std::vector<uint64_t> scale = std::vector<uint64_t>(64, 0);
  uint8_t* q() { return reinterpret_cast<uint8_t*>(quant.data()); }
  uint8_t* s() { return reinterpret_cast<uint8_t*>(scale.data()); }
};

class Fp8OpTest : public OpTest {
 protected:
  // The FP8 op on 2 tokens x `hidden` with these tensors.
  int Fp8(const void* input, const void* residual_in, void* residual_out, void* norm_out,
          void* quant_out, void* scale, const void* gamma, int quant = ARFUSE_QUANT_FP8_PER_TOKEN,
          int layout = 0, uint32_t hidden = 64, int dtype = kBF16) {
    return arfuse_fused_allreduce_residual_rmsnorm_fp8(
        ctx_, nullptr, input, residual_in, residual_out, norm_out, quant_out, scale, gamma, 2,
        hidden, dtype, 1e-5f, quant, layout);
  }
  int Fp8Default(int quant = ARFUSE_QUANT_FP8_PER_TOKEN, int layout = 0, uint32_t hidden = 64,
                 int dtype = kBF16) {
    return Fp8(in, rin, rout, nout, o_.q(), o_.s(), g, quant, layout, hidden, dtype);
  }
  // The op and arfuse_supports both answer OUT_OF_RANGE "fusion unavailable ..." with `part`.
  void Fp8Unavailable(int quant, int layout, uint32_t hidden, int dtype, const std::string& part) {
    RankTensors t(DType::kFP32, 0, 0, 2, hidden);
    Fp8Out o;
    EXPECT_EQ(Fp8(t.input(), t.residual_in(), t.residual_out(), t.norm_out(), o.q(), o.s(),
                  t.gamma(), quant, layout, hidden, dtype),
              ARFUSE_OUT_OF_RANGE)
        << part;
    EXPECT_THAT(arfuse_last_error(), StartsWith("fusion unavailable for this op: "));
    EXPECT_THAT(arfuse_last_error(), HasSubstr(part));
    EXPECT_EQ(arfuse_supports(ctx_, ARFUSE_PATTERN_FP8_STATIC + quant - 1, 2, hidden, dtype),
              ARFUSE_OUT_OF_RANGE)
        << part;
    EXPECT_THAT(arfuse_last_error(), HasSubstr(part));
    EXPECT_EQ(t.bytes(2, t.tensor_bytes), std::vector<uint8_t>(t.tensor_bytes, 0xee));
  }
  Fp8Out o_;
};

TEST_F(Fp8OpTest, EachQuantMatchesTheCpuReferenceWithOrWithoutNormOut) {
  for (int quant : {1, 2, 3}) {
    for (int layout : {0, 1, 2, 3}) {
      if ((quant == ARFUSE_QUANT_FP8_PER_GROUP) != (layout != 0)) continue;
      for (bool with_norm : {true, false}) {
        std::vector<RankTensors> ranks;
        ranks.emplace_back(DType::kBF16, 0, quant, 3, 256);
        RankTensors want(DType::kBF16, 0, quant, 3, 256);
        Fp8Out got, exp;
        const float static_scale = 0.02f;
        std::memcpy(got.s(), &static_scale, 4);
        std::memcpy(exp.s(), &static_scale, 4);
        std::vector<const void*> ins = {ranks[0].input()};
        CpuOpArgs a;
        a.pattern = static_cast<Pattern>(2 + quant);
        a.dtype = DType::kBF16;
        a.world_size = 1;
        a.hidden = 256;
        a.num_tokens = 3;
        a.eps = 1e-5f;
        a.rank_inputs = ins.data();
        a.residual_in = want.residual_in();
        a.residual_out = want.residual_out();
        a.norm_out = want.norm_out();
        a.gamma = want.gamma();
        a.quant_out = exp.q();
        a.scale = exp.s();
        a.scale_layout = static_cast<uint8_t>(layout);
        ASSERT_TRUE(ReferenceFusedOp(a).ok());
        RankTensors& t = ranks[0];
        ASSERT_EQ(arfuse_fused_allreduce_residual_rmsnorm_fp8(
                      ctx_, nullptr, t.input(), t.residual_in(), t.residual_out(),
                      with_norm ? t.norm_out() : nullptr, got.q(), got.s(), t.gamma(), 3, 256,
                      kBF16, 1e-5f, quant, layout),
                  ARFUSE_OK)
            << arfuse_last_error();
        EXPECT_EQ(t.bytes(2, t.tensor_bytes), want.bytes(2, want.tensor_bytes));
        EXPECT_EQ(t.bytes(3, t.tensor_bytes), with_norm
                                                  ? want.bytes(3, want.tensor_bytes)
                                                  : std::vector<uint8_t>(t.tensor_bytes, 0xee));
        EXPECT_EQ(got.quant, exp.quant) << quant << " " << layout;
        EXPECT_EQ(got.scale, exp.scale) << quant << " " << layout;
      }
    }
    EXPECT_EQ(arfuse_supports(ctx_, 2 + quant, 3, 256, kBF16), ARFUSE_OK);
  }
}

TEST_F(Fp8OpTest, BadQuantAndScaleLayoutValuesAreInvalid) {
  Invalid(Fp8Default(0), "quant 0 is not ARFUSE_QUANT_FP8_STATIC (1)");
  Invalid(Fp8Default(4), "quant 4 is not ARFUSE_QUANT_FP8_STATIC (1), ARFUSE_QUANT_FP8_PER_TOKEN");
  Invalid(Fp8Default(ARFUSE_QUANT_FP8_PER_GROUP, 0, 256),
          "scale_layout 0 is not ARFUSE_SCALE_FP32_ROW_MAJOR (1), ARFUSE_SCALE_FP32_MN_MAJOR (2) "
          "or ARFUSE_SCALE_UE8M0_PACKED (3)");
  Invalid(Fp8Default(ARFUSE_QUANT_FP8_PER_GROUP, 4, 256), "scale_layout 4 is not");
  Invalid(Fp8Default(ARFUSE_QUANT_FP8_PER_GROUP, -1, 256), "scale_layout -1 is not");
  Invalid(Fp8Default(ARFUSE_QUANT_FP8_PER_GROUP, 257, 256), "scale_layout 257 is not");
  Invalid(Fp8Default(ARFUSE_QUANT_FP8_STATIC, 1),
          "scale_layout 1 is for ARFUSE_QUANT_FP8_PER_GROUP only: pass 0 with quant 1");
  Invalid(Fp8Default(ARFUSE_QUANT_FP8_PER_TOKEN, 3), "scale_layout 3 is for");
  // The ctx's own checks come first: a NULL ctx, then a disabled one.
  Invalid(arfuse_fused_allreduce_residual_rmsnorm_fp8(nullptr, nullptr, in, rin, rout, nout, o_.q(),
                                                      o_.s(), g, 2, 64, kBF16, 1e-5f, 9, 0),
          "ctx is NULL");
  ASSERT_EQ(arfuse_disable(ctx_, "drained"), ARFUSE_OK);
  EXPECT_EQ(Fp8Default(9), ARFUSE_UNAVAILABLE);
  EXPECT_EQ(Fp8Default(), ARFUSE_UNAVAILABLE);
}

TEST_F(Fp8OpTest, Fp32InputIsUnavailable) {
  for (int quant : {1, 2, 3}) {
    Fp8Unavailable(quant, quant == 3 ? 1 : 0, 256, ARFUSE_DTYPE_FP32,
                   std::string("pattern ") + PatternName(static_cast<Pattern>(2 + quant)) +
                       " takes bf16 or fp16 input, not fp32");
  }
}

TEST_F(Fp8OpTest, APerGroupHiddenThatIsNotAMultipleOf128IsUnavailable) {
  Fp8Unavailable(ARFUSE_QUANT_FP8_PER_GROUP, 1, 64, kBF16,
                 "pattern allreduce_residual_rmsnorm_fp8_per_group: hidden 64 is not a multiple "
                 "of the group size 128");
  // The other FP8 patterns take any hidden the norm takes.
  EXPECT_EQ(arfuse_supports(ctx_, ARFUSE_PATTERN_FP8_STATIC, 2, 64, kBF16), ARFUSE_OK);
  EXPECT_EQ(arfuse_supports(ctx_, ARFUSE_PATTERN_FP8_PER_TOKEN, 2, 64, kBF16), ARFUSE_OK);
  EXPECT_EQ(Fp8Default(ARFUSE_QUANT_FP8_PER_TOKEN, 0, 64), ARFUSE_OK) << arfuse_last_error();
}

TEST_F(Fp8OpTest, NullAndMisalignedFp8Tensors) {
  Invalid(Fp8(in, rin, rout, nout, nullptr, o_.s(), g), "quant_out is NULL");
  Invalid(Fp8(in, rin, rout, nout, o_.q(), nullptr, g), "scale is NULL");
  Invalid(Fp8(in, rin, rout, nout, o_.q(), nullptr, g, ARFUSE_QUANT_FP8_STATIC), "scale is NULL");
  Invalid(Fp8(in, rin, rout, nout, At(o_.q(), 8), o_.s(), g), "quant_out is not 16-byte aligned");
  Invalid(Fp8(in, rin, rout, nout, o_.q(), At(o_.s(), 2), g), "scale is not 4-byte aligned");
  Invalid(Fp8(in, rin, rout, nout, o_.q(), At(o_.s(), 1), g, ARFUSE_QUANT_FP8_STATIC),
          "scale is not 4-byte aligned");
  // A scale 4-byte aligned is enough; norm_out may be NULL.
  EXPECT_EQ(Fp8(in, rin, rout, nout, o_.q(), At(o_.s(), 4), g), ARFUSE_OK) << arfuse_last_error();
  EXPECT_EQ(Fp8(in, rin, rout, nullptr, o_.q(), o_.s(), g), ARFUSE_OK) << arfuse_last_error();
  // The tensors of the norm are checked as for pattern 2.
  Invalid(Fp8(in, rin, nullptr, nout, o_.q(), o_.s(), g), "residual_out is NULL");
  Invalid(Fp8(in, rin, rout, nout, o_.q(), o_.s(), nullptr), "gamma is NULL");
}

TEST_F(Fp8OpTest, OverlappingFp8Tensors) {
  Invalid(Fp8(in, rin, rout, nout, nout, o_.s(), g), "quant_out overlaps norm_out");
  Invalid(Fp8(in, rin, rout, nullptr, rout, o_.s(), g), "quant_out overlaps residual_out");
  Invalid(Fp8(in, rin, rout, nout, o_.q(), At(o_.q(), 16), g), "scale overlaps quant_out");
  Invalid(Fp8(in, rin, rout, nout, const_cast<void*>(in), o_.s(), g), "quant_out overlaps input");
  Invalid(Fp8(in, rin, rout, nout, o_.q(), const_cast<void*>(g), g), "scale overlaps gamma");
  // The static scale is read: an output over it is refused by that output's name.
  Invalid(Fp8(in, rin, rout, nout, o_.q(), rout, g, ARFUSE_QUANT_FP8_STATIC),
          "residual_out overlaps scale");
  Invalid(Fp8(in, rin, rout, nout, o_.s(), o_.s(), g, ARFUSE_QUANT_FP8_STATIC),
          "quant_out overlaps scale");
}

TEST(ErrorNames, EveryKernelCodeHasOne) {
  EXPECT_STREQ(arfuse_error_name(0), "none");
  EXPECT_STREQ(arfuse_error_name(1), "timeout");
  EXPECT_STREQ(arfuse_error_name(2), "host_abort");
  EXPECT_STREQ(arfuse_error_name(3), "peer_abort");
  EXPECT_STREQ(arfuse_error_name(4), "poisoned");
  EXPECT_STREQ(arfuse_error_name(5), "op_mismatch");
  EXPECT_STREQ(arfuse_error_name(kErrorStaleGeneration), "stale_generation");
  EXPECT_STREQ(arfuse_error_name(kErrorLaunchAbi), "launch_abi");
  EXPECT_STREQ(arfuse_error_name(6), "abandoned");
  EXPECT_STREQ(arfuse_error_name(7), "unknown");
}

TEST_F(OpTest, TheCppWrapperMapsCodesToStatuses) {
  auto ws = TestHostWorkspace::Create(1, 16, 256, DType::kBF16, 1);
  ASSERT_TRUE(ws.ok());
  absl::StatusOr<InStreamContext> ctx =
      InStreamContext::Attach(Blob(HostExport(**ws, 0)), {(*ws)->fd.get()});
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  ASSERT_TRUE(ctx->valid());
  absl::StatusOr<arfuse_ctx_info> info = ctx->Info();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->hidden, 256u);
  absl::Status s = ctx->Supports(Pattern::kAllReduce, 17, 256, DType::kBF16);
  EXPECT_TRUE(absl::IsOutOfRange(s)) << s;
  EXPECT_TRUE(IsFusionUnavailable(s));
  EXPECT_THAT(std::string(s.message()), StartsWith("fusion unavailable for this op: "));
  RankTensors t(DType::kBF16, 0, 0, 2, 256);
  s = ctx->FusedAllReduce(nullptr, t.input(), t.input(), 2, 256, DType::kBF16);
  EXPECT_TRUE(s.ok()) << s;
  s = ctx->FusedAllReduceResidualRmsNorm(nullptr, t.input(), t.residual_in(), t.residual_out(),
                                         t.norm_out(), t.gamma(), 2, 256, DType::kBF16, -1.0f);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_TRUE(ctx->Check().ok());
  EXPECT_TRUE(ctx->Disable("lost the sidecar").ok());
  s = ctx->Supports(Pattern::kAllReduce, 1, 256, DType::kBF16);
  EXPECT_TRUE(absl::IsUnavailable(s));
  EXPECT_TRUE(IsFusionUnavailable(s));
  InStreamContext moved = std::move(*ctx);
  EXPECT_FALSE(ctx->valid());
  EXPECT_TRUE(moved.valid());
  moved.Reset();
  EXPECT_FALSE(moved.valid());

  absl::StatusOr<InStreamContext> bad = InStreamContext::Attach("short", {});
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << bad.status();
  EXPECT_THAT(bad.status().message(), HasSubstr("shorter than its header"));
}

#if ARFUSE_TEST_CUDA
// The GPU workspace's own limits, from the layout the blob carries (CudaExport: 512 x 1024 bf16,
// world 2: one-shot slots of 1 MiB, scatter slots of 512 KiB).
TEST(CudaCapacity, TheTwoShotSliceMustFitAScatterSlot) {
  UniqueFd fd(::memfd_create("arfuse-test", MFD_CLOEXEC));
  InStreamExport e = testing::CudaExport(fd.get());
  AttachHeader h;
  std::memcpy(&h, Blob(e).data(), sizeof(h));
  EXPECT_TRUE(lib::CheckCudaCapacity(h, 512, 1024, DType::kBF16).ok());
  plain::Status s = lib::CheckCudaCapacity(h, 513, 1024, DType::kBF16);
  EXPECT_EQ(s.code(), plain::StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("exceed the workspace's one-shot slot of 1048576 bytes"));
  // The scatter slot holds 256 rows of 1024: 511 rows of 1024 / 2 ranks need 256 (fits).
  EXPECT_TRUE(lib::CheckCudaCapacity(h, 511, 1024, DType::kBF16).ok());
  const uint64_t smaller_scatter = 256 * 1024;
  std::memcpy(h.layout + 40, &smaller_scatter, sizeof(smaller_scatter));  // scatter_slot_bytes
  s = lib::CheckCudaCapacity(h, 512, 1024, DType::kBF16);
  EXPECT_EQ(s.code(), plain::StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(),
              HasSubstr("the two-shot slice of 256 tokens x 1024 hidden exceeds the workspace's "
                        "scatter slot of 262144 bytes"));
}
#endif

}  // namespace
}  // namespace arfuse::instream
