// arfuse's fused kernels (the kernels layer only: kernels/allreduce_fusion) for two ranks that
// live in this process on one GPU: one workspace per rank (plain cudaMalloc; the peer pointers
// are this process's pointers) and one rank's launch with FusionParams filled as the sidecar
// fills them (MakeFusionParams), each rank capped at its sm_budget so both spinning grids are
// resident at once, as the kernels' own one-GPU tests and `arfuse-bench kernels` do.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "bench/flashinfer/cases.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"

namespace arfuse::bench_fi {

class ArfuseGroup {
 public:
  // Workspaces for `max_tokens` x `hidden` bf16, initialized (LaunchWorkspaceInit, synchronized).
  // sm_budget: the SMs each rank's grid may assume; spin_timeout_ns: each spin's deadline, after
  // which a kernel gives up with an error code instead of spinning on.
  static cudaError_t Create(uint32_t max_tokens, uint32_t hidden, uint32_t sm_budget,
                            uint64_t spin_timeout_ns, cudaStream_t stream,
                            std::unique_ptr<ArfuseGroup>* out, std::string* why);
  ~ArfuseGroup();
  ArfuseGroup(const ArfuseGroup&) = delete;
  ArfuseGroup& operator=(const ArfuseGroup&) = delete;

  // Every rank's workspace reset (after an error poisoned them); synchronized.
  cudaError_t Reinit(cudaStream_t stream);

  // Enqueues rank `rank`'s op on `stream`. `static_scale`: the kFp8Static case's device float.
  cudaError_t Launch(int rank, const RankOp& op, const float* static_scale,
                     cudaStream_t stream) const;

  // Each rank's workspace error word (0: healthy); synchronizes `stream`.
  cudaError_t ErrorWords(cudaStream_t stream, uint32_t (&codes)[kWorld]) const;

  uint32_t sm_budget() const { return sm_budget_; }
  uint64_t bytes_per_rank() const { return layout_.total_bytes; }

 private:
  ArfuseGroup() = default;

  WorkspaceLayout layout_{};
  uint32_t sm_budget_ = 0;
  uint64_t spin_timeout_ns_ = 0;
  void* workspace_[kWorld] = {};
};

}  // namespace arfuse::bench_fi
