// libarfuse_client's reading of the attach blob (kernels/instream/attach_abi.h): every rule the
// blob must meet before anything is mapped or loaded. Pure host logic (no CUDA, no driver), so
// every rule is unit-tested on machines without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/common/op_types.h"
#include "kernels/common/plain_status.h"
#include "kernels/contract/op_contract.h"
#include "kernels/instream/attach_abi.h"

namespace arfuse::instream::lib {

// The op contract's numbers (kernels/contract/op_contract.h), as the blob's plain bytes hold them.
inline constexpr uint8_t kAlgoOneShot = static_cast<uint8_t>(FusionAlgo::kOneShot);
inline constexpr uint8_t kAlgoTwoShot = static_cast<uint8_t>(FusionAlgo::kTwoShot);
// DeviceError::kOpMismatch: the ranks launched different ops (only GPU kernels detect it this way;
// the host collective refuses such an op with INVALID_ARGUMENT).
inline constexpr uint32_t kErrorOpMismatch = static_cast<uint32_t>(DeviceError::kOpMismatch);
// Entries an attach may carry: both patterns and both algorithms for each hidden size.
inline constexpr uint32_t kMaxEntries = kMaxAttachEntries;
// The two-shot barrier has a slot per block.
inline constexpr uint32_t kMaxGrid = static_cast<uint32_t>(kMaxFusionBlocks);

// The blob's parts, copied out (the image stays in the caller's blob: it is loaded during the
// attach and not kept).
struct ParsedBlob {
  AttachHeader header{};
  std::vector<KernelEntry> entries;
  std::vector<RankMemory> ranks;  // indexed by rank
  const uint8_t* image = nullptr;
  uint64_t image_bytes = 0;

  DeviceKind device() const { return static_cast<DeviceKind>(header.device_kind); }
  DType dtype() const { return static_cast<DType>(header.dtype); }
};

// Checks and copies the blob: INVALID_ARGUMENT for a malformed blob, FAILED_PRECONDITION for a
// version this library does not read, each naming the field. `num_fds` is how many descriptors
// the caller picked up (fd_index must be below it).
plain::StatusOr<ParsedBlob> ParseAttachBlob(const void* blob, size_t blob_bytes, size_t num_fds);

bool IsKnownDType(uint32_t dtype);

}  // namespace arfuse::instream::lib
