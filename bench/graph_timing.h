// CUDA-graph timing shared by the arfuse-bench subcommands: one op captured many times in one
// graph, the graph replayed with every rank in step, us per op of each replay.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/peers/exchange.h"

namespace arfuse::bench {

struct GraphTiming {
  int ops = 1;      // enqueue() calls captured in the graph
  int warmup = 0;   // untimed replays first
  int repeats = 1;  // timed replays
  // Each barrier and each replay's completion may take this long.
  absl::Duration timeout = absl::Seconds(60);
};

// Runs enqueue() (one op on `s`) once outside capture, since NCCL connects lazily and nothing lazy
// may happen in a capture; captures timing.ops x enqueue() in one graph; replays it
// warmup + repeats times, each after a barrier of every rank named <tag>/<replay>, so that one
// rank's launch latency is not timed as another's spinning. Returns us per op of each timed
// replay, in order.
absl::StatusOr<std::vector<double>> TimeGraphReplays(Exchange& ex, cudaStream_t s,
                                                     const GraphTiming& timing,
                                                     const std::function<absl::Status()>& enqueue,
                                                     const std::string& tag);

}  // namespace arfuse::bench
