// Helpers of the GPU rank worker: device buffers, input patterns, output hashes.
#pragma once

#include <cuda_runtime_api.h>
#include <sys/types.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/common/op_types.h"

namespace arfuse::testing {

// RAII device allocation; the destructor frees without waiting for peers.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  absl::Status Upload(const std::vector<uint16_t>& host);
  absl::StatusOr<std::vector<uint16_t>> Download(size_t elements) const;

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

enum class InputKind {
  kRandom,              // uniform in [-2, 2]
  kIntegers,            // integers in [-8, 8]: every sum is exact
  kZerosAndSubnormals,  // only +-0.0 and bf16 subnormals (the pattern that hung FlashInfer)
};

// bf16 bit patterns of a [tokens, hidden] tensor for `rank`, deterministic in (seed, rank).
std::vector<uint16_t> MakeBf16Input(InputKind kind, uint32_t seed, int rank, size_t elements);

// FNV-1a over 16-bit words.
uint64_t HashWords(const std::vector<uint16_t>& words, uint64_t h = 1469598103934665603ull);

}  // namespace arfuse::testing
