// `arfuse-bench epilogue`'s kernels: one block, rows in series, cycles per row of the row's last
// step with each FP8 pattern (bench/fp8_epilogue.h lists the variants). The row layout is the
// fused kernels' (kernels/add_rmsnorm/row_math.cuh, first bucket), so a row's threads and the
// values each holds are theirs; what the one-block timing leaves out is the allreduce before it.
#include <cstdlib>
#include <random>
#include <vector>

#include "bench/fp8_epilogue.h"
#include "kernels/add_rmsnorm/row_math.cuh"
#include "kernels/add_rmsnorm/row_quant.cuh"
#include "kernels/quant/fp8_format.h"
#include "kernels/quant/fp8_quant.cuh"

namespace arfuse::bench {
namespace {

constexpr DType kDT = DType::kBF16;
constexpr int kVec = device::BucketVecs(0);
constexpr int kElems = device::VecTraits<kDT>::kElems;
using device::Raw16;
namespace f8 = device::fp8;

struct EpilogueArgs {
  const char* rows;   // bf16 [rows, hidden]: the pre-norm sums
  const char* gamma;  // bf16 [hidden]
  const float* static_scale;
  uint32_t hidden;
  uint32_t num_rows;
  char* norm_out;   // bf16 [rows, hidden]
  char* quant_out;  // E4M3 [rows, hidden]
  void* scales;     // per-token or per-group scales (sized for the largest)
  long long* cycles;
};

// The variants that leave a step out (kCodesOnly, kPerTokenWarpAmax): the per-token pattern's
// steps with one of them changed.
template <EpilogueVariant kV>
__device__ __forceinline__ void PartialEpilogue(const EpilogueArgs& a, uint32_t row,
                                                const Raw16 (&pre)[kVec], float total,
                                                uint32_t vecs, const Raw16 (&g)[kVec]) {
  const uint32_t t0 = threadIdx.x;
  const uint32_t stride = blockDim.x;
  const float inv_rms =
      __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, static_cast<float>(a.hidden)), 1e-6f)));
  char* const q_row = a.quant_out + static_cast<uint64_t>(row) * a.hidden;
  float x[kVec][kElems];
  float local = 0.0f;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    device::NormalizedVector<kDT, kVec>(pre, g, k, inv_rms, x[k]);
    if (t0 + k * stride < vecs) local = f8::AbsMaxInto<kElems>(local, x[k]);
  }
  float inv_scale = 1.0f;
  if constexpr (kV != EpilogueVariant::kCodesOnly) {
    // kPerTokenWarpAmax: each warp's amax, no block reduction.
    const float scale = f8::DynamicTokenScale(f8::LaneGroupMax<32>(local));
    if (threadIdx.x == 0) static_cast<float*>(a.scales)[row] = scale;
    inv_scale = f8::InvScale(scale);
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const uint32_t v = t0 + k * stride;
    if (v < vecs) f8::StoreE4m3Multiplied<kElems>(x[k], inv_scale, q_row + v * kElems);
  }
}

template <EpilogueVariant kV>
__global__ void __launch_bounds__(device::BucketMaxThreads(0)) EpilogueKernel(EpilogueArgs a) {
  __shared__ float sum_scratch[32];
  __shared__ float amax_scratch[32];
  const uint32_t vecs = a.hidden / kElems;
  const uint32_t t0 = threadIdx.x;
  const uint32_t stride = blockDim.x;
  Raw16 g[kVec];
  device::LoadRowVectors<kVec>(g, a.gamma, t0, stride, vecs);
  const float static_inv_scale = f8::InvScale(*a.static_scale);
  long long cycles = 0;
  for (uint32_t row = 0; row < a.num_rows; ++row) {
    Raw16 pre[kVec];
    device::LoadRowVectors<kVec>(pre, a.rows + static_cast<uint64_t>(row) * a.hidden * 2, t0,
                                 stride, vecs);
    // Wait for the loads before the clock starts: the timed part is the arithmetic, the block
    // reduction and the stores, not this row's loads.
    uint32_t loaded = 0;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (t0 + k * stride < vecs) loaded ^= pre[k].w[0] ^ pre[k].w[1] ^ pre[k].w[2] ^ pre[k].w[3];
    }
    if (loaded == 0x9e3779b9u && a.num_rows == 0u) sum_scratch[0] = 0.0f;  // never true
    __syncthreads();
    const long long start = clock64();
    float mine = 0.0f;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (t0 + k * stride >= vecs) continue;
#pragma unroll
      for (int j = 0; j < kElems; ++j) {
        const float y = device::VecTraits<kDT>::ToFloat(device::GetBits<kDT>(pre[k], j));
        mine = __fadd_rn(mine, __fmul_rn(y, y));
      }
    }
    const float total = device::BlockSum(mine, sum_scratch);
    if constexpr (kV == EpilogueVariant::kUnquantized) {
      device::NormRowStore<kDT, kVec>(pre, total, t0, stride, vecs, a.hidden, 1e-6f, g,
                                      a.norm_out + static_cast<uint64_t>(row) * a.hidden * 2);
    } else if constexpr (kV == EpilogueVariant::kCodesOnly ||
                         kV == EpilogueVariant::kPerTokenWarpAmax) {
      PartialEpilogue<kV>(a, row, pre, total, vecs, g);
    } else {
      const QuantKind kind =
          kV == EpilogueVariant::kStatic ? QuantKind::kStatic
          : (kV == EpilogueVariant::kPerToken || kV == EpilogueVariant::kPerTokenTwice)
              ? QuantKind::kPerToken
              : QuantKind::kPerGroup;
      const auto layout = kV == EpilogueVariant::kPerGroupUe8m0
                              ? fp8::GroupScaleLayout::kUe8m0Packed
                              : fp8::GroupScaleLayout::kFp32RowMajor;
      const device::QuantRowOp q{
          kind, static_cast<uint8_t>(layout), a.num_rows, a.hidden, a.quant_out, a.scales};
      constexpr bool kKeep = kV != EpilogueVariant::kPerTokenTwice;
      device::QuantizeRow<kDT, kVec, kKeep>(q, 1e-6f, true, row, pre, total, t0, stride, vecs, g,
                                            amax_scratch, static_inv_scale);
    }
    __syncthreads();
    cycles += clock64() - start;
  }
  if (threadIdx.x == 0) *a.cycles = cycles;
}

template <EpilogueVariant kV>
void Launch(const EpilogueArgs& a, unsigned threads) {
  EpilogueKernel<kV><<<1, threads>>>(a);
}

void LaunchVariant(EpilogueVariant v, const EpilogueArgs& a, unsigned threads) {
  switch (v) {
    case EpilogueVariant::kUnquantized:
      return Launch<EpilogueVariant::kUnquantized>(a, threads);
    case EpilogueVariant::kStatic:
      return Launch<EpilogueVariant::kStatic>(a, threads);
    case EpilogueVariant::kPerToken:
      return Launch<EpilogueVariant::kPerToken>(a, threads);
    case EpilogueVariant::kPerTokenTwice:
      return Launch<EpilogueVariant::kPerTokenTwice>(a, threads);
    case EpilogueVariant::kPerGroupFp32:
      return Launch<EpilogueVariant::kPerGroupFp32>(a, threads);
    case EpilogueVariant::kPerGroupUe8m0:
      return Launch<EpilogueVariant::kPerGroupUe8m0>(a, threads);
    case EpilogueVariant::kCodesOnly:
      return Launch<EpilogueVariant::kCodesOnly>(a, threads);
    case EpilogueVariant::kPerTokenWarpAmax:
      return Launch<EpilogueVariant::kPerTokenWarpAmax>(a, threads);
  }
}

// Device memory of one run, freed on every return.
struct DeviceBuffers {
  std::vector<void*> owned;
  ~DeviceBuffers() {
    for (void* p : owned) cudaFree(p);
  }
  cudaError_t Alloc(size_t bytes, void** out) {
    *out = nullptr;
    if (cudaError_t e = cudaMalloc(out, bytes); e != cudaSuccess) return e;
    owned.push_back(*out);
    return cudaSuccess;
  }
};

}  // namespace

const char* EpilogueVariantName(EpilogueVariant v) {
  switch (v) {
    case EpilogueVariant::kUnquantized:
      return "unquantized";
    case EpilogueVariant::kStatic:
      return "static";
    case EpilogueVariant::kPerToken:
      return "per-token";
    case EpilogueVariant::kPerTokenTwice:
      return "per-token, values twice";
    case EpilogueVariant::kPerGroupFp32:
      return "per-group fp32";
    case EpilogueVariant::kPerGroupUe8m0:
      return "per-group UE8M0";
    case EpilogueVariant::kCodesOnly:
      return "part: codes only";
    case EpilogueVariant::kPerTokenWarpAmax:
      return "part: per-token, warp amax";
  }
  return "?";
}

cudaError_t TimeEpilogue(const EpilogueRun& run, double* cycles_per_row) {
  if (run.hidden == 0 || run.hidden % fp8::kGroupSize != 0 || run.hidden > kMaxEpilogueHidden ||
      run.rows == 0 || run.repeats < 1 || cycles_per_row == nullptr) {
    return cudaErrorInvalidValue;
  }
  const size_t elems = static_cast<size_t>(run.rows) * run.hidden;
  // Values of either sign around 1 (bf16 bits), gamma in [1, 2): a row's amax is its largest.
  std::mt19937 rng(1);
  std::vector<uint16_t> rows(elems);
  std::vector<uint16_t> gamma(run.hidden);
  for (uint16_t& b : rows) b = static_cast<uint16_t>(0x3f80u ^ (rng() & 0x80ffu));
  for (uint16_t& b : gamma) b = static_cast<uint16_t>(0x3f80u | (rng() & 0x007fu));
  const float static_scale = 0.37f;
  DeviceBuffers mem;
  void *d_rows, *d_gamma, *d_norm, *d_quant, *d_scales, *d_static, *d_cycles;
  const size_t scale_bytes = fp8::GroupScaleBytes(fp8::GroupScaleLayout::kFp32RowMajor, run.rows,
                                                  run.hidden / fp8::kGroupSize);
  for (auto [bytes, out] : {std::pair<size_t, void**>{elems * 2, &d_rows},
                            {run.hidden * size_t{2}, &d_gamma},
                            {elems * 2, &d_norm},
                            {elems, &d_quant},
                            {scale_bytes + 4096, &d_scales},
                            {sizeof(float), &d_static},
                            {sizeof(long long), &d_cycles}}) {
    if (cudaError_t e = mem.Alloc(bytes, out); e != cudaSuccess) return e;
  }
  cudaMemcpy(d_rows, rows.data(), elems * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(d_gamma, gamma.data(), run.hidden * size_t{2}, cudaMemcpyHostToDevice);
  if (cudaError_t e = cudaMemcpy(d_static, &static_scale, sizeof(float), cudaMemcpyHostToDevice);
      e != cudaSuccess) {
    return e;
  }
  const EpilogueArgs a{static_cast<const char*>(d_rows),
                       static_cast<const char*>(d_gamma),
                       static_cast<const float*>(d_static),
                       run.hidden,
                       run.rows,
                       static_cast<char*>(d_norm),
                       static_cast<char*>(d_quant),
                       d_scales,
                       static_cast<long long*>(d_cycles)};
  const auto threads = static_cast<unsigned>(device::RowBlockThreads(run.hidden / kElems));
  long long best = -1;
  for (int r = 0; r < run.repeats; ++r) {
    LaunchVariant(run.variant, a, threads);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    long long c = 0;
    if (cudaError_t e = cudaMemcpy(&c, d_cycles, sizeof(c), cudaMemcpyDeviceToHost);
        e != cudaSuccess) {
      return e;
    }
    if (best < 0 || c < best) best = c;
  }
  *cycles_per_row = static_cast<double>(best) / run.rows;
  return cudaSuccess;
}

}  // namespace arfuse::bench
