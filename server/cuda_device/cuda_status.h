// One macro family for CUDA runtime, CUDA driver and NCCL results -> absl::Status.
//
// Every failure clears the runtime's last error (so a later unrelated check does not report it
// again), logs one key=value line and maps to a code a client can act on:
//   out of memory                         -> RESOURCE_EXHAUSTED
//   invalid value / argument / usage      -> INVALID_ARGUMENT
//   not supported / not permitted         -> FAILED_PRECONDITION
//   sticky device errors, remote failures -> UNAVAILABLE (sticky ones carry a payload, see
//                                            IsStickyDeviceError in device_error.h: the daemon
//                                            must report NOT_SERVING and exit for a restart)
//   anything else                         -> INTERNAL
// Messages name the call and the error, never a pointer or a handle.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace arfuse {

// `expr` is the source text of the call, `file`/`line` where it was made. OK for success.
absl::Status CudaResultToStatus(cudaError_t err, const char* expr, const char* file, int line);
absl::Status CudaResultToStatus(CUresult err, const char* expr, const char* file, int line);
absl::Status CudaResultToStatus(ncclResult_t err, const char* expr, const char* file, int line);

// True for errors that leave the CUDA context unusable (illegal address, launch failure, ...):
// every later call in this process fails the same way, so only a restart recovers.
bool IsStickyCudaError(cudaError_t err);
bool IsStickyCudaError(CUresult err);

// True for errors that say this process cannot get, or has lost, its client of the GPU: the
// device is held exclusively by another process, or the MPS server refuses new clients (it is
// recovering from a fault and waits for every client to leave) or has dropped this one. The
// runtime does not keep them as a sticky error, but retrying in the same process did not recover
// (on H200 under MPS, a sidecar retried for 130 s after a peer had left a stuck NCCL kernel,
// docs/reliability.md); a restarted process does. They map like sticky errors (UNAVAILABLE with
// the sticky payload) and are recorded for DeviceHealth(), so the daemon exits for a restart.
bool IsRestartOnlyCudaError(cudaError_t err);
bool IsRestartOnlyCudaError(CUresult err);

// OK while the current device's context is usable; the sticky error's status (UNAVAILABLE with
// the sticky payload, see IsStickyDeviceError) once it is not, or once a restart-only error (see
// IsRestartOnlyCudaError) was mapped in this process. Does not wait for the device: the daemon's
// health loop calls it to decide NOT_SERVING + exit.
absl::Status DeviceHealth();

// Records that this process's device holds work that can never finish (an NCCL kernel waiting
// for a peer that agreed to the op and is gone: nothing frees it, not even ncclCommAbort).
// DeviceHealth() then reports a sticky error naming `why`, so the daemon reports NOT_SERVING and
// exits for a restart, as for a lost context. Never cleared.
void MarkDeviceWedged(absl::string_view why);

}  // namespace arfuse

// Converts the result of a CUDA runtime, driver or NCCL call to absl::Status.
#define ARFUSE_CUDA_STATUS(expr) ::arfuse::CudaResultToStatus((expr), #expr, __FILE__, __LINE__)

// Returns from the enclosing function with the mapped status when the call failed.
#define ARFUSE_CUDA_RETURN_IF_ERROR(expr) ARFUSE_RETURN_IF_ERROR(ARFUSE_CUDA_STATUS(expr))

// Cleanup variant (destructors, error paths): logs and clears the error, never returns or throws.
#define ARFUSE_CUDA_LOG_IF_ERROR(expr) static_cast<void>(ARFUSE_CUDA_STATUS(expr))
