// The host engine's private copies of an op's client tensors other than the input. The CPU
// collective reads residual_in, gamma and (the static FP8 pattern) the scale, and writes the
// outputs, in these buffers; every access to client memory is a GuardedCopy (guarded_copy.h), so
// a client that shrinks its region under the op fails that op alone.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "server/engine_api/engine.h"

namespace arfuse {

class OpStaging {
 public:
  // Points `staged` at the private buffers (even when a copy fails: the collective still runs
  // on them, so the peers complete the op) and copies the op's inputs in; the first failed
  // copy's error.
  absl::Status In(const OpArgs& op, OpArgs* staged);
  // Copies the op's outputs from the private buffers back into the client's memory.
  absl::Status Out(const OpArgs& op) const;

 private:
  std::vector<uint8_t> in_, gamma_, out_, norm_;
  std::vector<uint8_t> quant_, scale_;  // the FP8 patterns' quant_out and scale
};

}  // namespace arfuse
