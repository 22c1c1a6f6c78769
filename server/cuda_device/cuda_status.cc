#include "server/cuda_device/cuda_status.h"

#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/cuda_device/device_error.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

// Strips the directory so messages stay short and do not depend on the build machine.
const char* BaseName(const char* file) {
  const char* base = file;
  for (const char* p = file; *p != '\0'; ++p) {
    if (*p == '/') base = p + 1;
  }
  return base;
}

absl::Status Make(absl::StatusCode code, bool sticky, const std::string& api, const char* name,
                  const char* text, const char* expr, const char* file, int line) {
  std::string message = absl::StrCat(api, " call ", expr, " failed: ", name, " (", text, ")");
  spdlog::error("event=device_call_failed api={} error={} sticky={} site={}:{}", api, name, sticky,
                BaseName(file), line);
  if (sticky) {
    absl::Status status = StickyDeviceError(message);
    return status;
  }
  return absl::Status(code, message);
}

// cuGetErrorName / cuGetErrorString through the runtime's driver entry points, so that this file
// (and the tests of the mapping) need no libcuda at link or load time: machines without a driver
// still get a status, with the numeric code as the name.
using DriverErrorFn = CUresult (*)(CUresult, const char**);
DriverErrorFn LookUpDriver(const char* symbol) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    static_cast<void>(cudaGetLastError());
    return nullptr;
  }
  return reinterpret_cast<DriverErrorFn>(fn);
}

std::string DriverErrorText(CUresult err, bool name) {
  static const DriverErrorFn get_name = LookUpDriver("cuGetErrorName");
  static const DriverErrorFn get_string = LookUpDriver("cuGetErrorString");
  const DriverErrorFn fn = name ? get_name : get_string;
  const char* out = nullptr;
  if (fn != nullptr && fn(err, &out) == CUDA_SUCCESS && out != nullptr) return out;
  return name ? absl::StrCat("CUresult(", static_cast<int>(err), ")") : "no driver to describe it";
}

}  // namespace

bool IsStickyCudaError(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorLaunchTimeout:
    case cudaErrorContextIsDestroyed:
      return true;
    default:
      return false;
  }
}

bool IsRestartOnlyCudaError(cudaError_t err) {
  switch (err) {
    case cudaErrorDevicesUnavailable:
    case cudaErrorMpsConnectionFailed:
    case cudaErrorMpsRpcFailure:
    case cudaErrorMpsServerNotReady:
    case cudaErrorMpsClientTerminated:
      return true;
    default:
      return false;
  }
}

bool IsRestartOnlyCudaError(CUresult err) {
  switch (err) {
    case CUDA_ERROR_DEVICE_UNAVAILABLE:
    case CUDA_ERROR_MPS_CONNECTION_FAILED:
    case CUDA_ERROR_MPS_RPC_FAILURE:
    case CUDA_ERROR_MPS_SERVER_NOT_READY:
    case CUDA_ERROR_MPS_CLIENT_TERMINATED:
      return true;
    default:
      return false;
  }
}

bool IsStickyCudaError(CUresult err) {
  switch (err) {
    case CUDA_ERROR_ILLEGAL_ADDRESS:
    case CUDA_ERROR_LAUNCH_FAILED:
    case CUDA_ERROR_HARDWARE_STACK_ERROR:
    case CUDA_ERROR_ILLEGAL_INSTRUCTION:
    case CUDA_ERROR_MISALIGNED_ADDRESS:
    case CUDA_ERROR_INVALID_ADDRESS_SPACE:
    case CUDA_ERROR_INVALID_PC:
    case CUDA_ERROR_ASSERT:
    case CUDA_ERROR_ECC_UNCORRECTABLE:
    case CUDA_ERROR_LAUNCH_TIMEOUT:
    case CUDA_ERROR_CONTEXT_IS_DESTROYED:
      return true;
    default:
      return false;
  }
}

namespace {
absl::Mutex g_lost_mu;
// Why this process can no longer use its device (the first reason), or null. Never freed:
// process-wide.
std::string* g_lost ABSL_GUARDED_BY(g_lost_mu) = nullptr;

void RecordDeviceLost(std::string why) {
  absl::MutexLock lock(&g_lost_mu);
  if (g_lost == nullptr) g_lost = new std::string(std::move(why));
}
}  // namespace

void MarkDeviceWedged(absl::string_view why) {
  RecordDeviceLost(absl::StrCat("the device holds work that cannot finish: ", why));
}

absl::Status DeviceHealth() {
  {
    absl::MutexLock lock(&g_lost_mu);
    if (g_lost != nullptr) return StickyDeviceError(*g_lost);
  }
  // A sticky error is reported by every call, peeking included; a non-sticky one is left alone
  // for the call site that owns it.
  const cudaError_t err = cudaPeekAtLastError();
  if (!IsStickyCudaError(err)) return absl::OkStatus();
  return CudaResultToStatus(err, "cudaPeekAtLastError()", __FILE__, __LINE__);
}

absl::Status CudaResultToStatus(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  // Clears the runtime's record of a non-sticky error so the next check starts clean; a sticky
  // error cannot be cleared and stays reported by every later call.
  static_cast<void>(cudaGetLastError());
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (err) {
    case cudaErrorMemoryAllocation:
      code = absl::StatusCode::kResourceExhausted;
      break;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
      code = absl::StatusCode::kInvalidArgument;
      break;
    case cudaErrorNotSupported:
    case cudaErrorNotPermitted:
    case cudaErrorPeerAccessUnsupported:
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureInvalidated:
      code = absl::StatusCode::kFailedPrecondition;
      break;
    default:
      break;
  }
  absl::Status status = Make(code, IsStickyCudaError(err) || IsRestartOnlyCudaError(err), "cuda",
                             cudaGetErrorName(err), cudaGetErrorString(err), expr, file, line);
  if (IsRestartOnlyCudaError(err)) RecordDeviceLost(std::string(status.message()));
  return status;
}

absl::Status CudaResultToStatus(CUresult err, const char* expr, const char* file, int line) {
  if (err == CUDA_SUCCESS) return absl::OkStatus();
  static_cast<void>(cudaGetLastError());
  const std::string name = DriverErrorText(err, true);
  const std::string text = DriverErrorText(err, false);
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (err) {
    case CUDA_ERROR_OUT_OF_MEMORY:
      code = absl::StatusCode::kResourceExhausted;
      break;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
      code = absl::StatusCode::kInvalidArgument;
      break;
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_NOT_PERMITTED:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_PEER_ACCESS_UNSUPPORTED:
      code = absl::StatusCode::kFailedPrecondition;
      break;
    default:
      break;
  }
  absl::Status status = Make(code, IsStickyCudaError(err) || IsRestartOnlyCudaError(err), "cu",
                             name.c_str(), text.c_str(), expr, file, line);
  if (IsRestartOnlyCudaError(err)) RecordDeviceLost(std::string(status.message()));
  return status;
}

absl::Status CudaResultToStatus(ncclResult_t err, const char* expr, const char* file, int line) {
  if (err == ncclSuccess) return absl::OkStatus();
  // NCCL wraps CUDA failures (ncclUnhandledCudaError); clear the runtime's record as well.
  cudaError_t cuda_err = cudaGetLastError();
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (err) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      code = absl::StatusCode::kInvalidArgument;
      break;
    case ncclRemoteError:
    case ncclSystemError:
      // A peer died or the transport failed: retrying after re-initialization may work.
      code = absl::StatusCode::kUnavailable;
      break;
    case ncclInProgress:
      code = absl::StatusCode::kDeadlineExceeded;
      break;
    default:
      break;
  }
  const char* name = "ncclError";
  switch (err) {
    case ncclUnhandledCudaError:
      name = "ncclUnhandledCudaError";
      break;
    case ncclSystemError:
      name = "ncclSystemError";
      break;
    case ncclInternalError:
      name = "ncclInternalError";
      break;
    case ncclInvalidArgument:
      name = "ncclInvalidArgument";
      break;
    case ncclInvalidUsage:
      name = "ncclInvalidUsage";
      break;
    case ncclRemoteError:
      name = "ncclRemoteError";
      break;
    case ncclInProgress:
      name = "ncclInProgress";
      break;
    default:
      break;
  }
  return Make(code, IsStickyCudaError(cuda_err), "nccl", name, ncclGetErrorString(err), expr, file,
              line);
}

}  // namespace arfuse
