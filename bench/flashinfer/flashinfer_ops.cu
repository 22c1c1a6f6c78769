// The one file that includes FlashInfer (ARFUSE_FLASHINFER_INCLUDE, outside this repository).
#include "bench/flashinfer/flashinfer_ops.h"

// Everything FlashInfer's header chain includes from CUDA comes first, so that the SM-count
// redirection below renames only FlashInfer's own calls, never a CUDA declaration.
#include <cooperative_groups.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_device_runtime_api.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#if CUDA_VERSION >= 12080
#include <cuda_fp4.h>
#endif

#include <array>
#include <atomic>
#include <cuda/std/limits>
#include <cuda/std/optional>
#include <exception>
#include <vector>

#include "bench/flashinfer/device_fill.h"

namespace arfuse::bench_fi {
namespace {

std::atomic<int> g_sm_count{0};

// FlashInfer's get_sm_count() (and its other attribute reads) call this: the device's answer,
// except the SM count when SetFlashInferSmCount set one.
cudaError_t DeviceGetAttributeForFlashInfer(int* value, cudaDeviceAttr attr, int device) {
  const cudaError_t err = ::cudaDeviceGetAttribute(value, attr, device);
  const int sms = g_sm_count.load(std::memory_order_relaxed);
  if (err == cudaSuccess && attr == cudaDevAttrMultiProcessorCount && sms > 0 && sms < *value) {
    *value = sms;
  }
  return err;
}

}  // namespace
}  // namespace arfuse::bench_fi

// logging.h includes spdlog for macros trtllm_allreduce_fusion.cuh never uses: skip it (its
// include guard), so the harness needs nothing of FlashInfer's but its include/ tree.
#define FLASHINFER_LOGGING_H_
#define cudaDeviceGetAttribute ::arfuse::bench_fi::DeviceGetAttributeForFlashInfer
#include "flashinfer/comm/trtllm_allreduce_fusion.cuh"
#undef cudaDeviceGetAttribute

#ifndef ARFUSE_FLASHINFER_VERSION
#define ARFUSE_FLASHINFER_VERSION "unknown"
#endif

namespace arfuse::bench_fi {
namespace {

namespace fi = ::flashinfer::trtllm_allreduce_fusion;
using Bf16 = __nv_bfloat16;
using FiParams = fi::AllReduceFusionParams<Bf16>;

// FlashInfer's Python constants (flashinfer/comm/trtllm_ar.py): BarrierFlagCount, MAX_COMM_SIZE.
constexpr uint64_t kBarrierFlagCount = 256;
constexpr uint64_t kMaxCommSize = 2147483647ull & ~((1ull << 21) - 1);
static_assert(kBarrierFlagCount == fi::details::kBarrierFlagCount);

uint64_t RoundUp16(uint64_t v) { return (v + 15) / 16 * 16; }

// allreduce_fusion_op's dispatch for T = bf16, NRanks = 2, fp32_acc = false (the Python API's
// default), one pattern: its launcher, which picks the grid, block and cluster.
template <fi::AllReduceFusionPattern P>
cudaError_t LaunchPattern(const FiParams& p) {
  return fi::allreduce_fusion_kernel_launcher<P, Bf16, kWorld, /*Fp32Acc=*/false>(
      p, /*launch_with_pdl=*/false);
}

cudaError_t Dispatch(const FiParams& p) {
  switch (p.pattern) {
    case fi::AllReduceFusionPattern::kARResidualRMSNorm:
      return LaunchPattern<fi::AllReduceFusionPattern::kARResidualRMSNorm>(p);
    case fi::AllReduceFusionPattern::kARResidualRMSNormFP8Quant:
      return LaunchPattern<fi::AllReduceFusionPattern::kARResidualRMSNormFP8Quant>(p);
    case fi::AllReduceFusionPattern::kARResidualRMSNormDynamicFP8Quant:
      return LaunchPattern<fi::AllReduceFusionPattern::kARResidualRMSNormDynamicFP8Quant>(p);
    case fi::AllReduceFusionPattern::kARResidualRMSNormPerTokenGroupFP8PackedQuant:
      return LaunchPattern<
          fi::AllReduceFusionPattern::kARResidualRMSNormPerTokenGroupFP8PackedQuant>(p);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

const char* FlashInferVersion() { return ARFUSE_FLASHINFER_VERSION; }

const char* FlashInferPatterns() {
  // Named through the enum so that a FlashInfer without one of them does not compile.
  static_assert(static_cast<int>(fi::AllReduceFusionPattern::kARResidualRMSNorm) == 1);
  static_assert(static_cast<int>(fi::AllReduceFusionPattern::kARResidualRMSNormFP8Quant) == 2);
  static_assert(
      static_cast<int>(fi::AllReduceFusionPattern::kARResidualRMSNormPerTokenGroupFP8PackedQuant) ==
      8);
  static_assert(static_cast<int>(fi::AllReduceFusionPattern::kARResidualRMSNormDynamicFP8Quant) ==
                10);
  return "1 kARResidualRMSNorm, 2 kARResidualRMSNormFP8Quant, 8 "
         "kARResidualRMSNormPerTokenGroupFP8PackedQuant, 10 kARResidualRMSNormDynamicFP8Quant";
}

void SetFlashInferSmCount(int sms) { g_sm_count.store(sms, std::memory_order_relaxed); }

cudaError_t FlashInferGroup::Create(uint32_t max_tokens, uint32_t hidden, cudaStream_t stream,
                                    std::unique_ptr<FlashInferGroup>* out) {
  std::unique_ptr<FlashInferGroup> g(new FlashInferGroup());
  // trtllm_create_ipc_workspace_for_all_reduce_fusion's sizes (use_fp32_lamport off).
  const uint64_t elems = uint64_t{max_tokens} * hidden;
  g->buffer_size_ = RoundUp16(kWorld * elems * 2);
  g->flag_size_ = RoundUp16(kWorld * kBarrierFlagCount * 4);
  g->lamport_comm_size_ = kWorld * elems * 2;
  if (g->lamport_comm_size_ > kMaxCommSize) g->lamport_comm_size_ = kMaxCommSize;
  const uint64_t lamport_bytes = RoundUp16(g->lamport_comm_size_ * 3);
  g->bytes_per_rank_ = g->buffer_size_ + g->flag_size_ + lamport_bytes + 5 * 4;
  for (int r = 0; r < kWorld; ++r) {
    if (cudaError_t e = cudaMalloc(&g->comm_[r], g->buffer_size_); e != cudaSuccess) return e;
    if (cudaError_t e = cudaMalloc(&g->barrier_[r], g->flag_size_); e != cudaSuccess) return e;
    if (cudaError_t e = cudaMalloc(&g->lamport_[r], lamport_bytes); e != cudaSuccess) return e;
    void* flags = nullptr;
    if (cudaError_t e = cudaMalloc(&flags, 5 * sizeof(int)); e != cudaSuccess) return e;
    g->flags_[r] = static_cast<int*>(flags);
    void* ws = nullptr;
    if (cudaError_t e = cudaMalloc(&ws, (3 * kWorld + 1) * sizeof(void*)); e != cudaSuccess) {
      return e;
    }
    g->workspace_[r] = static_cast<void**>(ws);
  }
  // The pointer array each rank's kernel reads: [comm bufs][barrier flags][Lamport bufs] of every
  // rank, then this rank's own flag struct (SyncComm, LamportComm: workspace[3 * NRanks]).
  for (int r = 0; r < kWorld; ++r) {
    std::vector<void*> ptrs;
    for (void* const* set : {g->comm_, g->barrier_, g->lamport_}) {
      for (int q = 0; q < kWorld; ++q) ptrs.push_back(set[q]);
    }
    ptrs.push_back(g->flags_[r]);
    if (cudaError_t e = cudaMemcpy(g->workspace_[r], ptrs.data(), ptrs.size() * sizeof(void*),
                                   cudaMemcpyHostToDevice);
        e != cudaSuccess) {
      return e;
    }
  }
  if (cudaError_t e = g->Reset(stream); e != cudaSuccess) return e;
  *out = std::move(g);
  return cudaSuccess;
}

cudaError_t FlashInferGroup::Reset(cudaStream_t stream) {
  // The flag struct: atomic counter, two-shot flag, Lamport flag, Lamport buffer size (the
  // triple buffer's stride), Lamport clear size.
  const int flags[5] = {0, 0, 0, static_cast<int>(lamport_comm_size_), 0};
  for (int r = 0; r < kWorld; ++r) {
    // Zeroed comm buffer and barrier flags (the symmetric-memory path memsets its flags; the
    // barrier waits for a flag to leave the previous value, so they must start at 0).
    if (cudaError_t e = cudaMemsetAsync(comm_[r], 0, buffer_size_, stream); e != cudaSuccess) {
      return e;
    }
    if (cudaError_t e = cudaMemsetAsync(barrier_[r], 0, flag_size_, stream); e != cudaSuccess) {
      return e;
    }
    // trtllm_lamport_initialize: every 16-bit element of the three buffers is -0.0, the
    // "not written yet" value the one-shot kernel polls for.
    if (cudaError_t e =
            FillU16(lamport_[r], RoundUp16(lamport_comm_size_ * 3) / 2, 0x8000u, stream);
        e != cudaSuccess) {
      return e;
    }
    if (cudaError_t e =
            cudaMemcpyAsync(flags_[r], flags, sizeof(flags), cudaMemcpyHostToDevice, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaStreamSynchronize(stream);
}

FlashInferGroup::~FlashInferGroup() {
  for (int r = 0; r < kWorld; ++r) {
    for (void* p : {comm_[r], barrier_[r], lamport_[r], static_cast<void*>(flags_[r]),
                    static_cast<void*>(workspace_[r])}) {
      if (p != nullptr) cudaFree(p);
    }
  }
}

bool FlashInferGroup::Supports(const RankOp& op, std::string* why) {
  if (!op.oneshot && op.tokens <= static_cast<uint32_t>(kWorld)) {
    if (why != nullptr) *why = "FlashInfer's two-shot needs tokens > ranks";
    return false;
  }
  return true;
}

cudaError_t FlashInferGroup::Launch(int rank, const RankOp& op, float* static_scale,
                                    cudaStream_t stream, std::string* why) const {
  if (!Supports(op, why)) return cudaErrorInvalidValue;
  const CaseInfo info = InfoOf(op.c);
  // What the C++ binding (csrc/trtllm_allreduce_fusion.cu) fills from the Python call.
  FiParams p;
  p.nranks = kWorld;
  p.rank = rank;
  p.size = static_cast<int>(op.tokens * op.hidden);
  p.hidden_dim = static_cast<int>(op.hidden);
  p.workspace = workspace_[rank];
  p.allreduce_in = const_cast<void*>(op.t.input);
  p.allreduce_out = nullptr;
  p.residual_in = const_cast<void*>(op.t.residual_in);
  p.residual_out = op.t.residual_out;
  p.norm_out = info.quant == QuantKind::kNone ? op.t.norm_out : nullptr;
  p.quant_out = info.quant == QuantKind::kNone ? nullptr : op.t.quant_out;
  p.scale_out = info.quant == QuantKind::kPerToken || info.quant == QuantKind::kPerGroup
                    ? op.t.scale
                    : nullptr;
  p.rms_gamma = const_cast<void*>(op.t.gamma);
  p.rms_eps = kEps;
  p.weight_bias = 0.0f;
  p.scale_factor = info.quant == QuantKind::kStatic ? static_scale : nullptr;
  p.use_oneshot = op.oneshot;
  p.stream = stream;
  p.pattern = static_cast<fi::AllReduceFusionPattern>(info.flashinfer_pattern);
  p.trigger_completion_at_end = true;
  if (info.quant == QuantKind::kPerGroup) {
    // The binding sets both when block_quant_group_size is given: tokens rounded up to 4.
    p.block_quant_group_size = static_cast<int>(fp8::kGroupSize);
    p.tma_aligned_mn = static_cast<int>(fp8::TmaAlignedTokens(op.tokens));
  }
  try {
    return Dispatch(p);
  } catch (const std::exception& e) {
    if (why != nullptr) *why = e.what();
    return cudaErrorInvalidValue;
  }
}

}  // namespace arfuse::bench_fi
