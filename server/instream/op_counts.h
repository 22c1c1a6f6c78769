// The in-stream clients' op counts as the sidecar sums them (their counter pages,
// kernels/instream/op_counters.h): plain numbers shared by the attachments' table, the metrics
// and the Fusion service. Header-only, no dependencies beyond the page's ABI.
#pragma once

#include <cstdint>

#include "kernels/instream/op_counters.h"

namespace arfuse {

// Ops of the in-stream plane as the sidecar counted them (one attachment's, or a sum).
struct InStreamOpCounts {
  // fused[pattern - 1][token bucket] (instream::kOpTokenBucketNames).
  uint64_t fused[instream::kOpPatterns][instream::kOpTokenBuckets] = {};
  // declined[instream::DeclineReason] (instream::kDeclineReasonNames).
  uint64_t declined[instream::kDeclineReasons] = {};

  uint64_t fused_total() const {
    uint64_t n = 0;
    for (const auto& per_pattern : fused) {
      for (uint64_t v : per_pattern) n += v;
    }
    return n;
  }
  uint64_t declined_total() const {
    uint64_t n = 0;
    for (uint64_t v : declined) n += v;
    return n;
  }
  // Slot by slot, modulo 2^64 (sums of wrapping counters wrap alike).
  InStreamOpCounts& operator+=(const InStreamOpCounts& o) {
    for (uint32_t p = 0; p < instream::kOpPatterns; ++p) {
      for (uint32_t b = 0; b < instream::kOpTokenBuckets; ++b) fused[p][b] += o.fused[p][b];
    }
    for (uint32_t r = 0; r < instream::kDeclineReasons; ++r) declined[r] += o.declined[r];
    return *this;
  }
  bool operator==(const InStreamOpCounts& o) const = default;
};

}  // namespace arfuse
