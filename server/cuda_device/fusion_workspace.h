// The fused kernels' workspace on one rank: peer memory sized by the kernels' WorkspaceLayout
// (kernels/allreduce_fusion/allreduce_fusion.h has the sizing rule), host-mapped abort and
// error words, and the generation that a collective re-initialization bumps.
//
// Lifecycle (docs/reliability.md, "Nothing lost", says what each state means to a client):
//   Create      collective; allocates, maps every peer unicast, runs LaunchWorkspaceInit, waits
//               for it and barriers, so no rank writes into a peer that is not initialized.
//               Refused while the stream captures a CUDA graph (no collectives inside capture).
//   Launch      checks fit and poison before every op; never launches on a poisoned workspace.
//   poisoned    once a kernel recorded an error (a peer did not arrive within the spin timeout,
//               the host aborted, a peer aborted): every op is refused until
//   Reinitialize collective; waits (bounded) for this rank's stream, barriers so that no peer's
//               kernel still writes here, re-initializes, barriers again, bumps the generation.
//   Abort       sets the host abort word: every spin in progress or to come exits. Never blocks.
//   destructor  aborts first (so spinning kernels exit), then releases memory without waiting
//               for peers.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/common/op_types.h"
#include "server/cuda_device/peer_memory.h"
#include "server/engine_api/engine.h"
#include "server/engine_api/instream_host.h"

namespace arfuse {

class Exchange;

struct WorkspaceOptions {
  std::string backend = "trtllm";  // "trtllm" (CUDA IPC) or "mnnvl" (VMM)
  VmmHandleType vmm_handle = VmmHandleType::kAuto;
  uint32_t max_tokens = 2048;
  uint32_t hidden = 8192;
  DType dtype = DType::kBF16;
  absl::Duration spin_timeout = absl::Seconds(5);
  // FusionParams::sm_budget: same on every rank; 0 = all SMs.
  uint32_t sm_budget = 0;
};

// Host-mapped words the kernels read (abort) and write (error); layout shared with the device
// through FusionParams::host_abort / host_error.
struct HostWords {
  uint32_t abort;
  uint32_t error;
};
static_assert(sizeof(HostWords) == 8, "HostWords is read by the device");

class FusionWorkspace {
 public:
  static absl::StatusOr<std::unique_ptr<FusionWorkspace>> Create(Exchange& exchange,
                                                                 const WorkspaceOptions& options,
                                                                 cudaStream_t stream,
                                                                 absl::Time deadline);
  FusionWorkspace(const FusionWorkspace&) = delete;
  FusionWorkspace& operator=(const FusionWorkspace&) = delete;
  ~FusionWorkspace();

  // INVALID_ARGUMENT (nothing launched) when the op does not fit: contract::CheckOp in the
  // engine's voice (another dtype than the workspace's, hidden not a multiple of 8 or above the
  // workspace's, num_tokens x hidden above max_tokens x hidden).
  absl::Status CheckFits(uint32_t num_tokens, uint32_t hidden, DType dtype) const;

  // Enqueues one op. FAILED_PRECONDITION when poisoned; INVALID_ARGUMENT when it does not fit or
  // the kernels refuse the arguments.
  absl::Status Launch(const OpArgs& op, FusionAlgo algo, cudaStream_t stream);

  // The kernel params Launch would use for `op` and `algo`, checked (CheckFits and
  // CheckFusionParams) but not launched; the doorbell plane's plan table holds them.
  // INVALID_ARGUMENT as Launch.
  absl::StatusOr<FusionParams> MakeParams(const OpArgs& op, FusionAlgo algo) const;

  // The kernels' error code as last written to the host mirror (FusionError); 0 = healthy.
  uint32_t error_code() const;
  bool poisoned() const { return error_code() != 0; }
  // Makes every spin exit with kHostAbort (and so poisons the workspace). Never blocks.
  void Abort();

  absl::Status Reinitialize(Exchange& exchange, cudaStream_t stream, absl::Time deadline);

  // The in-stream kernels' counters and the workspace's error word, copied from the device on a
  // stream of its own (never behind the engine's kernels). DEADLINE_EXCEEDED past `deadline`.
  absl::StatusOr<InStreamCounters> ReadInStreamCounters(absl::Time deadline);
  // Retires an op a client left half done (FusionError::kAbandoned): writes the code into this
  // rank's error word and every rank's abort word with a copy engine,
  // so every launch on any rank from now on refuses at its first control-word load and every
  // spin exits; the group then re-forms. Never blocks.
  void PoisonGroup(FusionError code);
  // What a client process needs to map rank r's buffer (PeerMemory::ExportForClient).
  absl::StatusOr<InStreamRankMemory> ExportForClient(int r) const {
    return memory_->ExportForClient(r);
  }
  int world_size() const { return memory_->world_size(); }

  // Unique within the process across workspaces (never reused after this one is dropped); its
  // GenerationTag is written into the control block at every initialization.
  uint64_t generation() const { return generation_; }
  const WorkspaceLayout& layout() const { return layout_; }
  // Device memory this rank allocated for the workspace (its own buffer, not the peers').
  uint64_t bytes_per_rank() const { return memory_->bytes(); }
  const char* kind() const { return memory_->kind(); }
  // Rank r's workspace as mapped in this process (unicast); for benchmarks' peer reads.
  void* peer_base(int r) const { return memory_->peer(r); }
  const WorkspaceOptions& options() const { return options_; }
  // This rank's own workspace (peer_base(rank())) and rank.
  void* local_base() const { return memory_->local(); }
  int rank() const { return memory_->rank(); }
  // Device address of the host-mapped abort word (FusionParams::host_abort): the doorbell
  // plane's waiters poll it, so Abort() also sends them away.
  const uint32_t* device_host_abort() const { return &device_host_words_->abort; }

 private:
  FusionWorkspace(const WorkspaceOptions& options, const WorkspaceLayout& layout)
      : options_(options), layout_(layout) {}
  // Init + generation tag + wait (bounded) + barrier; the host words are cleared first.
  absl::Status InitAndBarrier(Exchange& exchange, cudaStream_t stream, const std::string& tag,
                              uint64_t generation, absl::Time deadline);
  // Writes FusionControl::generation of this rank's workspace (stream-ordered).
  absl::Status WriteGenerationTag(uint32_t tag, cudaStream_t stream);

  // Pinned host words the control-block copies go through.
  struct ControlStaging {
    uint32_t tag;
    uint32_t abort;
    uint32_t error;                   // PoisonGroup's code
    uint32_t peer_abort;              // FusionError::kPeerAbort, for the peers' abort words
    alignas(16) uint8_t control[96];  // FusionControl's first bytes (error .. instream_stale)
    // FusionControl::instream_ops, the kernels' per-attachment launch counts.
    alignas(64) uint8_t instream_ops[sizeof(instream::InStreamOpTable)];
  };

  WorkspaceOptions options_;
  WorkspaceLayout layout_;
  std::unique_ptr<PeerMemory> memory_;
  HostWords* host_words_ = nullptr;         // pinned, mapped
  HostWords* device_host_words_ = nullptr;  // the same words as the device sees them
  ControlStaging* staging_ = nullptr;       // pinned
  // Control-block copies (abort, tag, counters): independent of the engine's stream.
  cudaStream_t control_stream_ = nullptr;
  std::mutex control_mu_;  // one counters copy at a time (staging_->control)
  uint64_t generation_ = 0;
  // The stream of the last launch: teardown waits (bounded) for it after aborting.
  cudaStream_t last_stream_ = nullptr;
};

// Polls `stream` until its work completed or `deadline` passed (DEADLINE_EXCEEDED); a failed
// stream's error is returned. Never blocks past the deadline.
absl::Status WaitStream(cudaStream_t stream, absl::Time deadline);
// The same for an event.
absl::Status WaitEvent(cudaEvent_t event, absl::Time deadline);

}  // namespace arfuse
