#include "server/doorbell/doorbell_plane.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/core/status_macros.h"
#include "server/doorbell/scoped_device.h"
#include "server/engine/doorbell_host.h"
#include "server/gpu/cuda_status.h"
#include "spdlog/spdlog.h"

namespace arfuse {

static_assert(kDoorbellPlaneSlots == kMaxDoorbellSlots);
namespace {

using doorbell_internal::ScopedDevice;

constexpr uint32_t kMaxQueueDepth = 64;
// How long teardown waits for queued kernels to leave after the stop word (they see it within
// microseconds unless a fused op spins on a missing peer) before leaking instead of blocking.
constexpr absl::Duration kTeardownWait = absl::Milliseconds(200);
// Bound on the small side-stream jobs (plan upload, slot reset).
constexpr absl::Duration kSideStreamWait = absl::Seconds(2);

uint64_t ToNanos(absl::Duration d) { return static_cast<uint64_t>(absl::ToInt64Nanoseconds(d)); }

// The host writes the control words with plain release stores; the waiter polls them over PCIe.
void StoreControl(uint32_t* word, uint32_t value) {
  __atomic_store_n(word, value, __ATOMIC_RELEASE);
}

DoorbellReport ReadReport(const DoorbellReport* r) {
  const volatile DoorbellReport* v = r;
  DoorbellReport out{};
  out.outcome = v->outcome;
  out.slot = v->slot;
  out.num_tokens = v->num_tokens;
  out.error = v->error;
  out.served_in_place = v->served_in_place;
  out.error_in_place = v->error_in_place;
  return out;
}

void ClearReport(DoorbellReport* r) {
  volatile DoorbellReport* v = r;
  v->outcome = 0;
  v->slot = 0;
  v->num_tokens = 0;
  v->error = 0;
  v->served_in_place = 0;
  v->error_in_place = 0;
}

bool SameLayout(const WorkspaceLayout& a, const WorkspaceLayout& b) {
  return a.control_offset == b.control_offset && a.lamport_offset == b.lamport_offset &&
         a.lamport_buffer_bytes == b.lamport_buffer_bytes &&
         a.lamport_slot_bytes == b.lamport_slot_bytes && a.scatter_offset == b.scatter_offset &&
         a.scatter_slot_bytes == b.scatter_slot_bytes && a.gather_offset == b.gather_offset &&
         a.total_bytes == b.total_bytes && a.max_tokens == b.max_tokens && a.hidden == b.hidden &&
         a.world_size == b.world_size && a.dtype == b.dtype;
}

// Plans whose fused launch is the same kernel with the same grid rule (allreduce_fusion.h): the
// indirect launch queued for one runs the other's ops, and the serving launch runs both in place.
// (World size and rank are the plane's, alike for every plan.)
bool SameLaunchShape(const FusionParams& a, const FusionParams& b) {
  return a.dtype == b.dtype && a.pattern == b.pattern && a.hidden == b.hidden &&
         a.sm_budget == b.sm_budget;
}

bool UsesOneShot(const DoorbellPlanOptions& o) { return o.twoshot_min_tokens > 1; }
bool UsesTwoShot(const DoorbellPlanOptions& o) { return o.twoshot_min_tokens <= o.max_tokens; }

}  // namespace

absl::StatusOr<std::unique_ptr<DoorbellPlane>> DoorbellPlane::Create(
    const DoorbellPlaneOptions& options) {
  if (options.stream == nullptr) {
    return absl::InvalidArgumentError(
        "doorbell plane needs the engine's stream (the legacy default stream would serialize "
        "with every other stream)");
  }
  if (options.local_workspace == nullptr || options.layout.total_bytes == 0) {
    return absl::InvalidArgumentError("doorbell plane needs this rank's workspace and its layout");
  }
  if (options.device < 0) return absl::InvalidArgumentError("doorbell plane: device is negative");
  if (options.queue_depth == 0 || options.queue_depth > kMaxQueueDepth) {
    return absl::InvalidArgumentError(absl::StrCat("doorbell queue depth must be 1..",
                                                   kMaxQueueDepth, ", got ", options.queue_depth));
  }
  if (options.idle_timeout <= absl::ZeroDuration() || options.idle_timeout > absl::Seconds(60)) {
    return absl::InvalidArgumentError("doorbell idle timeout must be in (0, 60 s]");
  }
  if (options.poll_interval <= absl::ZeroDuration() ||
      options.poll_interval > absl::Milliseconds(100)) {
    return absl::InvalidArgumentError("doorbell poll interval must be in (0, 100 ms]");
  }
  if (options.max_poll_interval < options.poll_interval ||
      options.max_poll_interval > absl::Milliseconds(100)) {
    return absl::InvalidArgumentError(
        "doorbell max poll interval must be in [poll interval, 100 ms]");
  }
  if (options.serve_blocks > kMaxDoorbellServeBlocks) {
    return absl::InvalidArgumentError(absl::StrCat("doorbell serving launch runs at most ",
                                                   kMaxDoorbellServeBlocks, " blocks, got ",
                                                   options.serve_blocks));
  }
  if (options.trace_ops > kMaxDoorbellTraceOps) {
    return absl::InvalidArgumentError(absl::StrCat(
        "doorbell trace holds at most ", kMaxDoorbellTraceOps, " ops, got ", options.trace_ops));
  }
  std::unique_ptr<DoorbellPlane> plane(new DoorbellPlane(options));
  ARFUSE_RETURN_IF_ERROR(plane->Allocate());
  plane->thread_ = std::thread([p = plane.get()] { p->Loop(); });
  spdlog::info("event=doorbell_plane_created device={} queue_depth={} idle_timeout_ms={}",
               options.device, options.queue_depth,
               absl::ToDoubleMilliseconds(options.idle_timeout));
  return plane;
}

DoorbellPlane::DoorbellPlane(const DoorbellPlaneOptions& options)
    : options_(options), poll_wait_(options.poll_interval) {}

absl::Status DoorbellPlane::Allocate() {
  ScopedDevice device(options_.device);
  // Before any of the plane's kernels can be resident and spinning (kernels/doorbell/doorbell.h).
  ARFUSE_CUDA_RETURN_IF_ERROR(PrepareDoorbellSidecarKernels());
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
  void* raw = nullptr;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMalloc(&raw, sizeof(DoorbellBlock)));
  block_ = static_cast<DoorbellBlock*>(raw);
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMalloc(&raw, kMaxDoorbellSlots * sizeof(DoorbellPlanEntry)));
  plan_table_ = static_cast<DoorbellPlanEntry*>(raw);
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMalloc(&raw, sizeof(DoorbellOp)));
  op_ = static_cast<DoorbellOp*>(raw);
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(block_, 0, sizeof(DoorbellBlock), side_stream_));
  {
    // Every slot names the GPU that holds it: a client ringing from this GPU orders the op at GPU
    // scope (DoorbellRingScopeFor). Written once; no kernel touches these bytes.
    cudaDeviceProp prop;
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options_.device));
    uint8_t uuids[kMaxDoorbellSlots][sizeof(DoorbellSlot::owner_uuid)];
    static_assert(sizeof(prop.uuid.bytes) == sizeof(DoorbellSlot::owner_uuid));
    for (auto& u : uuids) std::memcpy(u, prop.uuid.bytes, sizeof(u));
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
        &block_->slots[0].owner_uuid, sizeof(DoorbellSlot), uuids, sizeof(uuids[0]),
        sizeof(uuids[0]), kMaxDoorbellSlots, cudaMemcpyHostToDevice, side_stream_));
    // The copy reads `uuids` (pageable, on this stack) until it completes.
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(side_stream_));
  }
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(plan_table_, 0, kMaxDoorbellSlots * sizeof(DoorbellPlanEntry), side_stream_));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(op_, 0, sizeof(DoorbellOp), side_stream_));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMalloc(&raw, sizeof(DoorbellServeState)));
  serve_state_ = static_cast<DoorbellServeState*>(raw);
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(serve_state_, 0, sizeof(DoorbellServeState), side_stream_));
  if (options_.trace_ops > 0) {
    const size_t bytes = options_.trace_ops * sizeof(DoorbellTraceRecord);
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaMalloc(&raw, bytes));
    trace_ = static_cast<DoorbellTraceRecord*>(raw);
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(trace_, 0, bytes, side_stream_));
  }

  ARFUSE_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&raw, sizeof(DoorbellControl), cudaHostAllocMapped));
  control_host_ = static_cast<DoorbellControl*>(raw);
  std::memset(control_host_, 0, sizeof(DoorbellControl));
  control_host_->generation = 1;
  void* device_view = nullptr;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device_view, control_host_, 0));
  control_device_ = static_cast<const DoorbellControl*>(device_view);
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaHostAlloc(&raw, options_.queue_depth * sizeof(DoorbellReport), cudaHostAllocMapped));
  reports_host_ = static_cast<DoorbellReport*>(raw);
  std::memset(reports_host_, 0, options_.queue_depth * sizeof(DoorbellReport));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device_view, reports_host_, 0));
  reports_device_ = static_cast<DoorbellReport*>(device_view);
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&raw, sizeof(DoorbellPlanEntry), cudaHostAllocDefault));
  staging_ = static_cast<DoorbellPlanEntry*>(raw);

  events_.resize(options_.queue_depth, nullptr);
  for (uint32_t i = 0; i < options_.queue_depth; ++i) {
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&events_[i], cudaEventDisableTiming));
  }
  {
    absl::MutexLock lock(&mu_);
    for (uint32_t i = options_.queue_depth; i > 0; --i) free_entries_.push_back(i - 1);
  }
  cudaIpcMemHandle_t handle;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, block_));
  static_assert(sizeof(handle) == 64, "the Doorbell message carries a 64-byte handle");
  ipc_handle_.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  return WaitSideStream(absl::Now() + kSideStreamWait, "doorbell memory reset");
}

DoorbellPlane::~DoorbellPlane() {
  Stop();
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
  }
  if (thread_.joinable()) thread_.join();
  // The stop word makes every queued waiter leave at once; give them a moment, never more.
  bool drained = false;
  const absl::Time deadline = absl::Now() + kTeardownWait;
  ScopedDevice device(options_.device);
  while (true) {
    bool busy = false;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [seq, entry] : inflight_) {
        if (cudaEventQuery(events_[entry]) == cudaErrorNotReady) busy = true;
      }
    }
    if (side_stream_ != nullptr && cudaStreamQuery(side_stream_) == cudaErrorNotReady) busy = true;
    if (!busy) {
      drained = true;
      break;
    }
    if (absl::Now() > deadline) break;
    absl::SleepFor(absl::Microseconds(200));
  }
  cudaGetLastError();
  if (!drained) {
    // A queued kernel still runs (most likely a fused op spinning on a peer until its spin
    // timeout): freeing now would wait for it. Leak the few KiB instead.
    spdlog::warn(
        "event=doorbell_teardown_leak reason=\"doorbell kernels still running after {} ms; "
        "their memory is not freed\"",
        absl::ToInt64Milliseconds(kTeardownWait));
    return;
  }
  for (cudaEvent_t e : events_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (side_stream_ != nullptr) cudaStreamDestroy(side_stream_);
  if (block_ != nullptr) cudaFree(block_);
  if (plan_table_ != nullptr) cudaFree(plan_table_);
  if (op_ != nullptr) cudaFree(op_);
  if (serve_state_ != nullptr) cudaFree(serve_state_);
  if (trace_ != nullptr) cudaFree(trace_);
  if (control_host_ != nullptr) cudaFreeHost(control_host_);
  if (reports_host_ != nullptr) cudaFreeHost(reports_host_);
  if (staging_ != nullptr) cudaFreeHost(staging_);
  cudaGetLastError();
}

absl::Status DoorbellPlane::HasTrace() const {
  if (trace_ != nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError("doorbell plane has no trace (trace_ops is 0)");
}

absl::StatusOr<std::vector<DoorbellTraceRecord>> DoorbellPlane::ReadTrace() {
  ARFUSE_RETURN_IF_ERROR(HasTrace());
  std::vector<DoorbellTraceRecord> records(options_.trace_ops);
  ScopedDevice device(options_.device);
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(records.data(), trace_,
                                              records.size() * sizeof(DoorbellTraceRecord),
                                              cudaMemcpyDeviceToHost, side_stream_));
  ARFUSE_RETURN_IF_ERROR(WaitSideStream(absl::Now() + kSideStreamWait, "doorbell trace copy"));
  return records;
}

absl::Status DoorbellPlane::ClearTrace() {
  ARFUSE_RETURN_IF_ERROR(HasTrace());
  ScopedDevice device(options_.device);
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(trace_, 0, options_.trace_ops * sizeof(DoorbellTraceRecord), side_stream_));
  return WaitSideStream(absl::Now() + kSideStreamWait, "doorbell trace reset");
}

absl::Status DoorbellPlane::WaitSideStream(absl::Time deadline, const char* what) {
  while (true) {
    const cudaError_t err = cudaStreamQuery(side_stream_);
    if (err == cudaSuccess) return absl::OkStatus();
    if (err != cudaErrorNotReady) return CudaResultToStatus(err, what, __FILE__, __LINE__);
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, " did not finish in time"));
    }
    absl::SleepFor(absl::Microseconds(20));
  }
}

bool DoorbellPlane::ServeParamsLocked(DoorbellServeParams* sp) const {
  if (!options_.serve_in_place || options_.serve_blocks == 0) return false;
  // The lowest active slot that runs one-shot rings picks the shape; every active plan of the
  // same shape is served in place too.
  const Plan* first = nullptr;
  uint32_t mask = 0;
  uint32_t rows = 0;
  for (uint32_t i = 0; i < kMaxDoorbellSlots; ++i) {
    const Plan& p = plans_[i];
    if (!p.active || !UsesOneShot(p.options)) continue;
    if (first == nullptr) first = &p;
    if (!SameLaunchShape(p.params, first->params)) continue;
    mask |= 1u << i;
    // One-shot rings are below the two-shot threshold and within the maximum.
    rows = std::max(rows, std::min(p.options.max_tokens, p.options.twoshot_min_tokens - 1));
  }
  if (first == nullptr) return false;
  sp->inplace_template = first->params;
  sp->inplace_template.num_tokens = 0;
  sp->inplace_template.algo = FusionAlgo::kOneShot;
  sp->inplace_mask = mask;
  sp->max_blocks = std::max(1u, std::min(options_.serve_blocks, rows));
  return true;
}

uint32_t DoorbellPlane::ActiveMaskLocked() const {
  uint32_t mask = 0;
  for (uint32_t i = 0; i < kMaxDoorbellSlots; ++i) {
    if (plans_[i].active) mask |= 1u << i;
  }
  return mask;
}

absl::StatusOr<DoorbellHandle> DoorbellPlane::AddPlan(const FusionParams& plan,
                                                      const DoorbellPlanOptions& plan_options) {
  ScopedDevice device(options_.device);
  // Validation first, without the lock or the device.
  if (!SameLayout(plan.layout, options_.layout)) {
    return absl::InvalidArgumentError(
        "doorbell plan's workspace layout differs from the plane's workspace");
  }
  if (plan.rank < 0 || plan.rank >= kMaxWorldSize ||
      plan.peer_workspace[plan.rank] != options_.local_workspace) {
    return absl::InvalidArgumentError(
        "doorbell plan's own workspace (peer_workspace[rank]) is not the plane's workspace");
  }
  if (!IsHiddenAligned(plan.hidden)) {
    return absl::InvalidArgumentError(
        absl::StrCat("doorbell plan ", contract::HiddenNotAligned(plan.hidden)));
  }
  DoorbellPlanOptions opts = plan_options;
  const uint32_t fit = contract::MaxTokensThatFit(options_.layout, plan.hidden);
  if (opts.max_tokens == 0) opts.max_tokens = fit;
  if (opts.max_tokens == 0 || opts.max_tokens > fit) {
    return absl::InvalidArgumentError(
        absl::StrCat("doorbell plan max_tokens ", opts.max_tokens, " at hidden ", plan.hidden,
                     " does not fit the workspace (at most ", fit, ")"));
  }
  for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
    if (algo == FusionAlgo::kOneShot ? !UsesOneShot(opts) : !UsesTwoShot(opts)) continue;
    FusionParams check = plan;
    check.num_tokens = opts.max_tokens;
    check.algo = algo;
    const char* why = nullptr;
    if (CheckFusionParams(check, &why) != cudaSuccess) {
      return absl::InvalidArgumentError(
          absl::StrCat("doorbell plan refused by the fused kernels (",
                       algo == FusionAlgo::kOneShot ? "one-shot" : "two-shot",
                       "): ", why != nullptr ? why : "invalid"));
    }
  }

  absl::MutexLock lock(&mu_);
  if (state_ == State::kStopped || state_ == State::kFailed) {
    return absl::FailedPreconditionError(
        absl::StrCat("doorbell plane is stopped: ", counters_.health.ToString()));
  }
  PumpLocked();  // may free retired slots
  uint32_t slot = kMaxDoorbellSlots;
  for (uint32_t i = 0; i < kMaxDoorbellSlots; ++i) {
    if (!plans_[i].active && !plans_[i].retiring) {
      slot = i;
      break;
    }
  }
  if (slot == kMaxDoorbellSlots) {
    return absl::ResourceExhaustedError(
        absl::StrCat("all ", kMaxDoorbellSlots, " doorbell slots are in use; destroy a plan"));
  }
  DoorbellPlanEntry entry{};
  entry.params = plan;
  entry.params.num_tokens = 0;
  entry.max_tokens = opts.max_tokens;
  entry.twoshot_min_tokens = opts.twoshot_min_tokens;
  *staging_ = entry;
  // The slot enters no waiter's mask before this upload and reset finished: a waiter never reads
  // a half-written entry, and the client gets an armed slot.
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(plan_table_ + slot, staging_, sizeof(entry),
                                              cudaMemcpyHostToDevice, side_stream_));
  ARFUSE_CUDA_RETURN_IF_ERROR(
      LaunchDoorbellResetSlots(reinterpret_cast<DoorbellSlot*>(block_), 1u << slot, side_stream_));
  ARFUSE_RETURN_IF_ERROR(WaitSideStream(absl::Now() + kSideStreamWait, "doorbell plan upload"));
  Plan& p = plans_[slot];
  p.active = true;
  p.params = entry.params;
  p.options = opts;
  p.retiring = false;
  RebuildSignaturesLocked();
  // Queued waiters do not know the new slot (their mask is fixed): send them away so that the
  // replacements serve it at once.
  KickLocked();
  PumpLocked();
  spdlog::info(
      "event=doorbell_plan_added slot={} hidden={} pattern={} max_tokens={} "
      "twoshot_min_tokens={}",
      slot, plan.hidden, PatternName(plan.pattern), opts.max_tokens, opts.twoshot_min_tokens);
  DoorbellHandle handle;
  handle.slot = slot;
  handle.ipc_handle = ipc_handle_;
  handle.offset = DoorbellSlotOffset(slot);
  return handle;
}

absl::Status DoorbellPlane::RemovePlan(uint32_t slot) {
  ScopedDevice device(options_.device);
  absl::MutexLock lock(&mu_);
  if (slot >= kMaxDoorbellSlots || !plans_[slot].active) {
    return absl::NotFoundError(absl::StrCat("no doorbell plan in slot ", slot));
  }
  Plan& p = plans_[slot];
  p.active = false;
  p.retiring = true;
  p.retire_after_seq = next_seq_;
  RebuildSignaturesLocked();
  KickLocked();
  // A client still ringing this slot stops polling (and does not ring again).
  const absl::Status st = CudaResultToStatus(
      LaunchDoorbellSetError(reinterpret_cast<DoorbellSlot*>(block_), 1u << slot,
                             static_cast<uint32_t>(DoorbellError::kStopped), side_stream_),
      "doorbell slot close", __FILE__, __LINE__);
  PumpLocked();
  spdlog::info("event=doorbell_plan_removed slot={}", slot);
  return st;
}

absl::Status DoorbellPlane::Start() {
  ScopedDevice device(options_.device);
  absl::MutexLock lock(&mu_);
  switch (state_) {
    case State::kCreated:
      state_ = State::kRunning;
      break;
    case State::kRunning:
      return absl::OkStatus();
    case State::kPaused:
      return absl::FailedPreconditionError("doorbell plane is paused: use Resume");
    case State::kStopped:
    case State::kFailed:
      return absl::FailedPreconditionError(
          absl::StrCat("doorbell plane is stopped: ", counters_.health.ToString()));
  }
  PumpLocked();
  spdlog::info("event=doorbell_plane_started plans={}", __builtin_popcount(ActiveMaskLocked()));
  return absl::OkStatus();
}

absl::Status DoorbellPlane::Pause(absl::Time deadline) {
  ScopedDevice device(options_.device);
  {
    absl::MutexLock lock(&mu_);
    if (state_ == State::kRunning) state_ = State::kPaused;
    KickLocked();
  }
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      PumpLocked();
      if (inflight_.empty()) return absl::OkStatus();
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          "doorbell ops still running at the pause deadline (a fused op waiting for a peer?)");
    }
    absl::SleepFor(std::min(options_.poll_interval, absl::Microseconds(50)));
  }
}

absl::Status DoorbellPlane::Resume() {
  ScopedDevice device(options_.device);
  absl::MutexLock lock(&mu_);
  switch (state_) {
    case State::kPaused:
      state_ = State::kRunning;
      break;
    case State::kRunning:
      return absl::OkStatus();
    case State::kCreated:
      return absl::FailedPreconditionError("doorbell plane not started");
    case State::kStopped:
    case State::kFailed:
      return absl::FailedPreconditionError(
          absl::StrCat("doorbell plane is stopped: ", counters_.health.ToString()));
  }
  PumpLocked();
  return absl::OkStatus();
}

absl::Status DoorbellPlane::ResetSlots(absl::Time deadline) {
  ScopedDevice device(options_.device);
  absl::MutexLock lock(&mu_);
  if (state_ != State::kPaused && state_ != State::kCreated) {
    return absl::FailedPreconditionError("doorbell slots can only be reset while paused");
  }
  PumpLocked();
  if (!inflight_.empty()) {
    return absl::FailedPreconditionError("doorbell ops still queued: Pause until they finished");
  }
  ARFUSE_CUDA_RETURN_IF_ERROR(LaunchDoorbellResetSlots(reinterpret_cast<DoorbellSlot*>(block_),
                                                       ActiveMaskLocked(), side_stream_));
  ARFUSE_RETURN_IF_ERROR(WaitSideStream(deadline, "doorbell slot reset"));
  counters_.health = absl::OkStatus();
  counters_.last_error = 0;
  spdlog::info("event=doorbell_slots_reset plans={}", __builtin_popcount(ActiveMaskLocked()));
  return absl::OkStatus();
}

void DoorbellPlane::Stop() {
  ScopedDevice device(options_.device);
  absl::MutexLock lock(&mu_);
  if (control_host_ != nullptr) StoreControl(&control_host_->stop, 1);
  if (state_ == State::kStopped) return;
  const bool was_failed = state_ == State::kFailed;
  state_ = State::kStopped;
  if (block_ != nullptr && side_stream_ != nullptr && !was_failed) {
    // Rings in progress stop polling; later rings do not ring. Asynchronous: never waits.
    const cudaError_t err =
        LaunchDoorbellSetError(reinterpret_cast<DoorbellSlot*>(block_), ActiveMaskLocked(),
                               static_cast<uint32_t>(DoorbellError::kStopped), side_stream_);
    if (err != cudaSuccess) {
      spdlog::warn("event=doorbell_stop_close_failed error={}", cudaGetErrorName(err));
      cudaGetLastError();
    }
  }
  if (counters_.health.ok()) counters_.health = absl::CancelledError("doorbell plane stopped");
  spdlog::info("event=doorbell_plane_stopped served={} idle={}", counters_.served, counters_.idle);
}

DoorbellPlaneStatus DoorbellPlane::Status() const {
  absl::MutexLock lock(&mu_);
  DoorbellPlaneStatus s = counters_;
  // In-place ops of launches still queued or resident (their report's count is live).
  for (const auto& [seq, entry] : inflight_) {
    const uint32_t live =
        static_cast<const volatile DoorbellReport*>(reports_host_ + entry)->served_in_place;
    s.served += live;
    s.served_in_place += live;
  }
  s.running = state_ == State::kRunning;
  s.paused = state_ == State::kPaused;
  s.plans = static_cast<uint32_t>(__builtin_popcount(ActiveMaskLocked()));
  s.inflight = static_cast<uint32_t>(inflight_.size());
  return s;
}

DoorbellSlot* DoorbellPlane::slot_for_testing(uint32_t slot) const {
  return slot < kMaxDoorbellSlots ? reinterpret_cast<DoorbellSlot*>(block_) + slot : nullptr;
}

void DoorbellPlane::KickLocked() {
  ++generation_;
  StoreControl(&control_host_->generation, generation_);
  // Every queued waiter leaves now and is replaced only when the thread sees it ended.
  poll_wait_ = options_.poll_interval;
  poll_soon_ = true;
}

void DoorbellPlane::FailLocked(absl::Status status) {
  spdlog::error("event=doorbell_plane_failed status=\"{}\"", status.ToString());
  state_ = State::kFailed;
  counters_.health = std::move(status);
  StoreControl(&control_host_->stop, 1);
}

void DoorbellPlane::RebuildSignaturesLocked() {
  signatures_.clear();
  for (const Plan& p : plans_) {
    if (!p.active) continue;
    for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
      if (algo == FusionAlgo::kOneShot ? !UsesOneShot(p.options) : !UsesTwoShot(p.options)) {
        continue;
      }
      // The fused launch's kernel and grid depend on these (allreduce_fusion.h); plans that share
      // them share the launch.
      const bool known =
          std::any_of(signatures_.begin(), signatures_.end(), [&](const Signature& s) {
            return s.grid_template.algo == algo && SameLaunchShape(s.grid_template, p.params);
          });
      if (known) continue;
      Signature s;
      s.grid_template = p.params;
      s.grid_template.algo = algo;
      s.grid_template.num_tokens = 0;
      signatures_.push_back(s);
    }
  }
}

bool DoorbellPlane::LoopHasWorkLocked() const {
  return shutdown_ || !inflight_.empty() || (state_ == State::kRunning && ActiveMaskLocked() != 0);
}

bool DoorbellPlane::WakeEarlyLocked() const { return shutdown_ || poll_soon_; }

void DoorbellPlane::Loop() {
  cudaSetDevice(options_.device);
  absl::MutexLock lock(&mu_);
  while (!shutdown_) {
    PumpLocked();
    ++counters_.host_polls;
    if (LoopHasWorkLocked()) {
      // A resident serving launch consumes no triple for as long as rings keep coming, and a
      // waiter none until a ring or its idle timeout: looking every poll_interval then only burns
      // a core. Each look that finds nothing doubles the wait (PumpLocked and KickLocked reset
      // it), so the first consumed triple after a quiet spell is seen within max_poll_interval
      // while the queue_depth - 1 behind it keep serving.
      const absl::Duration wait = poll_wait_;
      poll_wait_ = std::min(poll_wait_ * 2, options_.max_poll_interval);
      poll_soon_ = false;
      // Sleeps with the lock released; wakes early for shutdown or a kick.
      mu_.AwaitWithTimeout(absl::Condition(this, &DoorbellPlane::WakeEarlyLocked), wait);
    } else {
      // Nothing in flight and nothing to queue (no plans, paused or failed): sleep until a call
      // changes that. absl::Mutex evaluates the condition whenever a holder of mu_ releases it,
      // so AddPlan, Resume and the destructor wake this thread without a separate signal; an
      // idle sidecar no longer wakes every poll interval.
      mu_.Await(absl::Condition(this, &DoorbellPlane::LoopHasWorkLocked));
    }
  }
}

void DoorbellPlane::NoteFusionFailureLocked(uint32_t slot, uint32_t tokens, uint32_t error) {
  if ((error & ~0xffu) != static_cast<uint32_t>(DoorbellError::kFusionFailed) ||
      !counters_.health.ok()) {
    return;
  }
  counters_.health = absl::FailedPreconditionError(
      absl::StrCat("doorbell op on slot ", slot, " failed: ", DoorbellErrorName(error),
                   "; re-initialize the workspace, then ResetSlots"));
  spdlog::error("event=doorbell_op_failed slot={} tokens={} error=\"{}\"", slot, tokens,
                DoorbellErrorName(error));
}

void DoorbellPlane::PumpLocked() {
  if (state_ == State::kFailed) return;
  while (!inflight_.empty()) {
    const auto [seq, entry] = inflight_.front();
    const cudaError_t err = cudaEventQuery(events_[entry]);
    if (err == cudaErrorNotReady) break;
    if (err != cudaSuccess) {
      FailLocked(CudaResultToStatus(err, "doorbell op (event query)", __FILE__, __LINE__));
      return;
    }
    inflight_.pop_front();
    free_entries_.push_back(entry);
    // Triples are being consumed: look again soon (Loop doubles this while nothing is).
    poll_wait_ = options_.poll_interval;
    const DoorbellReport r = ReadReport(reports_host_ + entry);
    counters_.served += r.served_in_place;
    counters_.served_in_place += r.served_in_place;
    if (r.error_in_place != 0) {
      ++counters_.failed;
      counters_.last_error = r.error_in_place;
      NoteFusionFailureLocked(r.slot, r.num_tokens, r.error_in_place);
    }
    switch (static_cast<DoorbellOutcome>(r.outcome)) {
      case DoorbellOutcome::kServed:
      case DoorbellOutcome::kRejected:
        if (r.outcome == static_cast<uint32_t>(DoorbellOutcome::kServed)) {
          ++counters_.served;
        } else {
          ++counters_.rejected;
        }
        if (r.error != 0) {
          if (r.outcome == static_cast<uint32_t>(DoorbellOutcome::kServed)) ++counters_.failed;
          counters_.last_error = r.error;
          NoteFusionFailureLocked(r.slot, r.num_tokens, r.error);
        }
        break;
      case DoorbellOutcome::kFailedInPlace:
        // Counted above from error_in_place; the launch ended so the host sees it now.
        break;
      case DoorbellOutcome::kIdle:
        ++counters_.idle;
        break;
      case DoorbellOutcome::kKicked:
        ++counters_.kicked;
        break;
      case DoorbellOutcome::kStopped:
        break;
      case DoorbellOutcome::kAborted:
        if (state_ == State::kRunning) {
          // Re-queuing would spin: every waiter leaves at once while the abort word is set. Rings
          // in progress fail fast instead of waiting for their timeout.
          state_ = State::kPaused;
          // The first error stays (an op that failed before says more than the abort).
          if (counters_.health.ok())
            counters_.health = absl::AbortedError(
                "doorbell waiter saw the workspace abort word: the group is failing; "
                "re-initialize the workspace, then ResetSlots and Resume");
          spdlog::error("event=doorbell_aborted");
          const cudaError_t e =
              LaunchDoorbellSetError(reinterpret_cast<DoorbellSlot*>(block_), ActiveMaskLocked(),
                                     static_cast<uint32_t>(DoorbellError::kFusionFailed) |
                                         static_cast<uint32_t>(FusionError::kHostAbort),
                                     side_stream_);
          if (e != cudaSuccess) cudaGetLastError();
        }
        break;
      case DoorbellOutcome::kPending:
        FailLocked(absl::InternalError("doorbell op finished without a report"));
        return;
    }
  }
  for (Plan& p : plans_) {
    if (p.retiring && (inflight_.empty() || inflight_.front().first >= p.retire_after_seq)) {
      p.retiring = false;
    }
  }
  while (state_ == State::kRunning && !free_entries_.empty() && ActiveMaskLocked() != 0) {
    const absl::Status st = EnqueueTripleLocked();
    if (!st.ok()) {
      FailLocked(st);
      return;
    }
  }
}

absl::Status DoorbellPlane::EnqueueTripleLocked() {
  const uint32_t entry = free_entries_.back();
  ClearReport(reports_host_ + entry);
  DoorbellSlot* slots = reinterpret_cast<DoorbellSlot*>(block_);
  DoorbellWaitParams w{};
  w.slots = slots;
  w.plans = plan_table_;
  w.op = op_;
  w.control = control_device_;
  w.workspace_abort = WorkspaceAbortWord(options_.local_workspace, options_.layout);
  w.host_abort = options_.host_abort;
  w.idle_timeout_ns = ToNanos(options_.idle_timeout);
  w.slot_mask = ActiveMaskLocked();
  w.generation = generation_;
  // Programmatic launches (option): the waiter after the previous completion, the first fused
  // launch after the waiter, the completion after the last fused launch. Never a second fused
  // launch: scheduled early, its whole grid would sit on SMs the first one's peers (ranks sharing
  // the GPU) may need to become co-resident.
  const bool pdl = options_.programmatic_launch;
  DoorbellServeParams sp{};
  if (ServeParamsLocked(&sp)) {
    sp.wait = w;
    sp.state = serve_state_;
    sp.report = reports_device_ + entry;
    sp.trace = trace_;
    sp.trace_ops = trace_ != nullptr ? options_.trace_ops : 0u;
    ARFUSE_CUDA_RETURN_IF_ERROR(LaunchDoorbellServe(sp, options_.stream, pdl));
  } else {
    ARFUSE_CUDA_RETURN_IF_ERROR(LaunchDoorbellWait(w, options_.stream, pdl));
  }
  for (size_t i = 0; i < signatures_.size(); ++i) {
    ARFUSE_CUDA_RETURN_IF_ERROR(LaunchAllReduceFusionIndirect(
        signatures_[i].grid_template, reinterpret_cast<const FusionParams*>(op_), options_.stream,
        pdl && i == 0));
  }
  DoorbellCompleteParams c{};
  c.slots = slots;
  c.op = op_;
  c.workspace_error = WorkspaceErrorWord(options_.local_workspace, options_.layout);
  c.report = reports_device_ + entry;
  ARFUSE_CUDA_RETURN_IF_ERROR(LaunchDoorbellComplete(c, options_.stream, pdl));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[entry], options_.stream));
  free_entries_.pop_back();
  inflight_.emplace_back(next_seq_++, entry);
  return absl::OkStatus();
}

}  // namespace arfuse
