// The doorbell plane's host thread: it keeps queue_depth triples (waiter or serving launch, the
// fused launches, the completion) queued on the engine's stream, reads each finished triple's
// host-mapped report into the counters and the health, and frees retired slots. It backs off
// while nothing is consumed and sleeps while there is nothing to queue for.
#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/cuda_device/cuda_status.h"
#include "server/doorbell/doorbell_plane.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

uint64_t ToNanos(absl::Duration d) { return static_cast<uint64_t>(absl::ToInt64Nanoseconds(d)); }

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

}  // namespace

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
