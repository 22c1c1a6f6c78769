#include <algorithm>

#include "kernels/add_rmsnorm/add_rmsnorm.h"
#include "kernels/add_rmsnorm/row_math.cuh"
#include "kernels/add_rmsnorm/row_quant.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/contract/op_contract.h"
#include "kernels/quant/fp8_quant.cuh"

namespace arfuse {
namespace {

using device::kMaxVecPerThread;
using device::Raw16;

// One block per row, rows grid-strided, with the row layout of row_math.cuh (the fused kernels
// use the same, so both paths agree bit for bit). The input is the allreduced sum in dtype
// (NCCL's output): step 3 of the reference numerics is only the -0.0 -> +0.0 mapping here.
// kQuant (bf16/fp16 only): the FP8 patterns, p.quant says which; the codes and scales come from
// row_quant.cuh, the fused epilogue's own function, and norm_out is written only when given.
template <DType DT, int kBucket, bool kQuant>
__global__ void __launch_bounds__(device::BucketMaxThreads(kBucket))
    AddRmsNormKernel(const AddRmsNormParams p) {
  constexpr int kVec = device::BucketVecs(kBucket);
  __shared__ float scratch[32];
  // fp8::BlockMax's buffer: row r's is written again only at row r + 1's BlockMax, after that
  // row's BlockSum barriers, which every reader of row r's amax passed.
  __shared__ float amax_scratch[32];
  const uint32_t vecs_per_row = p.hidden / device::VecTraits<DT>::kElems;
  const size_t row_bytes = static_cast<size_t>(p.hidden) * DTypeSize(DT);
  float static_inv_scale = 0.0f;
  if constexpr (kQuant) {
    // Read once per block, as the fused kernels read it once per launch.
    if (p.quant == QuantKind::kStatic) {
      static_inv_scale = device::fp8::InvScale(*static_cast<const float*>(p.scale));
    }
  }
  for (uint32_t row = blockIdx.x; row < p.num_tokens; row += gridDim.x) {
    const size_t offset = row * row_bytes;
    Raw16 reduced[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const uint32_t v = threadIdx.x + k * blockDim.x;
      if (v < vecs_per_row) {
        reduced[k] = device::SanitizeNegativeZero<DT>(
            device::LoadRaw(static_cast<const char*>(p.input) + offset + v * 16u));
      }
    }
    if constexpr (!kQuant) {
      device::ResidualRmsNormRow<DT, kVec>(
          reduced, vecs_per_row, p.hidden, p.eps, static_cast<const char*>(p.residual_in) + offset,
          static_cast<char*>(p.residual_out) + offset, static_cast<char*>(p.norm_out) + offset,
          p.gamma, scratch);
    } else {
      // ResidualRmsNormRow's steps, with the quantization after the norm store.
      Raw16 res[kVec];
      Raw16 g[kVec];
      device::LoadRowVectors<kVec>(res, static_cast<const char*>(p.residual_in) + offset,
                                   threadIdx.x, blockDim.x, vecs_per_row);
      device::LoadRowVectors<kVec>(g, p.gamma, threadIdx.x, blockDim.x, vecs_per_row);
      const float mine =
          device::ResidualAddRow<DT, kVec>(reduced, res, threadIdx.x, blockDim.x, vecs_per_row,
                                           static_cast<char*>(p.residual_out) + offset);
      const float total = device::BlockSum(mine, scratch);
      if (p.norm_out != nullptr) {
        device::NormRowStore<DT, kVec>(reduced, total, threadIdx.x, blockDim.x, vecs_per_row,
                                       p.hidden, p.eps, g, static_cast<char*>(p.norm_out) + offset);
      }
      const device::QuantRowOp q{p.quant,  p.scale_layout, p.num_tokens,
                                 p.hidden, p.quant_out,    p.scale};
      device::QuantizeRow<DT, kVec>(q, p.eps, true, row, reduced, total, threadIdx.x, blockDim.x,
                                    vecs_per_row, g, amax_scratch, static_inv_scale);
    }
  }
}

template <DType DT, bool kQuant>
void LaunchAddRmsNormTyped(const AddRmsNormParams& p, unsigned grid, int threads,
                           uint32_t vecs_per_row, cudaStream_t stream) {
  device::WithRowBucket(vecs_per_row, [&](auto bucket) {
    AddRmsNormKernel<DT, decltype(bucket)::value, kQuant><<<grid, threads, 0, stream>>>(p);
  });
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

bool AlignedTo(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) % n) == 0; }

template <DType DT, bool kQuant>
cudaError_t LoadAddRmsNormKernels() {
  return LoadKernelFunctions({reinterpret_cast<const void*>(&AddRmsNormKernel<DT, 0, kQuant>),
                              reinterpret_cast<const void*>(&AddRmsNormKernel<DT, 1, kQuant>),
                              reinterpret_cast<const void*>(&AddRmsNormKernel<DT, 2, kQuant>),
                              reinterpret_cast<const void*>(&AddRmsNormKernel<DT, 3, kQuant>)});
}

// The FP8 pattern of a quant kind, so the pattern's rules are contract::CheckPattern's.
Pattern PatternOfQuant(QuantKind kind) {
  switch (kind) {
    case QuantKind::kStatic:
      return Pattern::kAllReduceResidualRmsNormFp8Static;
    case QuantKind::kPerToken:
      return Pattern::kAllReduceResidualRmsNormFp8PerToken;
    case QuantKind::kPerGroup:
      return Pattern::kAllReduceResidualRmsNormFp8PerGroup;
    case QuantKind::kNone:
      break;
  }
  return Pattern::kAllReduceResidualRmsNorm;
}

}  // namespace

cudaError_t PrepareAddRmsNormKernels() {
  return FirstError(
      {LoadAddRmsNormKernels<DType::kBF16, false>(), LoadAddRmsNormKernels<DType::kFP16, false>(),
       LoadAddRmsNormKernels<DType::kFP32, false>(), LoadAddRmsNormKernels<DType::kBF16, true>(),
       LoadAddRmsNormKernels<DType::kFP16, true>()});
}

cudaError_t CheckAddRmsNormParams(const AddRmsNormParams& p, const char** why) {
  const char* problem = nullptr;
  const bool quant = p.quant != QuantKind::kNone;
  if (p.dtype != DType::kBF16 && p.dtype != DType::kFP16 && p.dtype != DType::kFP32) {
    problem = "dtype is not bf16, fp16 or fp32";
  } else if (!IsHiddenAligned(p.hidden)) {
    problem = "hidden is not a positive multiple of 8";
  } else if (p.hidden > MaxAddRmsNormHidden(p.dtype)) {
    problem = "hidden is above the largest supported row";
  } else if (quant && p.quant != QuantKind::kStatic && p.quant != QuantKind::kPerToken &&
             p.quant != QuantKind::kPerGroup) {
    problem = "quant kind is not none, static, per-token or per-group";
  } else if (quant &&
             !contract::CheckPattern(contract::OpShape{p.dtype, p.hidden, p.num_tokens,
                                                       PatternOfQuant(p.quant), p.scale_layout},
                                     contract::OpVoice::kEngine)
                  .ok()) {
    problem =
        "the FP8 pattern's rules: bf16 or fp16 input; per-group: hidden a multiple of 128 and a "
        "known scale layout";
  } else if (p.num_tokens > 0 &&
             (p.input == nullptr || p.residual_in == nullptr || p.residual_out == nullptr ||
              (!quant && p.norm_out == nullptr) || p.gamma == nullptr)) {
    problem = "a tensor pointer is null";
  } else if (!Aligned16(p.input) || !Aligned16(p.residual_in) || !Aligned16(p.residual_out) ||
             !Aligned16(p.norm_out) || !Aligned16(p.gamma)) {
    problem = "a tensor pointer is not 16-byte aligned";
  } else if (quant && p.num_tokens > 0 && (p.quant_out == nullptr || p.scale == nullptr)) {
    problem = "quant_out or scale is null";
  } else if (quant && (!AlignedTo(p.quant_out, 8) || !AlignedTo(p.scale, 4))) {
    // E4M3 codes are stored a vector's elements at a time (8 bytes for bf16/fp16).
    problem = "quant_out is not 8-byte or scale not 4-byte aligned";
  }
  if (why != nullptr) *why = problem;
  return problem == nullptr ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t LaunchAddRmsNorm(const AddRmsNormParams& p, cudaStream_t stream) {
  if (cudaError_t err = CheckAddRmsNormParams(p, nullptr); err != cudaSuccess) return err;
  if (p.num_tokens == 0) return cudaSuccess;
  const uint32_t vecs_per_row = p.hidden / (16u / static_cast<uint32_t>(DTypeSize(p.dtype)));
  const int threads = device::RowBlockThreads(vecs_per_row);
  // Enough rows in flight to cover the GPU a few times over; no cross-block waiting here.
  const unsigned grid = std::min<uint32_t>(p.num_tokens, 4096u);
  const bool quant = p.quant != QuantKind::kNone;  // CheckAddRmsNormParams: bf16 or fp16 then
  switch (p.dtype) {
    case DType::kBF16:
      if (quant) {
        LaunchAddRmsNormTyped<DType::kBF16, true>(p, grid, threads, vecs_per_row, stream);
      } else {
        LaunchAddRmsNormTyped<DType::kBF16, false>(p, grid, threads, vecs_per_row, stream);
      }
      break;
    case DType::kFP16:
      if (quant) {
        LaunchAddRmsNormTyped<DType::kFP16, true>(p, grid, threads, vecs_per_row, stream);
      } else {
        LaunchAddRmsNormTyped<DType::kFP16, false>(p, grid, threads, vecs_per_row, stream);
      }
      break;
    case DType::kFP32:
      LaunchAddRmsNormTyped<DType::kFP32, false>(p, grid, threads, vecs_per_row, stream);
      break;
  }
  return cudaGetLastError();
}

}  // namespace arfuse
