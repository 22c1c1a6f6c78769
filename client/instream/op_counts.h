// libarfuse_client's writing side of the attachment's op counter page
// (kernels/instream/op_counters.h): the sidecar's sealed memfd mapped shared, and one relaxed
// atomic add per op decided. No RPC, no system call per op.
#pragma once

#include <cstdint>

#include "kernels/common/op_types.h"
#include "kernels/common/plain_status.h"
#include "kernels/instream/op_counters.h"

namespace arfuse::instream::lib {

class OpCountsMapping {
 public:
  OpCountsMapping() = default;  // no page: counting does nothing
  // Maps the page behind `fd` (the blob's counters_fd_index): INVALID_ARGUMENT for a negative
  // descriptor or an object smaller than kOpCounterObjectBytes (mapping it would fault), and
  // FAILED_PRECONDITION when it cannot be mapped.
  static plain::StatusOr<OpCountsMapping> Map(int fd);
  ~OpCountsMapping();
  OpCountsMapping(OpCountsMapping&& o) noexcept;
  OpCountsMapping& operator=(OpCountsMapping&& o) noexcept;
  OpCountsMapping(const OpCountsMapping&) = delete;
  OpCountsMapping& operator=(const OpCountsMapping&) = delete;

  // Relaxed atomic adds: each slot is a tally on its own, read by the sidecar whenever it
  // scrapes; nothing orders them against the op itself. Several threads (ctxs) may count at once.
  // The page has two pattern slots: allreduce (0) and allreduce_residual_rmsnorm (1). The FP8
  // patterns run the same add-RMSNorm and count in slot 1 (their codes are an epilogue).
  void Fused(Pattern pattern, uint32_t tokens) {
    if (page_ == nullptr || !TraitsOf(pattern).valid) return;
    const uint32_t p = IsNormPattern(pattern) ? 1 : 0;
    static_assert(kOpPatterns == 2, "the slot of each pattern above");
    __atomic_fetch_add(&page_->fused[p][OpTokenBucket(tokens)], 1, __ATOMIC_RELAXED);
  }
  void Declined(DeclineReason reason) {
    if (page_ == nullptr) return;
    const auto r = static_cast<uint32_t>(reason);
    if (r >= kDeclineReasons) return;
    __atomic_fetch_add(&page_->declined[r], 1, __ATOMIC_RELAXED);
  }

 private:
  explicit OpCountsMapping(OpCounterPage* page) : page_(page) {}
  OpCounterPage* page_ = nullptr;
};

}  // namespace arfuse::instream::lib
