// Interprocess CUDA events of the eager plane (docs/api.md): the client's event, recorded after it
// produced the input, is opened here and waited on by the engine's stream; the engine records a
// done event that the reply exports. The CUDA implementation is in cuda/; host mode has none
// (wait_event is then refused and done_event left empty).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace arfuse {

// Events for one op; owns what it opened.
class OpEvents {
 public:
  virtual ~OpEvents() = default;
  // cudaEvent_t values for ExecContext (null when absent).
  virtual void* wait_event() const = 0;
  virtual void* done_event() const = 0;
  // cudaIpcEventHandle_t bytes of done_event() for the reply.
  virtual std::string done_handle() const = 0;
};

class EventIpc {
 public:
  virtual ~EventIpc() = default;
  // Opens `wait_handle` (64 bytes, or empty: nothing to wait on) and picks a done event.
  // INVALID_ARGUMENT when the handle does not open; never echoes its bytes.
  virtual absl::StatusOr<std::unique_ptr<OpEvents>> Prepare(const std::string& wait_handle) = 0;
};

}  // namespace arfuse
