// The in-stream plane as the Fusion service sees it (docs/instream.md): CUDA-free, so the service
// builds and unit-tests without the toolkit. An engine that can hand its workspace to a client
// library (the CUDA engine, the host engine) implements it; the daemon's GatedEngine forwards to
// the engine it holds. The service turns an InStreamExport into the attach blob
// (server/instream/attach_blob.h) and offers its descriptors on the fd socket.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/fd/unique_fd.h"
#include "kernels/instream/attach_abi.h"
#include "kernels/instream/op_counters.h"
#include "server/engine_api/engine.h"

namespace arfuse {

// One rank's workspace memory as the client maps it.
struct InStreamRankMemory {
  instream::MemoryKind kind = instream::MemoryKind::kCudaIpc;
  uint64_t bytes = 0;
  std::string handle;  // 64 bytes for kCudaIpc and kVmmFabric, empty otherwise
  // kVmmPosixFd, kHostShm: a descriptor of this rank's memory (a duplicate the export owns);
  // for kHostShm only one entry holds one (the exporting rank's: the group's one object) and
  // every rank's RankMemory points at it.
  UniqueFd fd;
};

// Everything the attach blob describes, filled by the engine for one attach.
struct InStreamExport {
  instream::DeviceKind device = instream::DeviceKind::kHost;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint64_t generation = 0;
  uint8_t gpu_uuid[16] = {};
  uint32_t sm = 0;
  uint32_t sm_budget = 0;
  uint64_t spin_timeout_ns = 0;
  bool pdl = false;
  DType dtype = DType::kBF16;
  uint64_t oneshot_max_bytes = 0;
  uint64_t twoshot_max_bytes = 0;
  uint32_t kernel_config[5] = {};
  uint8_t layout[80] = {};  // WorkspaceLayout bytes (CUDA); zero in host mode
  uint32_t max_tokens = 0;
  uint32_t hidden = 0;
  uint64_t host_slot_bytes = 0;
  std::vector<instream::KernelEntry> entries;
  std::vector<InStreamRankMemory> ranks;  // indexed by rank
  // The kernel image for this GPU (CUDA): static data of the process, not owned.
  const void* image = nullptr;
  uint64_t image_bytes = 0;
};

// What the engine's workspace did while clients launched on it: the kernels' counters and
// error word, read by the daemon for metrics and poisoning.
struct InStreamCounters {
  uint64_t generation = 0;  // the workspace's generation (InStreamExport::generation)
  uint64_t launches = 0;    // in-stream launches that passed the generation check
  uint64_t stale = 0;       // launches refused for a stale generation or launch ABI
  uint32_t error = 0;       // the workspace's sticky error word (FusionError), 0 = healthy
  std::string error_name;   // "timeout", ... ("" when healthy)
  // An op is in flight on this rank (CUDA: the control block's one-shot or two-shot in-flight
  // counts are nonzero; a launch killed mid-op leaves them so).
  bool op_in_flight = false;
  // CUDA: the kernels' launch counts by attachment slot, pattern and token bucket
  // (FusionControl::instream_ops), graph replays included. Absent in host mode, where the client
  // library runs every op itself and its counter page is the count.
  std::optional<instream::InStreamOpTable> ops;
};

class InStreamHost {
 public:
  virtual ~InStreamHost() = default;

  // Describes the workspace for a client that will run ops of these hidden sizes (empty: the
  // workspace's). UNAVAILABLE (not initialized, or being replaced), FAILED_PRECONDITION (fusion
  // is off for the group, poisoned, no kernel image for this GPU), INVALID_ARGUMENT (a hidden
  // the kernels cannot run or above the workspace's).
  virtual absl::StatusOr<InStreamExport> ExportInStream(const std::vector<uint32_t>& hiddens) = 0;

  // Reads the kernels' counters and the error word (off the op path: a small copy).
  virtual absl::StatusOr<InStreamCounters> InStreamStatus() = 0;

  // Writes the workspace's abort word: every in-stream kernel spinning on it exits with an error
  // (the workspace is then poisoned). Never blocks.
  virtual void AbortInStream() = 0;

  // The attachment `attach_id` ended without a Detach (its session ended: the client exited or
  // died). When it launched an op of this rank that did not complete, that op is abandoned: its
  // sequence number and what it published are retired by poisoning the workspace, before any
  // peer's op can pair with them (the group then re-forms). Returns whether it poisoned. Never
  // blocks.
  virtual bool InStreamClientEnded(uint64_t attach_id) = 0;
};

}  // namespace arfuse
