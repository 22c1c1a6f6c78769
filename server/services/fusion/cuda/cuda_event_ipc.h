// CUDA interprocess events for the eager plane. The client's wait events are opened once and
// cached by handle (clients reuse one event per stream); done events come from a ring of
// interprocess events created here, each exported once.
#pragma once

#include <memory>
#include <string>

#include "server/services/fusion/event_ipc.h"

namespace arfuse {

namespace cuda_events_internal {
struct State;
}

class CudaEventIpc final : public EventIpc {
 public:
  explicit CudaEventIpc(int32_t device_id);
  ~CudaEventIpc() override;
  absl::StatusOr<std::unique_ptr<OpEvents>> Prepare(const std::string& wait_handle) override;

 private:
  std::shared_ptr<cuda_events_internal::State> state_;
};

}  // namespace arfuse
