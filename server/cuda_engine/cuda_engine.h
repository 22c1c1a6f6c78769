// The CUDA engine: fused one-shot/two-shot kernels over a trtllm or mnnvl workspace, and the
// unfused path (NCCL allreduce + the add-RMSNorm kernel), chosen per op by the dispatch table.
//
// Initialize (collective, never during graph capture):
//   1. device identities are allgathered: ranks sharing a GPU (MPS) get an SM budget each, so
//      every simulated rank's spinning grid stays co-resident, and no NCCL (NCCL refuses them);
//   2. the NCCL communicator (+ a symmetric window) is built when the ranks have a GPU each;
//   3. the workspace is built for a fused backend; all ranks vote, so all fuse or none does;
//   4. the generation bumps. A poisoned workspace is re-initialized in place.
// Execute: fit / poison / generation checks, then the stream waits on ctx.wait_event, the op is
// launched, ctx.done_event recorded, and with ctx.synchronous the op is awaited until
// ctx.deadline (then aborted: the workspace is poisoned). One op in flight per engine.
//
// The unfused path never enqueues an NCCL collective its peers will not run: the ranks first
// agree on the op over the exchange given to Initialize (op_agreement.h), within the spin timeout
// (bounded by the call's deadline). A rank that does not come (its client died mid-step) fails
// the agreement on every rank with DEADLINE_EXCEEDED and poisons the engine; ranks asked for
// different ops (racing clients) all get INVALID_ARGUMENT and the engine serves on. An agreed op
// that still does not finish (a peer died or froze between the agreement and its kernel) leaves
// an NCCL kernel nothing can end: its synchronous wait poisons the engine, and destroying the
// engine then leaves the communicator alone (its abort would wait for that kernel forever) and
// marks the device wedged (MarkDeviceWedged), so the daemon exits to be restarted.
//
// The data planes' engine sides sit behind one member (planes_,
// server/cuda_engine/engine_planes.h), whose lifecycle hooks (server/engine_api/plane_hooks.h) the
// engine runs at an eager op, a re-initialization, a dropped workspace and its own end; the eager
// path names no plane. The doorbell plane (docs/doorbell.md) runs over the workspace, on the
// engine's stream (server/doorbell/engine_doorbell.h: when it is made, paused, re-armed and
// dropped). A workspace that is rebuilt or dropped takes the plane with it (aborted first, then
// stopped, then the workspace freed): its plans are gone and their rings fail with kStopped.
//
// The implementation is split by job: cuda_engine.cc (the engine, the eager op, the unfused
// path), cuda_engine_init.cc (Initialize), cuda_engine_planes.cc (InStreamHost, DoorbellHost).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/collective/dispatch_table.h"
#include "server/cuda_device/peer_memory.h"
#include "server/cuda_engine/engine_planes.h"
#include "server/doorbell/doorbell_dispatch.h"
#include "server/doorbell/doorbell_plane.h"
#include "server/engine_api/doorbell_host.h"
#include "server/engine_api/engine.h"
#include "server/engine_api/instream_host.h"
#include "server/instream/cuda/kernel_image.h"

namespace arfuse {

class FusionWorkspace;
class NcclComm;

// Settings the CUDA engine adds to EngineOptions (tests, benchmarks, ops overrides).
struct CudaEngineOptions {
  int device = -1;  // CUDA device ordinal; -1 keeps the current device
  VmmHandleType vmm_handle = VmmHandleType::kAuto;
  ForcedPath forced = ForcedPath::kAuto;
  DispatchTable table = DispatchTable::Published();
  bool enable_nccl = true;
  bool enable_nccl_symmetric = true;
  // FusionParams::sm_budget; 0 = automatic: SMs / ranks sharing this GPU, less two blocks per
  // rank (its doorbell waiter and its client's ring kernel) when the doorbell plane is enabled.
  uint32_t sm_budget = 0;
  // The doorbell plane (AddDoorbellPlan). Off: AddDoorbellPlan answers FAILED_PRECONDITION.
  bool enable_doorbell = true;
  uint32_t doorbell_queue_depth = 8;
  bool doorbell_programmatic_launch = false;
  // DoorbellPlaneOptions::serve_blocks (at most kSharedGpuDoorbellServeBlocks when ranks share
  // the GPU); 0 turns in-place serving off. arfused's default (--doorbell-serve-blocks) is 16:
  // each resident block keeps a register-heavy client kernel off its SM (docs/doorbell.md).
  uint32_t doorbell_serve_blocks = kDefaultDoorbellServeBlocks;
};

class CudaEngine final : public Engine, public DoorbellHost, public InStreamHost {
 public:
  CudaEngine(const EngineOptions& options, const CudaEngineOptions& cuda_options);
  ~CudaEngine() override;

  // `exchange` must outlive the engine (or the next Initialize): unfused ops agree over it.
  absl::Status Initialize(Exchange& exchange, absl::Time deadline) override;
  absl::StatusOr<OpOutcome> Execute(const OpArgs& op, const ExecContext& ctx) override;
  void Abort() override;
  EngineStatus Status() const override;
  DoorbellHost* doorbell_host() override { return this; }
  InStreamHost* instream_host() override { return this; }

  // InStreamHost (docs/instream.md): the workspace's mappings, the kernel image for this GPU
  // (loaded here first to check it and size its grids) and the dispatch for a client library.
  absl::StatusOr<InStreamExport> ExportInStream(const std::vector<uint32_t>& hiddens) override;
  absl::StatusOr<InStreamCounters> InStreamStatus() override;
  void AbortInStream() override { Abort(); }
  bool InStreamClientEnded(uint64_t attach_id) override;

  // DoorbellHost. The plan's twoshot_min_tokens comes from the dispatch table (the same on every
  // rank); a shape the dispatcher sends to the unfused path at max_tokens is refused with
  // FAILED_PRECONDITION (use the eager plane).
  absl::StatusOr<DoorbellGrant> AddDoorbellPlan(const OpArgs& op_template, uint32_t max_tokens,
                                                absl::Time deadline) override;
  absl::Status RemoveDoorbellPlan(const DoorbellGrant& grant, absl::Time deadline) override;
  // The plane's counters and health; NOT_FOUND while there is no plane.
  absl::StatusOr<DoorbellPlaneStatus> DoorbellStatus() const;
  // Tests that ring from this process (a legacy IPC handle cannot be opened by the process that
  // exported it): the grant's slot, or null when its plane is gone.
  DoorbellSlot* doorbell_slot_for_testing(const DoorbellGrant& grant) const;

  // The path Execute would take for this shape now (forced choice included).
  absl::StatusOr<DispatchChoice> Choose(uint32_t num_tokens, uint32_t hidden, DType dtype) const;
  void SetForcedPath(ForcedPath forced);
  // The engine's stream: ops run on it, in order.
  cudaStream_t stream() const { return stream_; }
  int sm() const { return sm_; }
  bool nccl_available() const;
  bool nccl_symmetric_available() const;
  bool shares_gpu() const;

 private:
  friend absl::StatusOr<std::unique_ptr<CudaEngine>> MakeCudaEngine(
      const EngineOptions& options, const CudaEngineOptions& cuda_options);

  absl::StatusOr<OpOutcome> ExecuteLocked(const OpArgs& op, const ExecContext& ctx)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ValidateOp(const OpArgs& op) const;
  absl::Status LaunchUnfused(const OpArgs& op, bool symmetric, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every rank agrees on the unfused op before any enqueues it; poisons the engine when the
  // agreement failed for want of a rank (not for a refused op).
  absl::Status AgreeOnUnfusedLocked(const OpArgs& op, bool symmetric, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PoisonLocked(const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether an unfused op enqueued earlier is still unfinished after waiting the spin timeout.
  bool UnfusedOpStuck() const;
  // Allocates unfused_scratch_ once (an FP8 op without norm_out on the regular NCCL path).
  absl::Status EnsureUnfusedScratchLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads the kernels' error word after a fused op; poisons and maps the error.
  absl::Status CheckFusedError() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status InitializeLocked(Exchange& exchange, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Aborts the workspace's spins, stops and frees the doorbell plane, then frees the workspace.
  void ResetWorkspaceLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The doorbell plane's options over the current workspace.
  DoorbellPlaneOptions DoorbellOptionsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<DoorbellGrant> AddDoorbellPlanLocked(const OpArgs& op_template,
                                                      uint32_t max_tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  DispatchRequest DispatchRequestLocked(const OpArgs& op) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // How long a copy of the workspace's control words may take (a copy engine; never behind ops).
  static constexpr absl::Duration kInStreamReadTimeout = absl::Milliseconds(20);

  const EngineOptions options_;
  CudaEngineOptions cuda_options_;
  int device_ = 0;
  int sm_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t op_done_ = nullptr;
  // Recorded after every unfused op: the destructor tells a finished NCCL op from a stuck one.
  cudaEvent_t unfused_done_ = nullptr;

  // Held for the whole of Initialize and Execute: one op in flight.
  mutable absl::Mutex mu_;
  std::unique_ptr<FusionWorkspace> workspace_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<NcclComm> nccl_ ABSL_GUARDED_BY(mu_);
  // Symmetric windows live on their own (blocking) communicator: a failed registration leaves
  // that communicator unusable, and the regular one must survive it.
  std::unique_ptr<NcclComm> sym_nccl_ ABSL_GUARDED_BY(mu_);
  void* symmetric_buffer_ ABSL_GUARDED_BY(mu_) = nullptr;  // owned by sym_nccl_
  size_t symmetric_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool shares_gpu_ ABSL_GUARDED_BY(mu_) = false;
  // The unfused path's sum for FP8 ops without norm_out: max_tokens x max_hidden of the dtype,
  // taken at the first such op (most callers pass norm_out or the symmetric window serves).
  void* unfused_scratch_ ABSL_GUARDED_BY(mu_) = nullptr;
  // The exchange of the last Initialize: unfused ops agree over it.
  Exchange* exchange_ ABSL_GUARDED_BY(mu_) = nullptr;
  // The planes' engine sides and their hooks; the doorbell plane over workspace_ (none until the
  // first doorbell plan, and without a workspace).
  EnginePlanes planes_ ABSL_GUARDED_BY(mu_);
  // Status() and Abort() must not wait for an op: their state lives under a second lock.
  mutable absl::Mutex state_mu_;
  mutable EngineStatus status_ ABSL_GUARDED_BY(state_mu_);
  FusionWorkspace* abortable_ ABSL_GUARDED_BY(state_mu_) = nullptr;
  // The in-stream image as loaded here (on the first export).
  std::unique_ptr<InStreamKernelImage> image_ ABSL_GUARDED_BY(mu_);
  // Set once a client was given the workspace: from then on Status() also reads the device's
  // error word, which in-stream kernels write instead of this process's host mirror.
  std::atomic<bool> exported_{false};
  // The last error word read from the device (0 = healthy), for Status().
  mutable std::atomic<uint32_t> instream_error_{0};
};

// The factory the daemon calls (CUDA builds only). FAILED_PRECONDITION when there is no GPU.
absl::StatusOr<std::unique_ptr<Engine>> MakeCudaEngine(const EngineOptions& options);
absl::StatusOr<std::unique_ptr<CudaEngine>> MakeCudaEngine(const EngineOptions& options,
                                                           const CudaEngineOptions& cuda_options);

}  // namespace arfuse
