// The doorbell plane's lifecycle and control: its memory, the trace, start, pause, resume, the
// slots' reset, stop and the status. The plans' slots are in doorbell_plane_plans.cc, the host
// thread that keeps the triples queued in doorbell_plane_pump.cc.
#include "server/doorbell/doorbell_plane.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/cuda_device/cuda_status.h"
#include "server/doorbell/scoped_device.h"
#include "server/engine_api/doorbell_host.h"
#include "spdlog/spdlog.h"

namespace arfuse {

static_assert(kDoorbellPlaneSlots == kMaxDoorbellSlots);
namespace {

using doorbell_internal::ScopedDevice;

constexpr uint32_t kMaxQueueDepth = 64;
// How long teardown waits for queued kernels to leave after the stop word (they see it within
// microseconds unless a fused op spins on a missing peer) before leaking instead of blocking.
constexpr absl::Duration kTeardownWait = absl::Milliseconds(200);

// The host writes the control words with plain release stores; the waiter polls them over PCIe.
void StoreControl(uint32_t* word, uint32_t value) {
  __atomic_store_n(word, value, __ATOMIC_RELEASE);
}

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

uint32_t DoorbellPlane::ActiveMaskLocked() const {
  uint32_t mask = 0;
  for (uint32_t i = 0; i < kMaxDoorbellSlots; ++i) {
    if (plans_[i].active) mask |= 1u << i;
  }
  return mask;
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

}  // namespace arfuse
