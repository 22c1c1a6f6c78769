// The doorbell plane's device guard. (CUDA results map to absl::Status through
// server/cuda_device/cuda_status.h, as everywhere in the server.)
#pragma once

#include <cuda_runtime_api.h>

namespace arfuse::doorbell_internal {

// Makes `device` current for the scope and restores the caller's device after: the plane's
// methods run on whatever thread the engine calls them from.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ != device) cudaSetDevice(device);
  }
  ~ScopedDevice() {
    int now = -1;
    if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) {
      cudaSetDevice(previous_);
    }
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace arfuse::doorbell_internal
