// The doorbell plane as an engine holds it (docs/doorbell.md): at most one DoorbellPlane over the
// engine's workspace, created on the first plan (so a sidecar that never serves a doorbell pays
// nothing), its id, its plan count, and the pause/resume protocol around everything else the
// engine puts on its stream, as the plane's lifecycle hooks (server/engine_api/plane_hooks.h):
//   - an eager op pauses the plane while it is enqueued (queued waiters leave at once) and
//     resumes it right after (BeforeOp, AfterOp);
//   - an in-place re-initialization pauses it (BeforeReinitialize), re-initializes the
//     workspace, then re-arms the slots and resumes it (Reinitialized): plans survive;
//   - a workspace that is rebuilt or dropped takes the plane with it (WorkspaceDropped): its
//     plans are gone and their rings fail with kStopped.
// The engine decides when; this class knows how. Not thread-safe: the engine calls it under the
// lock that serializes its ops.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "server/doorbell/doorbell_dispatch.h"
#include "server/doorbell/doorbell_plane.h"
#include "server/engine_api/doorbell_host.h"
#include "server/engine_api/plane_hooks.h"

namespace arfuse {

class EngineDoorbell final : public PlaneHooks {
 public:
  // `rank` names the engine in logs; `spin_timeout` bounds how long a pause waits for doorbell
  // ops already taken (they end within it even when a peer never comes).
  EngineDoorbell(int rank, absl::Duration spin_timeout);
  // Stops and frees the plane (bounded: see ~DoorbellPlane).
  ~EngineDoorbell() override = default;
  EngineDoorbell(const EngineDoorbell&) = delete;
  EngineDoorbell& operator=(const EngineDoorbell&) = delete;

  // Whether a plane exists (it then runs over the engine's current workspace).
  bool active() const { return plane_ != nullptr; }

  // Creates and starts the plane when there is none yet; `generation` is the workspace's, for
  // the log.
  absl::Status Ensure(const DoorbellPlaneOptions& options, uint64_t generation);

  // PlaneHooks.
  // Before an eager op: doorbell waiters queued ahead on the engine's stream would hold the op
  // back until their idle timeout, so they leave first (when the plane has plans) and queue
  // again behind it at AfterOp. DEADLINE_EXCEEDED when doorbell ops were still running at the
  // deadline: the op must not run.
  absl::Status BeforeOp(absl::Time deadline) override;
  // Resumes the plane if BeforeOp paused it.
  void AfterOp() override;
  // The plane stops queuing and its waiters leave before the workspace is touched. A slow pause
  // is logged, not returned: the re-initialization aborts the workspace, which ends any doorbell
  // op waiting for a peer.
  void BeforeReinitialize(absl::Time deadline) override;
  // The slots are re-armed (sticky errors cleared) and the plane runs again (also when an abort
  // had paused it). A plane that cannot be re-armed is dropped.
  void Reinitialized(absl::Time deadline) override;
  // Stops and frees the plane: its plans are gone. No-op without a plane.
  void WorkspaceDropped(const char* why) override;
  // Stops and frees the plane without a word: the engine is going away.
  void EngineClosing() override { plane_.reset(); }
  // Leaves the plane as it is, never to be freed: the engine's device holds work that can never
  // finish, and freeing would wait for it (the process exits to be restarted).
  void DeviceWedged() override { static_cast<void>(plane_.release()); }

  // Registers a plan whose op is `params` (the fused op at max_tokens) and whose rings choose
  // their algorithm by `dispatch`. The plane must exist (Ensure).
  absl::StatusOr<DoorbellGrant> AddPlan(const FusionParams& params, uint32_t max_tokens,
                                        const DoorbellDispatch& dispatch, uint32_t hidden);

  // DoorbellHost::RemoveDoorbellPlan's contract: OK for a grant of a plane that is gone; waits
  // (until `deadline`) for queued ops that may still run the plan, so that its memory may be
  // unmapped.
  absl::Status RemovePlan(const DoorbellGrant& grant, absl::Time deadline);

  // The plane's counters and health; NOT_FOUND while there is no plane.
  absl::StatusOr<DoorbellPlaneStatus> Status() const;
  // The grant's slot, or null when its plane is gone (tests that ring from this process).
  DoorbellSlot* slot_for_testing(const DoorbellGrant& grant) const;

 private:
  // How long a pause waits for doorbell ops already taken to finish.
  absl::Time PauseDeadline(absl::Time deadline) const;
  // Pauses the plane until `deadline` so that nothing queued ahead of the engine's stream runs
  // any more; `*resume` says whether Resume must follow (it was running).
  absl::Status Pause(absl::Time deadline, bool* resume);
  // Resumes the plane; a failure is logged (the plane reports it in its status).
  void Resume();

  const int rank_;
  const absl::Duration spin_timeout_;
  std::unique_ptr<DoorbellPlane> plane_;
  // Plane ids are unique in the process, so grants of a dropped plane are told apart.
  uint64_t id_ = 0;
  uint32_t plans_ = 0;
  // BeforeOp paused a running plane: AfterOp resumes it.
  bool resume_after_op_ = false;
};

}  // namespace arfuse
