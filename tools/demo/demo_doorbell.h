// arfuse-demo, CUDA builds: one shape on the doorbell plane in a client process.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "client/cpp/client.h"
#include "tools/demo/demo_shape.h"

namespace arfuse::demo {

// A failed doorbell CreatePlan that --doorbell=auto shows as skipped.
struct DoorbellRefused {
  std::string why;
};

// The same shape on the doorbell plane: CreatePlan{doorbell}, the slot opened by CUDA IPC, one
// ring kernel captured in a CUDA graph on this client's stream and replayed 3 + iters times; the
// input tensor is overwritten with another variant before every replay (outside the graph),
// and the outputs of the last replay of each variant are kept and checked against the CPU
// reference. us per op: CUDA events around each timed replay (the ring's whole round trip: the
// sidecar's waiter, the fused op with its peers, the completion).
absl::StatusOr<ShapeResult> RunDoorbellShape(client::Client& c, int rank, int world, const Shape& s,
                                             DType dt, int iters, DoorbellRefused* refused);

}  // namespace arfuse::demo
