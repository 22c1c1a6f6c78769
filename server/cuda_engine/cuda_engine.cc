#include "server/cuda_engine/cuda_engine.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/add_rmsnorm/add_rmsnorm.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/common/plain_status_absl.h"
#include "server/doorbell/doorbell_dispatch.h"
#include "server/gpu/cuda_status.h"
#include "server/gpu/fusion_workspace.h"
#include "server/gpu/group_step.h"
#include "server/gpu/nccl_comm.h"
#include "server/gpu/op_agreement.h"
#include "server/instream/cuda/workspace_export.h"
#include "server/peers/exchange.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

// How long a copy of the workspace's control words may take (a copy engine; never behind ops).
constexpr absl::Duration kInStreamReadTimeout = absl::Milliseconds(20);

// What every rank tells the others at the start of Initialize.
struct Hello {
  uint64_t generation = 0;
  bool has_workspace = false;
  bool has_nccl = false;
  int sms = 0;
  std::string device;  // host name + GPU UUID
};

std::string EncodeHello(const Hello& h) {
  return absl::StrCat(h.generation, "|", h.has_workspace ? 1 : 0, "|", h.has_nccl ? 1 : 0, "|",
                      h.sms, "|", h.device);
}

absl::StatusOr<Hello> DecodeHello(const std::string& s) {
  std::vector<std::string> parts = absl::StrSplit(s, absl::MaxSplits('|', 4));
  Hello h;
  int ws = 0, nc = 0;
  if (parts.size() != 5 || !absl::SimpleAtoi(parts[0], &h.generation) ||
      !absl::SimpleAtoi(parts[1], &ws) || !absl::SimpleAtoi(parts[2], &nc) ||
      !absl::SimpleAtoi(parts[3], &h.sms)) {
    return absl::InternalError("malformed engine hello from a peer");
  }
  h.has_workspace = ws != 0;
  h.has_nccl = nc != 0;
  h.device = parts[4];
  return h;
}

absl::StatusOr<std::string> DeviceIdentity(int device) {
  cudaDeviceProp prop;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string uuid;
  for (char c : prop.uuid.bytes)
    absl::StrAppend(&uuid, absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
  return absl::StrCat(host, "/", uuid);
}

std::string VoteReasons(const VoteResult& v) {
  std::string out;
  for (const std::string& r : v.reasons) absl::StrAppend(&out, out.empty() ? "" : "; ", r);
  return out;
}

// Half of what is left: a collective that can hang on a missing rank (NCCL init) must leave
// time for the vote that follows it.
absl::Time HalfwayTo(absl::Time deadline) {
  const absl::Time now = absl::Now();
  if (deadline <= now || deadline == absl::InfiniteFuture()) return deadline;
  return now + (deadline - now) / 2;
}

}  // namespace

CudaEngine::CudaEngine(const EngineOptions& options, const CudaEngineOptions& cuda_options)
    : options_(options),
      cuda_options_(cuda_options),
      doorbell_(options.rank, options.spin_timeout) {
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
    doorbell_.Leak();
    static_cast<void>(workspace_.release());
    static_cast<void>(sym_nccl_.release());
    static_cast<void>(nccl_.release());
    return;
  }
  // The doorbell plane goes before its workspace: the abort sends its waiters away (and ends a
  // fused op spinning on a peer), then the plane stops; workspace teardown then waits a bounded
  // time for its spins; NCCL aborts its communicator.
  if (workspace_ != nullptr) workspace_->Abort();
  doorbell_.Close();
  workspace_.reset();
  sym_nccl_.reset();
  nccl_.reset();
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

absl::Status CudaEngine::Initialize(Exchange& exchange, absl::Time deadline) {
  if (exchange.world_size() != options_.world_size || exchange.rank() != options_.rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "exchange is rank ", exchange.rank(), " of ", exchange.world_size(),
        " but the engine was made for rank ", options_.rank, " of ", options_.world_size));
  }
  if (!mu_.LockWhenWithDeadline(absl::Condition::kTrue, deadline)) {
    mu_.Unlock();
    return absl::DeadlineExceededError("an op held the engine until the initialize deadline");
  }
  absl::Status s = InitializeLocked(exchange, deadline);
  mu_.Unlock();
  if (!s.ok()) {
    absl::MutexLock state(&state_mu_);
    status_.state = WorkspaceState::kInitializing;
    status_.fusion_enabled = false;
    status_.reason = absl::StrCat("initialize failed: ", s.message());
    spdlog::error("event=engine_init_failed rank={} code={}", options_.rank,
                  absl::StatusCodeToString(s.code()));
  }
  return s;
}

absl::Status CudaEngine::InitializeLocked(Exchange& exchange, absl::Time deadline) {
  exchange_ = &exchange;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const int world = options_.world_size;
  // The doorbell plane stops queuing and its waiters leave before the workspace is touched
  // (docs/doorbell.md: Pause, re-initialize, ResetSlots, Resume). A doorbell op that waits for a
  // peer ends at the latest when Reinitialize aborts the workspace.
  doorbell_.PauseForReinitialize(deadline);
  {
    absl::MutexLock state(&state_mu_);
    status_.state = WorkspaceState::kInitializing;
    status_.fusion_enabled = false;
  }
  Hello mine;
  {
    absl::MutexLock state(&state_mu_);
    mine.generation = status_.generation;
  }
  mine.has_workspace = workspace_ != nullptr;
  mine.has_nccl = nccl_ != nullptr;
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&mine.sms, cudaDevAttrMultiProcessorCount, device_));
  absl::StatusOr<std::string> hello = DeviceIdentity(device_);
  if (hello.ok()) {
    mine.device = *hello;
    hello = EncodeHello(mine);
  }
  ARFUSE_ASSIGN_OR_RETURN(std::vector<std::string> hellos,
                          AllgatherStep(exchange, "engine.hello", hello, "engine hello", deadline));
  uint64_t generation = 0;
  bool all_have_workspace = true, all_have_nccl = true;
  int min_sms = mine.sms;
  std::map<std::string, int> per_gpu;
  for (const std::string& h : hellos) {
    ARFUSE_ASSIGN_OR_RETURN(Hello peer, DecodeHello(h));
    generation = std::max(generation, peer.generation);
    all_have_workspace &= peer.has_workspace;
    all_have_nccl &= peer.has_nccl;
    min_sms = std::min(min_sms, peer.sms);
    ++per_gpu[peer.device];
  }
  ++generation;
  int max_share = 0;
  for (const auto& [device, n] : per_gpu) max_share = std::max(max_share, n);
  shares_gpu_ = max_share > 1;
  // Ranks sharing one GPU (MPS) must not starve each other of SMs while they spin: each gets an
  // equal share, the same number on every rank so every rank's grid is the same. With the
  // doorbell plane every rank also keeps a waiter or a serving launch resident, and its client a
  // ring block (docs/doorbell.md): the fused grids leave room for all of them, since a serving
  // launch of one rank stays resident while another rank's fused grid (an eager prefill op)
  // runs (SharedGpuSmBudget).
  const uint32_t sm_budget =
      cuda_options_.sm_budget != 0
          ? cuda_options_.sm_budget
          : (shares_gpu_ ? SharedGpuSmBudget(
                               min_sms, max_share, cuda_options_.enable_doorbell,
                               DoorbellServeBlocksFor(cuda_options_.doorbell_serve_blocks, true))
                         : 0);
  PrefixedExchange ex(exchange, absl::StrCat("g", generation, "/"));

  // Unfused path: NCCL. Kept when every rank still has its communicator.
  std::string nccl_reason;
  if (!all_have_nccl) {
    symmetric_buffer_ = nullptr;
    symmetric_bytes_ = 0;
    sym_nccl_.reset();
    nccl_.reset();
  }
  if (!cuda_options_.enable_nccl) {
    sym_nccl_.reset();
    nccl_.reset();
    nccl_reason = "NCCL disabled by options";
  } else if (shares_gpu_) {
    nccl_.reset();
    nccl_reason = "ranks share a GPU (NCCL refuses duplicate GPUs)";
  } else if (nccl_ == nullptr) {
    absl::StatusOr<std::unique_ptr<NcclComm>> comm = NcclComm::Create(ex, HalfwayTo(deadline));
    ARFUSE_ASSIGN_OR_RETURN(
        VoteResult voted, ex.Vote("nccl.ok", comm.ok(),
                                  comm.ok() ? "" : std::string(comm.status().message()), deadline));
    if (voted.all_yes) {
      nccl_ = std::move(*comm);
      const size_t cap = static_cast<size_t>(options_.max_tokens) * options_.max_hidden *
                         DTypeSize(options_.dtype);
      if (cuda_options_.enable_nccl_symmetric) {
        absl::StatusOr<std::unique_ptr<NcclComm>> sym_comm =
            NcclComm::Create(ex, HalfwayTo(deadline), /*blocking=*/true);
        absl::StatusOr<void*> sym = sym_comm.ok()
                                        ? (*sym_comm)->AllocSymmetric(cap, HalfwayTo(deadline))
                                        : absl::StatusOr<void*>(sym_comm.status());
        ARFUSE_ASSIGN_OR_RETURN(
            VoteResult sym_voted,
            ex.Vote("nccl.symmetric", sym.ok(), sym.ok() ? "" : std::string(sym.status().message()),
                    deadline));
        if (sym_voted.all_yes) {
          sym_nccl_ = std::move(*sym_comm);
          symmetric_buffer_ = *sym;
          symmetric_bytes_ = cap;
        } else {
          spdlog::warn("event=nccl_symmetric_unavailable rank={} reason=\"{}\"", options_.rank,
                       VoteReasons(sym_voted));
        }
      }
    } else {
      nccl_reason = absl::StrCat("NCCL unavailable: ", VoteReasons(voted));
    }
  }

  // Fused path.
  std::string fuse_reason;
  const bool fused_backend = options_.backend == "trtllm" || options_.backend == "mnnvl";
  if (!fused_backend) {
    fuse_reason = options_.unfused_reason.empty()
                      ? absl::StrCat("backend ", options_.backend, ": unfused")
                      : absl::StrCat("fusion off: ", options_.unfused_reason);
  } else if (!IsSupportedWorldSize(world)) {
    fuse_reason = absl::StrCat("world size ", world, " is not fused (2, 4, 8 or 16)");
  }
  {
    absl::MutexLock state(&state_mu_);
    abortable_ = nullptr;
  }
  if (!fuse_reason.empty()) {
    ResetWorkspaceLocked();
  } else {
    absl::Status built;
    if (all_have_workspace && workspace_ != nullptr &&
        workspace_->options().sm_budget == sm_budget) {
      built = workspace_->Reinitialize(ex, stream_, deadline);
    } else {
      ResetWorkspaceLocked();
      WorkspaceOptions wo;
      wo.backend = options_.backend;
      wo.vmm_handle = cuda_options_.vmm_handle;
      wo.max_tokens = options_.max_tokens;
      wo.hidden = options_.max_hidden;
      wo.dtype = options_.dtype;
      wo.spin_timeout = options_.spin_timeout;
      wo.sm_budget = sm_budget;
      absl::StatusOr<std::unique_ptr<FusionWorkspace>> ws =
          FusionWorkspace::Create(ex, wo, stream_, deadline);
      built = ws.status();
      if (ws.ok()) workspace_ = std::move(*ws);
    }
    // A rank that cannot fuse while its peers spin would hang them: all fuse or none does.
    ARFUSE_ASSIGN_OR_RETURN(
        VoteResult voted,
        ex.Vote("fuse.ok", built.ok(), built.ok() ? "" : std::string(built.message()), deadline));
    if (!voted.all_yes) {
      ResetWorkspaceLocked();
      fuse_reason = absl::StrCat("fused workspace unavailable: ", VoteReasons(voted));
    }
  }
  // Re-initialized in place: the plans stay; their slots are re-armed and the plane runs again.
  doorbell_.ReArm(deadline);

  absl::MutexLock state(&state_mu_);
  status_.generation = generation;
  status_.backend = options_.backend;
  status_.workspace_bytes = workspace_ != nullptr ? workspace_->bytes_per_rank() : 0;
  if (workspace_ != nullptr) {
    abortable_ = workspace_.get();
    status_.state = WorkspaceState::kReady;
    status_.fusion_enabled = true;
    status_.reason =
        nccl_ != nullptr ? "fused, NCCL fallback ready" : absl::StrCat("fused only: ", nccl_reason);
  } else if (nccl_ != nullptr) {
    status_.state = WorkspaceState::kUnfused;
    status_.fusion_enabled = false;
    status_.reason = fuse_reason;
  } else {
    // Fusion is off (or impossible) and NCCL cannot run either (ranks sharing a GPU): the
    // sidecar still comes up, says so, and refuses every op with FAILED_PRECONDITION, so clients
    // take their own path at once instead of waiting for a workspace that never comes.
    status_.state = WorkspaceState::kUnfused;
    status_.fusion_enabled = false;
    status_.reason = absl::StrCat("no path in the sidecar (", fuse_reason, "; ", nccl_reason,
                                  "): clients run their own path");
  }
  spdlog::info(
      "event=engine_ready rank={} world_size={} generation={} backend={} fused={} nccl={} "
      "nccl_symmetric={} shares_gpu={} sm_budget={} workspace_bytes={}",
      options_.rank, world, generation, options_.backend, workspace_ != nullptr, nccl_ != nullptr,
      symmetric_buffer_ != nullptr, shares_gpu_, sm_budget, status_.workspace_bytes);
  return absl::OkStatus();
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

  // Doorbell waiters queued ahead on the stream would hold this op back until their idle
  // timeout: they leave first, and are queued again behind it.
  EngineDoorbell::ResumeGuard resume_doorbell;
  ARFUSE_RETURN_IF_ERROR(doorbell_.PauseForOp(ctx.deadline, &resume_doorbell));

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
  // Waiters queue again behind the op at once, not after a synchronous wait.
  resume_doorbell.Now();
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
    // may equal input), so no scratch buffer is needed.
    ARFUSE_RETURN_IF_ERROR(
        nccl_->AllReduce(op.input, op.norm_out, count, op.dtype, stream_, deadline));
    reduced = op.norm_out;
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
  const char* why = nullptr;
  if (CheckAddRmsNormParams(p, &why) != cudaSuccess) {
    return absl::InvalidArgumentError(
        absl::StrCat("add-RMSNorm refused the op: ", why != nullptr ? why : "invalid arguments"));
  }
  ARFUSE_CUDA_RETURN_IF_ERROR(LaunchAddRmsNorm(p, stream_));
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

void CudaEngine::ResetWorkspaceLocked() {
  if (workspace_ != nullptr) {
    // A doorbell op spinning on a peer ends now; the plane's waiters leave.
    workspace_->Abort();
    doorbell_.Drop("its workspace is rebuilt or dropped");
  }
  workspace_.reset();
}

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
  if (!doorbell_.active()) {
    ARFUSE_RETURN_IF_ERROR(doorbell_.Ensure(DoorbellOptionsLocked(), workspace_->generation()));
  }
  return doorbell_.AddPlan(params, max_tokens, dispatch, op.hidden);
}

absl::Status CudaEngine::RemoveDoorbellPlan(const DoorbellGrant& grant, absl::Time deadline) {
  if (!mu_.LockWhenWithDeadline(absl::Condition::kTrue, deadline)) {
    mu_.Unlock();
    return absl::DeadlineExceededError(
        "an op held the engine until the deadline; the doorbell plan was not removed");
  }
  cudaSetDevice(device_);
  absl::Status out = doorbell_.RemovePlan(grant, deadline);
  mu_.Unlock();
  return out;
}

DoorbellSlot* CudaEngine::doorbell_slot_for_testing(const DoorbellGrant& grant) const {
  absl::MutexLock lock(&mu_);
  return doorbell_.slot_for_testing(grant);
}

absl::StatusOr<DoorbellPlaneStatus> CudaEngine::DoorbellStatus() const {
  absl::MutexLock lock(&mu_);
  return doorbell_.Status();
}

}  // namespace arfuse
