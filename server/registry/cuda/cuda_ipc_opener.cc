#include "server/registry/cuda/cuda_ipc_opener.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/registry/validation.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace cuda_opener_internal {

struct Entry {
  void* base = nullptr;
  uint64_t size = 0;
  int refs = 0;
};

struct Cache {
  std::mutex mu;
  std::map<std::string, Entry> open;  // keyed by the raw handle bytes; never logged
};

}  // namespace cuda_opener_internal

namespace {

using cuda_opener_internal::Cache;

class IpcMapping final : public Mapping {
 public:
  IpcMapping(std::shared_ptr<Cache> cache, std::string key, int device, void* base, uint64_t size)
      : cache_(std::move(cache)), key_(std::move(key)), device_(device), base_(base),
        size_(size) {}
  ~IpcMapping() override {
    void* to_close = nullptr;
    {
      std::lock_guard<std::mutex> lock(cache_->mu);
      auto it = cache_->open.find(key_);
      if (it != cache_->open.end() && --it->second.refs == 0) {
        to_close = it->second.base;
        cache_->open.erase(it);
      }
    }
    if (to_close != nullptr) {
      // Does not wait for the device: ops using this memory already ended (the registry holds
      // the mapping while any op is in flight).
      cudaSetDevice(device_);
      cudaError_t err = cudaIpcCloseMemHandle(to_close);
      if (err != cudaSuccess) {
        spdlog::warn("event=ipc_close_failed error={}", cudaGetErrorName(err));
      }
    }
  }
  void* base() const override { return base_; }
  uint64_t allocation_size() const override { return size_; }

 private:
  std::shared_ptr<Cache> cache_;
  std::string key_;
  int device_;
  void* base_;
  uint64_t size_;
};

}  // namespace

CudaIpcOpener::CudaIpcOpener(int32_t device_id)
    : device_id_(device_id), cache_(std::make_shared<Cache>()) {}

CudaIpcOpener::~CudaIpcOpener() = default;

absl::StatusOr<std::unique_ptr<Mapping>> CudaIpcOpener::Open(const RegionSpec& spec) {
  if (spec.cuda_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc.handle must be exactly ",
                                                   sizeof(cudaIpcMemHandle_t), " bytes"));
  }
  static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes);
  std::lock_guard<std::mutex> lock(cache_->mu);
  auto it = cache_->open.find(spec.cuda_handle);
  if (it != cache_->open.end()) {
    ++it->second.refs;
    return std::unique_ptr<Mapping>(new IpcMapping(cache_, spec.cuda_handle, device_id_,
                                                   it->second.base, it->second.size));
  }
  cudaError_t err = cudaSetDevice(device_id_);
  if (err != cudaSuccess) {
    return absl::UnavailableError(
        absl::StrCat("sidecar cannot use its device: ", cudaGetErrorName(err)));
  }
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, spec.cuda_handle.data(), sizeof(handle));
  void* base = nullptr;
  err = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the non-sticky error so the next call starts clean
    if (err == cudaErrorMemoryAllocation) {
      return absl::ResourceExhaustedError("sidecar is out of device address space");
    }
    // Bytes that are not a live handle of this device; the bytes are never echoed.
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc.handle could not be opened on this device (", cudaGetErrorName(err),
        "): it must come from cudaIpcGetMemHandle on a live cudaMalloc allocation"));
  }
  CUdeviceptr range_base = 0;
  size_t range_size = 0;
  CUresult cr = cuMemGetAddressRange(&range_base, &range_size, reinterpret_cast<CUdeviceptr>(base));
  if (cr != CUDA_SUCCESS) {
    cudaIpcCloseMemHandle(base);
    return absl::InvalidArgumentError("cuda_ipc allocation size could not be measured");
  }
  // The opened pointer is the allocation's base, so the usable size runs from it.
  uint64_t size = static_cast<uint64_t>(range_base + range_size - reinterpret_cast<CUdeviceptr>(base));
  cache_->open[spec.cuda_handle] = cuda_opener_internal::Entry{base, size, 1};
  return std::unique_ptr<Mapping>(new IpcMapping(cache_, spec.cuda_handle, device_id_, base, size));
}

}  // namespace arfuse
