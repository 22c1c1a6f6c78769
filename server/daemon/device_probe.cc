#include "server/daemon/device_probe.h"

#if ARFUSE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace arfuse {

GpuProbe ProbeGpu(int device) {
  GpuProbe probe;
#if ARFUSE_HAVE_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for the probe
    return probe;
  }
  probe.device_count = count;
  if (device >= 0 && device < count) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
      probe.sm = prop.major * 10 + prop.minor;
      probe.name = prop.name;
    } else {
      cudaGetLastError();
    }
  }
#else
  (void)device;
#endif
  return probe;
}

}  // namespace arfuse
