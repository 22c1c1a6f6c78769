#include "client/instream/cuda_driver.h"

#include <dlfcn.h>

#include <mutex>
#include <string>

namespace arfuse::instream::lib {
namespace {

using GetProcAddressFn = PFN_cuGetProcAddress_v12000;

// Resolves `name` at ABI `version` (the number in its PFN type): the legacy default stream's
// variant, whatever the calling code's per-thread default stream setting.
template <typename Fn>
bool Resolve(GetProcAddressFn get, const char* name, int version, Fn* out) {
  void* fn = nullptr;
  CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  if (get(name, &fn, version, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &found) != CUDA_SUCCESS ||
      found != CU_GET_PROC_ADDRESS_SUCCESS || fn == nullptr) {
    return false;
  }
  *out = reinterpret_cast<Fn>(fn);
  return true;
}

plain::StatusOr<CudaDriver> Load() {
  // RTLD_LOCAL: the driver's symbols stay out of the global namespace; the framework's runtime
  // opens the same library and gets the same instance.
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = ::dlerror();
    return plain::UnavailableError(plain::StrCat("cannot load the CUDA driver (libcuda.so.1): ",
                                                 why != nullptr ? why : "not found"));
  }
  auto get = reinterpret_cast<GetProcAddressFn>(::dlsym(lib, "cuGetProcAddress_v2"));
  if (get == nullptr) {
    return plain::UnavailableError(
        "the CUDA driver has no cuGetProcAddress_v2: a driver for CUDA 12 or later is needed");
  }
  CudaDriver d;
  struct Want {
    const char* name;
    int version;
    bool ok;
  };
#define ARFUSE_RESOLVE(field, name, version) \
  { name, version, Resolve(get, name, version, &d.field) }
  const Want wants[] = {
      ARFUSE_RESOLVE(Init, "cuInit", 2000),
      ARFUSE_RESOLVE(GetErrorName, "cuGetErrorName", 6000),
      ARFUSE_RESOLVE(CtxGetCurrent, "cuCtxGetCurrent", 4000),
      ARFUSE_RESOLVE(CtxGetDevice, "cuCtxGetDevice", 2000),
      ARFUSE_RESOLVE(CtxPushCurrent, "cuCtxPushCurrent", 4000),
      ARFUSE_RESOLVE(CtxPopCurrent, "cuCtxPopCurrent", 4000),
      ARFUSE_RESOLVE(DeviceGetUuid, "cuDeviceGetUuid", 11040),
      ARFUSE_RESOLVE(DeviceGetAttribute, "cuDeviceGetAttribute", 2000),
      ARFUSE_RESOLVE(IpcOpenMemHandle, "cuIpcOpenMemHandle", 11000),
      ARFUSE_RESOLVE(IpcCloseMemHandle, "cuIpcCloseMemHandle", 4010),
      ARFUSE_RESOLVE(MemImportFromShareableHandle, "cuMemImportFromShareableHandle", 10020),
      ARFUSE_RESOLVE(MemAddressReserve, "cuMemAddressReserve", 10020),
      ARFUSE_RESOLVE(MemAddressFree, "cuMemAddressFree", 10020),
      ARFUSE_RESOLVE(MemMap, "cuMemMap", 10020),
      ARFUSE_RESOLVE(MemUnmap, "cuMemUnmap", 10020),
      ARFUSE_RESOLVE(MemSetAccess, "cuMemSetAccess", 10020),
      ARFUSE_RESOLVE(MemRelease, "cuMemRelease", 10020),
      ARFUSE_RESOLVE(ModuleLoadData, "cuModuleLoadData", 2000),
      ARFUSE_RESOLVE(ModuleUnload, "cuModuleUnload", 2000),
      ARFUSE_RESOLVE(ModuleGetFunction, "cuModuleGetFunction", 2000),
      ARFUSE_RESOLVE(FuncGetAttribute, "cuFuncGetAttribute", 2020),
      ARFUSE_RESOLVE(MemHostAlloc, "cuMemHostAlloc", 2020),
      ARFUSE_RESOLVE(MemFreeHost, "cuMemFreeHost", 2000),
      ARFUSE_RESOLVE(MemHostGetDevicePointer, "cuMemHostGetDevicePointer", 3020),
      ARFUSE_RESOLVE(PointerGetAttributes, "cuPointerGetAttributes", 7000),
      ARFUSE_RESOLVE(LaunchKernelEx, "cuLaunchKernelEx", 11060),
  };
#undef ARFUSE_RESOLVE
  for (const Want& w : wants) {
    if (!w.ok) {
      return plain::UnavailableError(
          plain::StrCat("the CUDA driver lacks ", w.name, " (ABI ", w.version, ")"));
    }
  }
  Resolve(get, "cuFuncLoad", 12040, &d.FuncLoad);  // optional
  if (CUresult r = d.Init(0); r != CUDA_SUCCESS) {
    return plain::UnavailableError(plain::StrCat("cuInit failed: ", d.ErrorName(r)));
  }
  return d;
}

}  // namespace

plain::StatusOr<const CudaDriver*> CudaDriver::Get() {
  static std::once_flag once;
  static plain::StatusOr<CudaDriver>* loaded = nullptr;
  std::call_once(once, [] { loaded = new plain::StatusOr<CudaDriver>(Load()); });
  if (!loaded->ok()) return loaded->status();
  return &**loaded;
}

std::string CudaDriver::ErrorName(CUresult r) const {
  const char* name = nullptr;
  if (GetErrorName == nullptr || GetErrorName(r, &name) != CUDA_SUCCESS || name == nullptr) {
    name = "CUDA_ERROR";
  }
  return plain::StrCat(name, " (", static_cast<int>(r), ")");
}

}  // namespace arfuse::instream::lib
