// The unfused path's add-RMSNorm kernel with the FP8 patterns on a real GPU: every pattern
// (static, per-token, per-group in its three scale layouts) x dtype (bf16, fp16) x hidden (the
// group, 4096, 8192 and the largest row) x tokens (1 .. 64) x with and without norm_out, with an
// all-zero row (amax 0), against the CPU: the fp32 normalized values recomputed from the CPU
// reference op's residual_out and quantized by kernels/quant's reference. The GPU adds the sum of
// squares in another order, so a code may differ by one E4M3 step and an fp32 scale by that sum's
// relative rounding (hidden x 2^-24); residual_out and the UE8M0 bytes are exact.
// Run: ctest --test-dir <build> -L gpu -R AddRmsNormFp8   (needs one GPU).
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/add_rmsnorm/add_rmsnorm.h"
#include "kernels/host/reference_op.h"
#include "kernels/quant/fp8_format.h"
#include "kernels/quant/fp8_reference.h"
#include "tests/kernels/fp8_steps.h"
#include "tests/kernels/fusion_gpu_util.h"

namespace arfuse {
namespace {

using ::arfuse::fp8::GroupScaleLayout;
using ::arfuse::fusion_test::DeviceBuffer;
using ::arfuse::fusion_test::Download;

using ::arfuse::fp8_test::E4m3Steps;

struct Case {
  DType dtype;
  QuantKind kind;
  GroupScaleLayout layout;  // kPerGroup only
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  static const char* kinds[] = {"none", "static", "per_token", "per_group"};
  std::string name =
      std::string(DTypeName(info.param.dtype)) + "_" + kinds[static_cast<int>(info.param.kind)];
  if (info.param.kind == QuantKind::kPerGroup) {
    name += "_layout" + std::to_string(static_cast<int>(info.param.layout));
  }
  return name;
}

class AddRmsNormFp8Gpu : public ::testing::TestWithParam<Case> {};

// One launch of `tokens` x `hidden` and its check against the CPU.
void RunCase(const Case& c, uint32_t tokens, uint32_t hidden, bool with_norm_out) {
  SCOPED_TRACE(::testing::Message() << "tokens " << tokens << " hidden " << hidden
                                    << (with_norm_out ? " with" : " without") << " norm_out");
  const DType dt = c.dtype;
  const size_t n = static_cast<size_t>(tokens) * hidden;
  const size_t bytes = n * DTypeSize(dt);
  const float eps = 1e-5f;
  const float static_scale = 0.0375f;
  std::mt19937 rng(tokens * 131u + hidden);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint8_t> input(bytes), residual(bytes), gamma(hidden * DTypeSize(dt));
  for (size_t i = 0; i < n; ++i) {
    // Row 1 (when there is one) is all zero: amax 0, the scale floors.
    const bool zero_row = tokens > 1 && i / hidden == 1;
    StoreFromFloat(dt, input.data(), i, zero_row ? 0.0f : (i % 17 == 0 ? -0.0f : dist(rng)));
    StoreFromFloat(dt, residual.data(), i, zero_row ? 0.0f : dist(rng));
  }
  for (size_t i = 0; i < hidden; ++i) StoreFromFloat(dt, gamma.data(), i, 1.0f + dist(rng));

  // The CPU: the unquantized reference op at world size 1, then kernels/quant's reference on
  // the fp32 normalized values (y * inv_rms) * gamma of its residual_out.
  std::vector<uint8_t> want_res(bytes), want_norm(bytes);
  const void* inputs[1] = {input.data()};
  CpuOpArgs a;
  a.dtype = dt;
  a.world_size = 1;
  a.hidden = hidden;
  a.num_tokens = tokens;
  a.eps = eps;
  a.rank_inputs = inputs;
  a.residual_in = residual.data();
  a.residual_out = want_res.data();
  a.norm_out = want_norm.data();
  a.gamma = gamma.data();
  ASSERT_TRUE(ReferenceFusedOp(a).ok());
  std::vector<float> x(n);
  for (uint32_t t = 0; t < tokens; ++t) {
    float ss = 0.0f;
    for (size_t i = 0; i < hidden; ++i) {
      const float y = LoadAsFloat(dt, want_res.data(), t * size_t{hidden} + i);
      ss += y * y;
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(hidden) + eps);
    for (size_t i = 0; i < hidden; ++i) {
      const float y = LoadAsFloat(dt, want_res.data(), t * size_t{hidden} + i);
      x[t * size_t{hidden} + i] = (y * inv) * LoadAsFloat(dt, gamma.data(), i);
    }
  }
  std::vector<uint8_t> want_codes(n), want_scales;
  plain::Status s;
  size_t scale_bytes = 4;
  if (c.kind == QuantKind::kStatic) {
    s = fp8::QuantizeRowsStatic(x.data(), tokens, hidden, static_scale, want_codes.data());
  } else if (c.kind == QuantKind::kPerToken) {
    scale_bytes = tokens * sizeof(float);
    want_scales.assign(scale_bytes, 0);
    s = fp8::QuantizeRowsPerToken(x.data(), tokens, hidden, want_codes.data(),
                                  reinterpret_cast<float*>(want_scales.data()));
  } else {
    scale_bytes = fp8::GroupScaleBytes(c.layout, tokens, hidden / fp8::kGroupSize);
    want_scales.assign(scale_bytes, 0xaa);
    s = fp8::QuantizeRowsPerGroup(x.data(), tokens, hidden, fp8::kGroupSize, c.layout,
                                  want_codes.data(), want_scales.data());
  }
  ASSERT_TRUE(s.ok()) << s.message();

  DeviceBuffer d_in(bytes), d_res(bytes), d_norm(bytes), d_gamma(gamma.size()), d_q(n),
      d_scale(scale_bytes);
  CUDA_OK(cudaMemcpy(d_in.ptr, input.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_res.ptr, residual.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_gamma.ptr, gamma.data(), gamma.size(), cudaMemcpyHostToDevice));
  // Poisoned outputs: a code, a scale or a padding byte the kernel does not write is seen.
  CUDA_OK(cudaMemset(d_q.ptr, 0x5a, n));
  CUDA_OK(cudaMemset(d_norm.ptr, 0x5a, bytes));
  if (c.kind == QuantKind::kStatic) {
    CUDA_OK(cudaMemcpy(d_scale.ptr, &static_scale, 4, cudaMemcpyHostToDevice));
  } else {
    CUDA_OK(cudaMemset(d_scale.ptr, 0x5a, scale_bytes));
  }
  AddRmsNormParams p{};
  p.input = d_in.ptr;
  p.residual_in = d_res.ptr;
  p.residual_out = d_res.ptr;  // in place, as the serving frameworks do
  p.norm_out = with_norm_out ? d_norm.ptr : nullptr;
  p.gamma = d_gamma.ptr;
  p.num_tokens = tokens;
  p.hidden = hidden;
  p.eps = eps;
  p.dtype = dt;
  p.quant = c.kind;
  p.scale_layout = c.kind == QuantKind::kPerGroup ? static_cast<uint8_t>(c.layout) : 0;
  p.quant_out = d_q.ptr;
  p.scale = d_scale.ptr;
  CUDA_OK(LaunchAddRmsNorm(p, nullptr));
  CUDA_OK(cudaDeviceSynchronize());

  ASSERT_TRUE(Download(d_res.ptr, bytes) == want_res) << "residual_out differs from the CPU";
  const std::vector<uint8_t> codes = Download(d_q.ptr, n);
  ASSERT_EQ(codes.size(), n);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_LE(E4m3Steps(codes[i], want_codes[i]), 1)
        << "element " << i << ": code 0x" << std::hex << int{codes[i]} << ", CPU 0x"
        << int{want_codes[i]};
  }
  if (c.kind != QuantKind::kStatic) {
    const std::vector<uint8_t> scales = Download(d_scale.ptr, scale_bytes);
    ASSERT_EQ(scales.size(), want_scales.size());
    if (c.kind == QuantKind::kPerGroup && c.layout == GroupScaleLayout::kUe8m0Packed) {
      ASSERT_TRUE(scales == want_scales) << "UE8M0 scales differ";
    } else {
      for (size_t i = 0; i + 4 <= scales.size(); i += 4) {
        float got, want;
        std::memcpy(&got, scales.data() + i, 4);
        std::memcpy(&want, want_scales.data() + i, 4);
        ASSERT_NEAR(got, want, std::ldexp(std::fabs(want) * hidden, -24)) << "scale byte " << i;
      }
    }
  }
  const std::vector<uint8_t> norm = Download(d_norm.ptr, bytes);
  if (!with_norm_out) {
    ASSERT_TRUE(norm == std::vector<uint8_t>(bytes, 0x5a)) << "norm_out written though null";
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const double got = LoadAsFloat(dt, norm.data(), i);
    const double want = LoadAsFloat(dt, want_norm.data(), i);
    ASSERT_LE(std::fabs(got - want), 0x1p-6 * std::max(std::fabs(want), 1e-3)) << "norm_out " << i;
  }
}

TEST_P(AddRmsNormFp8Gpu, MatchesQuantReferenceOfTheCpuNormalizedValues) {
  const Case c = GetParam();
  const uint32_t max_hidden = MaxAddRmsNormHidden(c.dtype);  // a multiple of the group
  for (uint32_t hidden : {fp8::kGroupSize, 4096u, 8192u, max_hidden}) {
    for (uint32_t tokens : {1u, 2u, 5u, 64u}) {
      for (bool with_norm_out : {true, false}) {
        RunCase(c, tokens, hidden, with_norm_out);
        if (HasFatalFailure()) return;
      }
    }
  }
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    cases.push_back({dt, QuantKind::kStatic, GroupScaleLayout::kFp32RowMajor});
    cases.push_back({dt, QuantKind::kPerToken, GroupScaleLayout::kFp32RowMajor});
    for (GroupScaleLayout l : {GroupScaleLayout::kFp32RowMajor, GroupScaleLayout::kFp32MnMajor,
                               GroupScaleLayout::kUe8m0Packed}) {
      cases.push_back({dt, QuantKind::kPerGroup, l});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(EveryPattern, AddRmsNormFp8Gpu, ::testing::ValuesIn(AllCases()), CaseName);

}  // namespace
}  // namespace arfuse
