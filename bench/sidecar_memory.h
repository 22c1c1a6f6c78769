// arfuse-bench sidecar: the tensors a client process registers with its sidecar (host shared
// memory, or CUDA memory by IPC handle), their layout and their contents.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/cpp/client.h"
#include "server/engine_api/engine.h"

namespace arfuse::bench::sidecar {

// One shape's tensors, bf16, each 256-byte aligned: input | residual_in | residual_out |
// norm_out | gamma. residual_out is not residual_in, so repeated ops see the same inputs.
struct Layout {
  uint64_t tensor = 0, input = 0, residual_in = 0, residual_out = 0, norm_out = 0, gamma = 0;
  uint64_t total = 0;
  Layout(uint32_t tokens, uint32_t hidden) {
    auto up = [](uint64_t v) { return (v + 255) / 256 * 256; };
    tensor = up(uint64_t{tokens} * hidden * 2);
    residual_in = tensor;
    residual_out = 2 * tensor;
    norm_out = 3 * tensor;
    gamma = 4 * tensor;
    total = gamma + up(uint64_t{hidden} * 2);
  }
};

// The op of `desc` (a plan's, at its max_tokens) as this process runs it itself, on tensors at
// `base` laid out as the plan's region is: the in-process rows run the sidecar's op.
OpArgs InProcessOp(const client::OpDesc& desc, char* base);

// One rank's inputs, residual and gamma for a shape, as bf16 bytes in `L`'s layout.
std::vector<char> HostImage(const Layout& L, uint32_t tokens, uint32_t hidden, int rank);

class Memory {
 public:
  virtual ~Memory() = default;
  virtual absl::StatusOr<client::Region> Register(client::Client& c, const std::string& name) = 0;
  virtual absl::Status Upload(const std::vector<char>& img) = 0;
  virtual char* device_ptr() { return nullptr; }
};

class HostMemory final : public Memory {
 public:
  explicit HostMemory(client::HostShmBuffer b) : b_(std::move(b)) {}
  absl::StatusOr<client::Region> Register(client::Client& c, const std::string& name) override {
    return c.RegisterHostBuffer(name, b_);
  }
  absl::Status Upload(const std::vector<char>& img) override {
    std::memcpy(b_.data(), img.data(), img.size());
    return absl::OkStatus();
  }

 private:
  client::HostShmBuffer b_;
};

#if defined(ARFUSE_BENCH_CUDA)
class CudaMemory final : public Memory {
 public:
  static absl::StatusOr<std::unique_ptr<Memory>> Create(uint64_t bytes, int device);
  ~CudaMemory() override;
  absl::StatusOr<client::Region> Register(client::Client& c, const std::string& name) override;
  absl::Status Upload(const std::vector<char>& img) override;
  char* device_ptr() override { return static_cast<char*>(ptr_); }

 private:
  CudaMemory() = default;
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;
  int device_ = 0;
  std::string handle_;
};
#endif

}  // namespace arfuse::bench::sidecar
