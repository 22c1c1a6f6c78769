// The doorbell self-test: a short in-process measurement of the hop, with the plane's own
// kernels. A "client" stream replays a CUDA graph of ring kernels; a "sidecar" stream has the
// same number of triples queued (waiter, an empty indirect fused launch, completion). The
// in-process reference replays a graph of the same fused launch. Both are timed with events.
// Touches no workspace and no peer (the fused launch has no tokens), so it runs on one rank
// alone, at startup or at plan creation. CUDA only.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/doorbell/doorbell_report.h"

namespace arfuse {

struct DoorbellSelfTestOptions {
  int device = 0;
  int ops = 200;           // rings per timed replay
  int repeats = 3;         // timed replays (after one warm-up); the fastest counts
  uint32_t hidden = 4096;  // shape of the empty fused launch (its grid and block)
  // Bound on every wait (ring timeout, waiter deadline, stream waits).
  absl::Duration timeout = absl::Seconds(5);
  // As DoorbellPlaneOptions::programmatic_launch: measure what the plane will run.
  bool programmatic_launch = false;
};

// INVALID_ARGUMENT for bad options, the CUDA error otherwise (FAILED_PRECONDITION without a
// device), DEADLINE_EXCEEDED if a replay did not finish in time, INTERNAL if a ring reported an
// error or the sidecar served a different number of ops.
absl::StatusOr<DoorbellHopReport> RunDoorbellSelfTest(const DoorbellSelfTestOptions& options);

}  // namespace arfuse
