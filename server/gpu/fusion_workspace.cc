#include "server/gpu/fusion_workspace.h"

#include <atomic>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/gpu/cuda_status.h"
#include "server/gpu/group_step.h"
#include "server/peers/exchange.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

// How long the destructor waits for this rank's kernels to notice the abort word before it
// leaks the memory instead of freeing it under a running kernel.
constexpr absl::Duration kTeardownGrace = absl::Seconds(1);
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
  ARFUSE_RETURN_IF_ERROR(
      StatusStep(exchange, "workspace.host_words", alloc, "workspace abort/error words", deadline));
  ws->last_stream_ = stream;
  ARFUSE_RETURN_IF_ERROR(ws->InitAndBarrier(exchange, stream, "workspace.initialized", deadline));
  ws->generation_ = 1;
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
  memory_.reset();
  ARFUSE_CUDA_LOG_IF_ERROR(cudaFreeHost(host_words_));
}

absl::Status FusionWorkspace::InitAndBarrier(Exchange& exchange, cudaStream_t stream,
                                             const std::string& tag, absl::Time deadline) {
  StoreWord(&host_words_->abort, 0);
  StoreWord(&host_words_->error, 0);
  absl::Status init = ARFUSE_CUDA_STATUS(LaunchWorkspaceInit(memory_->local(), layout_, stream));
  if (init.ok()) init = WaitStream(stream, deadline);
  // Every rank's workspace holds its sentinels before any rank stores into a peer.
  return StatusStep(exchange, tag, init, "workspace init", deadline);
}

absl::Status FusionWorkspace::CheckFits(uint32_t num_tokens, uint32_t hidden, DType dtype) const {
  if (dtype != layout_.dtype) {
    return absl::InvalidArgumentError(absl::StrCat("dtype ", DTypeName(dtype),
                                                   " does not match the workspace dtype ",
                                                   DTypeName(layout_.dtype)));
  }
  if (hidden == 0 || hidden % kHiddenMultiple != 0 || hidden > MaxFusionHidden(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden ", hidden, " must be a positive multiple of ", kHiddenMultiple,
                     " up to ", MaxFusionHidden(dtype)));
  }
  const uint64_t elements = static_cast<uint64_t>(num_tokens) * hidden;
  const uint64_t capacity = static_cast<uint64_t>(layout_.max_tokens) * layout_.hidden;
  if (elements > capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "op of ", num_tokens, " tokens x ", hidden, " hidden does not fit the workspace (",
        layout_.max_tokens, " tokens x ", layout_.hidden, " hidden)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<FusionParams> FusionWorkspace::MakeParams(const OpArgs& op, FusionAlgo algo) const {
  ARFUSE_RETURN_IF_ERROR(CheckFits(op.num_tokens, op.hidden, op.dtype));
  FusionParams p = {};
  for (int r = 0; r < memory_->world_size(); ++r) p.peer_workspace[r] = memory_->peer(r);
  p.input = op.input;
  p.output = op.output;
  p.residual_in = op.residual_in;
  p.residual_out = op.residual_out;
  p.norm_out = op.norm_out;
  p.gamma = op.gamma;
  p.host_abort = &device_host_words_->abort;
  p.host_error = &device_host_words_->error;
  p.spin_timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(options_.spin_timeout));
  p.layout = layout_;
  p.num_tokens = op.num_tokens;
  p.hidden = op.hidden;
  p.eps = op.eps;
  p.rank = memory_->rank();
  p.world_size = memory_->world_size();
  p.sm_budget = options_.sm_budget;
  p.dtype = op.dtype;
  p.pattern = op.pattern;
  p.algo = algo;
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
}

absl::Status FusionWorkspace::Reinitialize(Exchange& exchange, cudaStream_t stream,
                                           absl::Time deadline) {
  // Anything of ours still spinning exits now; then every rank confirms its stream is idle, so
  // no peer kernel writes into a workspace while it is being reset.
  Abort();
  absl::Status idle = WaitStream(stream, deadline);
  ARFUSE_RETURN_IF_ERROR(
      StatusStep(exchange, "workspace.quiesced", idle, "workspace quiesce", deadline));
  ARFUSE_RETURN_IF_ERROR(InitAndBarrier(exchange, stream, "workspace.reinitialized", deadline));
  ++generation_;
  spdlog::info("event=workspace_reinitialized rank={} generation={}", exchange.rank(), generation_);
  return absl::OkStatus();
}

}  // namespace arfuse
