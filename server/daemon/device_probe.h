// What the daemon needs to know about the GPU before it picks a device and an engine.
#pragma once

#include <string>

namespace arfuse {

struct GpuProbe {
  int device_count = 0;
  // Compute capability of the chosen device as major*10+minor; 0 when there is none.
  int sm = 0;
  std::string name;
};

// Counts visible GPUs and reads the compute capability of `device` (when it exists). Returns
// zeros in a build without CUDA or on a machine without a driver.
GpuProbe ProbeGpu(int device);

}  // namespace arfuse
