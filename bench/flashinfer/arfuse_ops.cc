#include "bench/flashinfer/arfuse_ops.h"

namespace arfuse::bench_fi {

cudaError_t ArfuseGroup::Create(uint32_t max_tokens, uint32_t hidden, uint32_t sm_budget,
                                uint64_t spin_timeout_ns, cudaStream_t stream,
                                std::unique_ptr<ArfuseGroup>* out, std::string* why) {
  std::unique_ptr<ArfuseGroup> g(new ArfuseGroup());
  const char* problem = nullptr;
  g->layout_ = ComputeWorkspaceLayout(kWorld, max_tokens, hidden, DType::kBF16, &problem);
  if (g->layout_.total_bytes == 0) {
    if (why != nullptr) *why = problem != nullptr ? problem : "no workspace layout";
    return cudaErrorInvalidValue;
  }
  g->sm_budget_ = sm_budget;
  g->spin_timeout_ns_ = spin_timeout_ns;
  for (int r = 0; r < kWorld; ++r) {
    if (cudaError_t e = cudaMalloc(&g->workspace_[r], g->layout_.total_bytes); e != cudaSuccess) {
      return e;
    }
  }
  // Loads every fused kernel now: a kernel loaded lazily at its first launch could wait for the
  // other rank's grid, already spinning (kernels/common/launch.cuh).
  if (cudaError_t e = PrepareAllReduceFusionKernels(); e != cudaSuccess) return e;
  if (cudaError_t e = g->Reinit(stream); e != cudaSuccess) return e;
  *out = std::move(g);
  return cudaSuccess;
}

ArfuseGroup::~ArfuseGroup() {
  for (void* w : workspace_) {
    if (w != nullptr) cudaFree(w);
  }
}

cudaError_t ArfuseGroup::Reinit(cudaStream_t stream) {
  for (void* w : workspace_) {
    if (cudaError_t e = LaunchWorkspaceInit(w, layout_, stream); e != cudaSuccess) return e;
  }
  // Every rank's sentinels are in place before any rank stores into a peer.
  return cudaStreamSynchronize(stream);
}

cudaError_t ArfuseGroup::Launch(int rank, const RankOp& op, const float* static_scale,
                                cudaStream_t stream) const {
  const CaseInfo info = InfoOf(op.c);
  FusedOpArgs a;
  a.pattern = info.arfuse_pattern;
  a.dtype = DType::kBF16;
  a.hidden = op.hidden;
  a.num_tokens = op.tokens;
  a.eps = kEps;
  a.input = op.t.input;
  a.residual_in = op.t.residual_in;
  a.residual_out = op.t.residual_out;
  a.gamma = op.t.gamma;
  // The FP8 patterns without norm_out (optional there), as `arfuse-bench kernels --fp8=1` runs
  // them and as FlashInfer's quantizing patterns (no norm output) compute.
  a.norm_out = info.quant == QuantKind::kNone ? op.t.norm_out : nullptr;
  if (info.quant != QuantKind::kNone) {
    a.quant_out = op.t.quant_out;
    a.scale = info.quant == QuantKind::kStatic ? const_cast<float*>(static_scale) : op.t.scale;
    a.scale_layout = info.scale_layout;
  }
  FusionLaunchSite site;
  site.peer_workspace = workspace_;
  site.rank = rank;
  site.world_size = kWorld;
  site.layout = layout_;
  site.spin_timeout_ns = spin_timeout_ns_;
  site.sm_budget = sm_budget_;
  const FusionParams p =
      MakeFusionParams(a, op.oneshot ? FusionAlgo::kOneShot : FusionAlgo::kTwoShot, site);
  // LaunchAllReduceFusion runs CheckFusionParams first (cudaErrorInvalidValue, nothing launched).
  return LaunchAllReduceFusion(p, stream);
}

cudaError_t ArfuseGroup::ErrorWords(cudaStream_t stream, uint32_t (&codes)[kWorld]) const {
  for (int r = 0; r < kWorld; ++r) {
    if (cudaError_t e = ReadWorkspaceError(workspace_[r], layout_, stream, &codes[r]);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

}  // namespace arfuse::bench_fi
