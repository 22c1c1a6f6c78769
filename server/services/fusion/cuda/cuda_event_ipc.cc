#include "server/services/fusion/cuda/cuda_event_ipc.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace arfuse {
namespace cuda_events_internal {

// Done events are reused round-robin. The ring is long enough that a client's
// cudaStreamWaitEvent on one always runs long before the sidecar records it again (the client
// waits on the reply of op k before it can submit op k + 1, and there are kDoneRing ops between
// two records of one event).
inline constexpr size_t kDoneRing = 32;
// Opened client events kept; the least recently opened is destroyed beyond this.
inline constexpr size_t kWaitCache = 64;

struct DoneEvent {
  cudaEvent_t event = nullptr;
  std::string handle;
};

struct State {
  int32_t device = 0;
  std::mutex mu;
  std::vector<DoneEvent> done;
  size_t next_done = 0;
  std::map<std::string, cudaEvent_t> waits;  // keyed by handle bytes; never logged
  std::deque<std::string> wait_order;
  ~State() {
    for (auto& d : done) cudaEventDestroy(d.event);
    for (auto& [h, e] : waits) cudaEventDestroy(e);
  }
};

}  // namespace cuda_events_internal

namespace {

using cuda_events_internal::State;

class CudaOpEvents final : public OpEvents {
 public:
  CudaOpEvents(cudaEvent_t wait, cudaEvent_t done, std::string handle)
      : wait_(wait), done_(done), handle_(std::move(handle)) {}
  // The events stay owned by State (cached / ring): nothing to release per op.
  void* wait_event() const override { return wait_; }
  void* done_event() const override { return done_; }
  std::string done_handle() const override { return handle_; }

 private:
  cudaEvent_t wait_;
  cudaEvent_t done_;
  std::string handle_;
};

}  // namespace

CudaEventIpc::CudaEventIpc(int32_t device_id) : state_(std::make_shared<State>()) {
  state_->device = device_id;
}

CudaEventIpc::~CudaEventIpc() = default;

absl::StatusOr<std::unique_ptr<OpEvents>> CudaEventIpc::Prepare(const std::string& wait_handle) {
  static_assert(sizeof(cudaIpcEventHandle_t) == 64);
  std::lock_guard<std::mutex> lock(state_->mu);
  // Only opening and creating events needs the device current (the engine sets it again before
  // its own calls): an op whose events are cached makes no CUDA call here.
  auto use_device = [this]() -> absl::Status {
    if (cudaSetDevice(state_->device) != cudaSuccess) {
      cudaGetLastError();
      return absl::UnavailableError("sidecar cannot use its device");
    }
    return absl::OkStatus();
  };
  cudaEvent_t wait = nullptr;
  if (!wait_handle.empty()) {
    if (wait_handle.size() != sizeof(cudaIpcEventHandle_t)) {
      return absl::InvalidArgumentError("wait_event must be exactly 64 bytes");
    }
    auto it = state_->waits.find(wait_handle);
    if (it != state_->waits.end()) {
      wait = it->second;
    } else {
      ARFUSE_RETURN_IF_ERROR(use_device());
      cudaIpcEventHandle_t h;
      std::memcpy(&h, wait_handle.data(), sizeof(h));
      cudaError_t err = cudaIpcOpenEventHandle(&wait, h);
      if (err != cudaSuccess) {
        cudaGetLastError();
        return absl::InvalidArgumentError(
            absl::StrCat("wait_event could not be opened (", cudaGetErrorName(err),
                         "): it must come from cudaIpcGetEventHandle of an event created with "
                         "cudaEventInterprocess | cudaEventDisableTiming"));
      }
      if (state_->wait_order.size() >= cuda_events_internal::kWaitCache) {
        auto old = state_->waits.find(state_->wait_order.front());
        if (old != state_->waits.end()) {
          cudaEventDestroy(old->second);
          state_->waits.erase(old);
        }
        state_->wait_order.pop_front();
      }
      state_->waits[wait_handle] = wait;
      state_->wait_order.push_back(wait_handle);
    }
  }
  if (state_->done.empty()) {
    ARFUSE_RETURN_IF_ERROR(use_device());
    for (size_t i = 0; i < cuda_events_internal::kDoneRing; ++i) {
      cuda_events_internal::DoneEvent d;
      cudaError_t err =
          cudaEventCreateWithFlags(&d.event, cudaEventInterprocess | cudaEventDisableTiming);
      cudaIpcEventHandle_t h;
      if (err == cudaSuccess) err = cudaIpcGetEventHandle(&h, d.event);
      if (err != cudaSuccess) {
        cudaGetLastError();
        return absl::ResourceExhaustedError(
            absl::StrCat("cannot create interprocess events: ", cudaGetErrorName(err)));
      }
      d.handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
      state_->done.push_back(std::move(d));
    }
  }
  const auto& d = state_->done[state_->next_done];
  state_->next_done = (state_->next_done + 1) % state_->done.size();
  return std::unique_ptr<OpEvents>(new CudaOpEvents(wait, d.event, d.handle));
}

}  // namespace arfuse
