#include "server/instream/attach_blob.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace arfuse {

using instream::AlignBlob;
using instream::AttachHeader;
using instream::KernelEntry;
using instream::MemoryKind;
using instream::RankMemory;

const char* MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kCudaIpc:
      return "cuda_ipc";
    case MemoryKind::kVmmPosixFd:
      return "vmm_posix_fd";
    case MemoryKind::kVmmFabric:
      return "vmm_fabric";
    case MemoryKind::kHostShm:
      return "host_shm";
  }
  return "unknown";
}

absl::StatusOr<AttachBlob> BuildAttachBlob(InStreamExport e, uint64_t attach_id) {
  if (e.world_size == 0 || e.ranks.size() != e.world_size || e.rank >= e.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "export describes ", e.ranks.size(), " ranks for rank ", e.rank, " of ", e.world_size));
  }
  const bool cuda = e.device == instream::DeviceKind::kCuda;
  if (cuda && (e.image == nullptr || e.image_bytes == 0)) {
    return absl::InvalidArgumentError("export has no kernel image");
  }
  if (cuda && e.entries.empty()) return absl::InvalidArgumentError("export has no kernel entry");
  if (e.entries.size() > 4 * instream::kMaxAttachHiddens) {
    return absl::InvalidArgumentError(absl::StrCat("export has ", e.entries.size(), " entries"));
  }

  AttachBlob blob;
  std::vector<RankMemory> ranks(e.world_size);
  int host_fd_index = -1;
  for (uint32_t r = 0; r < e.world_size; ++r) {
    InStreamRankMemory& m = e.ranks[r];
    RankMemory& out = ranks[r];
    out.kind = static_cast<uint32_t>(m.kind);
    out.bytes = m.bytes;
    out.fd_index = -1;
    switch (m.kind) {
      case MemoryKind::kCudaIpc:
      case MemoryKind::kVmmFabric:
        if (m.handle.size() != sizeof(out.handle)) {
          return absl::InvalidArgumentError(absl::StrCat("rank ", r, "'s ", MemoryKindName(m.kind),
                                                         " handle has ", m.handle.size(),
                                                         " bytes"));
        }
        std::memcpy(out.handle, m.handle.data(), sizeof(out.handle));
        break;
      case MemoryKind::kVmmPosixFd:
        if (!m.fd) return absl::InvalidArgumentError(absl::StrCat("rank ", r, " has no fd"));
        out.fd_index = static_cast<int32_t>(blob.fds.size());
        blob.fds.push_back(std::move(m.fd));
        break;
      case MemoryKind::kHostShm:
        // One object for the whole group: every rank's entry points at the one descriptor.
        if (m.fd && host_fd_index < 0) {
          host_fd_index = static_cast<int32_t>(blob.fds.size());
          blob.fds.push_back(std::move(m.fd));
        }
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("rank ", r, " has memory kind ", static_cast<uint32_t>(m.kind)));
    }
  }
  if (e.ranks[0].kind == MemoryKind::kHostShm) {
    if (host_fd_index < 0) return absl::InvalidArgumentError("host workspace has no fd");
    for (RankMemory& out : ranks) out.fd_index = host_fd_index;
  }

  AttachHeader h{};
  h.magic = instream::kAttachMagic;
  h.abi_version = instream::kAttachAbiVersion;
  h.launch_abi_version = instream::kLaunchAbiVersion;
  h.launch_args_bytes = instream::kLaunchArgsBytes;
  h.header_bytes = sizeof(AttachHeader);
  h.entry_bytes = sizeof(KernelEntry);
  h.rank_bytes = sizeof(RankMemory);
  h.device_kind = static_cast<uint32_t>(e.device);
  h.rank = e.rank;
  h.world_size = e.world_size;
  h.num_entries = static_cast<uint32_t>(e.entries.size());
  h.generation = e.generation;
  h.attach_id = attach_id;
  std::memcpy(h.gpu_uuid, e.gpu_uuid, sizeof(h.gpu_uuid));
  h.sm = e.sm;
  h.sm_budget = e.sm_budget;
  h.spin_timeout_ns = e.spin_timeout_ns;
  h.pdl = e.pdl ? 1u : 0u;
  h.dtype = static_cast<uint32_t>(e.dtype);
  h.oneshot_max_bytes = e.oneshot_max_bytes;
  h.twoshot_max_bytes = e.twoshot_max_bytes;
  std::memcpy(h.kernel_config, e.kernel_config, sizeof(h.kernel_config));
  std::memcpy(h.layout, e.layout, sizeof(h.layout));
  h.max_tokens = e.max_tokens;
  h.hidden = e.hidden;
  h.host_slot_bytes = e.host_slot_bytes;
  h.entries_offset = AlignBlob(sizeof(AttachHeader));
  h.ranks_offset = AlignBlob(h.entries_offset + e.entries.size() * sizeof(KernelEntry));
  h.image_offset = AlignBlob(h.ranks_offset + ranks.size() * sizeof(RankMemory));
  h.image_bytes = cuda ? e.image_bytes : 0;

  blob.bytes.assign(h.image_offset + h.image_bytes, '\0');
  char* out = blob.bytes.data();
  std::memcpy(out, &h, sizeof(h));
  if (!e.entries.empty()) {
    std::memcpy(out + h.entries_offset, e.entries.data(), e.entries.size() * sizeof(KernelEntry));
  }
  std::memcpy(out + h.ranks_offset, ranks.data(), ranks.size() * sizeof(RankMemory));
  if (h.image_bytes != 0) std::memcpy(out + h.image_offset, e.image, h.image_bytes);
  blob.memory_kind = MemoryKindName(e.ranks[0].kind);
  return blob;
}

}  // namespace arfuse
