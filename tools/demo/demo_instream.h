// arfuse-demo: one shape on the in-stream plane in a client process (docs/instream.md).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "client/cpp/client.h"
#include "tools/demo/demo_shape.h"

namespace arfuse::demo {

// Why a shape's in-stream row did not run, when no rank failed: the sidecar refused the attach
// (FAILED_PRECONDITION, e.g. fusion off; UNAVAILABLE), the client library declines the shape
// (OUT_OF_RANGE: beyond the fused range), or another rank said one of these (every rank skips
// together, since a rank that launches alone spins until the spin timeout).
struct InStreamSkipped {
  std::string why;
  bool declined = false;  // the shape, not the sidecar: a framework runs its own path for it
};

// The shape on the in-stream plane: Fusion.Attach for the shape's hidden size
// (client/cpp/instream_attach.h), the ranks' agreement that every one of them attached and fuses
// the shape (files in `dir`), then 3 warm-up and `iters` timed ops through libarfuse_client, on
// the client's own tensors, with another input variant before every op; the outputs of the last
// op of each variant are checked against the CPU reference. Then the attachment ends
// (arfuse_detach, Fusion.Detach), so the eager and doorbell rows that follow get the workspace.
//
// Host mode (`cuda` false): the ops run synchronously in this thread on host memory; us per op is
// the median wall time of one call. CUDA: the op is captured once in a CUDA graph on this
// client's stream and the graph is replayed; us per op is the median of CUDA events around each
// replay. Either way the attachment's error word (arfuse_check) is read after the ops.
//
// A non-OK status is a failure. A shape that no rank failed but some rank cannot run returns a
// result of path "skipped" (a refused attach) or "declined" (the shape) with `skipped` saying why.
absl::StatusOr<ShapeResult> RunInStreamShape(client::Client& c, const std::string& dir, int rank,
                                             int world, const Shape& s, DType dt, bool cuda,
                                             int iters, double timeout_s, InStreamSkipped* skipped);

}  // namespace arfuse::demo
