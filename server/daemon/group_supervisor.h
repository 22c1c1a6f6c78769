// The group supervisor of one arfused: forms the group (peers, the config decision and its vote,
// the generation base, the engine), watches it while it serves (a poisoned workspace, a lost peer
// link, a lost device), re-forms it after a poisoning or on request, and runs the admin
// operations that change it (the live backend switch, a drain, a re-initialization). Every rank
// runs the same steps in the same order, so the collectives (tags) line up across ranks.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "config/fusion_config.h"
#include "server/daemon/gated_engine.h"
#include "server/daemon/options.h"
#include "server/metrics/metrics.h"
#include "server/services/admin/admin_service.h"

namespace arfuse {

class Exchange;
class FusionService;

// Why host mode without --sm does not fuse: logged at start-up, and the group decision's reason
// that GetWorkspaceInfo, Negotiate (`arfusectl info`) and the Python client's warning show.
inline constexpr char kNoGpuArchitectureReason[] =
    "host mode without --sm has no GPU architecture to decide for, so fusion is off and "
    "allreduce_fusion returns None (the caller's own path runs); give --sm=90 or --sm=100 to "
    "decide as that GPU would";

// What the supervisor uses of the process around it. The pointers must outlive the supervisor.
struct GroupSupervisorContext {
  const DaemonOptions* options = nullptr;
  // This rank's topology and its fusion flags after their migration (config::MigrateFlags).
  config::Topology topology;
  config::FusionFlags flags;
  GatedEngine* gate = nullptr;
  Metrics* metrics = nullptr;
  FusionService* fusion = nullptr;
  // When the process started (Stats' uptime).
  absl::Time started;
  // Readiness (the health service's readiness entry and the metrics' gauge), written and read.
  std::function<void(bool serving)> set_readiness;
  std::function<bool()> serving;
  // A device only a new process recovers: exit code 1 and a shutdown request.
  std::function<void(const std::string& why)> exit_for_restart;
};

class GroupSupervisor final : public AdminControl {
 public:
  explicit GroupSupervisor(GroupSupervisorContext context);
  // The thread may be blocked joining peers (bounded by --peer-timeout): it is detached, and the
  // process exits without waiting for it.
  ~GroupSupervisor() override;
  GroupSupervisor(const GroupSupervisor&) = delete;
  GroupSupervisor& operator=(const GroupSupervisor&) = delete;

  // Starts the supervisor thread: it forms the group and serves until Stop.
  void Start();
  // Ends the supervision at its next step (shutdown). Safe from any thread, more than once.
  void Stop();

  // The group's decision; UNAVAILABLE naming why while the group has not decided yet.
  absl::StatusOr<config::Decision> Decided() const;
  // An eager op's low-cardinality labels: the backend, and why its path ran.
  void LabelOp(bool ok, OpSample* sample) const;

  // AdminControl.
  v1::GetStatsResponse Stats() override;
  absl::StatusOr<uint32_t> Drain(absl::Duration timeout) override;
  absl::StatusOr<v1::SetBackendResponse> SetBackend(const std::string& backend,
                                                    const std::optional<std::string>& collective_id,
                                                    absl::Time deadline) override;
  absl::StatusOr<v1::ReinitializeResponse> Reinitialize(absl::Time deadline) override;

 private:
  // Forms the group, serves, and re-forms it after a poisoning or on request, until Stop.
  void Supervise();
  absl::Status FormGroup();
  // Collective (over exchange_): the highest workspace generation any rank has served, which the
  // new engine's generations are counted on from.
  absl::StatusOr<uint64_t> AgreeGenerationBase(absl::Time deadline);
  // Builds and initializes an engine for `decision` (collective over exchange_).
  absl::StatusOr<std::unique_ptr<Engine>> BuildEngine(const config::Decision& decision,
                                                      absl::Time deadline);
  // CUDA mode: when the device reports a sticky error (a lost context, or work that can never
  // finish), reports NOT_SERVING and asks for an exit with code 1 so the process is restarted;
  // returns whether it did.
  bool StopOnLostDevice();
  void Publish(const config::Decision& decision, bool ready);
  void SetReadiness(bool serving) { context_.set_readiness(serving); }
  bool StopRequested();
  // Sleeps up to `d`, returning early on Stop or a re-initialization request.
  void WaitFor(absl::Duration d);

  const GroupSupervisorContext context_;
  const DaemonOptions& options_;
  GatedEngine& gate_;
  Metrics& metrics_;
  std::unique_ptr<Exchange> exchange_;
  std::thread thread_;

  // The group's decision and state, read by the Config service and Stats.
  mutable std::mutex state_mu_;
  config::FusionFlags flags_;
  config::Decision decision_;
  bool decided_ = false;
  std::string not_ready_reason_ = "the group is forming";
  uint64_t poisonings_ = 0;
  uint64_t reinitializations_ = 0;
  uint64_t backend_switches_ = 0;
  // The highest workspace generation this process has served (what clients saw); carried into
  // every engine that replaces the current one, so generations never repeat within the group.
  uint64_t served_generation_ = 0;
  // A collective admin call without a collective id failed on this rank only: the counted tags
  // of such calls differ across ranks until the group re-forms.
  bool admin_exchange_diverged_ = false;

  // One admin operation (switch, re-init, drain) at a time.
  std::mutex admin_mu_;
  std::atomic<bool> reinit_requested_{false};

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_requested_ = false;
};

}  // namespace arfuse
