// The CUDA driver API as libarfuse_client uses it, resolved at run time: dlopen("libcuda.so.1")
// and cuGetProcAddress, each function at the ABI version its pointer type names. The library
// links no CUDA library, so it loads on machines without a driver (host mode, CI) and next to any
// framework's own CUDA runtime; only a CUDA attach needs the driver. CUDA builds only.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include "kernels/common/plain_status.h"

namespace arfuse::instream::lib {

struct CudaDriver {
  PFN_cuInit_v2000 Init = nullptr;
  PFN_cuGetErrorName_v6000 GetErrorName = nullptr;
  PFN_cuCtxGetCurrent_v4000 CtxGetCurrent = nullptr;
  PFN_cuCtxGetDevice_v2000 CtxGetDevice = nullptr;
  PFN_cuCtxPushCurrent_v4000 CtxPushCurrent = nullptr;
  PFN_cuCtxPopCurrent_v4000 CtxPopCurrent = nullptr;
  PFN_cuDeviceGetUuid_v11040 DeviceGetUuid = nullptr;
  PFN_cuDeviceGetAttribute_v2000 DeviceGetAttribute = nullptr;
  PFN_cuIpcOpenMemHandle_v11000 IpcOpenMemHandle = nullptr;
  PFN_cuIpcCloseMemHandle_v4010 IpcCloseMemHandle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 MemImportFromShareableHandle = nullptr;
  PFN_cuMemAddressReserve_v10020 MemAddressReserve = nullptr;
  PFN_cuMemAddressFree_v10020 MemAddressFree = nullptr;
  PFN_cuMemMap_v10020 MemMap = nullptr;
  PFN_cuMemUnmap_v10020 MemUnmap = nullptr;
  PFN_cuMemSetAccess_v10020 MemSetAccess = nullptr;
  PFN_cuMemRelease_v10020 MemRelease = nullptr;
  PFN_cuModuleLoadData_v2000 ModuleLoadData = nullptr;
  PFN_cuModuleUnload_v2000 ModuleUnload = nullptr;
  PFN_cuModuleGetFunction_v2000 ModuleGetFunction = nullptr;
  PFN_cuFuncGetAttribute_v2020 FuncGetAttribute = nullptr;
  PFN_cuFuncLoad_v12040 FuncLoad = nullptr;  // optional: drivers before 12.4 lack it
  PFN_cuMemHostAlloc_v2020 MemHostAlloc = nullptr;
  PFN_cuMemFreeHost_v2000 MemFreeHost = nullptr;
  PFN_cuMemHostGetDevicePointer_v3020 MemHostGetDevicePointer = nullptr;
  PFN_cuPointerGetAttributes_v7000 PointerGetAttributes = nullptr;
  PFN_cuLaunchKernelEx_v11060 LaunchKernelEx = nullptr;

  // The process's driver, loaded on first use (and never unloaded: function pointers of it may
  // be in use on other threads). UNAVAILABLE when libcuda.so.1 or one of the functions is
  // missing (no driver, or one older than CUDA 12), or cuInit fails.
  static plain::StatusOr<const CudaDriver*> Get();

  // "CUDA_ERROR_INVALID_VALUE (1)" for messages.
  std::string ErrorName(CUresult r) const;
};

}  // namespace arfuse::instream::lib
