#include "server/cuda_device/fusion_workspace.h"

#include <atomic>
#include <cstddef>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/allreduce_fusion/fusion_control.h"
#include "kernels/common/plain_status_absl.h"
#include "kernels/contract/op_contract.h"
#include "server/collective/group_step.h"
#include "server/cuda_device/cuda_status.h"
#include "server/peers/exchange.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

// How long the destructor waits for this rank's kernels to notice the abort word before it
// leaks the memory instead of freeing it under a running kernel.
constexpr absl::Duration kTeardownGrace = absl::Seconds(1);
// How long a re-initialization waits after the abort for in-stream launches to leave.
constexpr absl::Duration kInStreamQuiesce = absl::Milliseconds(10);
// How long waits spin before they start sleeping between polls.
constexpr absl::Duration kHotPoll = absl::Milliseconds(1);

uint32_t LoadWord(uint32_t* word) {
  return std::atomic_ref<uint32_t>(*word).load(std::memory_order_acquire);
}
void StoreWord(uint32_t* word, uint32_t value) {
  std::atomic_ref<uint32_t>(*word).store(value, std::memory_order_release);
}

template <typename Query>
absl::Status PollUntil(Query query, absl::Time deadline, const char* what) {
  const absl::Time start = absl::Now();
  while (true) {
    cudaError_t err = query();
    if (err == cudaSuccess) return absl::OkStatus();
    if (err != cudaErrorNotReady) return ARFUSE_CUDA_STATUS(err);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, " did not complete before the deadline"));
    }
    // Short ops are awaited hot; long ones (a peer that is late) must not burn a core each.
    if (absl::Now() - start < kHotPoll) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(absl::Microseconds(50));
    }
  }
}

// Generations of every workspace this process makes, so a workspace made after another one was
// dropped never reuses its generation tags (a graph replayed on the old memory stays stale).
std::atomic<uint64_t> g_last_generation{0};

}  // namespace

absl::Status WaitStream(cudaStream_t stream, absl::Time deadline) {
  return PollUntil([stream] { return cudaStreamQuery(stream); }, deadline, "GPU work");
}

absl::Status WaitEvent(cudaEvent_t event, absl::Time deadline) {
  return PollUntil([event] { return cudaEventQuery(event); }, deadline, "GPU op");
}

absl::StatusOr<std::unique_ptr<FusionWorkspace>> FusionWorkspace::Create(
    Exchange& exchange, const WorkspaceOptions& options, cudaStream_t stream, absl::Time deadline) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    return absl::FailedPreconditionError(
        "workspaces are created before CUDA-graph capture, never during it");
  }
  const char* why = nullptr;
  const WorkspaceLayout layout = ComputeWorkspaceLayout(exchange.world_size(), options.max_tokens,
                                                        options.hidden, options.dtype, &why);
  if (layout.total_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot size a workspace for world_size=", exchange.world_size(),
        " max_tokens=", options.max_tokens, " hidden=", options.hidden,
        " dtype=", DTypeName(options.dtype), ": ", why != nullptr ? why : "unsupported"));
  }
  std::unique_ptr<FusionWorkspace> ws(new FusionWorkspace(options, layout));
  if (options.backend == "trtllm") {
    ARFUSE_ASSIGN_OR_RETURN(ws->memory_,
                            CreateIpcPeerMemory(exchange, layout.total_bytes, deadline));
  } else if (options.backend == "mnnvl") {
    ARFUSE_ASSIGN_OR_RETURN(ws->memory_, CreateVmmPeerMemory(exchange, layout.total_bytes,
                                                             options.vmm_handle, deadline));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown fused backend \"", options.backend, "\" (expected trtllm or mnnvl)"));
  }
  void* host = nullptr;
  absl::Status alloc =
      ARFUSE_CUDA_STATUS(cudaHostAlloc(&host, sizeof(HostWords), cudaHostAllocMapped));
  if (alloc.ok()) {
    ws->host_words_ = static_cast<HostWords*>(host);
    ws->host_words_->abort = 0;
    ws->host_words_->error = 0;
    void* device = nullptr;
    alloc = ARFUSE_CUDA_STATUS(cudaHostGetDevicePointer(&device, host, 0));
    ws->device_host_words_ = static_cast<HostWords*>(device);
  }
  if (alloc.ok()) {
    void* staging = nullptr;
    alloc =
        ARFUSE_CUDA_STATUS(cudaHostAlloc(&staging, sizeof(ControlStaging), cudaHostAllocDefault));
    ws->staging_ = static_cast<ControlStaging*>(staging);
  }
  if (alloc.ok()) {
    alloc =
        ARFUSE_CUDA_STATUS(cudaStreamCreateWithFlags(&ws->control_stream_, cudaStreamNonBlocking));
  }
  ARFUSE_RETURN_IF_ERROR(
      StatusStep(exchange, "workspace.host_words", alloc, "workspace abort/error words", deadline));
  ws->last_stream_ = stream;
  const uint64_t generation = g_last_generation.fetch_add(1) + 1;
  ARFUSE_RETURN_IF_ERROR(
      ws->InitAndBarrier(exchange, stream, "workspace.initialized", generation, deadline));
  ws->generation_ = generation;
  spdlog::info(
      "event=workspace_ready backend={} kind={} rank={} world_size={} max_tokens={} hidden={} "
      "dtype={} bytes_per_rank={}",
      options.backend, ws->kind(), exchange.rank(), exchange.world_size(), options.max_tokens,
      options.hidden, DTypeName(options.dtype), ws->bytes_per_rank());
  return ws;
}

FusionWorkspace::~FusionWorkspace() {
  if (host_words_ == nullptr) return;
  Abort();
  absl::Status idle = WaitStream(last_stream_, absl::Now() + kTeardownGrace);
  if (!idle.ok()) {
    // Freeing memory a kernel still reads is undefined; leaking it until the process exits is
    // not. The daemon restarts on sticky errors, which is when this happens.
    spdlog::error("event=workspace_leaked reason=kernels_still_running");
    static_cast<void>(memory_.release());
    return;
  }
  if (staging_ != nullptr && control_stream_ != nullptr && memory_ != nullptr) {
    // A client may keep this memory mapped (VMM handles are reference counted) and replay a
    // graph on it: a zero tag makes every such launch stale instead of waiting for peers that
    // moved on to another workspace.
    absl::Status retired = WriteGenerationTag(0, control_stream_);
    if (retired.ok()) retired = WaitStream(control_stream_, absl::Now() + kTeardownGrace);
    if (!retired.ok()) {
      spdlog::warn("event=workspace_retire_failed error=\"{}\"", std::string(retired.message()));
    }
  }
  memory_.reset();
  if (control_stream_ != nullptr) ARFUSE_CUDA_LOG_IF_ERROR(cudaStreamDestroy(control_stream_));
  if (staging_ != nullptr) ARFUSE_CUDA_LOG_IF_ERROR(cudaFreeHost(staging_));
  ARFUSE_CUDA_LOG_IF_ERROR(cudaFreeHost(host_words_));
}

absl::Status FusionWorkspace::WriteGenerationTag(uint32_t tag, cudaStream_t stream) {
  staging_->tag = tag;
  char* control = static_cast<char*>(memory_->local()) + layout_.control_offset;
  return ARFUSE_CUDA_STATUS(cudaMemcpyAsync(control + offsetof(FusionControl, generation),
                                            &staging_->tag, sizeof(uint32_t),
                                            cudaMemcpyHostToDevice, stream));
}

absl::Status FusionWorkspace::InitAndBarrier(Exchange& exchange, cudaStream_t stream,
                                             const std::string& tag, uint64_t generation,
                                             absl::Time deadline) {
  StoreWord(&host_words_->abort, 0);
  StoreWord(&host_words_->error, 0);
  absl::Status init = ARFUSE_CUDA_STATUS(LaunchWorkspaceInit(memory_->local(), layout_, stream));
  // The init zeroed the tag: in-stream launches of an older generation stay refused, and those of
  // this one run once it is written (stream order: after the init).
  if (init.ok()) init = WriteGenerationTag(GenerationTag(generation), stream);
  if (init.ok()) init = WaitStream(stream, deadline);
  // Every rank's workspace holds its sentinels before any rank stores into a peer.
  return StatusStep(exchange, tag, init, "workspace init", deadline);
}

absl::StatusOr<InStreamCounters> FusionWorkspace::ReadInStreamCounters(absl::Time deadline) {
  std::lock_guard<std::mutex> lock(control_mu_);
  const char* control = static_cast<const char*>(memory_->local()) + layout_.control_offset;
  static_assert(sizeof(ControlStaging::control) >= offsetof(FusionControl, instream_stale) + 8);
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging_->control, control, sizeof(staging_->control),
                                              cudaMemcpyDeviceToHost, control_stream_));
  static_assert(sizeof(ControlStaging::instream_ops) == sizeof(FusionControl::instream_ops));
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(staging_->instream_ops, control + offsetof(FusionControl, instream_ops),
                      sizeof(staging_->instream_ops), cudaMemcpyDeviceToHost, control_stream_));
  ARFUSE_RETURN_IF_ERROR(WaitStream(control_stream_, deadline));
  FusionControl c;
  std::memcpy(&c, staging_->control, sizeof(staging_->control));
  InStreamCounters out;
  out.launches = c.instream_launches;
  out.stale = c.instream_stale;
  out.error = c.error;
  out.op_in_flight = c.lamport_arrived != 0 || c.twoshot_arrived != 0;
  out.ops.emplace();
  std::memcpy(&*out.ops, staging_->instream_ops, sizeof(staging_->instream_ops));
  return out;
}

void FusionWorkspace::PoisonGroup(FusionError code) {
  if (staging_ == nullptr || control_stream_ == nullptr || memory_ == nullptr) return;
  std::lock_guard<std::mutex> lock(control_mu_);
  staging_->error = static_cast<uint32_t>(code);
  staging_->abort = static_cast<uint32_t>(FusionError::kHostAbort);
  staging_->peer_abort = static_cast<uint32_t>(FusionError::kPeerAbort);
  char* own = static_cast<char*>(memory_->local()) + layout_.control_offset;
  // The caller read the error word as 0 just before; a kernel that recorded a code since is
  // overwritten, which changes only the reason: the workspace is poisoned either way.
  ARFUSE_CUDA_LOG_IF_ERROR(cudaMemcpyAsync(own + offsetof(FusionControl, error), &staging_->error,
                                           sizeof(uint32_t), cudaMemcpyHostToDevice,
                                           control_stream_));
  ARFUSE_CUDA_LOG_IF_ERROR(cudaMemcpyAsync(own + offsetof(FusionControl, abort), &staging_->abort,
                                           sizeof(uint32_t), cudaMemcpyHostToDevice,
                                           control_stream_));
  // The peers' abort words, over the peer mappings this rank launches with: a peer's next launch
  // refuses (kPeerAbort) instead of reading what the client published into its buffers.
  for (int r = 0; r < memory_->world_size(); ++r) {
    if (r == memory_->rank()) continue;
    char* peer = static_cast<char*>(memory_->peer(r)) + layout_.control_offset;
    ARFUSE_CUDA_LOG_IF_ERROR(cudaMemcpyAsync(peer + offsetof(FusionControl, abort),
                                             &staging_->peer_abort, sizeof(uint32_t),
                                             cudaMemcpyDefault, control_stream_));
  }
  if (host_words_ != nullptr) StoreWord(&host_words_->abort, 1);
}

absl::Status FusionWorkspace::CheckFits(uint32_t num_tokens, uint32_t hidden, DType dtype) const {
  return ToAbsl(contract::CheckOp(contract::OpShape{dtype, hidden, num_tokens},
                                  contract::CapacityOf(layout_), contract::OpVoice::kEngine));
}

absl::StatusOr<FusionParams> FusionWorkspace::MakeParams(const OpArgs& op, FusionAlgo algo) const {
  ARFUSE_RETURN_IF_ERROR(CheckFits(op.num_tokens, op.hidden, op.dtype));
  void* peers[kMaxWorldSize] = {};
  for (int r = 0; r < memory_->world_size(); ++r) peers[r] = memory_->peer(r);
  FusionLaunchSite site;
  site.peer_workspace = peers;
  site.rank = memory_->rank();
  site.world_size = memory_->world_size();
  site.layout = layout_;
  site.spin_timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(options_.spin_timeout));
  site.sm_budget = options_.sm_budget;
  site.host_abort = &device_host_words_->abort;
  site.host_error = &device_host_words_->error;
  FusionParams p = MakeFusionParams(op, algo, site);
  const char* why = nullptr;
  if (CheckFusionParams(p, &why) != cudaSuccess) {
    return absl::InvalidArgumentError(
        absl::StrCat("fused kernel refused the op: ", why != nullptr ? why : "invalid arguments"));
  }
  return p;
}

absl::Status FusionWorkspace::Launch(const OpArgs& op, FusionAlgo algo, cudaStream_t stream) {
  if (poisoned()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "workspace is poisoned (", FusionErrorName(error_code()), "): re-initialize every rank"));
  }
  ARFUSE_ASSIGN_OR_RETURN(const FusionParams p, MakeParams(op, algo));
  last_stream_ = stream;
  ARFUSE_CUDA_RETURN_IF_ERROR(LaunchAllReduceFusion(p, stream));
  return absl::OkStatus();
}

uint32_t FusionWorkspace::error_code() const { return LoadWord(&host_words_->error); }

void FusionWorkspace::Abort() {
  if (host_words_ != nullptr) StoreWord(&host_words_->abort, 1);
  // In-stream launches do not see the host word (it lives in this process): the workspace's own
  // abort word reaches them. A copy engine writes it, so a GPU full of spinning blocks cannot
  // hold it back; cudaMemcpyAsync from pinned memory returns at once.
  if (staging_ != nullptr && control_stream_ != nullptr && memory_ != nullptr) {
    staging_->abort = static_cast<uint32_t>(FusionError::kHostAbort);
    char* control = static_cast<char*>(memory_->local()) + layout_.control_offset;
    ARFUSE_CUDA_LOG_IF_ERROR(cudaMemcpyAsync(control + offsetof(FusionControl, abort),
                                             &staging_->abort, sizeof(uint32_t),
                                             cudaMemcpyHostToDevice, control_stream_));
  }
}

absl::Status FusionWorkspace::Reinitialize(Exchange& exchange, cudaStream_t stream,
                                           absl::Time deadline) {
  // Anything of ours still spinning exits now; then every rank confirms its stream is idle, so
  // no peer kernel writes into a workspace while it is being reset.
  Abort();
  absl::Status idle = WaitStream(stream, deadline);
  // In-stream launches run in clients' streams, which this rank cannot wait for: they see the
  // abort word within microseconds (every spin polls it); this leaves them ample time to leave
  // before the reset, and launches that start later find a stale tag.
  if (idle.ok()) idle = WaitStream(control_stream_, deadline);
  absl::SleepFor(kInStreamQuiesce);
  ARFUSE_RETURN_IF_ERROR(
      StatusStep(exchange, "workspace.quiesced", idle, "workspace quiesce", deadline));
  const uint64_t generation = g_last_generation.fetch_add(1) + 1;
  ARFUSE_RETURN_IF_ERROR(
      InitAndBarrier(exchange, stream, "workspace.reinitialized", generation, deadline));
  generation_ = generation;
  spdlog::info("event=workspace_reinitialized rank={} generation={}", exchange.rank(), generation_);
  return absl::OkStatus();
}

}  // namespace arfuse
