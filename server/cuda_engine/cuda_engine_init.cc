// CudaEngine::Initialize (collective): the ranks' hello, NCCL, the workspace and the votes; and
// the workspace's drop, which takes the planes' hold on it first.
#include <unistd.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "server/collective/group_step.h"
#include "server/cuda_device/cuda_status.h"
#include "server/cuda_device/fusion_workspace.h"
#include "server/cuda_device/nccl_comm.h"
#include "server/cuda_engine/cuda_engine.h"
#include "server/doorbell/doorbell_dispatch.h"
#include "server/peers/exchange.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

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
  // The planes step aside before the workspace is touched (the doorbell plane, docs/doorbell.md:
  // Pause, re-initialize, ResetSlots, Resume). A doorbell op that waits for a peer ends at the
  // latest when Reinitialize aborts the workspace.
  planes_.BeforeReinitialize(deadline);
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
  // Re-initialized in place: the doorbell plans stay; their slots are re-armed and the plane runs
  // again.
  planes_.Reinitialized(deadline);

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

void CudaEngine::ResetWorkspaceLocked() {
  if (workspace_ != nullptr) {
    // A doorbell op spinning on a peer ends now; the planes let go of the workspace.
    workspace_->Abort();
    planes_.WorkspaceDropped("its workspace is rebuilt or dropped");
  }
  workspace_.reset();
}

}  // namespace arfuse
