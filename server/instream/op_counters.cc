#include "server/instream/op_counters.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace arfuse {

using instream::kDeclineReasons;
using instream::kOpPatterns;
using instream::kOpTokenBuckets;

absl::StatusOr<std::unique_ptr<InStreamOpCounterPage>> InStreamOpCounterPage::Create() {
  UniqueFd fd(::memfd_create("arfuse-instream-op-counters", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create the op counter page (memfd_create): ", std::strerror(errno)));
  }
  const auto bytes = static_cast<off_t>(instream::kOpCounterObjectBytes);
  if (::ftruncate(fd.get(), bytes) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot size the op counter page: ", std::strerror(errno)));
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot seal the op counter page: ", std::strerror(errno)));
  }
  // Read-only here: the sidecar never writes what the client counts.
  void* map = ::mmap(nullptr, instream::kOpCounterObjectBytes, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (map == MAP_FAILED) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot map the op counter page: ", std::strerror(errno)));
  }
  return std::unique_ptr<InStreamOpCounterPage>(new InStreamOpCounterPage(std::move(fd), map));
}

InStreamOpCounterPage::~InStreamOpCounterPage() {
  ::munmap(const_cast<void*>(map_), instream::kOpCounterObjectBytes);
}

const InStreamOpCounts& InStreamOpCounterPage::Sample() {
  const auto* page = static_cast<const instream::OpCounterPage*>(map_);
  // Relaxed loads of aligned words: each slot is read whole, never torn, whatever the client
  // writes meanwhile; no ordering between slots is needed (each is its own count).
  auto read = [&](const uint64_t& slot, uint64_t& last, uint64_t& counted) {
    const uint64_t now = __atomic_load_n(&slot, __ATOMIC_RELAXED);
    const uint64_t d = instream::OpCounterDelta(last, now);
    if (d == 0 && now != last) ++refused_;
    counted += d;
    last = now;
  };
  for (uint32_t p = 0; p < kOpPatterns; ++p) {
    for (uint32_t b = 0; b < kOpTokenBuckets; ++b) {
      read(page->fused[p][b], last_.fused[p][b], counted_.fused[p][b]);
    }
  }
  for (uint32_t r = 0; r < kDeclineReasons; ++r) {
    read(page->declined[r], last_.declined[r], counted_.declined[r]);
  }
  return counted_;
}

}  // namespace arfuse
