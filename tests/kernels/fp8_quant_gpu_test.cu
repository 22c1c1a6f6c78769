// The FP8 epilogue math of kernels/quant/fp8_quant.cuh on a GPU, bit for bit against the CPU
// reference (kernels/quant/fp8_reference.h): the conversion of every one of the 2^32 fp32 bit
// patterns (one code at a time and four per word), and rows at hidden 384, 4096, 8192 and 16384
// held in registers with the fused kernels' row layout, quantized with a static scale, a
// per-token dynamic scale and per-group scales in the three layouts (every output byte, every
// scale's bits, the scale tensors' padding).
// Run on a GPU machine: ctest --test-dir <build> -L gpu -R Fp8QuantGpu --output-on-failure
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "kernels/add_rmsnorm/row_math.cuh"
#include "kernels/quant/fp8_quant.cuh"
#include "kernels/quant/fp8_reference.h"
#include "tests/kernels/fp8_steps.h"

namespace arfuse {
namespace {

namespace dq = ::arfuse::device::fp8;
using ::arfuse::fp8::GroupScaleLayout;
using ::arfuse::fp8::kGroupSize;

#define CUDA_OK(expr)                                                          \
  do {                                                                         \
    const cudaError_t err_ = (expr);                                           \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (false)

struct DeviceBuffer {
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (cudaMalloc(&ptr, n == 0 ? 1 : n) != cudaSuccess) ptr = nullptr;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
  void* ptr = nullptr;
  size_t bytes = 0;
};

// ---- every fp32 bit pattern -------------------------------------------------------------------

// Patterns base .. base + n - 1 (n a multiple of 4): `single[i]` one conversion at a time,
// `quad[i / 4]` four per word through the paired instruction.
__global__ void ConvertEveryPattern(uint32_t base, uint32_t n, uint8_t* single, uint32_t* quad) {
  const uint32_t quads = n / 4u;
  for (uint32_t w = blockIdx.x * blockDim.x + threadIdx.x; w < quads; w += gridDim.x * blockDim.x) {
    float x[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[j] = __uint_as_float(base + 4u * w + static_cast<uint32_t>(j));
      single[4u * w + j] = dq::E4m3FromFloat(x[j]);
    }
    quad[w] = dq::E4m3QuadFromFloats(x[0], x[1], x[2], x[3]);
  }
}

TEST(Fp8QuantGpu, EveryFloatConvertsAsTheReference) {
  constexpr uint32_t kChunk = 1u << 28;
  DeviceBuffer single(kChunk);
  DeviceBuffer quad(kChunk);
  ASSERT_NE(single.ptr, nullptr);
  ASSERT_NE(quad.ptr, nullptr);
  std::vector<uint8_t> got_single(kChunk);
  std::vector<uint8_t> got_quad(kChunk);
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::atomic<uint64_t> mismatches{0};
  std::atomic<uint32_t> first_bad{0};
  for (uint64_t base = 0; base < (1ull << 32); base += kChunk) {
    ConvertEveryPattern<<<4096, 256>>>(static_cast<uint32_t>(base), kChunk, single.as<uint8_t>(),
                                       quad.as<uint32_t>());
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(got_single.data(), single.ptr, kChunk, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(got_quad.data(), quad.ptr, kChunk, cudaMemcpyDeviceToHost));
    std::vector<std::thread> pool;
    for (unsigned w = 0; w < threads; ++w) {
      pool.emplace_back([&, w] {
        uint64_t bad = 0;
        for (uint64_t i = w; i < kChunk; i += threads) {
          const uint32_t bits = static_cast<uint32_t>(base + i);
          float x;
          std::memcpy(&x, &bits, sizeof(x));
          const uint8_t want = fp8::E4m3FromFloat(x);
          if (got_single[i] != want || got_quad[i] != want) {
            if (bad++ == 0) first_bad.store(bits);
          }
        }
        mismatches += bad;
      });
    }
    for (auto& t : pool) t.join();
    ASSERT_EQ(mismatches.load(), 0u) << std::hex << "first mismatch at bits 0x" << first_bad.load();
  }
}

// ---- the reciprocal against the quotient ------------------------------------------------------

// For every x of base .. base + n - 1 whose IEEE quotient by `scale` is at most 2^100 in
// magnitude (the epilogue's are at most about 448; NaN x included), compares the epilogue's code
// E4M3(x * InvScale(scale)) with the quotient's E4M3(__fdiv_rn(x, scale)): counts the x whose
// codes differ, and those more than one E4M3 step apart (or of another sign, NaN-ness).
__global__ void ReciprocalEveryPattern(uint64_t base, uint64_t n, float scale,
                                       unsigned long long* differ, unsigned long long* too_far) {
  const float inv = dq::InvScale(scale);
  unsigned long long d = 0, far = 0;
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float x = __uint_as_float(static_cast<uint32_t>(base + i));
    const float want = __fdiv_rn(x, scale);
    if (fabsf(want) > 0x1p100f || (isinf(x) && !isinf(scale))) continue;
    const uint8_t got_code = dq::E4m3FromFloat(dq::MulRn(x, inv));
    const uint8_t want_code = dq::E4m3FromFloat(want);
    d += got_code != want_code;
    far += !fp8_test::E4m3WithinOneStepSameSign(got_code, want_code);
  }
  if (d != 0) atomicAdd(differ, d);
  if (far != 0) atomicAdd(too_far, far);
}

// The codes the epilogue takes for a per-token or fp32 group scale, over all 2^32 patterns of x,
// for the scales the formulas give at their edges (the floors, an all-ones significand, the
// largest finite), powers of two and random ones; and an infinite scale (finite x give +-0, an
// infinity NaN, as x / inf): at most one E4M3 step from the quotient's, with x's sign. Powers of
// two and an infinite scale give the quotient's code exactly (the reciprocal is exact).
TEST(Fp8QuantGpu, TheReciprocalsCodeIsWithinOneStepOfTheQuotientsForEveryFloat) {
  std::vector<float> scales = {fp8::kMinScalingFactor,
                               fp8::GroupScaleFp32(0.0f),
                               1.0f,
                               0x1.fffffep-1f,
                               0x1.fffffep+0f,
                               fp8::DynamicTokenScale(336.0f),
                               fp8::DynamicTokenScale(3.4028235e38f),
                               fp8::GroupScaleFp32(3.4028235e38f),
                               0x1p-20f,
                               0x1p100f,
                               INFINITY};
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> exponent(-42.0f, 119.0f);
  for (int i = 0; i < 6; ++i) scales.push_back(std::exp2(exponent(rng)));
  DeviceBuffer counts(2 * sizeof(unsigned long long));
  ASSERT_NE(counts.ptr, nullptr);
  unsigned long long differ_in_all = 0;
  for (const float scale : scales) {
    CUDA_OK(cudaMemset(counts.ptr, 0, counts.bytes));
    auto* c = counts.as<unsigned long long>();
    ReciprocalEveryPattern<<<4096, 256>>>(0, 1ull << 32, scale, c, c + 1);
    CUDA_OK(cudaGetLastError());
    unsigned long long got[2] = {1, 1};
    CUDA_OK(cudaMemcpy(got, counts.ptr, sizeof(got), cudaMemcpyDeviceToHost));
    EXPECT_EQ(got[1], 0u) << std::hexfloat << "codes over one step apart for scale " << scale;
    const bool exact_reciprocal = std::isinf(scale) || std::exp2(std::ilogb(scale)) == scale;
    if (exact_reciprocal) EXPECT_EQ(got[0], 0u) << std::hexfloat << "scale " << scale;
    differ_in_all += got[0];
  }
  // Some codes do differ, so the comparison is not vacuous; the count is printed for the record.
  EXPECT_GT(differ_in_all, 0u);
  std::printf("codes differing by one step from the quotient's, over %zu scales x 2^32 x: %llu\n",
              scales.size(), differ_in_all);
}

// ---- rows in the row layout -------------------------------------------------------------------

struct RowArgs {
  const float* x = nullptr;
  uint32_t tokens = 0;
  uint32_t hidden = 0;
  const float* static_scale = nullptr;  // a device pointer, as the static pattern takes it
  uint8_t* q_static = nullptr;
  uint8_t* q_token = nullptr;
  float* token_scales = nullptr;
  uint8_t* q_group = nullptr;  // fp32 group scales
  void* scales_row_major = nullptr;
  void* scales_mn_major = nullptr;
  uint8_t* q_group_ue8m0 = nullptr;
  void* scales_ue8m0 = nullptr;
};

// One row per block at a time, held as the fused kernels hold it: row thread t has vectors
// t, t + T, ... of kElems fp32 values (8 stand for a bf16/fp16 vector, 4 for fp32). Bounded
// for the largest block RowBlockThreads gives (1024 threads at hidden 8192 bf16): without it the
// compiler may use more registers than a 1024-thread block can have, and the launch fails.
template <int kElems, int kVec>
__global__ void __launch_bounds__(1024) QuantizeRowsKernel(RowArgs a) {
  __shared__ float scratch[2][32];
  constexpr int kLanes = dq::kGroupLanes<kGroupSize, kElems>;
  const uint32_t vecs = a.hidden / kElems;
  const uint32_t groups = a.hidden / kGroupSize;
  const uint32_t stride = blockDim.x;
  const uint32_t t0 = threadIdx.x;
  const float inv_static = dq::InvScale(*a.static_scale);
  uint32_t parity = 0;
  for (uint32_t row = blockIdx.x; row < a.tokens; row += gridDim.x) {
    const uint64_t row_at = static_cast<uint64_t>(row) * a.hidden;
    float f[kVec][kElems];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const uint32_t v = t0 + k * stride;
#pragma unroll
      for (int j = 0; j < kElems; ++j) f[k][j] = v < vecs ? a.x[row_at + v * kElems + j] : 0.0f;
    }
    // Static scale.
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const uint32_t v = t0 + k * stride;
      if (v < vecs)
        dq::StoreE4m3Multiplied<kElems>(f[k], inv_static, a.q_static + row_at + v * kElems);
    }
    // Dynamic per-token scale.
    float mine = 0.0f;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (t0 + k * stride < vecs) mine = dq::AbsMaxInto<kElems>(mine, f[k]);
    }
    const float amax = dq::BlockMax(mine, scratch[parity]);
    parity ^= 1u;
    const float token_scale = dq::DynamicTokenScale(amax);
    if (t0 == 0) a.token_scales[row] = token_scale;
    const float token_inv = dq::InvScale(token_scale);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const uint32_t v = t0 + k * stride;
      if (v < vecs)
        dq::StoreE4m3Multiplied<kElems>(f[k], token_inv, a.q_token + row_at + v * kElems);
    }
    // Per-group scales: every lane reduces for every k (the shuffle needs the whole warp).
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const uint32_t v = t0 + k * stride;
      const float group_amax = dq::GroupAbsMax<kGroupSize, kElems>(f[k]);
      if (v < vecs) {
        const uint32_t g = v / kLanes;
        const float scale = dq::GroupScaleFp32(group_amax);
        const uint8_t e = dq::Ue8m0FromAmax(group_amax);
        if (v % kLanes == 0) {
          dq::StoreGroupScale(GroupScaleLayout::kFp32RowMajor, a.scales_row_major, row, g, a.tokens,
                              groups, scale, e);
          dq::StoreGroupScale(GroupScaleLayout::kFp32MnMajor, a.scales_mn_major, row, g, a.tokens,
                              groups, scale, e);
          dq::StoreGroupScale(GroupScaleLayout::kUe8m0Packed, a.scales_ue8m0, row, g, a.tokens,
                              groups, scale, e);
        }
        dq::StoreE4m3Multiplied<kElems>(f[k], dq::InvScale(scale), a.q_group + row_at + v * kElems);
        dq::StoreE4m3Multiplied<kElems>(f[k], dq::Ue8m0Reciprocal(e),
                                        a.q_group_ue8m0 + row_at + v * kElems);
      }
    }
    // Shared by the row's threads, as the epilogue shares it.
    dq::ZeroGroupScalePadding(GroupScaleLayout::kFp32MnMajor, a.scales_mn_major, row, a.tokens,
                              groups, t0, stride);
    dq::ZeroGroupScalePadding(GroupScaleLayout::kUe8m0Packed, a.scales_ue8m0, row, a.tokens, groups,
                              t0, stride);
  }
}

// Values whose conversion sits on an edge: every E4M3 midpoint and its neighbours, the
// saturation boundary, E4M3 and fp32 subnormals, zeros of both signs.
std::vector<float> EdgeValues() {
  std::vector<float> v;
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = fp8::E4m3ToFloat(static_cast<uint8_t>(c));
    const float hi = fp8::E4m3ToFloat(static_cast<uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;
    for (const float x : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      v.push_back(x);
      v.push_back(-x);
    }
  }
  for (const float x :
       {448.0f, 456.0f, 464.0f, std::nextafter(464.0f, 0.0f), std::nextafter(464.0f, INFINITY),
        480.0f, 1e30f, 3.4e38f, std::ldexp(1.0f, -10), std::ldexp(3.0f, -10),
        std::ldexp(15.0f, -10), 1e-45f, 1e-40f, 1.1754942e-38f, 0.0f}) {
    v.push_back(x);
    v.push_back(-x);
  }
  return v;
}

std::vector<float> TestRows(uint32_t tokens, uint32_t hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> magnitude(-20.0f, 20.0f);
  std::vector<float> x(static_cast<size_t>(tokens) * hidden);
  for (uint32_t t = 0; t < tokens; ++t) {
    const float row_scale = std::exp2(magnitude(rng));
    for (uint32_t i = 0; i < hidden; ++i)
      x[static_cast<size_t>(t) * hidden + i] = normal(rng) * row_scale;
  }
  auto row = [&](uint32_t t) { return x.begin() + static_cast<size_t>(t) * hidden; };
  if (tokens > 1) std::fill(row(1), row(1) + hidden, 0.0f);  // all zero
  if (tokens > 2) {
    const std::vector<float> edges = EdgeValues();  // row 2: the edges, cycled
    for (uint32_t i = 0; i < hidden; ++i) row(2)[i] = edges[i % edges.size()];
  }
  if (tokens > 3) std::fill(row(3), row(3) + hidden, -0.0f);  // all -0.0
  if (tokens > 4) {
    row(4)[hidden / 2 + 3] = INFINITY;  // one inf: its group's and its token's scales are inf
    row(4)[7] = std::nanf("");          // one NaN: ignored by the amax, converted to NaN
  }
  if (tokens > 5 && hidden >= 2 * kGroupSize) {
    // Row 5: group 0 all NaN (its amax is the floor's) and group 1 NaN in every other pair of
    // elements: the amax trees meet NaN subtrees as well as NaN leaves.
    std::fill(row(5), row(5) + kGroupSize, std::nanf(""));
    for (uint32_t i = kGroupSize; i < 2 * kGroupSize; i += 4) {
      row(5)[i] = std::nanf("");
      row(5)[i + 1] = -std::nanf("");
    }
  }
  if (tokens > 6 && hidden >= 64) {
    // Row 6: NaN but for element i of the i-th 8 elements (i < 8): a vector's one number sits
    // at every leaf of the amax tree in turn (bf16/fp16 vectors), or vectors of NaNs alone lie
    // between vectors with one number (fp32 vectors of 4).
    for (uint32_t i = 0; i < 64; ++i) row(6)[i] = i % 8 == i / 8 ? 0.5f + i : std::nanf("");
  }
  return x;
}

template <typename T>
std::vector<T> Download(const DeviceBuffer& b, size_t n) {
  std::vector<T> out(n);
  if (n > 0 &&
      cudaMemcpy(out.data(), b.ptr, n * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess) {
    out.clear();
  }
  return out;
}

template <typename T>
size_t FirstDifference(const std::vector<T>& a, const std::vector<T>& b) {
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return i;
  }
  return a.size() == b.size() ? SIZE_MAX : std::min(a.size(), b.size());
}

void CheckRows(int elems, uint32_t tokens, uint32_t hidden, float static_scale) {
  SCOPED_TRACE(testing::Message() << "elems " << elems << " tokens " << tokens << " hidden "
                                  << hidden << " static scale " << static_scale);
  const uint32_t groups = hidden / kGroupSize;
  const size_t n = static_cast<size_t>(tokens) * hidden;
  const std::vector<float> x = TestRows(tokens, hidden, hidden * 31 + tokens + elems);
  const size_t row_major_bytes =
      fp8::GroupScaleBytes(GroupScaleLayout::kFp32RowMajor, tokens, groups);
  const size_t mn_major_bytes =
      fp8::GroupScaleBytes(GroupScaleLayout::kFp32MnMajor, tokens, groups);
  const size_t ue8m0_bytes = fp8::GroupScaleBytes(GroupScaleLayout::kUe8m0Packed, tokens, groups);

  DeviceBuffer d_x(n * 4), d_scale(4), q_static(n), q_token(n), token_scales(tokens * 4),
      q_group(n), s_row(row_major_bytes), s_mn(mn_major_bytes), q_ue8m0(n), s_ue8m0(ue8m0_bytes);
  for (const DeviceBuffer* b : {&d_x, &d_scale, &q_static, &q_token, &token_scales, &q_group,
                                &s_row, &s_mn, &q_ue8m0, &s_ue8m0}) {
    ASSERT_NE(b->ptr, nullptr);
    CUDA_OK(cudaMemset(b->ptr, 0xa5, b->bytes));  // poison: every byte must be written
  }
  CUDA_OK(cudaMemcpy(d_x.ptr, x.data(), n * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_scale.ptr, &static_scale, 4, cudaMemcpyHostToDevice));

  RowArgs a;
  a.x = d_x.as<float>();
  a.tokens = tokens;
  a.hidden = hidden;
  a.static_scale = d_scale.as<float>();
  a.q_static = q_static.as<uint8_t>();
  a.q_token = q_token.as<uint8_t>();
  a.token_scales = token_scales.as<float>();
  a.q_group = q_group.as<uint8_t>();
  a.scales_row_major = s_row.ptr;
  a.scales_mn_major = s_mn.ptr;
  a.q_group_ue8m0 = q_ue8m0.as<uint8_t>();
  a.scales_ue8m0 = s_ue8m0.ptr;
  const uint32_t vecs = hidden / static_cast<uint32_t>(elems);
  ASSERT_LE(device::RowVecsPerThread(vecs), 8);
  const int threads = device::RowBlockThreads(vecs);
  // Fewer blocks than rows, so a block also runs several rows (the scratch's two buffers).
  const unsigned blocks = std::max(1u, tokens / 2);
  if (elems == 8) {
    QuantizeRowsKernel<8, 8><<<blocks, threads>>>(a);
  } else {
    QuantizeRowsKernel<4, 8><<<blocks, threads>>>(a);
  }
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());

  std::vector<uint8_t> want_static(n), want_token(n), want_group(n), want_ue8m0(n);
  std::vector<float> want_token_scales(tokens);
  std::vector<uint8_t> want_row(row_major_bytes), want_mn(mn_major_bytes),
      want_s_ue8m0(ue8m0_bytes);
  ASSERT_TRUE(
      fp8::QuantizeRowsStatic(x.data(), tokens, hidden, static_scale, want_static.data()).ok());
  ASSERT_TRUE(fp8::QuantizeRowsPerToken(x.data(), tokens, hidden, want_token.data(),
                                        want_token_scales.data())
                  .ok());
  ASSERT_TRUE(fp8::QuantizeRowsPerGroup(x.data(), tokens, hidden, kGroupSize,
                                        GroupScaleLayout::kFp32RowMajor, want_group.data(),
                                        want_row.data())
                  .ok());
  std::vector<uint8_t> unused(n);
  ASSERT_TRUE(fp8::QuantizeRowsPerGroup(x.data(), tokens, hidden, kGroupSize,
                                        GroupScaleLayout::kFp32MnMajor, unused.data(),
                                        want_mn.data())
                  .ok());
  ASSERT_TRUE(fp8::QuantizeRowsPerGroup(x.data(), tokens, hidden, kGroupSize,
                                        GroupScaleLayout::kUe8m0Packed, want_ue8m0.data(),
                                        want_s_ue8m0.data())
                  .ok());

  auto expect_same = [](const auto& got, const auto& want, const char* what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    const size_t at = FirstDifference(got, want);
    EXPECT_EQ(at, SIZE_MAX) << what << " differs first at element " << at;
  };
  expect_same(Download<uint8_t>(q_static, n), want_static, "static codes");
  expect_same(Download<uint8_t>(q_token, n), want_token, "per-token codes");
  expect_same(Download<float>(token_scales, tokens), want_token_scales, "per-token scales");
  expect_same(Download<uint8_t>(q_group, n), want_group, "fp32-group codes");
  expect_same(Download<uint8_t>(s_row, row_major_bytes), want_row, "row-major group scales");
  expect_same(Download<uint8_t>(s_mn, mn_major_bytes), want_mn, "MN-major group scales");
  expect_same(Download<uint8_t>(q_ue8m0, n), want_ue8m0, "UE8M0-group codes");
  expect_same(Download<uint8_t>(s_ue8m0, ue8m0_bytes), want_s_ue8m0, "packed UE8M0 scales");
}

TEST(Fp8QuantGpu, Bf16RowLayoutMatchesTheReference) {
  for (const uint32_t hidden : {384u, 4096u, 8192u}) {
    for (const uint32_t tokens : {1u, 5u, 7u, 64u}) {
      for (const float scale : {1.0f, 0.37f, 2.5e-3f}) CheckRows(8, tokens, hidden, scale);
    }
  }
}

TEST(Fp8QuantGpu, Fp32RowLayoutMatchesTheReference) {
  for (const uint32_t hidden : {384u, 4096u, 8192u, 16384u}) {
    for (const uint32_t tokens : {1u, 5u, 7u, 64u}) {
      for (const float scale : {1.0f, 0.37f, 2.5e-3f}) CheckRows(4, tokens, hidden, scale);
    }
  }
}

}  // namespace
}  // namespace arfuse
