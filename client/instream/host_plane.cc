#include "client/instream/host_plane.h"

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace arfuse::instream::lib {

plain::StatusOr<std::unique_ptr<HostPlane>> HostPlane::Attach(const ParsedBlob& blob,
                                                              const int* fds) {
  const AttachHeader& h = blob.header;
  const RankMemory& mine = blob.ranks[h.rank];
  const int fd = fds[mine.fd_index];
  if (fd < 0) {
    return plain::InvalidArgumentError(
        plain::StrCat("fds[", mine.fd_index, "] (the host workspace) is negative"));
  }
  auto mapping = host::HostWsMapping::Map(fd, mine.bytes);
  if (!mapping.ok()) return mapping.status();
  if (plain::Status s = host::CheckHostWorkspace(mapping->data(), static_cast<int>(h.world_size),
                                                 h.host_slot_bytes, h.generation);
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<HostPlane>(new HostPlane(blob, std::move(*mapping)));
}

HostPlane::HostPlane(const ParsedBlob& blob, host::HostWsMapping mapping)
    : header_(blob.header),
      mapping_(std::move(mapping)),
      collective_(mapping_.data(), static_cast<int>(header_.rank),
                  static_cast<int>(header_.world_size), header_.host_slot_bytes) {}

plain::Status HostPlane::CheckCapacity(uint32_t, uint32_t, DType) const {
  // The slot holds max_tokens x hidden of the workspace's dtype (the blob reader checked
  // host_slot_bytes against it), and DispatchOp refused anything larger: every op fits.
  return plain::OkStatus();
}

plain::Status HostPlane::Run(const OpRequest& op, const Dispatch&, uint32_t program_key, void*) {
  host::HostWaitLimits limits;
  // The spin timeout, capped where steady_clock's nanoseconds would overflow (about 292 years).
  const auto now = std::chrono::steady_clock::now();
  const uint64_t room = static_cast<uint64_t>((std::chrono::steady_clock::time_point::max() - now) /
                                              std::chrono::nanoseconds(1));
  limits.deadline = now + std::chrono::nanoseconds(std::min(header_.spin_timeout_ns, room));
  // The attach id names this client as the op's launcher: the sidecar retires the op if this
  // attachment ends before the op completes.
  host::HostOpResult r = collective_.Run(op, header_.generation, limits, /*client=*/true,
                                         /*copy_input=*/nullptr, header_.attach_id, program_key);
  if (r.error != 0) {
    uint32_t none = 0;
    error_.compare_exchange_strong(none, r.error, std::memory_order_acq_rel);
  }
  return r.status;
}

uint32_t HostPlane::ErrorCode() const {
  if (uint32_t e = error_.load(std::memory_order_acquire); e != 0) return e;
  // Nothing failed here yet; the workspace may have moved on without this attachment.
  const host::HostWsHeader* h = collective_.header();
  if (h->retired.load(std::memory_order_acquire) != 0) return kErrorStaleGeneration;
  if (h->abort_word.load(std::memory_order_acquire) != 0) {
    const uint32_t e = h->error.load(std::memory_order_acquire);
    return e != 0 ? e : static_cast<uint32_t>(host::HostWsError::kPoisoned);
  }
  return 0;
}

}  // namespace arfuse::instream::lib
