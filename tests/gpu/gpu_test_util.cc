#include "tests/gpu/gpu_test_util.h"

#include "absl/strings/str_cat.h"
#include "kernels/host/half_convert.h"
#include "server/cuda_device/cuda_status.h"

namespace arfuse::testing {

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (!ARFUSE_CUDA_STATUS(cudaMalloc(&ptr_, bytes)).ok()) ptr_ = nullptr;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) ARFUSE_CUDA_LOG_IF_ERROR(cudaFree(ptr_));
}

absl::Status DeviceBuffer::Upload(const std::vector<uint16_t>& host) {
  if (ptr_ == nullptr) return absl::ResourceExhaustedError("device buffer was not allocated");
  if (host.size() * 2 > bytes_) return absl::InvalidArgumentError("upload larger than buffer");
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(ptr_, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  // A pageable upload may return before its DMA finished, and the engine's stream does not
  // wait for the legacy stream: finish it before any op reads the buffer.
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint16_t>> DeviceBuffer::Download(size_t elements) const {
  if (ptr_ == nullptr) return absl::ResourceExhaustedError("device buffer was not allocated");
  std::vector<uint16_t> host(elements);
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemcpy(host.data(), ptr_, elements * 2, cudaMemcpyDeviceToHost));
  return host;
}

std::vector<uint16_t> MakeBf16Input(InputKind kind, uint32_t seed, int rank, size_t elements) {
  std::mt19937 gen(seed * 7919u + static_cast<uint32_t>(rank) * 104729u + 1u);
  std::vector<uint16_t> out(elements);
  for (size_t i = 0; i < elements; ++i) {
    switch (kind) {
      case InputKind::kRandom: {
        std::uniform_real_distribution<float> d(-2.0f, 2.0f);
        out[i] = FloatToBf16Bits(d(gen));
        break;
      }
      case InputKind::kIntegers: {
        std::uniform_int_distribution<int> d(-8, 8);
        out[i] = FloatToBf16Bits(static_cast<float>(d(gen)));
        break;
      }
      case InputKind::kZerosAndSubnormals: {
        // +0, -0, and subnormals of both signs (0x0001..0x007f, 0x8001..0x807f).
        std::uniform_int_distribution<int> d(0, 3);
        std::uniform_int_distribution<int> mant(1, 0x7f);
        switch (d(gen)) {
          case 0:
            out[i] = 0x0000;
            break;
          case 1:
            out[i] = 0x8000;
            break;
          case 2:
            out[i] = static_cast<uint16_t>(mant(gen));
            break;
          default:
            out[i] = static_cast<uint16_t>(0x8000 | mant(gen));
            break;
        }
        break;
      }
    }
  }
  return out;
}

uint64_t HashWords(const std::vector<uint16_t>& words, uint64_t h) {
  for (uint16_t w : words) {
    h ^= w & 0xff;
    h *= 1099511628211ull;
    h ^= w >> 8;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace arfuse::testing
