// The in-stream plane's op counter page: one small host shared-memory object per attachment
// (a sealed memfd the sidecar creates and hands to the client with the attach's other
// descriptors, AttachHeader::counters_fd_index), in which libarfuse_client counts every op it
// decides: fused ops by pattern and token bucket, declined ops (the caller runs its own path) by
// reason. The library increments its own slots with relaxed atomic adds at decision time, so
// counting costs no RPC and no system call; the sidecar reads the slots with relaxed loads and
// exports them (arfuse_instream_ops_total, docs/metrics.md).
//
// The page is written by the client, so the sidecar trusts nothing in it: it reads only the fixed
// slots below, each as one aligned 64-bit word, and bounds the difference between two reads of a
// slot (OpCounterDelta), so a client that writes garbage changes only its own attachment's
// numbers. Counters wrap at 2^64; differences are taken modulo 2^64, so a wrap counts right.
//
// No CUDA and no protobuf: the sidecar and host-only client builds include this header, and the
// in-stream kernels (kernels/instream/instream_kernels.cu) take their token bucket from it too.
#pragma once

#include <cstddef>
#include <cstdint>

// OpTokenBucket runs on the host (the library's page) and on the GPU (the kernels' launch counts,
// FusionControl::instream_ops), so that both count an op in the same bucket.
#if defined(__CUDACC__)
#define ARFUSE_OP_COUNTERS_HD __host__ __device__
#else
#define ARFUSE_OP_COUNTERS_HD
#endif

namespace arfuse::instream {

// Token buckets of fused ops (tokens of the op, the batch's rows): decode batches fall in the
// first three, prefill chunks in the last two. Bucket b holds tokens in
// [kOpTokenBucketLow[b], kOpTokenBucketLow[b + 1]).
inline constexpr uint32_t kOpTokenBuckets = 5;
inline constexpr uint32_t kOpTokenBucketLow[kOpTokenBuckets] = {1, 2, 9, 65, 513};
inline constexpr const char* kOpTokenBucketNames[kOpTokenBuckets] = {"1", "2-8", "9-64", "65-512",
                                                                     "513+"};

// The edges are literals, not reads of kOpTokenBucketLow: a namespace-scope host array is not
// device memory. The static_asserts below pin them to the table.
ARFUSE_OP_COUNTERS_HD inline constexpr uint32_t OpTokenBucket(uint32_t tokens) {
  return tokens >= 513u ? 4u : tokens >= 65u ? 3u : tokens >= 9u ? 2u : tokens >= 2u ? 1u : 0u;
}
static_assert(OpTokenBucket(0) == 0 && OpTokenBucket(1) == 0);
static_assert(OpTokenBucket(kOpTokenBucketLow[1] - 1) == 0 &&
              OpTokenBucket(kOpTokenBucketLow[1]) == 1);
static_assert(OpTokenBucket(kOpTokenBucketLow[2] - 1) == 1 &&
              OpTokenBucket(kOpTokenBucketLow[2]) == 2);
static_assert(OpTokenBucket(kOpTokenBucketLow[3] - 1) == 2 &&
              OpTokenBucket(kOpTokenBucketLow[3]) == 3);
static_assert(OpTokenBucket(kOpTokenBucketLow[4] - 1) == 3 &&
              OpTokenBucket(kOpTokenBucketLow[4]) == 4);
static_assert(OpTokenBucket(0xffffffffu) == kOpTokenBuckets - 1);

// Why the library declined an op. The numbers are slot indexes of the page: never reuse one.
enum class DeclineReason : uint32_t {
  kDisabled = 0,         // the ctx is disabled (a drain, a lost sidecar): ARFUSE_UNAVAILABLE
  kDtype = 1,            // another dtype than the workspace's
  kShape = 2,            // hidden not a multiple of kHiddenMultiple, or above the workspace's
  kNotAttached = 3,      // hidden not among the attach's hidden sizes
  kCapacity = 4,         // tokens x hidden above the workspace's buffers
  kRange = 5,            // payload above the fused range (twoshot_max_bytes)
  kNoKernel = 6,         // the sidecar has no kernel for this pattern, algorithm and dtype
  kInvalidArgument = 7,  // a NULL, misaligned or overlapping tensor, a bad eps, pattern or dtype
  kMemory = 8,           // a tensor is not device memory of the attachment's GPU (CUDA)
  kNotContiguous = 9,    // the caller's tensors are not contiguous (reported by the caller)
  kOther = 10,           // anything else the caller reports (arfuse_note_declined)
};
inline constexpr uint32_t kDeclineReasons = 11;
// Slots reserved for reasons: a later release adds reasons without moving the page's layout.
inline constexpr uint32_t kDeclineSlots = 16;
inline constexpr const char* kDeclineReasonNames[kDeclineReasons] = {
    "disabled", "dtype",          "shape",     "not_attached",
    "capacity", "range",          "no_kernel", "invalid_argument",
    "memory",   "not_contiguous", "other"};

// Patterns counted (arfuse::Pattern 1 and 2, at index pattern - 1).
inline constexpr uint32_t kOpPatterns = 2;
inline constexpr uint32_t kOpBucketSlots = 8;

struct OpCounterPage {
  // fused[pattern - 1][OpTokenBucket(tokens)]: ops the library launched fused (CUDA: launched or
  // captured into a graph once). On CUDA the sidecar exports the kernels' own per-attachment
  // launch counts instead (FusionControl::instream_ops: replays included); this slot is what
  // the library decided.
  uint64_t fused[kOpPatterns][kOpBucketSlots];
  // declined[DeclineReason]: ops the library did not launch, the caller runs its own path.
  uint64_t declined[kDeclineSlots];
  uint64_t reserved[32];
};
static_assert(sizeof(OpCounterPage) == 512);
static_assert(offsetof(OpCounterPage, declined) == 128);
static_assert(kOpTokenBuckets <= kOpBucketSlots);
static_assert(kDeclineReasons <= kDeclineSlots);

// The kernels' own launch counts (FusionControl::instream_ops, in the workspace's control block):
// the sidecar gives each in-stream attachment one of the first kInStreamAttachSlots slots at
// attach (AttachHeader::counter_slot), its launches carry the index
// (InStreamLaunchArgs::counter_slot), and block 0's thread 0 of each launch that passed the
// generation check adds one to ops[slot][pattern - 1][OpTokenBucket(num_tokens)]. The last slot
// counts launches carrying an index out of range, and those of attachments that found every slot
// taken. The sidecar reads the table with one small copy beside instream_launches.
inline constexpr uint32_t kInStreamCounterSlots = 32;
inline constexpr uint32_t kInStreamAttachSlots = kInStreamCounterSlots - 1;
inline constexpr uint32_t kInStreamUnattributedSlot = kInStreamCounterSlots - 1;
struct InStreamOpTable {
  uint64_t ops[kInStreamCounterSlots][kOpPatterns][kOpBucketSlots];
};
static_assert(sizeof(InStreamOpTable) == 4096);

// Bytes of the shared-memory object (a page; the counters use its first sizeof(OpCounterPage)).
inline constexpr uint64_t kOpCounterObjectBytes = 4096;
static_assert(sizeof(OpCounterPage) <= kOpCounterObjectBytes);

// The most one slot may advance between two reads of the sidecar (which reads at least every
// probe interval and at every scrape): 2^40 ops is days of ops at any rate one client reaches, so
// a larger difference is a client writing garbage (or lowering a counter), not counting.
inline constexpr uint64_t kMaxOpCounterDelta = uint64_t{1} << 40;

// Whether a slot advanced from `last` to `now` by a plausible amount, written to `*advanced`
// (modulo 2^64: a wrap counts right); false when the difference is beyond kMaxOpCounterDelta
// (garbage, or a counter that went back).
inline constexpr bool OpCounterAdvance(uint64_t last, uint64_t now, uint64_t* advanced) {
  const uint64_t d = now - last;
  if (d > kMaxOpCounterDelta) return false;
  *advanced = d;
  return true;
}

// What a slot advanced from `last` to `now`, or 0 when OpCounterAdvance refuses it (the sidecar
// then takes `now` as the new baseline).
inline constexpr uint64_t OpCounterDelta(uint64_t last, uint64_t now) {
  uint64_t d = 0;
  return OpCounterAdvance(last, now, &d) ? d : 0;
}

}  // namespace arfuse::instream
