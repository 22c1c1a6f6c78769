#include "server/instream/attach_blob.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/instream/attach_abi.h"
#include "kernels/instream/op_counters.h"

namespace arfuse {
namespace {

using instream::AlignBlob;
using instream::AttachHeader;
using instream::KernelEntry;
using instream::MemoryKind;
using instream::RankMemory;

bool NeedsFd(MemoryKind k) { return k == MemoryKind::kVmmPosixFd || k == MemoryKind::kHostShm; }
bool NeedsHandle(MemoryKind k) { return k == MemoryKind::kCudaIpc || k == MemoryKind::kVmmFabric; }

}  // namespace

std::vector<int> AttachBlobFds(const InStreamExport& e) {
  std::vector<int> fds;
  for (const InStreamRankMemory& m : e.ranks) {
    if (m.fd.valid()) fds.push_back(m.fd.get());
  }
  return fds;
}

const char* AttachMemoryKindName(const InStreamExport& e) {
  if (e.ranks.empty()) return "none";
  switch (e.ranks[0].kind) {
    case MemoryKind::kCudaIpc:
      return "cuda_ipc";
    case MemoryKind::kVmmPosixFd:
      return "vmm_posix_fd";
    case MemoryKind::kVmmFabric:
      return "vmm_fabric";
    case MemoryKind::kHostShm:
      return "host_shm";
  }
  return "none";
}

absl::StatusOr<std::string> BuildAttachBlob(const InStreamExport& e, uint64_t attach_id,
                                            bool counters, uint32_t counter_slot) {
  if (counter_slot >= instream::kInStreamCounterSlots) {
    return absl::InvalidArgumentError(absl::StrCat("counter_slot ", counter_slot, " is not below ",
                                                   instream::kInStreamCounterSlots));
  }
  const bool cuda = e.device == instream::DeviceKind::kCuda;
  if (!cuda && e.device != instream::DeviceKind::kHost) {
    return absl::InvalidArgumentError(
        absl::StrCat("export device_kind ", static_cast<uint32_t>(e.device), " is unknown"));
  }
  if (e.world_size < 1 || e.world_size > static_cast<uint32_t>(kMaxWorldSize)) {
    return absl::InvalidArgumentError(absl::StrCat("export world_size ", e.world_size,
                                                   " is out of range [1, ", kMaxWorldSize, "]"));
  }
  if (e.rank >= e.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("export rank ", e.rank, " is out of range for world_size ", e.world_size));
  }
  if (e.ranks.size() != e.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("export has ", e.ranks.size(),
                                                   " rank memories for world_size ", e.world_size));
  }
  if (e.entries.size() > instream::kMaxAttachEntries) {
    return absl::InvalidArgumentError(absl::StrCat("export has ", e.entries.size(),
                                                   " kernel entries, at most ",
                                                   instream::kMaxAttachEntries));
  }
  for (size_t i = 0; i < e.entries.size(); ++i) {
    if (std::memchr(e.entries[i].function, '\0', instream::kFunctionNameBytes) == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("export entry ", i, "'s function name is not NUL-terminated"));
    }
  }
  if (cuda && (e.image == nullptr || e.image_bytes == 0)) {
    return absl::InvalidArgumentError("a CUDA export needs a kernel image");
  }
  if (!cuda && (e.image != nullptr || e.image_bytes != 0)) {
    return absl::InvalidArgumentError("a host export has no kernel image");
  }

  // Descriptor indexes: the rank entries that hold one, in rank order.
  std::vector<int32_t> own_index(e.world_size, -1);
  int32_t next = 0, host_index = -1;
  for (uint32_t r = 0; r < e.world_size; ++r) {
    const InStreamRankMemory& m = e.ranks[r];
    if (!m.fd.valid()) continue;
    if (!NeedsFd(m.kind)) {
      return absl::InvalidArgumentError(
          absl::StrCat("export rank ", r, " holds a descriptor its memory kind does not use"));
    }
    own_index[r] = next++;
    if (m.kind == MemoryKind::kHostShm) {
      if (host_index >= 0) {
        return absl::InvalidArgumentError(
            "export has more than one host workspace descriptor (the group has one object)");
      }
      host_index = own_index[r];
    }
  }

  std::vector<RankMemory> ranks(e.world_size);
  for (uint32_t r = 0; r < e.world_size; ++r) {
    const InStreamRankMemory& m = e.ranks[r];
    RankMemory& out = ranks[r];
    std::memset(&out, 0, sizeof(out));
    out.kind = static_cast<uint32_t>(m.kind);
    out.bytes = m.bytes;
    out.fd_index = -1;
    if (m.kind == MemoryKind::kHostShm) {
      if (cuda) {
        return absl::InvalidArgumentError(
            absl::StrCat("export rank ", r, ": host memory in a CUDA export"));
      }
      if (host_index < 0) {
        return absl::InvalidArgumentError("host export without the workspace's descriptor");
      }
      out.fd_index = host_index;
    } else {
      if (!cuda) {
        return absl::InvalidArgumentError(
            absl::StrCat("export rank ", r, ": GPU memory in a host export"));
      }
      if (m.kind == MemoryKind::kVmmPosixFd) {
        if (own_index[r] < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("export rank ", r, ": a VMM POSIX-FD memory without its descriptor"));
        }
        out.fd_index = own_index[r];
      } else if (!NeedsHandle(m.kind)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "export rank ", r, ": memory kind ", static_cast<uint32_t>(m.kind), " is unknown"));
      }
    }
    if (NeedsHandle(m.kind)) {
      if (m.handle.size() != sizeof(out.handle)) {
        return absl::InvalidArgumentError(absl::StrCat("export rank ", r, ": handle is ",
                                                       m.handle.size(), " bytes, not ",
                                                       sizeof(out.handle)));
      }
      std::memcpy(out.handle, m.handle.data(), sizeof(out.handle));
    } else if (!m.handle.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("export rank ", r, ": a handle its memory kind does not use"));
    }
  }

  AttachHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = instream::kAttachMagic;
  h.abi_version = instream::kAttachAbiVersion;
  h.launch_abi_version = instream::kLaunchAbiVersion;
  h.launch_args_bytes = instream::kLaunchArgsBytes;
  h.header_bytes = sizeof(AttachHeader);
  h.entry_bytes = sizeof(KernelEntry);
  h.rank_bytes = sizeof(RankMemory);
  h.counter_slot = counter_slot;
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
  h.pdl = e.pdl ? 1 : 0;
  h.dtype = static_cast<uint32_t>(e.dtype);
  h.oneshot_max_bytes = e.oneshot_max_bytes;
  h.twoshot_max_bytes = e.twoshot_max_bytes;
  std::memcpy(h.kernel_config, e.kernel_config, sizeof(h.kernel_config));
  static_assert(sizeof(h.layout) == sizeof(e.layout));
  std::memcpy(h.layout, e.layout, sizeof(h.layout));
  h.max_tokens = e.max_tokens;
  h.hidden = e.hidden;
  h.host_slot_bytes = e.host_slot_bytes;
  // The counter page's descriptor comes after the export's own (next is their count).
  h.counters_fd_index = counters ? next : -1;
  h.counters_bytes = counters ? sizeof(instream::OpCounterPage) : 0;
  h.entries_offset = AlignBlob(sizeof(AttachHeader));
  h.ranks_offset = AlignBlob(h.entries_offset + e.entries.size() * sizeof(KernelEntry));
  h.image_offset = AlignBlob(h.ranks_offset + ranks.size() * sizeof(RankMemory));
  h.image_bytes = e.image_bytes;

  std::string blob(h.image_offset + h.image_bytes, '\0');
  std::memcpy(blob.data(), &h, sizeof(h));
  if (!e.entries.empty()) {
    std::memcpy(blob.data() + h.entries_offset, e.entries.data(),
                e.entries.size() * sizeof(KernelEntry));
  }
  std::memcpy(blob.data() + h.ranks_offset, ranks.data(), ranks.size() * sizeof(RankMemory));
  if (h.image_bytes > 0) std::memcpy(blob.data() + h.image_offset, e.image, h.image_bytes);
  return blob;
}

}  // namespace arfuse
