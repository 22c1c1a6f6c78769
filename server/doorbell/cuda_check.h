// CUDA runtime result -> absl::Status for server/doorbell. Kept local (not server/gpu's
// cuda_status.h) so the doorbell plane builds and links without the CUDA engine and NCCL.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace arfuse::doorbell_internal {

// OK for cudaSuccess. Clears the runtime's last error so an unrelated later check does not see
// it. The message names the call and the error, never a pointer.
inline absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  const std::string message =
      absl::StrCat(what, " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  switch (err) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorInvalidValue:
      return absl::InvalidArgumentError(message);
    case cudaErrorNotSupported:
    case cudaErrorNotPermitted:
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

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

#define ARFUSE_DOORBELL_CUDA(expr, what) \
  ARFUSE_RETURN_IF_ERROR(::arfuse::doorbell_internal::CudaStatus((expr), (what)))
