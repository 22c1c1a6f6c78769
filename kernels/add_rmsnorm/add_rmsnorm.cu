#include <algorithm>

#include "kernels/add_rmsnorm/add_rmsnorm.h"
#include "kernels/add_rmsnorm/row_math.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/contract/op_contract.h"

namespace arfuse {
namespace {

using device::kMaxVecPerThread;
using device::Raw16;

// One block per row, rows grid-strided, with the row layout of row_math.cuh (the fused kernels
// use the same, so both paths agree bit for bit). The input is the allreduced sum in dtype
// (NCCL's output): step 3 of the reference numerics is only the -0.0 -> +0.0 mapping here.
template <DType DT, int kBucket>
__global__ void __launch_bounds__(device::BucketMaxThreads(kBucket))
    AddRmsNormKernel(const AddRmsNormParams p) {
  constexpr int kVec = device::BucketVecs(kBucket);
  __shared__ float scratch[32];
  const uint32_t vecs_per_row = p.hidden / device::VecTraits<DT>::kElems;
  const size_t row_bytes = static_cast<size_t>(p.hidden) * DTypeSize(DT);
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
    device::ResidualRmsNormRow<DT, kVec>(reduced, vecs_per_row, p.hidden, p.eps,
                                         static_cast<const char*>(p.residual_in) + offset,
                                         static_cast<char*>(p.residual_out) + offset,
                                         static_cast<char*>(p.norm_out) + offset, p.gamma, scratch);
  }
}

template <DType DT>
void LaunchAddRmsNormTyped(const AddRmsNormParams& p, unsigned grid, int threads, int bucket,
                           cudaStream_t stream) {
  switch (bucket) {
    case 0:
      AddRmsNormKernel<DT, 0><<<grid, threads, 0, stream>>>(p);
      break;
    case 1:
      AddRmsNormKernel<DT, 1><<<grid, threads, 0, stream>>>(p);
      break;
    case 2:
      AddRmsNormKernel<DT, 2><<<grid, threads, 0, stream>>>(p);
      break;
    default:
      AddRmsNormKernel<DT, 3><<<grid, threads, 0, stream>>>(p);
      break;
  }
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <DType DT>
cudaError_t LoadAddRmsNormKernels() {
  return LoadKernelFunctions({reinterpret_cast<const void*>(&AddRmsNormKernel<DT, 0>),
                              reinterpret_cast<const void*>(&AddRmsNormKernel<DT, 1>),
                              reinterpret_cast<const void*>(&AddRmsNormKernel<DT, 2>),
                              reinterpret_cast<const void*>(&AddRmsNormKernel<DT, 3>)});
}

}  // namespace

cudaError_t PrepareAddRmsNormKernels() {
  return FirstError({LoadAddRmsNormKernels<DType::kBF16>(), LoadAddRmsNormKernels<DType::kFP16>(),
                     LoadAddRmsNormKernels<DType::kFP32>()});
}

cudaError_t CheckAddRmsNormParams(const AddRmsNormParams& p, const char** why) {
  const char* problem = nullptr;
  if (p.dtype != DType::kBF16 && p.dtype != DType::kFP16 && p.dtype != DType::kFP32) {
    problem = "dtype is not bf16, fp16 or fp32";
  } else if (!IsHiddenAligned(p.hidden)) {
    problem = "hidden is not a positive multiple of 8";
  } else if (p.hidden > MaxAddRmsNormHidden(p.dtype)) {
    problem = "hidden is above the largest supported row";
  } else if (p.num_tokens > 0 &&
             (p.input == nullptr || p.residual_in == nullptr || p.residual_out == nullptr ||
              p.norm_out == nullptr || p.gamma == nullptr)) {
    problem = "a tensor pointer is null";
  } else if (!Aligned16(p.input) || !Aligned16(p.residual_in) || !Aligned16(p.residual_out) ||
             !Aligned16(p.norm_out) || !Aligned16(p.gamma)) {
    problem = "a tensor pointer is not 16-byte aligned";
  }
  if (why != nullptr) *why = problem;
  return problem == nullptr ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t LaunchAddRmsNorm(const AddRmsNormParams& p, cudaStream_t stream) {
  if (cudaError_t err = CheckAddRmsNormParams(p, nullptr); err != cudaSuccess) return err;
  if (p.num_tokens == 0) return cudaSuccess;
  const uint32_t vecs_per_row = p.hidden / (16u / static_cast<uint32_t>(DTypeSize(p.dtype)));
  const int threads = device::RowBlockThreads(vecs_per_row);
  const int bucket = device::RowBucket(vecs_per_row);
  // Enough rows in flight to cover the GPU a few times over; no cross-block waiting here.
  const unsigned grid = std::min<uint32_t>(p.num_tokens, 4096u);
  switch (p.dtype) {
    case DType::kBF16:
      LaunchAddRmsNormTyped<DType::kBF16>(p, grid, threads, bucket, stream);
      break;
    case DType::kFP16:
      LaunchAddRmsNormTyped<DType::kFP16>(p, grid, threads, bucket, stream);
      break;
    case DType::kFP32:
      LaunchAddRmsNormTyped<DType::kFP32>(p, grid, threads, bucket, stream);
      break;
  }
  return cudaGetLastError();
}

}  // namespace arfuse
