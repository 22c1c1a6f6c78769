// The engine runs the fused op on this rank: the CUDA engine (workspaces, fused kernels, NCCL
// fallback) or the host engine (host shared memory and the CPU implementation). The Fusion
// service resolves regions to pointers and hands them here; engines know nothing of gRPC.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/common/op_types.h"

namespace arfuse {

class Exchange;
class DoorbellHost;
class InStreamHost;

// Numbers match arfuse.v1.ExecPath.
enum class ExecPath : uint8_t { kOneShot = 1, kTwoShot = 2, kUnfused = 3, kHost = 4 };
// Numbers match arfuse.v1.WorkspaceState.
enum class WorkspaceState : uint8_t {
  kInitializing = 1,
  kReady = 2,
  kPoisoned = 3,
  kDraining = 4,
  kUnfused = 5
};

inline constexpr const char* ExecPathName(ExecPath p) {
  switch (p) {
    case ExecPath::kOneShot:
      return "oneshot";
    case ExecPath::kTwoShot:
      return "twoshot";
    case ExecPath::kUnfused:
      return "unfused";
    case ExecPath::kHost:
      return "host";
  }
  return "unknown";
}

struct EngineOptions {
  int rank = 0;
  int world_size = 1;
  int nnodes = 1;
  // Resolved backend: "trtllm", "mnnvl" or "none" (unfused).
  std::string backend = "none";
  // Workspace capacity: ops with num_tokens * hidden * dtype size above
  // max_tokens * max_hidden * dtype size are refused.
  uint32_t max_tokens = 2048;
  uint32_t max_hidden = 8192;
  DType dtype = DType::kBF16;
  // Every spin gives up after this long, poisons the workspace and reports an error.
  absl::Duration spin_timeout = absl::Seconds(5);
  // With backend "none": why the group's decision turned fusion off. Status().reason says it, so
  // GetWorkspaceInfo (what clients and `arfusectl info` read) tells the user why nothing fuses.
  std::string unfused_reason;
};

// One op, with pointers valid in this process (already bounds-checked by the registry).
using OpArgs = FusedOpArgs;

struct ExecContext {
  absl::Time deadline = absl::InfiniteFuture();
  // CUDA only: an opened interprocess event (cudaEvent_t) to wait on before the op, and one to
  // record after it; null when absent.
  void* wait_event = nullptr;
  void* done_event = nullptr;
  // Block until the op completed (always true in host mode).
  bool synchronous = false;
};

struct OpOutcome {
  ExecPath path = ExecPath::kHost;
  std::string reason;
};

struct EngineStatus {
  WorkspaceState state = WorkspaceState::kInitializing;
  uint64_t generation = 0;
  std::string backend = "none";
  bool fusion_enabled = false;
  std::string reason;
  uint64_t workspace_bytes = 0;
};

class Engine {
 public:
  virtual ~Engine() = default;

  // Collective: every rank calls it with the same options (except rank). Builds the workspace
  // and votes; when any rank cannot fuse, all ranks run unfused. Bumps the generation.
  virtual absl::Status Initialize(Exchange& exchange, absl::Time deadline) = 0;

  // Runs one op. Errors: INVALID_ARGUMENT (does not fit the workspace), FAILED_PRECONDITION
  // (poisoned: re-initialize), ABORTED/DEADLINE_EXCEEDED (a peer did not arrive; the workspace is
  // now poisoned), UNAVAILABLE (not initialized).
  virtual absl::StatusOr<OpOutcome> Execute(const OpArgs& op, const ExecContext& ctx) = 0;

  // Makes every spin in progress or to come exit with an error (host watchdog, shutdown). Never
  // blocks.
  virtual void Abort() = 0;

  virtual EngineStatus Status() const = 0;

  // The doorbell plane (server/engine_api/doorbell_host.h), or null when this engine has none (host
  // mode). The pointer lives as long as the engine.
  virtual DoorbellHost* doorbell_host() { return nullptr; }

  // The in-stream plane (server/engine_api/instream_host.h), or null when this engine cannot hand
  // its workspace to a client library. The pointer lives as long as the engine.
  virtual InStreamHost* instream_host() { return nullptr; }
};

}  // namespace arfuse
