#include "bench/sidecar_memory.h"

#include <optional>

#if defined(ARFUSE_BENCH_CUDA)
#include <cuda_runtime_api.h>

#include "server/cuda_device/cuda_status.h"
#endif

namespace arfuse::bench::sidecar {

OpArgs InProcessOp(const client::OpDesc& desc, char* base) {
  auto at = [base](const std::optional<client::TensorLoc>& t) { return base + t->offset; };
  OpArgs op;
  op.pattern = desc.pattern;
  op.dtype = desc.dtype;
  op.hidden = desc.hidden;
  op.num_tokens = desc.max_tokens;
  op.eps = *desc.eps;
  op.input = at(desc.input);
  op.residual_in = at(desc.residual_in);
  op.residual_out = at(desc.residual_out);
  op.norm_out = at(desc.norm_out);
  op.gamma = at(desc.gamma);
  return op;
}

namespace {

uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);  // values below are exact in bf16
}

}  // namespace

std::vector<char> HostImage(const Layout& L, uint32_t tokens, uint32_t hidden, int rank) {
  std::vector<char> img(L.total, 0);
  const uint64_t n = uint64_t{tokens} * hidden;
  auto put = [&](uint64_t off, uint64_t i, float v) {
    uint16_t b = Bf16(v);
    std::memcpy(img.data() + off + 2 * i, &b, 2);
  };
  for (uint64_t i = 0; i < n; ++i) {
    put(L.input, i, float(int((i * 7 + rank * 13) % 17) - 8) / 8.0f);
    put(L.residual_in, i, float(int((i * 5) % 11) - 5) / 4.0f);
  }
  for (uint64_t h = 0; h < hidden; ++h) put(L.gamma, h, 0.5f + float(h % 9) / 8.0f);
  return img;
}

#if defined(ARFUSE_BENCH_CUDA)
absl::StatusOr<std::unique_ptr<Memory>> CudaMemory::Create(uint64_t bytes, int device) {
  std::unique_ptr<CudaMemory> m(new CudaMemory());
  m->device_ = device;
  m->bytes_ = bytes;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMalloc(&m->ptr_, bytes));
  cudaIpcMemHandle_t h;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&h, m->ptr_));
  m->handle_.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  return std::unique_ptr<Memory>(std::move(m));
}

CudaMemory::~CudaMemory() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

absl::StatusOr<client::Region> CudaMemory::Register(client::Client& c, const std::string& name) {
  return c.RegisterCudaIpc(name, handle_, device_, bytes_);
}

absl::Status CudaMemory::Upload(const std::vector<char>& img) {
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemcpy(ptr_, img.data(), img.size(), cudaMemcpyHostToDevice));
  return absl::OkStatus();
}
#endif

}  // namespace arfuse::bench::sidecar
