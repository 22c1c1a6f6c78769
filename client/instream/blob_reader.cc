#include "client/instream/blob_reader.h"

#include <cstring>

#include "kernels/host/host_collective.h"
#include "kernels/instream/op_counters.h"

namespace arfuse::instream::lib {
namespace {

plain::Status Malformed(std::string_view what) {
  return plain::InvalidArgumentError(plain::StrCat("attach blob: ", what));
}

// Whether [offset, offset + count * size) lies inside a blob of `total` bytes; count * size
// cannot overflow (count is bounded by the caller), offset + length is never formed.
bool Inside(uint64_t offset, uint64_t length, uint64_t total) {
  return offset <= total && length <= total - offset;
}

plain::Status CheckRegion(const char* name, uint64_t offset, uint64_t length, uint64_t total) {
  if (offset % 16 != 0) {
    return Malformed(plain::StrCat(name, " ", offset, " is not a multiple of 16"));
  }
  if (offset < sizeof(AttachHeader)) {
    return Malformed(plain::StrCat(name, " ", offset, " lies inside the header"));
  }
  if (!Inside(offset, length, total)) {
    return Malformed(plain::StrCat(name, " ", offset, " + ", length,
                                   " bytes lies outside the blob of ", total, " bytes"));
  }
  return plain::OkStatus();
}

plain::Status CheckEntry(const ParsedBlob& p, uint32_t i) {
  const KernelEntry& e = p.entries[i];
  const std::string at = plain::StrCat("entry ", i, "'s ");
  if (std::memchr(e.function, '\0', sizeof(e.function)) == nullptr) {
    return Malformed(plain::StrCat(at, "function name is not NUL-terminated"));
  }
  if (!IsKnownDType(e.dtype)) {
    return Malformed(
        plain::StrCat(at, "dtype ", e.dtype, " is not bf16 (1), fp16 (2) or fp32 (3)"));
  }
  if (!TraitsOf(static_cast<Pattern>(e.pattern)).valid) {
    return Malformed(plain::StrCat(at, "pattern ", e.pattern, " is not 1 to ", kMaxPattern));
  }
  if (e.algo != kAlgoOneShot && e.algo != kAlgoTwoShot) {
    return Malformed(plain::StrCat(at, "algo ", e.algo, " is not one-shot (1) or two-shot (2)"));
  }
  if (!IsHiddenAligned(e.hidden) || e.hidden > p.header.hidden) {
    return Malformed(plain::StrCat(at, contract::HiddenNotAligned(e.hidden),
                                   " up to the workspace's ", p.header.hidden));
  }
  if (p.device() != DeviceKind::kCuda) return plain::OkStatus();  // the host runs no kernel
  if (e.function[0] == '\0') return Malformed(plain::StrCat(at, "function name is empty"));
  if (e.max_grid < 1 || e.max_grid > kMaxGrid) {
    return Malformed(plain::StrCat(at, "max_grid ", e.max_grid, " is not in 1..", kMaxGrid));
  }
  if (e.block_threads < 32 || e.block_threads > 1024 || e.block_threads % 32 != 0) {
    return Malformed(plain::StrCat(at, "block_threads ", e.block_threads,
                                   " is not a multiple of 32 in 32..1024"));
  }
  if (e.rows_divisor < 1) return Malformed(plain::StrCat(at, "rows_divisor is 0"));
  return plain::OkStatus();
}

plain::Status CheckRank(const ParsedBlob& p, uint32_t r, size_t num_fds) {
  const RankMemory& m = p.ranks[r];
  const std::string at = plain::StrCat("rank ", r, "'s memory ");
  const auto kind = static_cast<MemoryKind>(m.kind);
  const bool cuda = p.device() == DeviceKind::kCuda;
  bool uses_fd = false;
  switch (kind) {
    case MemoryKind::kCudaIpc:
    case MemoryKind::kVmmFabric:
      if (!cuda)
        return Malformed(plain::StrCat(at, "kind ", m.kind, " is GPU memory in a host blob"));
      break;
    case MemoryKind::kVmmPosixFd:
      if (!cuda)
        return Malformed(plain::StrCat(at, "kind ", m.kind, " is GPU memory in a host blob"));
      uses_fd = true;
      break;
    case MemoryKind::kHostShm:
      if (cuda) return Malformed(plain::StrCat(at, "kind 4 (host) in a CUDA blob"));
      uses_fd = true;
      break;
    default:
      return Malformed(plain::StrCat(at, "kind ", m.kind, " is unknown"));
  }
  if (uses_fd) {
    if (m.fd_index < 0 || static_cast<uint64_t>(m.fd_index) >= num_fds) {
      return Malformed(
          plain::StrCat(at, "fd_index ", m.fd_index, " is not below num_fds ", num_fds));
    }
  } else if (m.fd_index != -1) {
    return Malformed(plain::StrCat(at, "fd_index ", m.fd_index, " must be -1 for a handle"));
  }
  if (m.bytes == 0) return Malformed(plain::StrCat(at, "bytes is 0"));
  if (!cuda) {
    if (m.fd_index != p.ranks[0].fd_index) {
      return Malformed(plain::StrCat(at, "fd_index ", m.fd_index, " differs from rank 0's ",
                                     p.ranks[0].fd_index, " (the group has one host workspace)"));
    }
    const uint64_t want =
        host::HostWsTotalBytes(static_cast<int>(p.header.world_size), p.header.host_slot_bytes);
    if (m.bytes != want) {
      return Malformed(plain::StrCat(at, "bytes ", m.bytes, " is not the host workspace's ", want));
    }
  }
  return plain::OkStatus();
}

// The op counter page: none (-1, 0), or a descriptor of its own of sizeof(OpCounterPage) bytes
// (the library writes into it: it must not be a rank's workspace).
plain::Status CheckCounters(const ParsedBlob& p, size_t num_fds) {
  const AttachHeader& h = p.header;
  if (h.counters_fd_index == -1) {
    if (h.counters_bytes != 0) {
      return Malformed(plain::StrCat("counters_bytes ", h.counters_bytes,
                                     " without a counter page (counters_fd_index -1)"));
    }
    return plain::OkStatus();
  }
  if (h.counters_fd_index < 0 || static_cast<uint64_t>(h.counters_fd_index) >= num_fds) {
    return Malformed(plain::StrCat("counters_fd_index ", h.counters_fd_index,
                                   " is not -1 or below num_fds ", num_fds));
  }
  for (uint32_t r = 0; r < h.world_size; ++r) {
    if (p.ranks[r].fd_index == h.counters_fd_index) {
      return Malformed(plain::StrCat("counters_fd_index ", h.counters_fd_index, " is rank ", r,
                                     "'s workspace descriptor"));
    }
  }
  if (h.counters_bytes != sizeof(OpCounterPage)) {
    return Malformed(plain::StrCat("counters_bytes ", h.counters_bytes, " is not ",
                                   sizeof(OpCounterPage), " (this library's op counter page)"));
  }
  return plain::OkStatus();
}

}  // namespace

bool IsKnownDType(uint32_t dtype) {
  return dtype == static_cast<uint32_t>(DType::kBF16) ||
         dtype == static_cast<uint32_t>(DType::kFP16) ||
         dtype == static_cast<uint32_t>(DType::kFP32);
}

plain::StatusOr<ParsedBlob> ParseAttachBlob(const void* blob, size_t blob_bytes, size_t num_fds) {
  if (blob == nullptr) return plain::InvalidArgumentError("attach blob is NULL");
  if (blob_bytes < sizeof(AttachHeader)) {
    return Malformed(plain::StrCat(blob_bytes, " bytes is shorter than its header (",
                                   sizeof(AttachHeader), " bytes)"));
  }
  ParsedBlob p;
  AttachHeader& h = p.header;
  std::memcpy(&h, blob, sizeof(h));
  if (h.magic != kAttachMagic) return Malformed("magic is not AFSI: not an attach blob");
  if (h.abi_version != kAttachAbiVersion) {
    return plain::FailedPreconditionError(
        plain::StrCat("attach blob: abi_version ", h.abi_version, " differs from this library's ",
                      kAttachAbiVersion, " (upgrade libarfuse_client or the sidecar)"));
  }
  if (h.launch_abi_version != kLaunchAbiVersion) {
    return plain::FailedPreconditionError(plain::StrCat("attach blob: launch_abi_version ",
                                                        h.launch_abi_version,
                                                        " of the sidecar's kernels "
                                                        "differs from this library's ",
                                                        kLaunchAbiVersion,
                                                        " (upgrade libarfuse_client or the "
                                                        "sidecar)"));
  }
  if (h.launch_args_bytes != kLaunchArgsBytes) {
    return plain::FailedPreconditionError(plain::StrCat("attach blob: launch_args_bytes ",
                                                        h.launch_args_bytes,
                                                        " of the sidecar's kernels "
                                                        "differs from this library's ",
                                                        kLaunchArgsBytes));
  }
  if (h.header_bytes != sizeof(AttachHeader)) {
    return Malformed(
        plain::StrCat("header_bytes ", h.header_bytes, " is not ", sizeof(AttachHeader)));
  }
  if (h.entry_bytes != sizeof(KernelEntry)) {
    return Malformed(plain::StrCat("entry_bytes ", h.entry_bytes, " is not ", sizeof(KernelEntry)));
  }
  if (h.rank_bytes != sizeof(RankMemory)) {
    return Malformed(plain::StrCat("rank_bytes ", h.rank_bytes, " is not ", sizeof(RankMemory)));
  }
  const bool cuda = h.device_kind == static_cast<uint32_t>(DeviceKind::kCuda);
  if (!cuda && h.device_kind != static_cast<uint32_t>(DeviceKind::kHost)) {
    return Malformed(plain::StrCat("device_kind ", h.device_kind, " is not CUDA (1) or host (2)"));
  }
  if (cuda ? !IsSupportedWorldSize(static_cast<int>(h.world_size))
           : (h.world_size < 1 || h.world_size > static_cast<uint32_t>(kMaxWorldSize))) {
    return Malformed(plain::StrCat("world_size ", h.world_size, " is not ",
                                   cuda ? "2, 4, 8 or 16" : "in 1..16"));
  }
  if (h.rank >= h.world_size) {
    return Malformed(plain::StrCat("rank ", h.rank, " is not below world_size ", h.world_size));
  }
  if (h.num_entries < 1 || h.num_entries > kMaxEntries) {
    return Malformed(plain::StrCat("num_entries ", h.num_entries, " is not in 1..", kMaxEntries));
  }
  if (!IsKnownDType(h.dtype)) {
    return Malformed(plain::StrCat("dtype ", h.dtype, " is not bf16 (1), fp16 (2) or fp32 (3)"));
  }
  if (h.spin_timeout_ns == 0) return Malformed("spin_timeout_ns is 0");
  if (h.max_tokens == 0) return Malformed("max_tokens is 0");
  if (!IsHiddenAligned(h.hidden)) return Malformed(contract::HiddenNotAligned(h.hidden));
  if (!cuda) {
    const uint64_t capacity = contract::CapacityBytes(
        contract::WorkspaceCapacity{h.max_tokens, h.hidden, static_cast<DType>(h.dtype), true});
    if (h.host_slot_bytes < capacity || h.host_slot_bytes % host::kHostWsSlotAlign != 0) {
      return Malformed(plain::StrCat("host_slot_bytes ", h.host_slot_bytes,
                                     " is not a multiple of ", host::kHostWsSlotAlign,
                                     " holding max_tokens x hidden (", capacity, " bytes)"));
    }
  }
  if (plain::Status s = CheckRegion("entries_offset", h.entries_offset,
                                    uint64_t{h.num_entries} * sizeof(KernelEntry), blob_bytes);
      !s.ok()) {
    return s;
  }
  if (plain::Status s = CheckRegion("ranks_offset", h.ranks_offset,
                                    uint64_t{h.world_size} * sizeof(RankMemory), blob_bytes);
      !s.ok()) {
    return s;
  }
  if (plain::Status s = CheckRegion("image_offset", h.image_offset, h.image_bytes, blob_bytes);
      !s.ok()) {
    return s;
  }
  if (cuda && h.image_bytes == 0) return Malformed("image_bytes is 0: a CUDA blob needs its image");
  if (!cuda && h.image_bytes != 0) return Malformed("image_bytes must be 0 in a host blob");

  const auto* base = static_cast<const uint8_t*>(blob);
  p.entries.resize(h.num_entries);
  std::memcpy(p.entries.data(), base + h.entries_offset, h.num_entries * sizeof(KernelEntry));
  p.ranks.resize(h.world_size);
  std::memcpy(p.ranks.data(), base + h.ranks_offset, h.world_size * sizeof(RankMemory));
  p.image = h.image_bytes > 0 ? base + h.image_offset : nullptr;
  p.image_bytes = h.image_bytes;
  for (uint32_t i = 0; i < h.num_entries; ++i) {
    if (plain::Status s = CheckEntry(p, i); !s.ok()) return s;
  }
  for (uint32_t r = 0; r < h.world_size; ++r) {
    if (plain::Status s = CheckRank(p, r, num_fds); !s.ok()) return s;
  }
  if (plain::Status s = CheckCounters(p, num_fds); !s.ok()) return s;
  return p;
}

}  // namespace arfuse::instream::lib
