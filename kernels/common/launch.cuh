// One kernel launch, shared by the fused, doorbell and ring launchers. CUDA only (host code of
// .cu files).
#pragma once

#include <cuda_runtime_api.h>

#include <initializer_list>

namespace arfuse {

// Launches `kernel<<<grid, threads, 0, stream>>>(args...)`; with `programmatic`, as a
// programmatic dependent launch (sm_90+): the grid may be scheduled while the kernel before it on
// the stream still runs, so the kernel must wait (griddepcontrol.wait, WaitForPrerequisiteGrid)
// before it touches anything that kernel wrote. Returns the launch error.
template <typename Kernel, typename... Args>
cudaError_t LaunchKernel(Kernel kernel, unsigned grid, unsigned threads, bool programmatic,
                         cudaStream_t stream, Args... args) {
  if (!programmatic) {
    kernel<<<grid, threads, 0, stream>>>(args...);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// Loads each kernel's function into the current context now (cudaFuncGetAttributes forces it).
// With lazy module loading (the CUDA default) a kernel is otherwise loaded at its first launch,
// and that load may wait for every kernel running in the context to finish: when the running
// kernel spins until the new one has run (a doorbell waiter and its fused launch, a serving
// launch and a new plan's kernels), the process hangs. Each family's Prepare*Kernels calls this
// with all of its instantiations. Returns the first error.
inline cudaError_t LoadKernelFunctions(std::initializer_list<const void*> kernels) {
  for (const void* kernel : kernels) {
    cudaFuncAttributes attributes;
    if (cudaError_t err = cudaFuncGetAttributes(&attributes, kernel); err != cudaSuccess) {
      return err;
    }
  }
  return cudaSuccess;
}

// The first error of several calls made in order (all of them are made), or cudaSuccess.
inline cudaError_t FirstError(std::initializer_list<cudaError_t> errors) {
  for (cudaError_t err : errors) {
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace arfuse
