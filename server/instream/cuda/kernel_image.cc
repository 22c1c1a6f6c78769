#include "server/instream/cuda/kernel_image.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/instream/instream_image.h"
#include "server/cuda_device/cuda_status.h"

namespace arfuse {

absl::StatusOr<std::unique_ptr<InStreamKernelImage>> InStreamKernelImage::Load(uint32_t sm) {
  size_t size = 0;
  const void* bytes = instream::KernelImage(sm, &size);
  if (bytes == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this build has no in-stream kernel image for sm_", sm, " (CMAKE_CUDA_ARCHITECTURES)"));
  }
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaFree(nullptr));  // the runtime's primary context, current
  CUmodule module = nullptr;
  ARFUSE_CUDA_RETURN_IF_ERROR(cuModuleLoadData(&module, bytes));
  return std::unique_ptr<InStreamKernelImage>(new InStreamKernelImage(module, bytes, size));
}

InStreamKernelImage::~InStreamKernelImage() {
  if (module_ != nullptr) ARFUSE_CUDA_LOG_IF_ERROR(cuModuleUnload(module_));
}

absl::StatusOr<int> InStreamKernelImage::BlocksPerSm(const std::string& function, int threads) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_per_sm_.find({function, threads});
  if (it != blocks_per_sm_.end()) return it->second;
  CUfunction fn = nullptr;
  absl::Status found = ARFUSE_CUDA_STATUS(cuModuleGetFunction(&fn, module_, function.c_str()));
  if (!found.ok()) {
    return absl::InternalError(
        absl::StrCat("the in-stream image has no function ", function, ": ", found.message()));
  }
  int max_threads = 0;
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cuFuncGetAttribute(&max_threads, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn));
  if (threads > max_threads) {
    return absl::InternalError(absl::StrCat(function, " takes at most ", max_threads,
                                            " threads per block, the entry asks ", threads));
  }
  int blocks = 0;
  ARFUSE_CUDA_RETURN_IF_ERROR(cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, threads, 0));
  blocks = std::max(blocks, 1);
  blocks_per_sm_[{function, threads}] = blocks;
  return blocks;
}

absl::StatusOr<std::vector<instream::KernelEntry>> InStreamKernelImage::Entries(
    DType dtype, int world_size, const std::vector<uint32_t>& hiddens, uint32_t sm_budget,
    int sms) {
  std::vector<instream::KernelEntry> entries;
  const int usable = sm_budget > 0 ? std::min<int>(sms, static_cast<int>(sm_budget)) : sms;
  for (uint32_t hidden : hiddens) {
    for (int pattern_value = 1; pattern_value <= kMaxPattern; ++pattern_value) {
      const auto pattern = static_cast<Pattern>(pattern_value);
      for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
        instream::KernelEntry e{};
        if (!instream::DescribeKernelEntry(dtype, pattern, algo, hidden, world_size, &e)) {
          // The FP8 patterns have entries where they run (DescribeKernelEntry: bf16, fp16; the
          // per-group one at hidden a multiple of 128); elsewhere none, and the client declines.
          if (IsQuantPattern(pattern)) continue;
          return absl::InvalidArgumentError(absl::StrCat(
              "hidden ", hidden, " ", DTypeName(dtype), " cannot run in-stream at world size ",
              world_size, " (a positive multiple of ", kHiddenMultiple, " up to ",
              MaxFusionHidden(dtype), ")"));
        }
        ARFUSE_ASSIGN_OR_RETURN(int per_sm,
                                BlocksPerSm(e.function, static_cast<int>(e.block_threads)));
        e.max_grid = static_cast<uint32_t>(
            std::clamp(usable * per_sm, 1, static_cast<int>(kMaxFusionBlocks)));
        entries.push_back(e);
      }
    }
  }
  return entries;
}

}  // namespace arfuse
