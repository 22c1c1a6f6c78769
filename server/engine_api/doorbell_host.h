// The doorbell plane as the Fusion service sees it (docs/doorbell.md): CUDA-free, so the service
// builds and unit-tests without the toolkit. The CUDA engine implements it over its
// DoorbellPlane; the daemon's GatedEngine forwards to the engine it holds; engines without a
// doorbell plane (host mode) return null from Engine::doorbell_host().
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/engine_api/engine.h"

namespace arfuse {

// Slots of one doorbell plane: one per registered plan (a call site of the client). Equal to the
// kernels' kMaxDoorbellSlots (static_asserted where both are visible, server/doorbell).
inline constexpr uint32_t kDoorbellPlaneSlots = 32;

// What one registered doorbell plan got: the proto's Doorbell message field for field, plus
// what identifies it for removal and what the client may want to know.
struct DoorbellGrant {
  // The plane that holds the plan. A plane lives as long as its engine's workspace: a new engine
  // (the daemon re-forms the group after a poisoning) or a new workspace makes a new plane, whose
  // id differs, and removing a grant of an older plane does nothing (that plane is gone and its
  // slots were stopped: rings fail with DoorbellError::kStopped).
  uint64_t plane_id = 0;
  uint32_t slot = 0;
  std::string ipc_handle;  // 64 bytes: cudaIpcMemHandle_t of the slot block
  uint64_t offset = 0;     // byte offset of the slot in the block
  uint32_t request_value = 0;
  uint32_t complete_value = 0;
  uint32_t reset_value = 0;
  // The largest token count a ring may ask for.
  uint32_t max_tokens = 0;
  // Rings with num_tokens >= this run two-shot, the others one-shot (0xffffffff: never
  // two-shot); taken from the dispatch table, so the same on every rank and the same algorithm
  // an eager op of that many tokens would run.
  uint32_t twoshot_min_tokens = 0xffffffffu;
  // The path a ring of max_tokens takes, and why (CreatePlanResponse's path and reason).
  ExecPath path_at_max = ExecPath::kOneShot;
  std::string reason;
};

class DoorbellHost {
 public:
  virtual ~DoorbellHost() = default;

  // Registers a doorbell plan for `op_template`: a complete op with pointers valid in this
  // process at `max_tokens` (its num_tokens is ignored). The memory it points to must stay
  // mapped until RemoveDoorbellPlan returned OK. Errors: UNAVAILABLE (engine not initialized, or
  // being replaced: retry), FAILED_PRECONDITION (no fused workspace, poisoned, a shape the
  // dispatcher sends to the unfused path: use the eager plane), INVALID_ARGUMENT (does not fit),
  // RESOURCE_EXHAUSTED (every slot taken), DEADLINE_EXCEEDED (the engine was busy until
  // `deadline`).
  virtual absl::StatusOr<DoorbellGrant> AddDoorbellPlan(const OpArgs& op_template,
                                                        uint32_t max_tokens,
                                                        absl::Time deadline) = 0;

  // Unregisters the plan; rings on its slot fail with DoorbellError::kStopped. OK means no
  // kernel queued by the plane can touch the plan's memory any more (it may be unmapped).
  // OK for a grant whose plane is gone. DEADLINE_EXCEEDED when queued kernels were still running
  // at `deadline` (a fused op waiting for a peer): the plan is removed but its memory must stay
  // mapped.
  virtual absl::Status RemoveDoorbellPlan(const DoorbellGrant& grant, absl::Time deadline) = 0;
};

}  // namespace arfuse
