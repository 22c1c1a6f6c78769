#include "client/instream/host_plane.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"

namespace arfuse::instream::lib {

absl::StatusOr<std::unique_ptr<HostPlane>> HostPlane::Attach(const ParsedBlob& blob,
                                                             const int* fds) {
  const AttachHeader& h = blob.header;
  const RankMemory& mine = blob.ranks[h.rank];
  const int fd = fds[mine.fd_index];
  if (fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("fds[", mine.fd_index, "] (the host workspace) is negative"));
  }
  auto mapping = host::HostWsMapping::Map(fd, mine.bytes);
  if (!mapping.ok()) return mapping.status();
  if (absl::Status s = host::CheckHostWorkspace(mapping->data(), static_cast<int>(h.world_size),
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

absl::Status HostPlane::CheckCapacity(uint32_t, uint32_t, DType) const {
  // The slot holds max_tokens x hidden of the workspace's dtype (the blob reader checked
  // host_slot_bytes against it), and DispatchOp refused anything larger: every op fits.
  return absl::OkStatus();
}

absl::Status HostPlane::Run(const OpRequest& op, const Dispatch&, void*) {
  host::HostWaitLimits limits;
  limits.deadline = absl::Now() + absl::Nanoseconds(static_cast<int64_t>(
                                      std::min<uint64_t>(header_.spin_timeout_ns, INT64_MAX)));
  // The attach id names this client as the op's launcher: the sidecar retires the op if this
  // attachment ends before the op completes.
  host::HostOpResult r = collective_.Run(op, header_.generation, limits, /*client=*/true,
                                         /*copy_input=*/nullptr, header_.attach_id);
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
