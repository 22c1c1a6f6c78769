// CudaEngine as the planes' host: InStreamHost (the in-stream export, its counters, a client's
// end) and DoorbellHost (the doorbell plans, over planes_.doorbell()).
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/cuda_device/cuda_status.h"
#include "server/cuda_device/fusion_workspace.h"
#include "server/cuda_engine/cuda_engine.h"
#include "server/doorbell/doorbell_dispatch.h"
#include "server/instream/cuda/workspace_export.h"
#include "spdlog/spdlog.h"

namespace arfuse {

// ---- in-stream plane ----

absl::StatusOr<InStreamExport> CudaEngine::ExportInStream(const std::vector<uint32_t>& hiddens) {
  absl::MutexLock lock(&mu_);
  {
    absl::MutexLock state(&state_mu_);
    if (status_.state == WorkspaceState::kInitializing) {
      return absl::UnavailableError("the workspace is being built; attach again shortly");
    }
  }
  if (workspace_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("fusion is off for the group (", Status().reason, ")"));
  }
  if (workspace_->poisoned()) {
    return absl::FailedPreconditionError(absl::StrCat("the workspace is poisoned (",
                                                      FusionErrorName(workspace_->error_code()),
                                                      "); attach again after the group re-forms"));
  }
  // An attached client's kernel that failed marks the workspace only (Status() reads it): no
  // new attachment to it until the group re-forms.
  if (const uint32_t error = instream_error_.load(); error != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("the workspace is poisoned by an in-stream "
                     "op (",
                     FusionErrorName(error), "); attach again after the group re-forms"));
  }
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (image_ == nullptr) {
    ARFUSE_ASSIGN_OR_RETURN(image_, InStreamKernelImage::Load(static_cast<uint32_t>(sm_)));
  }
  InStreamExportSpec spec;
  spec.device = device_;
  spec.sm = sm_;
  spec.rank = options_.rank;
  spec.world_size = options_.world_size;
  spec.dtype = options_.dtype;
  spec.forced = cuda_options_.forced;
  spec.table = &cuda_options_.table;
  ARFUSE_ASSIGN_OR_RETURN(InStreamExport e,
                          ExportWorkspaceInStream(*workspace_, *image_, spec, hiddens));
  exported_.store(true);
  return e;
}

absl::StatusOr<InStreamCounters> CudaEngine::InStreamStatus() {
  absl::MutexLock state(&state_mu_);
  if (abortable_ == nullptr) return absl::UnavailableError("no fused workspace");
  ARFUSE_ASSIGN_OR_RETURN(InStreamCounters c,
                          abortable_->ReadInStreamCounters(absl::Now() + kInStreamReadTimeout));
  instream_error_.store(c.error);
  c.generation = abortable_->generation();
  if (c.error != 0) c.error_name = FusionErrorName(c.error);
  return c;
}

bool CudaEngine::InStreamClientEnded(uint64_t /*attach_id*/) {
  absl::MutexLock state(&state_mu_);
  if (abortable_ == nullptr) return false;
  // The kernels do not record which attachment launched them: an op in flight when a client's
  // session ends is taken to be that client's (one plane per workspace: the sidecar runs none of
  // its own while clients are attached). A client killed mid-op leaves the in-flight counts set
  // (its kernel never finished); one that ended between ops leaves them 0 and poisons nothing.
  absl::StatusOr<InStreamCounters> c =
      abortable_->ReadInStreamCounters(absl::Now() + kInStreamReadTimeout);
  // A control block that cannot be read in time may hide a half-done op: poison to be safe.
  if (c.ok() && !c->op_in_flight) return false;
  if (c.ok() && c->error != 0) return false;  // already poisoned; the group re-forms
  abortable_->PoisonGroup(FusionError::kAbandoned);
  instream_error_.store(static_cast<uint32_t>(FusionError::kAbandoned));
  spdlog::error(
      "event=workspace_poisoned rank={} reason=\"an attached client ended mid-op "
      "(abandoned)\"",
      options_.rank);
  return true;
}

// ---- doorbell plane ----

DoorbellPlaneOptions CudaEngine::DoorbellOptionsLocked() const {
  DoorbellPlaneOptions o;
  o.device = device_;
  o.stream = stream_;
  o.local_workspace = workspace_->local_base();
  o.layout = workspace_->layout();
  o.host_abort = workspace_->device_host_abort();
  o.queue_depth = cuda_options_.doorbell_queue_depth;
  o.programmatic_launch = cuda_options_.doorbell_programmatic_launch;
  o.serve_blocks = DoorbellServeBlocksFor(cuda_options_.doorbell_serve_blocks, shares_gpu_);
  o.serve_in_place = o.serve_blocks > 0;
  if (o.serve_blocks != cuda_options_.doorbell_serve_blocks) {
    spdlog::info(
        "event=doorbell_serve_blocks_capped requested={} serve_blocks={} reason=\"ranks share "
        "this GPU\"",
        cuda_options_.doorbell_serve_blocks, o.serve_blocks);
  }
  return o;
}

DispatchRequest CudaEngine::DispatchRequestLocked(const OpArgs& op) const {
  DispatchRequest req;
  req.sm = sm_;
  req.world_size = options_.world_size;
  req.num_tokens = op.num_tokens;
  req.hidden = op.hidden;
  req.dtype = op.dtype;
  req.fused_available = workspace_ != nullptr && !workspace_->poisoned();
  req.twoshot_available =
      IsFusionSupported(op.dtype, options_.world_size, op.pattern, FusionAlgo::kTwoShot);
  req.nccl_available = nccl_ != nullptr;
  req.nccl_symmetric_available =
      symmetric_buffer_ != nullptr &&
      PayloadBytes(op.num_tokens, op.hidden, op.dtype) <= symmetric_bytes_;
  req.forced = cuda_options_.forced;
  return req;
}

absl::StatusOr<DoorbellGrant> CudaEngine::AddDoorbellPlan(const OpArgs& op_template,
                                                          uint32_t max_tokens,
                                                          absl::Time deadline) {
  if (!mu_.LockWhenWithDeadline(absl::Condition::kTrue, deadline)) {
    mu_.Unlock();
    return absl::DeadlineExceededError("an op held the engine until the deadline");
  }
  absl::StatusOr<DoorbellGrant> out = AddDoorbellPlanLocked(op_template, max_tokens);
  mu_.Unlock();
  return out;
}

absl::StatusOr<DoorbellGrant> CudaEngine::AddDoorbellPlanLocked(const OpArgs& op_template,
                                                                uint32_t max_tokens) {
  if (!cuda_options_.enable_doorbell) {
    return absl::FailedPreconditionError(
        "the doorbell plane is disabled on this engine: use the eager plane (Execute)");
  }
  WorkspaceState state;
  std::string reason;
  {
    absl::MutexLock s(&state_mu_);
    state = status_.state;
    reason = status_.reason;
  }
  if (state == WorkspaceState::kInitializing) {
    return absl::UnavailableError(absl::StrCat("engine is not initialized (", reason, ")"));
  }
  if (state == WorkspaceState::kPoisoned || (workspace_ != nullptr && workspace_->poisoned())) {
    return absl::FailedPreconditionError(
        "the workspace is poisoned: re-initialize every rank, then create the doorbell plan");
  }
  if (workspace_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("the doorbell plane runs only the fused kernels and this group runs unfused (",
                     reason, "): use the eager plane (CreatePlan without doorbell, then Execute)"));
  }
  if (max_tokens == 0) return absl::InvalidArgumentError("a doorbell plan needs max_tokens > 0");
  OpArgs op = op_template;
  op.num_tokens = max_tokens;
  ARFUSE_RETURN_IF_ERROR(ValidateOp(op));
  ARFUSE_ASSIGN_OR_RETURN(const DoorbellDispatch dispatch,
                          ChooseDoorbellDispatch(cuda_options_.table, DispatchRequestLocked(op)));
  ARFUSE_ASSIGN_OR_RETURN(const FusionParams params,
                          workspace_->MakeParams(op, FusionAlgo::kOneShot));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (!planes_.doorbell().active()) {
    ARFUSE_RETURN_IF_ERROR(
        planes_.doorbell().Ensure(DoorbellOptionsLocked(), workspace_->generation()));
  }
  return planes_.doorbell().AddPlan(params, max_tokens, dispatch, op.hidden);
}

absl::Status CudaEngine::RemoveDoorbellPlan(const DoorbellGrant& grant, absl::Time deadline) {
  if (!mu_.LockWhenWithDeadline(absl::Condition::kTrue, deadline)) {
    mu_.Unlock();
    return absl::DeadlineExceededError(
        "an op held the engine until the deadline; the doorbell plan was not removed");
  }
  cudaSetDevice(device_);
  absl::Status out = planes_.doorbell().RemovePlan(grant, deadline);
  mu_.Unlock();
  return out;
}

DoorbellSlot* CudaEngine::doorbell_slot_for_testing(const DoorbellGrant& grant) const {
  absl::MutexLock lock(&mu_);
  return planes_.doorbell().slot_for_testing(grant);
}

absl::StatusOr<DoorbellPlaneStatus> CudaEngine::DoorbellStatus() const {
  absl::MutexLock lock(&mu_);
  return planes_.doorbell().Status();
}

}  // namespace arfuse
