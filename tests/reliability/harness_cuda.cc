// CUDA memory for the reliability harness (--device=cuda sidecars): a plain cudaMalloc
// allocation exported by a legacy IPC handle, with a host staging copy. Built only with the
// CUDA toolkit (ARFUSE_RELIABILITY_WITH_CUDA).
#include <cuda_runtime_api.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/reliability/harness.h"

namespace arfuse::reliability {
namespace {

absl::Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

class CudaMemory final : public TensorMemory {
 public:
  ~CudaMemory() override {
    if (ptr_ != nullptr) {
      cudaSetDevice(device_);
      cudaFree(ptr_);
    }
  }
  static absl::StatusOr<std::unique_ptr<TensorMemory>> Create(int rank, uint64_t bytes) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      return absl::FailedPreconditionError("no CUDA device visible");
    }
    std::unique_ptr<CudaMemory> m(new CudaMemory());
    m->device_ = rank % count;  // as arfused picks its GPU (--gpu=-1)
    m->staging_.assign(bytes, 0);
    if (absl::Status st = Cuda(cudaSetDevice(m->device_), "cudaSetDevice"); !st.ok()) return st;
    if (absl::Status st = Cuda(cudaMalloc(&m->ptr_, bytes), "cudaMalloc"); !st.ok()) return st;
    cudaIpcMemHandle_t h;
    if (absl::Status st = Cuda(cudaIpcGetMemHandle(&h, m->ptr_), "cudaIpcGetMemHandle"); !st.ok()) {
      return st;
    }
    m->handle_.assign(reinterpret_cast<const char*>(&h), sizeof(h));
    return std::unique_ptr<TensorMemory>(std::move(m));
  }
  char* host() override { return staging_.data(); }
  absl::Status Upload() override {
    cudaSetDevice(device_);
    return Cuda(cudaMemcpy(ptr_, staging_.data(), staging_.size(), cudaMemcpyHostToDevice),
                "cudaMemcpy H2D");
  }
  absl::Status Download() override {
    cudaSetDevice(device_);
    return Cuda(cudaMemcpy(staging_.data(), ptr_, staging_.size(), cudaMemcpyDeviceToHost),
                "cudaMemcpy D2H");
  }
  absl::StatusOr<client::Region> Register(client::Client& c, const std::string& name) override {
    return c.RegisterCudaIpc(name, handle_, device_, staging_.size());
  }

 private:
  CudaMemory() = default;
  int device_ = 0;
  void* ptr_ = nullptr;
  std::string handle_;
  std::vector<char> staging_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<TensorMemory>> MakeCudaTensorMemory(int rank, uint64_t bytes) {
  return CudaMemory::Create(rank, bytes);
}

}  // namespace arfuse::reliability
