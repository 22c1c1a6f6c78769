// The sidecar's doorbell plane (docs/doorbell.md): the device words a client's ring
// kernel rings, and the kernels kept queued ahead on the engine's stream that serve them.
//
// Per queued op (a "triple"), on the engine's stream:
//   LaunchDoorbellWait           one warp polls the request words of the active slots (and the
//                                stop/generation words, the abort words and an idle deadline)
//   LaunchAllReduceFusionIndirect one per plan shape and algorithm in use: runs the op the waiter
//                                wrote, or does nothing (idle, another shape)
//   LaunchDoorbellComplete       records errors in the slot, release-stores the completion
// A host thread keeps queue_depth triples queued: it polls one event per triple, reads the
// triple's report (host-mapped) and queues a new one. An idle waiter (no ring before its
// deadline) consumed nothing and is simply replaced.
//
// Wiring (CudaEngine owns one per workspace, after the workspace exists, outside graph capture):
//   DoorbellPlaneOptions o;  o.device = device_; o.stream = stream_;
//   o.local_workspace = workspace_->peer_base(rank); o.layout = workspace_->layout();
//   o.host_abort = <device address of the workspace's mapped abort word> (FusionParams::host_abort)
//   auto plane = DoorbellPlane::Create(o);                      // then plane->Start()
//   CreatePlan(doorbell=true): FusionParams p = <the op's params as for an eager launch, any
//     num_tokens>; plane->AddPlan(p, {max_tokens, twoshot_min_tokens}) -> DoorbellHandle, whose
//     fields fill the proto's Doorbell message one to one.
//   DestroyPlan: plane->RemovePlan(handle.slot).
//   Eager Execute on the same stream: Pause(deadline) first (queued waiters leave at once), run
//     the op, Resume(). Without the pause the eager op waits behind the queued waiters.
//   Status(): poisoned/aborted/failed shows in health; ops, idle relaunches, errors as counters.
//   Re-initialization after poison: Pause, re-initialize the workspace (collective), ResetSlots,
//     Resume. Shutdown: Abort the workspace, then destroy the plane (never blocks), then the
//     workspace.
//
// Cross-rank contract (as for eager ops): every rank's plane holds the same plans with the same
// options (twoshot_min_tokens above all: it picks the algorithm on the device), and the clients
// of all ranks ring the same plans in the same order with the same token counts, one ring in
// flight per rank. Idle waiters need no agreement: an op that does not run touches no protocol
// state, so the ops that run still pair up one to one across ranks.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/doorbell/doorbell.h"

namespace arfuse {

struct DoorbellPlaneOptions {
  int device = 0;
  // The engine's stream: the plane's kernels and the eager ops run on it, in order. Required.
  cudaStream_t stream = nullptr;
  // This rank's workspace (its error and abort words are polled) and its layout. Required.
  void* local_workspace = nullptr;
  WorkspaceLayout layout{};
  // Optional: device address of the engine's host-mapped abort word; waiters leave when it is set.
  const uint32_t* host_abort = nullptr;
  // Triples kept queued ahead (1..64). More absorbs longer host hiccups between re-arms.
  uint32_t queue_depth = 8;
  // A waiter with no ring for this long exits (consuming nothing) and is replaced.
  absl::Duration idle_timeout = absl::Milliseconds(100);
  // How often the host thread looks for consumed triples (while any are in flight or plans are
  // active; otherwise it sleeps until a plan is added or the plane resumes).
  absl::Duration poll_interval = absl::Microseconds(20);
  // While its looks find no consumed triple (a serving launch resident between rings, waiters
  // waiting), the host thread doubles its interval up to this; a consumed triple or a plan change
  // brings it back to poll_interval. The queue must last one such interval: rings that each use up
  // a triple (two-shot, shapes not served in place) arriving faster than queue_depth per
  // max_poll_interval after a quiet spell wait for the host once. Equal to poll_interval: no
  // back-off. In [poll_interval, 100 ms].
  absl::Duration max_poll_interval = absl::Microseconds(160);
  // Launch the first fused kernel and the completion kernel of each triple as programmatic
  // dependents (sm_90+), so they are scheduled while the kernel before them still runs: hides
  // two launch latencies per op. Off by default until measured (doorbell_bench --pdl).
  bool programmatic_launch = false;
  // Serve one-shot rings in place (LaunchDoorbellServe): the queued waiter runs them itself, with
  // no launch per op, while the launch stays resident between rings. Rings it cannot run (two-shot,
  // another plan shape) go to the fused launches behind it as without this option.
  bool serve_in_place = true;
  // Most blocks a serving launch keeps resident (fewer when the in-place plans have fewer rows
  // or fewer fit the SM budget). Idle, they poll one word with __nanosleep, but their registers
  // stay allocated: a client kernel whose blocks need more than the rest of an SM's register file
  // cannot use an SM that holds one (docs/doorbell.md has the measurement). At most
  // kMaxDoorbellServeBlocks.
  uint32_t serve_blocks = 32;
  // Diagnostics: keep a trace of the last `trace_ops` in-place ops (DoorbellTraceRecord: when
  // each step of the serving launch happened, ReadTrace). 0 = off, at most kMaxDoorbellTraceOps.
  uint32_t trace_ops = 0;
};
inline constexpr uint32_t kMaxDoorbellTraceOps = 1u << 16;

struct DoorbellPlanOptions {
  // Largest token count a ring may ask for; 0 = all the workspace fits at the plan's hidden.
  uint32_t max_tokens = 0;
  // Rings with num_tokens >= this run two-shot, below it one-shot (0xffffffff: never two-shot).
  // Must be the same on every rank (take it from the published dispatch table).
  uint32_t twoshot_min_tokens = 0xffffffffu;
};

// What CreatePlan returns in the proto's Doorbell message (field for field), plus the slot.
struct DoorbellHandle {
  uint32_t slot = 0;
  std::string ipc_handle;  // 64 bytes: cudaIpcMemHandle_t of the slot block
  uint64_t offset = 0;     // byte offset of the slot in the block
  uint32_t request_value = kDoorbellRequest;
  uint32_t complete_value = kDoorbellComplete;
  uint32_t reset_value = kDoorbellReset;
};

// The counters are the plane's host thread's: it counts an op when it finds the op's launch
// ended (it looks every poll interval), so they can trail what the clients' streams already saw.
struct DoorbellPlaneStatus {
  // OK while healthy. FAILED_PRECONDITION: an op failed in the fused kernel, the workspace is
  // poisoned (re-initialize, ResetSlots, Resume). ABORTED: a waiter saw the abort words.
  // INTERNAL and others: a CUDA call failed; the plane stopped.
  absl::Status health;
  bool running = false;  // waiters are being kept queued
  bool paused = false;
  uint32_t plans = 0;
  uint64_t served = 0;           // ops run (successfully or not)
  uint64_t served_in_place = 0;  // of which by a serving launch without a launch per op
  uint64_t failed = 0;           // served ops whose slot got an error
  uint64_t rejected = 0;         // rings with a token count above the plan's maximum
  uint64_t idle = 0;             // waiters that reached their deadline with no ring
  uint64_t kicked = 0;           // waiters sent away by a plan change or a pause
  uint32_t last_error = 0;       // DoorbellError of the last failed op
  uint32_t inflight = 0;         // launch triples queued on the stream and not yet seen ended
  // Passes of the plane thread's loop: one per poll interval (longer while nothing is consumed,
  // up to max_poll_interval) while it has triples in flight or active plans to queue them for,
  // none while it has neither (it sleeps until that changes).
  uint64_t host_polls = 0;
};

class DoorbellPlane {
 public:
  // Allocates the slot block (exported by legacy CUDA IPC), the plan table, the op record and the
  // host-mapped words. INVALID_ARGUMENT for bad options (checked before any CUDA call).
  static absl::StatusOr<std::unique_ptr<DoorbellPlane>> Create(const DoorbellPlaneOptions& options);
  // Stops, waits a short bounded time for the queued kernels to leave, frees. Never blocks on a
  // kernel: memory a kernel may still use is leaked (and logged) instead.
  ~DoorbellPlane();
  DoorbellPlane(const DoorbellPlane&) = delete;
  DoorbellPlane& operator=(const DoorbellPlane&) = delete;

  // Registers a plan: `plan` is a complete FusionParams for this rank's workspace (pointers into
  // the client's registered regions); num_tokens and algo are ignored. Validated with
  // CheckFusionParams at the plan's max_tokens for each algorithm it may use. RESOURCE_EXHAUSTED
  // when all kMaxDoorbellSlots slots are taken.
  absl::StatusOr<DoorbellHandle> AddPlan(const FusionParams& plan,
                                         const DoorbellPlanOptions& options);
  // Unregisters; rings on the slot fail with DoorbellError::kStopped. The slot is reused only
  // after every triple that could serve it has finished.
  absl::Status RemovePlan(uint32_t slot);

  // Keeps queue_depth triples queued from now on.
  absl::Status Start();
  // Stops queuing, sends queued waiters away (they consume nothing) and waits, until `deadline`,
  // for the queued triples to finish (an op already taken runs to its end). DEADLINE_EXCEEDED
  // when they did not (e.g. a fused op spinning on a missing peer).
  absl::Status Pause(absl::Time deadline);
  absl::Status Resume();
  // Re-arms every active slot (clears sticky errors) and the health. Only while paused (or not
  // started) with nothing queued, e.g. after the workspace was re-initialized.
  absl::Status ResetSlots(absl::Time deadline);
  // Final: waiters leave, rings on every slot fail with kStopped. Never blocks (plain stores to
  // host-mapped words, one asynchronous launch on a side stream).
  void Stop();

  DoorbellPlaneStatus Status() const;
  // The trace of in-place ops (trace_ops records, in ring order: a record whose `op` is 0 was
  // never written). A copy on the plane's own side stream: ops served meanwhile may be half
  // written, so read it when no ring is in flight. FAILED_PRECONDITION without a trace.
  absl::StatusOr<std::vector<DoorbellTraceRecord>> ReadTrace();
  // Zeroes the trace (the same caveat).
  absl::Status ClearTrace();
  // Where the slots live (for tests and the in-process self-test): device pointer of slot `slot`.
  DoorbellSlot* slot_for_testing(uint32_t slot) const;

 private:
  struct Plan {
    bool active = false;
    FusionParams params{};
    DoorbellPlanOptions options;
    // Set when removed: the slot is free once every triple queued before removal finished.
    bool retiring = false;
    uint64_t retire_after_seq = 0;
  };
  // One fused launch queued behind each waiter.
  struct Signature {
    FusionParams grid_template;
  };
  enum class State { kCreated, kRunning, kPaused, kStopped, kFailed };
  // Bound on the small side-stream jobs (plan upload, slot reset, trace copy).
  static constexpr absl::Duration kSideStreamWait = absl::Seconds(2);

  explicit DoorbellPlane(const DoorbellPlaneOptions& options);
  absl::Status Allocate();
  void Loop();
  // Collects finished triples and queues new ones while running.
  void PumpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status EnqueueTripleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RebuildSignaturesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waiters launched before now leave (kKicked) without consuming anything.
  void KickLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailLocked(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A served op's slot got a kFusionFailed error: health FAILED_PRECONDITION (first one wins).
  void NoteFusionFailureLocked(uint32_t slot, uint32_t tokens, uint32_t error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION unless the plane was created with a trace (trace_ops > 0).
  absl::Status HasTrace() const;
  // Runs `what` on the side stream and waits for it until `deadline`.
  absl::Status WaitSideStream(absl::Time deadline, const char* what);
  uint32_t ActiveMaskLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the plane thread has anything to poll for: triples in flight, or a running plane
  // with active plans (to queue triples for), or shutdown.
  bool LoopHasWorkLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the plane thread's timed wait early: shutdown, or a kick (its replacements must be
  // queued promptly, whatever the thread's backed-off interval).
  bool WakeEarlyLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fills the serving launch's template, in-place mask and grid cap from the active plans;
  // false when no plan can be served in place (the plain waiter is queued then).
  bool ServeParamsLocked(DoorbellServeParams* sp) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const DoorbellPlaneOptions options_;
  // Device memory.
  DoorbellBlock* block_ = nullptr;  // exported
  DoorbellPlanEntry* plan_table_ = nullptr;
  DoorbellOp* op_ = nullptr;
  DoorbellServeState* serve_state_ = nullptr;
  DoorbellTraceRecord* trace_ = nullptr;  // trace_ops records, or null
  // Host-mapped: host pointer and device address of the same words.
  DoorbellControl* control_host_ = nullptr;
  const DoorbellControl* control_device_ = nullptr;
  DoorbellReport* reports_host_ = nullptr;  // queue_depth entries
  DoorbellReport* reports_device_ = nullptr;
  DoorbellPlanEntry* staging_ = nullptr;  // pinned, for plan table uploads
  cudaStream_t side_stream_ = nullptr;    // plan uploads, slot resets and errors
  std::vector<cudaEvent_t> events_;       // one per queue entry
  std::string ipc_handle_;

  mutable absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kCreated;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // The plane thread's next timed wait (poll_interval .. max_poll_interval) and whether a kick
  // asked it to look again at once.
  absl::Duration poll_wait_ ABSL_GUARDED_BY(mu_);
  bool poll_soon_ ABSL_GUARDED_BY(mu_) = false;
  std::array<Plan, kMaxDoorbellSlots> plans_ ABSL_GUARDED_BY(mu_);
  std::vector<Signature> signatures_ ABSL_GUARDED_BY(mu_);
  uint32_t generation_ ABSL_GUARDED_BY(mu_) = 1;
  // Queued triples, oldest first: (sequence number, queue entry).
  std::deque<std::pair<uint64_t, uint32_t>> inflight_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> free_entries_ ABSL_GUARDED_BY(mu_);
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  DoorbellPlaneStatus counters_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace arfuse
