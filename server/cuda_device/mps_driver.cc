#include "server/cuda_device/mps_driver.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdlib>

namespace arfuse {

DriverMps QueryDriverMps(int device) {
#if CUDA_VERSION >= 12030
  // The runtime initializes the driver (the shim's cuDeviceGet needs it); no driver or no
  // device is not sticky, and the scan decides.
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0 ||
      (device < 0 && cudaGetDevice(&device) != cudaSuccess)) {
    cudaGetLastError();
    return DriverMps::kUnknown;
  }
  CUdevice dev = 0;
  if (cuDeviceGet(&dev, device) != CUDA_SUCCESS) return DriverMps::kUnknown;
  int value = 0;
  const CUresult result = cuDeviceGetAttribute(&value, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, dev);
  return DriverMpsFromAttribute(static_cast<int>(result), value);
#else
  // Headers older than the attribute: nothing to ask.
  (void)device;
  return DriverMps::kUnknown;
#endif
}

MpsInfo DetectMpsOnDevice(int device) {
  const char* env = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  return DetectMps(env == nullptr ? "" : env, "/proc", QueryDriverMps(device));
}

}  // namespace arfuse
