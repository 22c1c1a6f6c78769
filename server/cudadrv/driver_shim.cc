// The CUDA driver API functions arfuse calls, resolved at first use through the runtime's
// driver entry points instead of linking libcuda.so.1. arfused must start on machines without a
// GPU driver (CI, --device=host); linking libcuda directly would make the dynamic loader refuse
// to start the process there. Each function returns CUDA_ERROR_NOT_INITIALIZED when no driver
// is present.
#include <cuda.h>
#include <cuda_runtime_api.h>

namespace {

template <typename Fn>
Fn ResolveDriver(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &fn, CUDA_VERSION, cudaEnableDefault, &query) !=
          cudaSuccess ||
      query != cudaDriverEntryPointSuccess) {
    cudaGetLastError();  // no driver: not sticky, and the caller gets a driver error code
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

}  // namespace

// `symbol` is what cuda.h maps the name to (some names are versioned by macro); `name` is the
// entry point to ask the driver for.
#define ARFUSE_DRIVER_FORWARD(name, symbol, params, args)                   \
  extern "C" CUresult CUDAAPI symbol params {                               \
    static const auto fn = ResolveDriver<CUresult(CUDAAPI*) params>(#name); \
    if (fn == nullptr) return CUDA_ERROR_NOT_INITIALIZED;                   \
    return fn args;                                                         \
  }

ARFUSE_DRIVER_FORWARD(cuDeviceGet, cuDeviceGet, (CUdevice * device, int ordinal), (device, ordinal))
ARFUSE_DRIVER_FORWARD(cuDeviceGetAttribute, cuDeviceGetAttribute,
                      (int* pi, CUdevice_attribute attrib, CUdevice dev), (pi, attrib, dev))
ARFUSE_DRIVER_FORWARD(cuMemGetAddressRange, cuMemGetAddressRange_v2,
                      (CUdeviceptr * base, size_t* size, CUdeviceptr dptr), (base, size, dptr))
ARFUSE_DRIVER_FORWARD(cuMemCreate, cuMemCreate,
                      (CUmemGenericAllocationHandle * handle, size_t size,
                       const CUmemAllocationProp* prop, unsigned long long flags),
                      (handle, size, prop, flags))
ARFUSE_DRIVER_FORWARD(cuMemRelease, cuMemRelease, (CUmemGenericAllocationHandle handle), (handle))
ARFUSE_DRIVER_FORWARD(cuMemExportToShareableHandle, cuMemExportToShareableHandle,
                      (void* shareable, CUmemGenericAllocationHandle handle,
                       CUmemAllocationHandleType type, unsigned long long flags),
                      (shareable, handle, type, flags))
ARFUSE_DRIVER_FORWARD(cuMemImportFromShareableHandle, cuMemImportFromShareableHandle,
                      (CUmemGenericAllocationHandle * handle, void* os_handle,
                       CUmemAllocationHandleType type),
                      (handle, os_handle, type))
ARFUSE_DRIVER_FORWARD(cuMemAddressReserve, cuMemAddressReserve,
                      (CUdeviceptr * ptr, size_t size, size_t alignment, CUdeviceptr addr,
                       unsigned long long flags),
                      (ptr, size, alignment, addr, flags))
ARFUSE_DRIVER_FORWARD(cuMemAddressFree, cuMemAddressFree, (CUdeviceptr ptr, size_t size),
                      (ptr, size))
ARFUSE_DRIVER_FORWARD(cuMemMap, cuMemMap,
                      (CUdeviceptr ptr, size_t size, size_t offset,
                       CUmemGenericAllocationHandle handle, unsigned long long flags),
                      (ptr, size, offset, handle, flags))
ARFUSE_DRIVER_FORWARD(cuMemUnmap, cuMemUnmap, (CUdeviceptr ptr, size_t size), (ptr, size))
ARFUSE_DRIVER_FORWARD(cuMemSetAccess, cuMemSetAccess,
                      (CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count),
                      (ptr, size, desc, count))
ARFUSE_DRIVER_FORWARD(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity,
                      (size_t * granularity, const CUmemAllocationProp* prop,
                       CUmemAllocationGranularity_flags option),
                      (granularity, prop, option))
// The in-stream kernel image: the sidecar loads it itself to check it and size its grids.
ARFUSE_DRIVER_FORWARD(cuModuleLoadData, cuModuleLoadData, (CUmodule * module, const void* image),
                      (module, image))
ARFUSE_DRIVER_FORWARD(cuModuleUnload, cuModuleUnload, (CUmodule module), (module))
ARFUSE_DRIVER_FORWARD(cuModuleGetFunction, cuModuleGetFunction,
                      (CUfunction * function, CUmodule module, const char* name),
                      (function, module, name))
ARFUSE_DRIVER_FORWARD(cuFuncGetAttribute, cuFuncGetAttribute,
                      (int* value, CUfunction_attribute attrib, CUfunction function),
                      (value, attrib, function))
ARFUSE_DRIVER_FORWARD(cuOccupancyMaxActiveBlocksPerMultiprocessor,
                      cuOccupancyMaxActiveBlocksPerMultiprocessor,
                      (int* blocks, CUfunction function, int block_size, size_t dynamic_smem),
                      (blocks, function, block_size, dynamic_smem))
