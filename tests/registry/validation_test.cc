// Every validation rule of server/registry/validation.h (docs/api.md) with a negative case
// asserting code and message.
#include "server/registry/validation.h"

#include <cmath>
#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

RegistryLimits Limits() { return RegistryLimits{}; }

RegionSpec CudaSpec(size_t handle_len = 64, int32_t device = 0) {
  RegionSpec s;
  s.name = "r";
  s.byte_size = 4096;
  s.kind = MemoryKind::kCudaIpc;
  s.cuda_handle.assign(handle_len, '\x5a');
  s.device_id = device;
  return s;
}

OpRequest NormOp() {
  OpRequest op;
  op.pattern = 2;
  op.dtype = 1;
  op.hidden = 64;
  op.max_tokens = 4;
  op.input = {true, 1, 1, 0};
  op.residual_in = {true, 1, 1, 512};
  op.residual_out = {true, 1, 1, 512};
  op.norm_out = {true, 1, 1, 1024};
  op.gamma = {true, 1, 1, 1536};
  return op;
}

TEST(RegionSpecValidation, AcceptsAValidCudaHandle) {
  EXPECT_TRUE(ValidateRegionSpec(CudaSpec(), MemoryKind::kCudaIpc, 0, Limits()).ok());
}

TEST(RegionSpecValidation, RefusesHandleOfWrongLength) {
  for (size_t len : {0, 1, 63, 65, 128}) {
    absl::Status s = ValidateRegionSpec(CudaSpec(len), MemoryKind::kCudaIpc, 0, Limits());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << len;
    EXPECT_THAT(s.message(), HasSubstr("exactly 64 bytes")) << len;
  }
}

TEST(RegionSpecValidation, RefusesBytesThatAreNotAHandle) {
  RegionSpec spec = CudaSpec();
  spec.cuda_handle.assign(64, '\0');
  absl::Status s = ValidateRegionSpec(spec, MemoryKind::kCudaIpc, 0, Limits());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("not a cudaIpcGetMemHandle result"));
}

TEST(RegionSpecValidation, RefusesAnotherDevice) {
  absl::Status s = ValidateRegionSpec(CudaSpec(64, 3), MemoryKind::kCudaIpc, 1, Limits());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("device_id 3 is not this sidecar's device 1"));
}

TEST(RegionSpecValidation, ErrorsNeverEchoTheHandleBytes) {
  RegionSpec spec = CudaSpec(63);
  spec.cuda_handle.assign(63, 'Q');
  absl::Status s = ValidateRegionSpec(spec, MemoryKind::kCudaIpc, 0, Limits());
  EXPECT_THAT(s.message(), Not(HasSubstr("QQQQ")));
}

TEST(RegionSpecValidation, RefusesMemoryOfTheOtherKind) {
  absl::Status s = ValidateRegionSpec(CudaSpec(), MemoryKind::kHostShm, 0, Limits());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("serves host_shm regions, not cuda_ipc"));
}

TEST(RegionSpecValidation, RefusesMissingMemory) {
  RegionSpec spec = CudaSpec();
  spec.kind.reset();
  absl::Status s = ValidateRegionSpec(spec, MemoryKind::kCudaIpc, 0, Limits());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("set cuda_ipc, host_fd or host_shm"));
}

// host_fd whose ticket the service did not redeem (a caller of the registry that skipped it).
TEST(RegionSpecValidation, RefusesAHostFdWithoutItsDescriptor) {
  RegionSpec spec;
  spec.name = "r";
  spec.byte_size = 64;
  spec.kind = MemoryKind::kHostShm;
  spec.host_by_fd = true;
  spec.fd_ticket = "0123456789abcdef0123456789abcdef";
  absl::Status s = ValidateRegionSpec(spec, MemoryKind::kHostShm, 0, Limits());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("host_fd: the fd ticket was not redeemed"));
  EXPECT_THAT(std::string(s.message()), Not(HasSubstr(spec.fd_ticket)));
}

TEST(RegionSpecValidation, RefusesZeroByteSize) {
  RegionSpec spec = CudaSpec();
  spec.byte_size = 0;
  absl::Status s = ValidateRegionSpec(spec, MemoryKind::kCudaIpc, 0, Limits());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("byte_size must be > 0"));
}

TEST(RegionSpecValidation, RefusesBadNames) {
  RegionSpec spec = CudaSpec();
  spec.name = "";
  EXPECT_THAT(ValidateRegionSpec(spec, MemoryKind::kCudaIpc, 0, Limits()).message(),
              HasSubstr("region name is empty"));
  spec.name = std::string(129, 'a');
  absl::Status s = ValidateRegionSpec(spec, MemoryKind::kCudaIpc, 0, Limits());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("129 bytes; the limit is 128"));
  spec.name = "a\nb";
  s = ValidateRegionSpec(spec, MemoryKind::kCudaIpc, 0, Limits());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("printable ASCII"));
}

TEST(RegionSpecValidation, EmptyNameIsInvalidArgument) {
  RegionSpec spec = CudaSpec();
  spec.name = "";
  absl::Status s = ValidateRegionSpec(spec, MemoryKind::kCudaIpc, 0, Limits());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("region name is empty"));
}

TEST(ShmNameValidation, AcceptsPlainNames) {
  EXPECT_TRUE(ValidateShmName("/arfuse-rank0.in_1").ok());
}

TEST(ShmNameValidation, RefusesPathsAndOddNames) {
  for (const char* bad : {"", "/", "arfuse", "/a/b", "/../etc/passwd", "/a b", "/..", "/x\x01"}) {
    absl::Status s = ValidateShmName(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.message(), HasSubstr("shm_name")) << bad;
  }
  absl::Status s = ValidateShmName("/" + std::string(251, 'a'));
  EXPECT_THAT(s.message(), HasSubstr("longer than 251"));
}

TEST(ShmNameValidation, EachRefusalNamesItsRule) {
  struct Case {
    std::string name;
    const char* text;
  } cases[] = {{"arfuse", "must start with \"/\""},
               {"/", "must start with \"/\""},
               {"/" + std::string(251, 'a'), "host_shm.shm_name is longer than 251 bytes"},
               {"/a/b", "may only contain [A-Za-z0-9._-] after the leading \"/\""},
               {"/a b", "may only contain [A-Za-z0-9._-]"},
               {"/.", "host_shm.shm_name is not an object name"},
               {"/..", "host_shm.shm_name is not an object name"}};
  for (const Case& c : cases) {
    absl::Status s = ValidateShmName(c.name);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(s.message(), HasSubstr(c.text)) << c.name;
  }
  // 251 bytes in all is the longest name taken.
  EXPECT_TRUE(ValidateShmName("/" + std::string(250, 'a')).ok());
}

TEST(RegionSize, RefusesMoreThanTheRealAllocation) {
  EXPECT_TRUE(CheckRegionSize(4096, 4096).ok());
  absl::Status s = CheckRegionSize(4097, 4096);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("byte_size 4097 exceeds the exported allocation of 4096"));
}

TEST(TensorRange, AcceptsExactFit) { EXPECT_TRUE(CheckTensorRange("input", 16, 4080, 4096).ok()); }

TEST(TensorRange, RefusesOverflowOf64Bits) {
  uint64_t offset = std::numeric_limits<uint64_t>::max() - 31;  // 2^64 - 32, 16-aligned
  absl::Status s = CheckTensorRange("input", offset, 64, 4096);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("input: offset 18446744073709551584 + size 64 overflows"));
}

TEST(TensorRange, RefusesPastTheRegion) {
  absl::Status s = CheckTensorRange("norm_out", 4080, 32, 4096);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("norm_out: bytes [4080, 4112) end past the region's 4096"));
}

TEST(TensorRange, RefusesMisalignedOffset) {
  absl::Status s = CheckTensorRange("gamma", 8, 16, 4096);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("gamma: offset 8 is not a multiple of 16"));
}

TEST(TensorBytes, MultipliesShapeByDtype) {
  EXPECT_EQ(*TensorBytes(DType::kBF16, 3, 64), 384u);
  EXPECT_EQ(*TensorBytes(DType::kFP32, 3, 64), 768u);
}

TEST(TensorBytes, RefusesOverflow) {
  auto r = TensorBytes(DType::kFP32, uint64_t{1} << 40, uint64_t{1} << 23);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("overflows 64 bits"));
}

TEST(OpShapeValidation, AcceptsTheNormPattern) {
  auto r = ValidateOpShape(NormOp(), Limits());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->pattern, Pattern::kAllReduceResidualRmsNorm);
  EXPECT_EQ(r->dtype, DType::kBF16);
  EXPECT_FLOAT_EQ(r->eps, 1e-6f);
}

// The FP8 patterns: residual_in, residual_out, gamma, quant_out and scale needed, norm_out
// optional; bf16 or fp16 input; per group hidden % 128 and a layout 1-3.
OpRequest Fp8Op(int32_t pattern, int32_t layout = 0) {
  OpRequest op = NormOp();
  op.pattern = pattern;
  op.hidden = 256;
  op.norm_out = {};
  op.quant_out = {true, 1, 1, 4096};
  op.scale = {true, 1, 1, 8192};
  op.scale_layout = layout;
  return op;
}

TEST(OpShapeValidation, AcceptsTheFp8PatternsWithOrWithoutNormOut) {
  for (int32_t p : {3, 4}) {
    auto r = ValidateOpShape(Fp8Op(p), Limits());
    ASSERT_TRUE(r.ok()) << p << ": " << r.status();
    EXPECT_EQ(r->scale_layout, 0);
  }
  for (int32_t layout : {1, 2, 3}) {
    OpRequest op = Fp8Op(5, layout);
    op.norm_out = {true, 1, 1, 2048};
    auto r = ValidateOpShape(op, Limits());
    ASSERT_TRUE(r.ok()) << layout << ": " << r.status();
    EXPECT_EQ(r->pattern, Pattern::kAllReduceResidualRmsNormFp8PerGroup);
    EXPECT_EQ(r->scale_layout, layout);
  }
  // Only the per-group pattern keeps a layout.
  auto r = ValidateOpShape(Fp8Op(3, 2), Limits());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->scale_layout, 0);
  EXPECT_EQ(OptionalRolesFor(Pattern::kAllReduceResidualRmsNormFp8Static),
            std::vector<TensorRole>{TensorRole::kNormOut});
  EXPECT_TRUE(OptionalRolesFor(Pattern::kAllReduceResidualRmsNorm).empty());
}

TEST(OpShapeValidation, RefusesFp8OpsWithoutQuantOutOrScale) {
  OpRequest no_quant = Fp8Op(3);
  no_quant.quant_out = {};
  auto r = ValidateOpShape(no_quant, Limits());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("needs quant_out, which is missing"));
  OpRequest no_scale = Fp8Op(4);
  no_scale.scale = {};
  r = ValidateOpShape(no_scale, Limits());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("needs scale, which is missing"));
}

TEST(OpShapeValidation, RefusesFp8OpsBreakingThePatternsRules) {
  OpRequest fp32 = Fp8Op(3);
  fp32.dtype = 3;
  auto r = ValidateOpShape(fp32, Limits());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("takes bf16 or fp16 input, not fp32"));
  OpRequest off_group = Fp8Op(5, 1);
  off_group.hidden = 192;
  r = ValidateOpShape(off_group, Limits());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("not a multiple of the group size 128"));
  for (int32_t layout : {0, 4, 255}) {
    r = ValidateOpShape(Fp8Op(5, layout), Limits());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << layout;
    EXPECT_THAT(r.status().message(), HasSubstr("scale layout")) << layout;
  }
  for (int32_t layout : {-1, 256, 1 << 20}) {
    r = ValidateOpShape(Fp8Op(5, layout), Limits());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << layout;
    EXPECT_THAT(r.status().message(), HasSubstr("scale_layout")) << layout;
  }
}

TEST(OpShapeValidation, Fp8TensorsHaveTheirPatternsSizes) {
  OpShape shape;
  shape.dtype = DType::kBF16;
  shape.hidden = 512;  // 4 groups
  shape.max_tokens = 8;
  shape.pattern = Pattern::kAllReduceResidualRmsNormFp8Static;
  EXPECT_EQ(*RoleBytes(shape, TensorRole::kQuantOut, 5), 5u * 512u);
  EXPECT_EQ(*RoleBytes(shape, TensorRole::kScale, 5), 4u);
  shape.pattern = Pattern::kAllReduceResidualRmsNormFp8PerToken;
  EXPECT_EQ(*RoleBytes(shape, TensorRole::kScale, 5), 20u);
  shape.pattern = Pattern::kAllReduceResidualRmsNormFp8PerGroup;
  shape.scale_layout = 1;  // fp32 [5, 4]
  EXPECT_EQ(*RoleBytes(shape, TensorRole::kScale, 5), 80u);
  shape.scale_layout = 2;  // fp32, 3 columns of align4(5) = 8 tokens, then 5
  EXPECT_EQ(*RoleBytes(shape, TensorRole::kScale, 5), (3u * 8u + 5u) * 4u);
  shape.scale_layout = 3;  // one int32 word of 4 exponents per token
  EXPECT_EQ(*RoleBytes(shape, TensorRole::kScale, 5), 20u);
  shape.pattern = Pattern::kAllReduceResidualRmsNorm;
  auto none = RoleBytes(shape, TensorRole::kScale, 5);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.status().message(), HasSubstr("has no scale"));
}

TEST(OpShapeValidation, AnFp8ScaleOverlapsNothing) {
  std::vector<Placement> p = {{TensorRole::kInput, 1, 0, 512}, {TensorRole::kScale, 1, 256, 4}};
  absl::Status s = CheckNoForbiddenOverlap(Pattern::kAllReduceResidualRmsNormFp8Static, p);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("input and scale overlap"));
  p = {{TensorRole::kQuantOut, 1, 0, 512}, {TensorRole::kResidualOut, 1, 256, 512}};
  s = CheckNoForbiddenOverlap(Pattern::kAllReduceResidualRmsNormFp8PerToken, p);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("quant_out and residual_out overlap"));
}

TEST(OpShapeValidation, RefusesUnknownPatternsFromANewerClient) {
  for (int32_t p : {0, 6, 99, -1}) {
    OpRequest op = NormOp();
    op.pattern = p;
    auto r = ValidateOpShape(op, Limits());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("is not supported (PATTERN_ALLREDUCE=1"));
  }
}

TEST(OpShapeValidation, RefusesDtypesTheBackendLacks) {
  for (int32_t d : {0, 4, 17}) {
    OpRequest op = NormOp();
    op.dtype = d;
    auto r = ValidateOpShape(op, Limits());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(),
                HasSubstr("dtype " + std::to_string(d) + " is not supported"));
  }
}

TEST(OpShapeValidation, RefusesHiddenNotAMultipleOf8) {
  for (uint32_t h : {0u, 4u, 12u, 4097u}) {
    OpRequest op = NormOp();
    op.hidden = h;
    auto r = ValidateOpShape(op, Limits());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("must be a positive multiple of 8"));
  }
  OpRequest op = NormOp();
  op.hidden = (1u << 16) + 8;
  EXPECT_THAT(ValidateOpShape(op, Limits()).status().message(), HasSubstr("exceeds the limit"));
}

TEST(OpShapeValidation, RefusesBadMaxTokens) {
  OpRequest op = NormOp();
  op.max_tokens = 0;
  EXPECT_THAT(ValidateOpShape(op, Limits()).status().message(),
              HasSubstr("max_tokens must be > 0"));
  op.max_tokens = (1u << 20) + 1;
  auto r = ValidateOpShape(op, Limits());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("max_tokens 1048577 exceeds the limit"));
}

TEST(OpShapeValidation, LimitsAndZeroesAreInvalidArgument) {
  OpRequest op = NormOp();
  op.hidden = (1u << 16) + 8;
  auto r = ValidateOpShape(op, Limits());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("hidden 65544 exceeds the limit of 65536"));
  op = NormOp();
  op.max_tokens = 0;
  r = ValidateOpShape(op, Limits());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("max_tokens must be > 0"));
  absl::Status s = CheckNumTokens(0, 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("num_tokens must be > 0"));
}

TEST(OpShapeValidation, RefusesBadEps) {
  for (float eps : {-1.0f, std::nanf(""), std::numeric_limits<float>::infinity()}) {
    OpRequest op = NormOp();
    op.eps = eps;
    auto r = ValidateOpShape(op, Limits());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("eps must be finite"));
  }
}

TEST(OpShapeValidation, RefusesMissingGammaOrResidualForTheNormPattern) {
  struct Case {
    TensorRef OpRequest::*field;
    const char* name;
  } cases[] = {{&OpRequest::gamma, "gamma"},
               {&OpRequest::residual_in, "residual_in"},
               {&OpRequest::residual_out, "residual_out"},
               {&OpRequest::norm_out, "norm_out"},
               {&OpRequest::input, "input"}};
  for (const Case& c : cases) {
    OpRequest op = NormOp();
    (op.*c.field).present = false;
    auto r = ValidateOpShape(op, Limits());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(r.status().message(),
                HasSubstr(std::string("needs ") + c.name + ", which is missing"));
  }
}

TEST(OpShapeValidation, AllReduceNeedsAnOutput) {
  OpRequest op;
  op.pattern = 1;
  op.dtype = 3;
  op.hidden = 8;
  op.max_tokens = 1;
  op.input = {true, 1, 1, 0};
  auto r = ValidateOpShape(op, Limits());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("pattern allreduce needs output"));
  op.output = op.input;
  EXPECT_TRUE(ValidateOpShape(op, Limits()).ok());
}

TEST(NumTokens, RefusesZeroAndAboveThePlan) {
  EXPECT_TRUE(CheckNumTokens(4, 4).ok());
  absl::Status s = CheckNumTokens(5, 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("num_tokens 5 exceeds the plan's max_tokens 4"));
  EXPECT_THAT(CheckNumTokens(0, 4).message(), HasSubstr("num_tokens must be > 0"));
}

TEST(Generation, StaleIsFailedPrecondition) {
  EXPECT_TRUE(CheckGeneration("region 1", 77, 77).ok());
  absl::Status s = CheckGeneration("region 1", 76, 77);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("region 1: stale generation"));
  s = CheckGeneration("plan 2", 0, 77);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("plan 2: generation is missing"));
}

TEST(Generation, LazyNameIsMadeOnlyForAFailure) {
  int named = 0;
  auto name = [&] {
    ++named;
    return std::string("region 3");
  };
  EXPECT_TRUE(CheckGeneration(77, 77, name).ok());
  EXPECT_EQ(named, 0);
  absl::Status s = CheckGeneration(76, 77, name);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("region 3: stale generation"));
  s = CheckGeneration(0, 77, name);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("region 3: generation is missing"));
  EXPECT_EQ(named, 2);
}

TEST(Overlap, AllowsExactInPlaceAliases) {
  std::vector<Placement> p = {{TensorRole::kResidualIn, 1, 0, 128},
                              {TensorRole::kResidualOut, 1, 0, 128},
                              {TensorRole::kNormOut, 1, 128, 128}};
  EXPECT_TRUE(CheckNoForbiddenOverlap(Pattern::kAllReduceResidualRmsNorm, p).ok());
  std::vector<Placement> q = {{TensorRole::kInput, 2, 0, 64}, {TensorRole::kOutput, 2, 0, 64}};
  EXPECT_TRUE(CheckNoForbiddenOverlap(Pattern::kAllReduce, q).ok());
}

TEST(Overlap, RefusesPartialOrForbiddenOverlap) {
  std::vector<Placement> p = {{TensorRole::kResidualOut, 1, 0, 128},
                              {TensorRole::kNormOut, 1, 64, 128}};
  absl::Status s = CheckNoForbiddenOverlap(Pattern::kAllReduceResidualRmsNorm, p);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("residual_out and norm_out overlap"));
  std::vector<Placement> q = {{TensorRole::kResidualIn, 1, 0, 128},
                              {TensorRole::kResidualOut, 1, 16, 128}};
  EXPECT_EQ(CheckNoForbiddenOverlap(Pattern::kAllReduceResidualRmsNorm, q).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<Placement> r = {{TensorRole::kInput, 1, 0, 128}, {TensorRole::kNormOut, 1, 0, 128}};
  EXPECT_THAT(CheckNoForbiddenOverlap(Pattern::kAllReduceResidualRmsNorm, r).message(),
              HasSubstr("input and norm_out overlap"));
}

TEST(Overlap, ReadsMayShareBytesAndRegionsMayDiffer) {
  std::vector<Placement> p = {{TensorRole::kInput, 1, 0, 128},
                              {TensorRole::kResidualIn, 1, 0, 128},
                              {TensorRole::kNormOut, 2, 0, 128}};
  EXPECT_TRUE(CheckNoForbiddenOverlap(Pattern::kAllReduceResidualRmsNorm, p).ok());
}

}  // namespace
}  // namespace arfuse
