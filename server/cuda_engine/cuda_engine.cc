#include "server/cuda_engine/cuda_engine.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/add_rmsnorm/add_rmsnorm.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/common/plain_status_absl.h"
#include "server/collective/op_agreement.h"
#include "server/cuda_device/cuda_status.h"
#include "server/cuda_device/fusion_workspace.h"
#include "server/cuda_device/nccl_comm.h"
#include "server/peers/exchange.h"
#include "spdlog/spdlog.h"

namespace arfuse {

CudaEngine::CudaEngine(const EngineOptions& options, const CudaEngineOptions& cuda_options)
    : options_(options), cuda_options_(cuda_options), planes_(options.rank, options.spin_timeout) {
  status_.state = WorkspaceState::kInitializing;
  status_.backend = options.backend;
  status_.reason = "not initialized";
}

CudaEngine::~CudaEngine() {
  {
    absl::MutexLock state(&state_mu_);
    abortable_ = nullptr;
  }
  if (UnfusedOpStuck()) {
    // An NCCL kernel waits for a peer that agreed to its op and is gone. ncclCommAbort would wait
    // for that kernel forever, and so would freeing memory (cudaFree synchronizes): leave the
    // communicators, the workspace and the plane as they are (the process exits to be restarted,
    // which ends the kernel) and never block here.
    spdlog::critical(
        "event=nccl_kernel_stuck rank={} action=leak_and_exit reason=\"an agreed unfused op did "
        "not finish: a peer died or froze mid-op\"",
        options_.rank);
    MarkDeviceWedged(
        "an NCCL kernel waits for a peer rank that agreed to the op and is gone; restart this "
        "sidecar");
    planes_.DeviceWedged();
    static_cast<void>(workspace_.release());
    static_cast<void>(sym_nccl_.release());
    static_cast<void>(nccl_.release());
    return;
  }
  // The planes go before their workspace: the abort sends the doorbell plane's waiters away (and
  // ends a fused op spinning on a peer), then the planes stop; workspace teardown then waits a
  // bounded time for its spins; NCCL aborts its communicator.
  if (workspace_ != nullptr) workspace_->Abort();
  planes_.EngineClosing();
  workspace_.reset();
  sym_nccl_.reset();
  nccl_.reset();
  if (unfused_scratch_ != nullptr) {
    ARFUSE_CUDA_LOG_IF_ERROR(cudaFreeAsync(unfused_scratch_, stream_));
  }
  if (op_done_ != nullptr) ARFUSE_CUDA_LOG_IF_ERROR(cudaEventDestroy(op_done_));
  if (unfused_done_ != nullptr) ARFUSE_CUDA_LOG_IF_ERROR(cudaEventDestroy(unfused_done_));
  // Returns at once; the stream's resources go when its work is done.
  if (stream_ != nullptr) ARFUSE_CUDA_LOG_IF_ERROR(cudaStreamDestroy(stream_));
}

absl::StatusOr<std::unique_ptr<Engine>> MakeCudaEngine(const EngineOptions& options) {
  ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<CudaEngine> engine,
                          MakeCudaEngine(options, CudaEngineOptions()));
  return std::unique_ptr<Engine>(std::move(engine));
}

absl::StatusOr<std::unique_ptr<CudaEngine>> MakeCudaEngine(const EngineOptions& options,
                                                           const CudaEngineOptions& cuda_options) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", options.rank, " is outside a group of ", options.world_size));
  }
  if (options.max_tokens == 0 || options.max_hidden == 0 ||
      !IsFusionHidden(options.max_hidden, options.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity max_tokens=", options.max_tokens, " max_hidden=", options.max_hidden,
                     " is invalid (hidden a positive multiple of ", kHiddenMultiple, " up to ",
                     MaxFusionHidden(options.dtype), ")"));
  }
  int count = 0;
  absl::Status counted = ARFUSE_CUDA_STATUS(cudaGetDeviceCount(&count));
  if (!counted.ok() || count == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA device is visible: ", counted.ok() ? "0 devices" : counted.message()));
  }
  auto engine = std::make_unique<CudaEngine>(options, cuda_options);
  int device = cuda_options.device;
  if (device < 0) ARFUSE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device ", device, " does not exist (", count, " visible)"));
  }
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  engine->device_ = device;
  int major = 0, minor = 0;
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  engine->sm_ = major * 10 + minor;
  // Every kernel the engine may launch is loaded now, before any can spin: with lazy module
  // loading a first launch behind a spinning kernel (a fused op waiting for its peers, the
  // doorbell plane's resident launch) could wait for it (kernels/common/launch.cuh).
  ARFUSE_CUDA_RETURN_IF_ERROR(PrepareAllReduceFusionKernels());
  ARFUSE_CUDA_RETURN_IF_ERROR(PrepareAddRmsNormKernels());
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&engine->stream_, cudaStreamNonBlocking));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&engine->op_done_, cudaEventDisableTiming));
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&engine->unfused_done_, cudaEventDisableTiming));
  return engine;
}

absl::Status CudaEngine::ValidateOp(const OpArgs& op) const {
  ARFUSE_RETURN_IF_ERROR(ToAbsl(contract::CheckOp(
      contract::ShapeOf(op),
      contract::WorkspaceCapacity{options_.max_tokens, options_.max_hidden, options_.dtype},
      contract::OpVoice::kEngine)));
  if (op.num_tokens == 0) return absl::InvalidArgumentError("num_tokens must be positive");
  if (op.input == nullptr) return absl::InvalidArgumentError("input is missing");
  if (op.pattern == Pattern::kAllReduce) {
    if (op.output == nullptr) return absl::InvalidArgumentError("output is missing");
  } else if (op.pattern == Pattern::kAllReduceResidualRmsNorm) {
    if (op.residual_in == nullptr || op.residual_out == nullptr || op.norm_out == nullptr ||
        op.gamma == nullptr) {
      return absl::InvalidArgumentError(
          "allreduce_residual_rmsnorm needs residual_in, residual_out, norm_out and gamma");
    }
  } else if (TraitsOf(op.pattern).quant != QuantKind::kNone) {
    // norm_out is optional beside quant_out (CheckOp above checked the pattern's own rules).
    if (op.residual_in == nullptr || op.residual_out == nullptr || op.gamma == nullptr ||
        op.quant_out == nullptr || op.scale == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          PatternName(op.pattern), " needs residual_in, residual_out, gamma, quant_out and scale"));
    }
  } else {
    return absl::InvalidArgumentError("unknown pattern");
  }
  return absl::OkStatus();
}

absl::StatusOr<DispatchChoice> CudaEngine::Choose(uint32_t num_tokens, uint32_t hidden,
                                                  DType dtype) const {
  absl::MutexLock lock(&mu_);
  DispatchRequest req;
  req.sm = sm_;
  req.world_size = options_.world_size;
  req.num_tokens = num_tokens;
  req.hidden = hidden;
  req.dtype = dtype;
  req.fused_available = workspace_ != nullptr && !workspace_->poisoned();
  req.twoshot_available = IsFusionSupported(
      dtype, options_.world_size, Pattern::kAllReduceResidualRmsNorm, FusionAlgo::kTwoShot);
  req.nccl_available = nccl_ != nullptr;
  req.nccl_symmetric_available =
      symmetric_buffer_ != nullptr && PayloadBytes(num_tokens, hidden, dtype) <= symmetric_bytes_;
  req.forced = cuda_options_.forced;
  return ChooseExecPath(cuda_options_.table, req);
}

void CudaEngine::SetForcedPath(ForcedPath forced) {
  absl::MutexLock lock(&mu_);
  cuda_options_.forced = forced;
}

bool CudaEngine::nccl_available() const {
  absl::MutexLock lock(&mu_);
  return nccl_ != nullptr;
}
bool CudaEngine::nccl_symmetric_available() const {
  absl::MutexLock lock(&mu_);
  return symmetric_buffer_ != nullptr;
}
bool CudaEngine::shares_gpu() const {
  absl::MutexLock lock(&mu_);
  return shares_gpu_;
}

absl::StatusOr<OpOutcome> CudaEngine::Execute(const OpArgs& op, const ExecContext& ctx) {
  if (!mu_.LockWhenWithDeadline(absl::Condition::kTrue, ctx.deadline)) {
    mu_.Unlock();
    return absl::DeadlineExceededError("another op held the engine until the deadline");
  }
  absl::StatusOr<OpOutcome> out = ExecuteLocked(op, ctx);
  mu_.Unlock();
  return out;
}

absl::Status CudaEngine::CheckFusedError() const {
  const uint32_t code = workspace_->error_code();
  if (code == 0) return absl::OkStatus();
  const std::string why = FusionErrorName(code);
  {
    absl::MutexLock state(&state_mu_);
    status_.state = WorkspaceState::kPoisoned;
    status_.fusion_enabled = false;
    status_.reason = absl::StrCat("workspace poisoned: ", why);
  }
  const std::string next = "; the workspace is poisoned: re-initialize every rank";
  switch (static_cast<FusionError>(code)) {
    case FusionError::kTimeout:
      return absl::DeadlineExceededError(
          absl::StrCat("a peer did not arrive within the spin timeout of ",
                       absl::FormatDuration(options_.spin_timeout), next));
    case FusionError::kHostAbort:
      return absl::AbortedError(absl::StrCat("the op was aborted on this rank", next));
    case FusionError::kPeerAbort:
      return absl::AbortedError(absl::StrCat("a peer rank aborted the op", next));
    case FusionError::kOpMismatch:
      // Two clients racing on one group paired ops of different shapes across the ranks: the
      // kernels refused the pair before storing any output. The request itself may be valid.
      return absl::InvalidArgumentError(absl::StrCat(
          "ranks disagree on the op: a peer rank ran another op (tokens, hidden, eps, dtype, "
          "pattern or algorithm) in the same call; no output was written",
          next));
    default:
      return absl::FailedPreconditionError(absl::StrCat("fused kernel error ", why, next));
  }
}

absl::StatusOr<OpOutcome> CudaEngine::ExecuteLocked(const OpArgs& op, const ExecContext& ctx) {
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
  if (state == WorkspaceState::kPoisoned) {
    return absl::FailedPreconditionError(absl::StrCat(reason, ": re-initialize every rank"));
  }
  if (workspace_ != nullptr) {
    absl::Status earlier = CheckFusedError();
    if (!earlier.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("an earlier op failed: ", earlier.message()));
    }
  }
  ARFUSE_RETURN_IF_ERROR(ValidateOp(op));
  DispatchRequest req;
  req.sm = sm_;
  req.world_size = options_.world_size;
  req.num_tokens = op.num_tokens;
  req.hidden = op.hidden;
  req.dtype = op.dtype;
  req.fused_available = workspace_ != nullptr;
  req.twoshot_available =
      IsFusionSupported(op.dtype, options_.world_size, op.pattern, FusionAlgo::kTwoShot);
  req.nccl_available = nccl_ != nullptr;
  req.nccl_symmetric_available =
      symmetric_buffer_ != nullptr &&
      PayloadBytes(op.num_tokens, op.hidden, op.dtype) <= symmetric_bytes_;
  req.forced = cuda_options_.forced;
  ARFUSE_ASSIGN_OR_RETURN(DispatchChoice choice, ChooseExecPath(cuda_options_.table, req));
  const bool fused = choice.path != ExecPath::kUnfused;
  if (!fused && !choice.nccl_symmetric && op.pattern != Pattern::kAllReduce &&
      op.norm_out == nullptr) {
    // An FP8 op without norm_out: NCCL's sum needs a home of its own (residual_out may be
    // residual_in, which the add-RMSNorm kernel still reads). Taken before the agreement, so a
    // failure here enqueues nothing that peers would wait for.
    ARFUSE_RETURN_IF_ERROR(EnsureUnfusedScratchLocked());
  }

  // The planes' work queued ahead on the stream would hold this op back: it steps aside first,
  // and queues again behind the op.
  AfterOpScope planes_after_op;
  ARFUSE_RETURN_IF_ERROR(planes_.BeforeOp(ctx.deadline));
  planes_after_op.Arm(&planes_);

  ARFUSE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (ctx.wait_event != nullptr) {
    ARFUSE_CUDA_RETURN_IF_ERROR(
        cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(ctx.wait_event), 0));
  }
  if (fused) {
    ARFUSE_RETURN_IF_ERROR(workspace_->Launch(
        op, choice.path == ExecPath::kOneShot ? FusionAlgo::kOneShot : FusionAlgo::kTwoShot,
        stream_));
  } else {
    // Agreed last, right before the enqueue: nothing that could still fail on this rank alone
    // stands between a peer's enqueue and ours.
    ARFUSE_RETURN_IF_ERROR(AgreeOnUnfusedLocked(op, choice.nccl_symmetric, ctx.deadline));
    absl::Status launched = LaunchUnfused(op, choice.nccl_symmetric, ctx.deadline);
    if (!launched.ok()) {
      // The peers enqueued their half of this agreed op and wait for ours.
      PoisonLocked(
          absl::StrCat("an agreed unfused op failed to launch on this rank: ", launched.message()));
      return launched;
    }
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventRecord(unfused_done_, stream_));
  }
  // op_done_ serves only the synchronous wait below (WaitEvent: hot polls for 1 ms, then backs
  // off); an asynchronous op replies right after the enqueue and does not pay for the record.
  if (ctx.synchronous) ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventRecord(op_done_, stream_));
  if (ctx.done_event != nullptr) {
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(ctx.done_event), stream_));
  }
  // The planes queue again behind the op at once, not after a synchronous wait.
  planes_after_op.Now();
  if (ctx.synchronous) {
    // An agreed NCCL op waits for its peers no longer than a fused kernel spins for them.
    absl::Status done =
        WaitEvent(op_done_, fused ? ctx.deadline
                                  : std::min(ctx.deadline, absl::Now() + options_.spin_timeout));
    if (absl::IsDeadlineExceeded(done) && fused) {
      // Make the kernel give up now rather than at its spin timeout, then wait for it to exit.
      workspace_->Abort();
      absl::Status exited = WaitEvent(op_done_, absl::Now() + options_.spin_timeout);
      if (!exited.ok()) return exited;
      absl::Status err = CheckFusedError();
      return absl::DeadlineExceededError(
          absl::StrCat("op did not complete before its deadline; ",
                       err.ok() ? "the workspace was aborted" : std::string(err.message())));
    }
    if (absl::IsDeadlineExceeded(done) && !fused) {
      // Every rank agreed to this op, so a peer that has not finished it died or froze after the
      // agreement: the NCCL kernel waits for it, and nothing but its arrival ends that kernel.
      PoisonLocked("an agreed unfused (NCCL) op did not finish: a peer rank died or froze mid-op");
      return absl::DeadlineExceededError(absl::StrCat(
          "the unfused (NCCL) op did not complete within the spin timeout of ",
          absl::FormatDuration(options_.spin_timeout),
          " or before its deadline although every rank agreed to it (a peer died or froze "
          "mid-op); the engine is poisoned: re-initialize every rank"));
    }
    ARFUSE_RETURN_IF_ERROR(done);
    if (fused) ARFUSE_RETURN_IF_ERROR(CheckFusedError());
  }
  return OpOutcome{choice.path, choice.reason};
}

absl::Status CudaEngine::AgreeOnUnfusedLocked(const OpArgs& op, bool symmetric,
                                              absl::Time deadline) {
  if (options_.world_size == 1) return absl::OkStatus();
  if (exchange_ == nullptr) return absl::FailedPreconditionError("engine is not initialized");
  UnfusedOpKey key;
  key.num_tokens = op.num_tokens;
  key.hidden = op.hidden;
  key.dtype = op.dtype;
  key.pattern = op.pattern;
  key.eps = op.eps;
  key.symmetric = symmetric;
  // The other patterns ignore scale_layout: only the per-group pattern's makes two ops differ.
  if (TraitsOf(op.pattern).quant == QuantKind::kPerGroup) key.scale_layout = op.scale_layout;
  uint64_t generation = 0;
  {
    absl::MutexLock state(&state_mu_);
    generation = status_.generation;
  }
  // A peer gets as long to reach the op, and then to confirm it, as a fused kernel waits for it.
  AgreementDeadlines deadlines;
  deadlines.arrive_by = absl::Now() + options_.spin_timeout;
  deadlines.confirm_within = options_.spin_timeout;
  deadlines.latest = deadline;
  absl::Status agreed = AgreeOnUnfusedOp(*exchange_, generation, key, deadlines);
  // A refused op was refused on every rank alike: nothing ran, the ranks stay in step.
  if (agreed.ok() || absl::IsInvalidArgument(agreed)) return agreed;
  // A rank did not come, or the link broke: the ranks' counts of agreed ops may differ from now
  // on, so the group must re-form before the next unfused op.
  PoisonLocked(absl::StrCat("unfused op agreement failed: ", agreed.message()));
  return absl::Status(agreed.code(),
                      absl::StrCat(agreed.message(),
                                   "; NCCL was not called; the engine is poisoned: re-initialize "
                                   "every rank"));
}

void CudaEngine::PoisonLocked(const std::string& reason) {
  absl::MutexLock state(&state_mu_);
  status_.state = WorkspaceState::kPoisoned;
  status_.fusion_enabled = false;
  status_.reason = reason;
  spdlog::error("event=engine_poisoned rank={} reason=\"{}\"", options_.rank, reason);
}

bool CudaEngine::UnfusedOpStuck() const {
  // An op whose peers are all alive finishes within its kernel's time. A peer that froze after
  // the agreement and is continued runs its half and ends ours: it gets the spin timeout, as
  // long as any cross-rank wait. (An event never recorded, no unfused op yet, queries as done.)
  if (unfused_done_ == nullptr) return false;
  return absl::IsDeadlineExceeded(WaitEvent(unfused_done_, absl::Now() + options_.spin_timeout));
}

absl::Status CudaEngine::LaunchUnfused(const OpArgs& op, bool symmetric, absl::Time deadline) {
  const size_t count = static_cast<size_t>(op.num_tokens) * op.hidden;
  const size_t bytes = count * DTypeSize(op.dtype);
  const void* reduced = nullptr;
  if (symmetric) {
    // NCCL's symmetric kernels need both buffers in registered windows: the client's are not.
    ARFUSE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(symmetric_buffer_, op.input, bytes, cudaMemcpyDeviceToDevice, stream_));
    ARFUSE_RETURN_IF_ERROR(sym_nccl_->AllReduce(symmetric_buffer_, symmetric_buffer_, count,
                                                op.dtype, stream_, deadline));
    if (op.pattern == Pattern::kAllReduce) {
      ARFUSE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(op.output, symmetric_buffer_, bytes, cudaMemcpyDeviceToDevice, stream_));
      return absl::OkStatus();
    }
    reduced = symmetric_buffer_;
  } else if (op.pattern == Pattern::kAllReduce) {
    return nccl_->AllReduce(op.input, op.output, count, op.dtype, stream_, deadline);
  } else {
    // norm_out holds the sum until the norm kernel overwrites it in place (allowed: norm_out
    // may equal input). An FP8 op may come without norm_out: the sum goes to the engine's scratch
    // (EnsureUnfusedScratchLocked ran before the agreement).
    void* sum = op.norm_out != nullptr ? op.norm_out : unfused_scratch_;
    if (sum == nullptr) return absl::InternalError("the unfused path has no buffer for the sum");
    ARFUSE_RETURN_IF_ERROR(nccl_->AllReduce(op.input, sum, count, op.dtype, stream_, deadline));
    reduced = sum;
  }
  AddRmsNormParams p = {};
  p.input = reduced;
  p.residual_in = op.residual_in;
  p.residual_out = op.residual_out;
  p.norm_out = op.norm_out;
  p.gamma = op.gamma;
  p.num_tokens = op.num_tokens;
  p.hidden = op.hidden;
  p.eps = op.eps;
  p.dtype = op.dtype;
  // The FP8 patterns quantize in the same kernel, with the fused epilogue's math.
  p.quant = TraitsOf(op.pattern).quant;
  p.scale_layout = op.scale_layout;
  p.quant_out = op.quant_out;
  p.scale = op.scale;
  const char* why = nullptr;
  if (CheckAddRmsNormParams(p, &why) != cudaSuccess) {
    return absl::InvalidArgumentError(
        absl::StrCat("add-RMSNorm refused the op: ", why != nullptr ? why : "invalid arguments"));
  }
  ARFUSE_CUDA_RETURN_IF_ERROR(LaunchAddRmsNorm(p, stream_));
  return absl::OkStatus();
}

absl::Status CudaEngine::EnsureUnfusedScratchLocked() {
  if (unfused_scratch_ != nullptr) return absl::OkStatus();
  // The capacity's bytes: CheckOp bounds every op's tokens x hidden by it. Stream-ordered, so
  // the allocation waits for no kernel (a resident doorbell kernel, a peer's NCCL op).
  const size_t bytes =
      static_cast<size_t>(options_.max_tokens) * options_.max_hidden * DTypeSize(options_.dtype);
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&unfused_scratch_, bytes, stream_));
  return absl::OkStatus();
}

void CudaEngine::Abort() {
  absl::MutexLock state(&state_mu_);
  if (abortable_ != nullptr) abortable_->Abort();
  spdlog::warn("event=engine_abort rank={}", options_.rank);
}

EngineStatus CudaEngine::Status() const {
  absl::MutexLock state(&state_mu_);
  EngineStatus s = status_;
  uint32_t error = abortable_ != nullptr ? abortable_->error_code() : 0;
  if (abortable_ != nullptr && error == 0 && exported_.load()) {
    // In-stream kernels record errors in the workspace only (their host word is the client's).
    absl::StatusOr<InStreamCounters> c =
        abortable_->ReadInStreamCounters(absl::Now() + kInStreamReadTimeout);
    if (c.ok()) instream_error_.store(c->error);
    error = instream_error_.load();
  }
  if (error != 0) {
    s.state = WorkspaceState::kPoisoned;
    s.fusion_enabled = false;
    s.reason = absl::StrCat("workspace poisoned: ", FusionErrorName(error));
  }
  return s;
}

}  // namespace arfuse
