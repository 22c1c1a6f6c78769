#include "server/doorbell/engine_doorbell.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

// Doorbell plane ids: unique in the process, never 0.
std::atomic<uint64_t> g_next_doorbell_id{1};

}  // namespace

EngineDoorbell::EngineDoorbell(int rank, absl::Duration spin_timeout)
    : rank_(rank), spin_timeout_(spin_timeout) {}

absl::Time EngineDoorbell::PauseDeadline(absl::Time deadline) const {
  return std::min(deadline, absl::Now() + spin_timeout_ + absl::Seconds(1));
}

absl::Status EngineDoorbell::Ensure(const DoorbellPlaneOptions& options, uint64_t generation) {
  if (plane_ != nullptr) return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<DoorbellPlane>> plane = DoorbellPlane::Create(options);
  if (!plane.ok()) {
    return absl::Status(plane.status().code(), absl::StrCat("cannot create the doorbell plane: ",
                                                            plane.status().message()));
  }
  ARFUSE_RETURN_IF_ERROR((*plane)->Start());
  plane_ = std::move(*plane);
  id_ = g_next_doorbell_id.fetch_add(1);
  plans_ = 0;
  spdlog::info("event=doorbell_plane_ready rank={} plane_id={} generation={}", rank_, id_,
               generation);
  return absl::OkStatus();
}

void EngineDoorbell::WorkspaceDropped(const char* why) {
  if (plane_ == nullptr) return;
  spdlog::warn("event=doorbell_plane_dropped rank={} plane_id={} plans={} reason=\"{}\"", rank_,
               id_, plans_, why);
  // Stop + bounded teardown: rings on its slots fail with kStopped.
  plane_.reset();
  id_ = 0;
  plans_ = 0;
}

absl::Status EngineDoorbell::Pause(absl::Time deadline, bool* resume) {
  *resume = plane_->Status().running;
  absl::Status paused = plane_->Pause(deadline);
  if (!paused.ok() && *resume) {
    // Nothing was launched: let the plane serve again rather than leave it paused.
    *resume = false;
    Resume();
  }
  return paused;
}

void EngineDoorbell::Resume() {
  absl::Status resumed = plane_->Resume();
  if (!resumed.ok()) {
    spdlog::warn("event=doorbell_resume_failed rank={} error=\"{}\"", rank_,
                 std::string(resumed.message()));
  }
}

void EngineDoorbell::BeforeReinitialize(absl::Time deadline) {
  if (plane_ == nullptr) return;
  bool was_running = false;
  absl::Status paused = Pause(PauseDeadline(deadline), &was_running);
  if (!paused.ok()) {
    spdlog::warn("event=doorbell_pause_slow rank={} error=\"{}\"", rank_,
                 std::string(paused.message()));
  }
}

void EngineDoorbell::Reinitialized(absl::Time deadline) {
  if (plane_ == nullptr) return;
  absl::Status reset = plane_->ResetSlots(deadline);
  if (reset.ok()) reset = plane_->Resume();
  if (!reset.ok()) {
    spdlog::error("event=doorbell_reset_failed rank={} error=\"{}\"", rank_,
                  std::string(reset.message()));
    WorkspaceDropped("its slots could not be re-armed after the re-initialization");
  }
}

absl::Status EngineDoorbell::BeforeOp(absl::Time deadline) {
  resume_after_op_ = false;
  if (plane_ == nullptr || plans_ == 0) return absl::OkStatus();
  bool paused_running = false;
  absl::Status paused = Pause(PauseDeadline(deadline), &paused_running);
  if (!paused.ok()) {
    return absl::DeadlineExceededError(
        absl::StrCat("doorbell ops still running on the engine's stream; the op did not run: ",
                     paused.message()));
  }
  resume_after_op_ = paused_running;
  return absl::OkStatus();
}

void EngineDoorbell::AfterOp() {
  if (!resume_after_op_) return;
  resume_after_op_ = false;
  if (plane_ == nullptr) return;
  absl::Status resumed = plane_->Resume();
  if (!resumed.ok()) {
    spdlog::warn("event=doorbell_resume_failed error=\"{}\"", std::string(resumed.message()));
  }
}

absl::StatusOr<DoorbellGrant> EngineDoorbell::AddPlan(const FusionParams& params,
                                                      uint32_t max_tokens,
                                                      const DoorbellDispatch& dispatch,
                                                      uint32_t hidden) {
  if (plane_ == nullptr) return absl::FailedPreconditionError("no doorbell plane");
  DoorbellPlanOptions plan_options;
  plan_options.max_tokens = max_tokens;
  plan_options.twoshot_min_tokens = dispatch.twoshot_min_tokens;
  ARFUSE_ASSIGN_OR_RETURN(const DoorbellHandle handle, plane_->AddPlan(params, plan_options));
  ++plans_;
  DoorbellGrant grant;
  grant.plane_id = id_;
  grant.slot = handle.slot;
  grant.ipc_handle = handle.ipc_handle;
  grant.offset = handle.offset;
  grant.request_value = handle.request_value;
  grant.complete_value = handle.complete_value;
  grant.reset_value = handle.reset_value;
  grant.max_tokens = max_tokens;
  grant.twoshot_min_tokens = dispatch.twoshot_min_tokens;
  grant.path_at_max = dispatch.path_at_max;
  grant.reason = dispatch.reason;
  spdlog::info(
      "event=doorbell_plan_registered rank={} plane_id={} slot={} hidden={} max_tokens={} "
      "twoshot_min_tokens={} plans={}",
      rank_, id_, handle.slot, hidden, max_tokens, dispatch.twoshot_min_tokens, plans_);
  return grant;
}

absl::Status EngineDoorbell::RemovePlan(const DoorbellGrant& grant, absl::Time deadline) {
  if (plane_ == nullptr || grant.plane_id != id_) return absl::OkStatus();
  absl::Status out = absl::OkStatus();
  absl::Status removed = plane_->RemovePlan(grant.slot);
  if (removed.ok()) {
    --plans_;
  } else if (!absl::IsNotFound(removed)) {
    out = removed;
  }
  if (removed.ok() || !absl::IsNotFound(removed)) {
    // Triples queued before the removal may still run the plan's op: wait until they are gone,
    // so that the caller may unmap the plan's memory.
    bool resume = false;
    absl::Status paused = Pause(PauseDeadline(deadline), &resume);
    if (resume) Resume();
    if (!paused.ok()) {
      out = absl::DeadlineExceededError(absl::StrCat(
          "doorbell plan removed, but doorbell ops were still running at the deadline (",
          paused.message(), "): its memory must stay mapped"));
    }
  }
  return out;
}

absl::StatusOr<DoorbellPlaneStatus> EngineDoorbell::Status() const {
  if (plane_ == nullptr) return absl::NotFoundError("no doorbell plane");
  return plane_->Status();
}

DoorbellSlot* EngineDoorbell::slot_for_testing(const DoorbellGrant& grant) const {
  if (plane_ == nullptr || grant.plane_id != id_) return nullptr;
  return plane_->slot_for_testing(grant.slot);
}

}  // namespace arfuse
