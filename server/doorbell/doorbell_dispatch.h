// Which algorithm a doorbell plan's rings run (docs/doorbell.md): the doorbell plane runs only
// the fused kernels, and the device picks one-shot or two-shot per ring by one token threshold
// that must be the same on every rank. Both come from the dispatch table here, so a ring of n
// tokens runs exactly what an eager op of n tokens would, and a plan whose shape the dispatcher
// sends to the unfused path is refused (FAILED_PRECONDITION: use the eager plane). CUDA-free,
// unit-tested in CI.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "server/collective/dispatch_table.h"
#include "server/engine_api/engine.h"

namespace arfuse {

// DoorbellPlanOptions::twoshot_min_tokens that means "never two-shot".
inline constexpr uint32_t kDoorbellNeverTwoShot = 0xffffffffu;

struct DoorbellDispatch {
  // Rings with num_tokens >= this run two-shot, the others one-shot.
  uint32_t twoshot_min_tokens = kDoorbellNeverTwoShot;
  // The path of a ring of max_tokens (one-shot or two-shot).
  ExecPath path_at_max = ExecPath::kOneShot;
  std::string reason;
};

// `at_max` is the dispatch request of the plan at its largest token count (num_tokens =
// max_tokens), as an eager op of that shape would be dispatched now (fused_available false when
// the workspace is missing or poisoned). Every token count 1..max_tokens must take a fused path:
// FAILED_PRECONDITION naming the reason otherwise (no fused workspace, forced unfused, a payload
// above the fused limits, the two-shot kernel unavailable in its range). INVALID_ARGUMENT for
// max_tokens 0.
absl::StatusOr<DoorbellDispatch> ChooseDoorbellDispatch(const DispatchTable& table,
                                                        const DispatchRequest& at_max);

// Most serving blocks a rank keeps resident when ranks share its GPU (MPS, tests and demos).
// Each rank's serving launch stays resident between rings, and beside it run the other ranks'
// serving launches, the clients' ring kernels and whatever else the clients launch: with 128
// blocks per rank and two sidecars on one H200, a client's graph of rings at 128 tokens stalled
// to its 90 s timeout, while 64 and 32 blocks ran it (docs/doorbell.md, the serving blocks).
inline constexpr uint32_t kSharedGpuDoorbellServeBlocks = 32;

// The serving launch's block cap a rank uses: `requested` (the --doorbell-serve-blocks flag; 0
// turns in-place serving off), at most kSharedGpuDoorbellServeBlocks when ranks share the GPU.
uint32_t DoorbellServeBlocksFor(uint32_t requested, bool shares_gpu);

// arfused's --doorbell-serve-blocks default (docs/doorbell.md: what the idle plane costs).
inline constexpr uint32_t kDefaultDoorbellServeBlocks = 16;

// FusionParams::sm_budget of each rank when `ranks` ranks share one GPU of `sms` SMs: an equal
// share of what every rank's resident doorbell blocks leave free (its waiter or serving launch
// and its client's ring: `serve_blocks` + 2 per rank, counted as a whole SM each, and 2 spare),
// at least 1. A fused grid whose peers' grids cannot all be resident beside it deadlocks to the
// spin timeout: each rank's resident blocks wait for rows of the other's that are not resident.
// Without the doorbell plane (`doorbell` false) nothing else is resident: SMs / ranks.
uint32_t SharedGpuSmBudget(int sms, int ranks, bool doorbell, uint32_t serve_blocks);

}  // namespace arfuse
