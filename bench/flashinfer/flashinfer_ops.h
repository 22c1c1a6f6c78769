// FlashInfer's fused allreduce (trtllm_allreduce_fusion.cuh, header-only CUDA) driven from C++
// for two ranks that live in this process on one GPU: the workspace laid out as FlashInfer's
// Python trtllm_create_ipc_workspace_for_all_reduce_fusion lays it out, and one rank's launch
// through FlashInfer's own launcher (allreduce_fusion_kernel_launcher, what allreduce_fusion_op
// dispatches to for bf16, 2 ranks, fp32_acc off). Nothing of FlashInfer's is visible here: only
// flashinfer_ops.cu includes its header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "bench/flashinfer/cases.h"

namespace arfuse::bench_fi {

// "v0.6.17 (a0a6b01...)": the FlashInfer tag and commit the harness was built with.
const char* FlashInferVersion();
// The trtllm_allreduce_fusion patterns this build drives, e.g. "1 kARResidualRMSNorm, ...".
const char* FlashInferPatterns();

// FlashInfer's launcher sizes its grid from the device's SM count (read once per process):
// `sms` > 0 makes it see that many SMs instead, the way arfuse's sm_budget caps arfuse's grids,
// so two ranks sharing one GPU each get their half. Must be called before the first launch.
void SetFlashInferSmCount(int sms);

class FlashInferGroup {
 public:
  // Every rank's comm buffer, barrier flags, Lamport triple buffer and flag struct, sized for
  // `max_tokens` x `hidden` (bf16, use_fp32_lamport off), initialized on `stream` (synchronized
  // before returning): Lamport buffers to -0.0, flags to {0, 0, 0, lamport_comm_size, 0}.
  static cudaError_t Create(uint32_t max_tokens, uint32_t hidden, cudaStream_t stream,
                            std::unique_ptr<FlashInferGroup>* out);
  ~FlashInferGroup();
  FlashInferGroup(const FlashInferGroup&) = delete;
  FlashInferGroup& operator=(const FlashInferGroup&) = delete;

  // Back to the state Create left (after a failed pair, whose ranks may be out of step).
  cudaError_t Reset(cudaStream_t stream);

  // Enqueues rank `rank`'s op on `stream`. `static_scale`: the kFp8Static case's device float
  // (FlashInfer's scale_factor). FlashInfer's checks throw; their text goes to `why` and the
  // call returns cudaErrorInvalidValue without launching.
  cudaError_t Launch(int rank, const RankOp& op, float* static_scale, cudaStream_t stream,
                     std::string* why) const;

  // Whether FlashInfer takes the op with that algorithm (its Python API asserts tokens > ranks
  // for the two-shot kernel); `why` says why not.
  static bool Supports(const RankOp& op, std::string* why);

  uint64_t bytes_per_rank() const { return bytes_per_rank_; }

 private:
  FlashInferGroup() = default;

  uint64_t buffer_size_ = 0;        // comm buffer: world x max_tokens x hidden x 2
  uint64_t flag_size_ = 0;          // barrier flags: world x 256 x 4
  uint64_t lamport_comm_size_ = 0;  // one of the three Lamport buffers
  uint64_t bytes_per_rank_ = 0;
  void* comm_[kWorld] = {};
  void* barrier_[kWorld] = {};
  void* lamport_[kWorld] = {};
  int* flags_[kWorld] = {};
  void** workspace_[kWorld] = {};  // device arrays of 3 x world + 1 pointers, one per rank
};

}  // namespace arfuse::bench_fi
