// The attach blob (kernels/instream/attach_abi.h) built from an engine's InStreamExport: the
// bytes Fusion.Attach hands the client library, and the descriptors it offers on the fd socket
// (in RankMemory::fd_index order). CUDA-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/engine/instream_host.h"
#include "server/peers/unique_fd.h"

namespace arfuse {

struct AttachBlob {
  std::string bytes;
  // The descriptors the blob's RankMemory entries index, moved out of the export.
  std::vector<UniqueFd> fds;
  // "cuda_ipc", "vmm_posix_fd", "vmm_fabric" or "host_shm" (rank 0's kind; all ranks share it).
  std::string memory_kind;
};

// INVALID_ARGUMENT when the export is inconsistent (ranks != world size, a handle of the wrong
// length, a descriptor missing for a kind that needs one, no image on CUDA, too many entries).
absl::StatusOr<AttachBlob> BuildAttachBlob(InStreamExport exported, uint64_t attach_id);

const char* MemoryKindName(instream::MemoryKind kind);

}  // namespace arfuse
