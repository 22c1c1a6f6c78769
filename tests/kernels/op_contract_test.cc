// The op contract (kernels/contract/op_contract.h, device_errors.h): a negative case per rule in
// each voice (the status code and part of the message), the workspace fit at its boundary, the
// layout formula, the one filling of FusionParams and the device error table. No CUDA.
#include "kernels/contract/op_contract.h"

#include <iterator>
#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace arfuse::contract {
namespace {

using plain::StatusCode;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr WorkspaceCapacity kBf16{/*max_tokens=*/16, /*hidden=*/256, DType::kBF16};

void ExpectRefused(const plain::Status& s, StatusCode code, const std::string& part) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_THAT(s.message(), HasSubstr(part));
}

TEST(OpContract, AnOpWithinTheCapacityPassesEveryVoice) {
  for (OpVoice v : {OpVoice::kEngine, OpVoice::kRegistry, OpVoice::kClient}) {
    OpRule rule = OpRule::kCapacity;
    EXPECT_TRUE(CheckOp(OpShape{DType::kBF16, 256, 16}, kBf16, v, &rule).ok());
    EXPECT_EQ(rule, OpRule::kNone);
    // Fewer tokens at a narrower row, and zero tokens, fit too.
    EXPECT_TRUE(CheckOp(OpShape{DType::kBF16, 128, 32}, kBf16, v).ok());
    EXPECT_TRUE(CheckOp(OpShape{DType::kBF16, 256, 0}, kBf16, v).ok());
  }
}

// The FP8 patterns' rules come first (CheckPattern): INVALID_ARGUMENT for the engine and the
// registry, OUT_OF_RANGE "fusion unavailable" for the client, naming the pattern.
TEST(OpContract, PatternRule) {
  const Pattern group = Pattern::kAllReduceResidualRmsNormFp8PerGroup;
  const uint8_t ue8m0 = static_cast<uint8_t>(fp8::GroupScaleLayout::kUe8m0Packed);
  for (OpVoice v : {OpVoice::kEngine, OpVoice::kRegistry, OpVoice::kClient}) {
    const StatusCode code =
        v == OpVoice::kClient ? StatusCode::kOutOfRange : StatusCode::kInvalidArgument;
    OpRule rule = OpRule::kNone;
    EXPECT_TRUE(CheckOp(OpShape{DType::kBF16, 256, 16, group, ue8m0}, kBf16, v, &rule).ok());
    EXPECT_TRUE(CheckOp(OpShape{DType::kBF16, 256, 16, Pattern::kAllReduceResidualRmsNormFp8Static},
                        kBf16, v)
                    .ok());
    ExpectRefused(CheckOp(OpShape{DType::kBF16, 256, 16, static_cast<Pattern>(6)}, kBf16, v, &rule),
                  code, "pattern 6 is not 1 to 5");
    EXPECT_EQ(rule, OpRule::kPattern);
    ExpectRefused(
        CheckPattern(OpShape{DType::kFP32, 256, 16, Pattern::kAllReduceResidualRmsNormFp8PerToken},
                     v),
        code, "takes bf16 or fp16 input, not fp32");
    ExpectRefused(CheckPattern(OpShape{DType::kBF16, 200, 16, group, ue8m0}, v), code,
                  "hidden 200 is not a multiple of the group size 128");
    ExpectRefused(CheckPattern(OpShape{DType::kBF16, 256, 16, group, 4}, v), code,
                  "scale layout 4 is not 1");
    if (v == OpVoice::kClient) {
      EXPECT_THAT(CheckPattern(OpShape{DType::kBF16, 256, 16, group, 0}, v).message(),
                  StartsWith(kUnavailablePrefix));
    }
  }
}

TEST(OpContract, HiddenRule) {
  EXPECT_TRUE(IsHiddenAligned(8));
  EXPECT_FALSE(IsHiddenAligned(0));
  EXPECT_FALSE(IsHiddenAligned(12));
  OpRule rule = OpRule::kNone;
  ExpectRefused(CheckOp(OpShape{DType::kBF16, 12, 1}, kBf16, OpVoice::kEngine, &rule),
                StatusCode::kInvalidArgument, "hidden 12 must be a positive multiple of 8");
  EXPECT_EQ(rule, OpRule::kHidden);
  ExpectRefused(CheckOp(OpShape{DType::kBF16, 0, 1}, kBf16, OpVoice::kRegistry),
                StatusCode::kInvalidArgument, "hidden 0 must be a positive multiple of 8");
  const plain::Status client = CheckOp(OpShape{DType::kBF16, 12, 1}, kBf16, OpVoice::kClient);
  ExpectRefused(client, StatusCode::kOutOfRange, "hidden 12 is not a positive multiple of 8");
  EXPECT_THAT(client.message(), StartsWith(kUnavailablePrefix));
  ExpectRefused(CheckHidden(4, OpVoice::kEngine), StatusCode::kInvalidArgument,
                "hidden 4 must be a positive multiple of 8");
  EXPECT_TRUE(CheckHidden(4096, OpVoice::kClient).ok());
}

TEST(OpContract, DTypeRule) {
  OpRule rule = OpRule::kNone;
  ExpectRefused(CheckOp(OpShape{DType::kFP16, 256, 1}, kBf16, OpVoice::kEngine, &rule),
                StatusCode::kInvalidArgument,
                "dtype fp16 does not match the workspace's dtype bf16");
  EXPECT_EQ(rule, OpRule::kDType);
  ExpectRefused(CheckOp(OpShape{DType::kFP16, 256, 1}, kBf16, OpVoice::kRegistry),
                StatusCode::kOutOfRange,
                "fusion unavailable for this op: dtype fp16 is not the workspace's bf16");
  ExpectRefused(CheckOp(OpShape{DType::kFP32, 256, 1}, kBf16, OpVoice::kClient),
                StatusCode::kOutOfRange, "dtype fp32 differs from the workspace's bf16");
  // The dtype rule comes first: a wrong dtype with a bad hidden names the dtype.
  CheckOp(OpShape{DType::kFP16, 12, 1}, kBf16, OpVoice::kEngine, &rule);
  EXPECT_EQ(rule, OpRule::kDType);
}

TEST(OpContract, HiddenAboveTheWorkspaceRule) {
  OpRule rule = OpRule::kNone;
  const plain::Status engine =
      CheckOp(OpShape{DType::kBF16, 264, 1}, kBf16, OpVoice::kEngine, &rule);
  ExpectRefused(engine, StatusCode::kInvalidArgument,
                "hidden 264 exceeds the workspace's max_hidden 256");
  EXPECT_THAT(engine.message(), HasSubstr("does not fit the workspace"));
  EXPECT_EQ(rule, OpRule::kHiddenAboveWorkspace);
  ExpectRefused(CheckOp(OpShape{DType::kBF16, 264, 1}, kBf16, OpVoice::kRegistry),
                StatusCode::kOutOfRange,
                "hidden 264 exceeds the workspace's hidden 256 (--hidden)");
  ExpectRefused(CheckOp(OpShape{DType::kBF16, 264, 1}, kBf16, OpVoice::kClient),
                StatusCode::kOutOfRange, "hidden 264 exceeds the workspace's 256");
}

TEST(OpContract, CapacityRuleAtItsBoundary) {
  // 16 tokens x 256 is the capacity: one more token is not, nor 33 tokens x 128 (4224 elements
  // against 4096), while 32 tokens x 128 is.
  OpRule rule = OpRule::kNone;
  ExpectRefused(CheckOp(OpShape{DType::kBF16, 256, 17}, kBf16, OpVoice::kEngine, &rule),
                StatusCode::kInvalidArgument,
                "op of 17 tokens x 256 hidden does not fit the workspace (16 tokens x 256 hidden)");
  EXPECT_EQ(rule, OpRule::kCapacity);
  ExpectRefused(CheckOp(OpShape{DType::kBF16, 128, 33}, kBf16, OpVoice::kRegistry),
                StatusCode::kOutOfRange,
                "33 tokens x hidden 128 exceed the workspace's 16 tokens x hidden 256");
  ExpectRefused(CheckOp(OpShape{DType::kBF16, 256, 17}, kBf16, OpVoice::kClient),
                StatusCode::kOutOfRange,
                "17 tokens x 256 hidden exceeds the workspace's 16 tokens x 256");
  EXPECT_TRUE(CheckOp(OpShape{DType::kBF16, 128, 32}, kBf16, OpVoice::kClient).ok());
}

TEST(OpContract, ByteSlotCountsBytesAndTakesAnyDType) {
  const WorkspaceCapacity slot{/*max_tokens=*/4, /*hidden=*/64, DType::kBF16, /*byte_slot=*/true};
  EXPECT_EQ(CapacityBytes(slot), 512u);
  // 2 fp32 tokens are the bytes of 4 bf16 tokens: they fit; 3 do not.
  EXPECT_TRUE(CheckOp(OpShape{DType::kFP32, 64, 2}, slot, OpVoice::kEngine).ok());
  ExpectRefused(CheckOp(OpShape{DType::kFP32, 64, 3}, slot, OpVoice::kEngine),
                StatusCode::kInvalidArgument,
                "(768 bytes) exceeds the workspace slot of 512 bytes");
  ExpectRefused(CheckOp(OpShape{DType::kBF16, 64, 5}, slot, OpVoice::kEngine),
                StatusCode::kInvalidArgument, "exceeds the workspace slot of 512 bytes");
}

TEST(OpContract, LayoutFormulaAndItsRefusals) {
  const char* why = nullptr;
  const WorkspaceLayout l = ComputeWorkspaceLayout(8, 2048, 8192, DType::kBF16, &why);
  EXPECT_EQ(why, nullptr);
  EXPECT_EQ(l.lamport_slot_bytes, 2048ull * 8192 * 2);
  EXPECT_EQ(l.lamport_buffer_bytes, 8 * l.lamport_slot_bytes);
  EXPECT_EQ(l.scatter_slot_bytes, 256ull * 8192 * 2);
  EXPECT_EQ(l.lamport_offset, kFusionControlBytes);  // already a multiple of 256
  EXPECT_EQ(l.total_bytes % kWorkspaceTotalAlign, 0u);
  EXPECT_EQ(ComputeWorkspaceLayout(3, 16, 256, DType::kBF16, &why).total_bytes, 0u);
  EXPECT_THAT(why, HasSubstr("world size"));
  EXPECT_EQ(ComputeWorkspaceLayout(2, 16, 12, DType::kBF16, &why).total_bytes, 0u);
  EXPECT_THAT(why, HasSubstr("multiple of 8"));
  EXPECT_EQ(ComputeWorkspaceLayout(2, 16, MaxFusionHidden(DType::kFP32) + 8, DType::kFP32, &why)
                .total_bytes,
            0u);
  EXPECT_THAT(why, HasSubstr("largest row"));
  EXPECT_EQ(ComputeWorkspaceLayout(2, 0, 256, DType::kBF16, &why).total_bytes, 0u);
  EXPECT_THAT(why, HasSubstr("max_tokens is zero"));
  EXPECT_TRUE(IsFusionHidden(MaxFusionHidden(DType::kBF16), DType::kBF16));
  EXPECT_FALSE(IsFusionHidden(MaxFusionHidden(DType::kBF16) + 8, DType::kBF16));
}

TEST(OpContract, FitsAtTheBoundary) {
  // 3 tokens on 2 ranks: the two-shot slice is 2 rows, the scatter slot is rounded to 256 bytes.
  const WorkspaceLayout l = ComputeWorkspaceLayout(2, 16, 256, DType::kBF16);
  ASSERT_NE(l.total_bytes, 0u);
  const uint32_t max = MaxTokensThatFit(l, 256);
  EXPECT_EQ(max, 16u);
  EXPECT_TRUE(Fits(l, OpShape{DType::kBF16, 256, max}));
  EXPECT_FALSE(Fits(l, OpShape{DType::kBF16, 256, max + 1}));
  EXPECT_TRUE(CheckFits(l, OpShape{DType::kBF16, 256, max}).ok());
  const plain::Status over = CheckFits(l, OpShape{DType::kBF16, 256, max + 1});
  ExpectRefused(over, StatusCode::kOutOfRange,
                "exceed the workspace's one-shot slot of 8192 bytes");
  EXPECT_THAT(over.message(), StartsWith(kUnavailablePrefix));
  // A narrower row fits more tokens; the boundary moves with it.
  const uint32_t narrow = MaxTokensThatFit(l, 128);
  EXPECT_EQ(narrow, 32u);
  EXPECT_TRUE(Fits(l, OpShape{DType::kBF16, 128, narrow}));
  EXPECT_FALSE(Fits(l, OpShape{DType::kBF16, 128, narrow + 1}));
  // The two-shot slice alone: a layout whose scatter slot is smaller than the one-shot slot's
  // share (17 tokens on 16 ranks: slices of 2 rows, a scatter slot of 1 row rounded to 256).
  WorkspaceLayout odd = ComputeWorkspaceLayout(16, 16, 128, DType::kBF16);
  ASSERT_NE(odd.total_bytes, 0u);
  odd.lamport_slot_bytes *= 2;  // room for 32 tokens in the one-shot slot
  EXPECT_TRUE(Fits(odd, OpShape{DType::kBF16, 128, 16}));
  EXPECT_FALSE(Fits(odd, OpShape{DType::kBF16, 128, 17}));
  ExpectRefused(CheckFits(odd, OpShape{DType::kBF16, 128, 17}), StatusCode::kOutOfRange,
                "the two-shot slice of 2 tokens x 128 hidden exceeds the workspace's scatter slot");
  EXPECT_EQ(MaxTokensThatFit(odd, 128), 16u);
  EXPECT_FALSE(Fits(WorkspaceLayout{}, OpShape{DType::kBF16, 128, 1}));
  EXPECT_EQ(MaxTokensThatFit(WorkspaceLayout{}, 128), 0u);
}

TEST(OpContract, MakeFusionParamsFillsEveryField) {
  int a = 0, b = 0, in = 0, out = 0;
  uint32_t abort_word = 0, error_word = 0;
  void* peers[2] = {&a, &b};
  FusionLaunchSite site;
  site.peer_workspace = peers;
  site.rank = 1;
  site.world_size = 2;
  site.layout = ComputeWorkspaceLayout(2, 16, 256, DType::kFP16);
  site.spin_timeout_ns = 123;
  site.sm_budget = 7;
  site.host_abort = &abort_word;
  site.host_error = &error_word;
  FusedOpArgs op;
  op.pattern = Pattern::kAllReduce;
  op.dtype = DType::kFP16;
  op.hidden = 256;
  op.num_tokens = 3;
  op.eps = 0.5f;
  op.input = &in;
  op.output = &out;
  const FusionParams p = MakeFusionParams(op, FusionAlgo::kTwoShot, site);
  EXPECT_EQ(p.peer_workspace[0], &a);
  EXPECT_EQ(p.peer_workspace[1], &b);
  EXPECT_EQ(p.peer_workspace[2], nullptr);
  EXPECT_EQ(p.input, &in);
  EXPECT_EQ(p.output, &out);
  EXPECT_EQ(p.host_abort, &abort_word);
  EXPECT_EQ(p.host_error, &error_word);
  EXPECT_EQ(p.spin_timeout_ns, 123u);
  EXPECT_EQ(p.layout.total_bytes, site.layout.total_bytes);
  EXPECT_EQ(p.num_tokens, 3u);
  EXPECT_EQ(p.hidden, 256u);
  EXPECT_EQ(p.eps, 0.5f);
  EXPECT_EQ(p.rank, 1);
  EXPECT_EQ(p.world_size, 2);
  EXPECT_EQ(p.sm_budget, 7u);
  EXPECT_EQ(p.dtype, DType::kFP16);
  EXPECT_EQ(p.pattern, Pattern::kAllReduce);
  EXPECT_EQ(p.algo, FusionAlgo::kTwoShot);
}

TEST(DeviceErrors, OneTableNamesEveryCode) {
  std::set<std::string> names, texts;
  for (const DeviceErrorInfo& e : kDeviceErrors) {
    names.insert(e.name);
    texts.insert(e.text);
    EXPECT_EQ(FindDeviceError(static_cast<uint32_t>(e.code)), &e);
  }
  EXPECT_EQ(names.size(), std::size(kDeviceErrors));
  EXPECT_EQ(texts.size(), std::size(kDeviceErrors));
  EXPECT_STREQ(DeviceErrorName(1), "timeout");
  EXPECT_STREQ(DeviceErrorName(5), "op_mismatch");
  EXPECT_STREQ(DeviceErrorName(16), "stale_generation");
  EXPECT_STREQ(DeviceErrorName(17), "launch_abi");
  EXPECT_STREQ(DeviceErrorName(7), "unknown");
  EXPECT_EQ(FindDeviceError(0x101), nullptr);
}

}  // namespace
}  // namespace arfuse::contract
