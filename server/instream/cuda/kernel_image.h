// The in-stream kernel image as loaded by the sidecar itself (CUDA only): before an image is
// handed to any client, the sidecar loads it into its own context, finds every entry a client may
// launch, and sizes each entry's grid from the loaded function's occupancy on this GPU, so the
// grid a client launches is the one that is co-resident with its peers' (every rank computes it
// from the same function on the same kind of GPU).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/common/op_types.h"
#include "kernels/instream/attach_abi.h"

namespace arfuse {

class InStreamKernelImage {
 public:
  // Loads the build's image for a GPU of compute capability `sm` into the current context
  // (cudaSetDevice first). FAILED_PRECONDITION when the build has no image for it.
  static absl::StatusOr<std::unique_ptr<InStreamKernelImage>> Load(uint32_t sm);
  ~InStreamKernelImage();
  InStreamKernelImage(const InStreamKernelImage&) = delete;
  InStreamKernelImage& operator=(const InStreamKernelImage&) = delete;

  const void* bytes() const { return bytes_; }
  uint64_t size() const { return size_; }

  // The entries (both patterns, both algorithms) for each hidden, with max_grid = the blocks
  // resident at once within `sm_budget` SMs (0: all) of `sms`, capped at kMaxFusionBlocks.
  // INVALID_ARGUMENT for a hidden the kernels cannot run; INTERNAL when the image lacks an entry.
  absl::StatusOr<std::vector<instream::KernelEntry>> Entries(DType dtype, int world_size,
                                                             const std::vector<uint32_t>& hiddens,
                                                             uint32_t sm_budget, int sms);

 private:
  InStreamKernelImage(CUmodule module, const void* bytes, uint64_t size)
      : module_(module), bytes_(bytes), size_(size) {}
  absl::StatusOr<int> BlocksPerSm(const std::string& function, int threads);

  CUmodule module_;
  const void* bytes_;
  uint64_t size_;
  std::mutex mu_;
  std::map<std::pair<std::string, int>, int> blocks_per_sm_;  // guarded by mu_
};

}  // namespace arfuse
