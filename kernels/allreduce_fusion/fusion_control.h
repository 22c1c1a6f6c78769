// The control block at the start of every rank's workspace (WorkspaceLayout::control_offset).
// Shared between host code (sizes, word addresses) and the kernels; peers write into it over
// NVLink, so its layout is fixed by static_asserts.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/instream/op_counters.h"

namespace arfuse {

// The 32-bit tag of a workspace generation that FusionControl::generation holds: never 0, so a
// zeroed (dropped) control block refuses every tagged launch.
__host__ __device__ constexpr uint32_t GenerationTag(uint64_t generation) {
  return static_cast<uint32_t>(generation % 0xffffffffull) + 1u;
}

// What one rank runs in one call, written by that rank into every peer's control block before
// its data, so that every rank checks, before it stores any output, that its peers run the same
// op: two clients racing on one group can pair rank 0's op of one shape with rank 1's op of
// another, and the one-shot would otherwise read the first rows of the longer op as the shorter
// op's data and return a wrong sum with no error. Each word holds a value in its low half and the
// call's tag in its high half (the one-shot: epoch + 1, the two-shot: barrier-A value), so a word
// left from an earlier call never matches and a zeroed slot (tag 0) means "not written yet".
// Words are written and read as aligned 64-bit elements, each single-copy atomic.
struct alignas(32) FusionOpDesc {
  // Low halves: num_tokens; hidden | program key bits 12-23 << 19 | in-stream origin << 31;
  // eps bits; dtype | pattern << 4 | algo << 8 | world_size << 12 | program key bits 0-11 << 20
  // (fusion_sync.cuh's MakeOpDesc).
  uint64_t words[4];
};
static_assert(sizeof(FusionOpDesc) == 32);

struct FusionControl {
  // First FusionError of this workspace; sticky until LaunchWorkspaceInit.
  uint32_t error;
  // Nonzero makes every spin on this rank exit: the host writes it (any value), and a failing
  // peer writes FusionError::kPeerAbort into it.
  uint32_t abort;
  // One-shot: number of calls so far; buffer epoch % 3 receives this call's data.
  uint32_t lamport_epoch;
  // One-shot: blocks of the current call that have read the epoch (each counts itself in before
  // it writes anything of the call into a peer); the last one advances the epoch and resets it
  // when it finishes. Nonzero while a call is in flight, and after a launch that was killed
  // mid-op (its process died): the owning sidecar reads it when an in-stream client's session
  // ends, to retire an op the client left half done (FusionError::kAbandoned).
  uint32_t lamport_arrived;
  // Two-shot: barrier sequence; a call's two barriers wait for seq + 1 and seq + 2.
  uint32_t twoshot_seq;
  // Two-shot: blocks of the current call that started (each counts itself in, fire-and-forget,
  // before it writes anything into a peer); reset with the barrier counters by the last block
  // at barrier B. Nonzero while a call is in flight (as lamport_arrived for the one-shot).
  uint32_t twoshot_arrived;
  // Two-shot: blocks of the current call that arrived at barrier A ([0]) and B ([1]); the last
  // at each signals the peers; the last at B resets both.
  uint32_t twoshot_count[2];
  // Unused since the one-shot writes the sentinel back right after reading each element (it
  // used to clear the previous call's buffer and recorded here how much); kept for the layout.
  uint64_t lamport_used_elems[3];
  // %globaltimer time before which no spinning thread of this rank reads the host abort word
  // again: one PCIe read per rank per interval, claimed with a CAS. (Every spinning block
  // reading it at once queued hundreds of PCIe reads and stalled ops for up to 2.4 ms.)
  uint64_t host_check_ns;
  // The workspace generation's tag (GenerationTag), written by the owning sidecar after every
  // initialization and zeroed when it drops the workspace. In-stream launches carry the tag they
  // attached with and change nothing when it differs (a launch captured before a
  // re-initialization, or on a workspace that is gone); the sidecar's own launches do not check.
  uint32_t generation;
  uint32_t reserved_gen;
  // In-stream launches that passed the generation check, and those refused for a stale
  // generation or launch ABI: counted by block 0 of each launch, read by the sidecar (metrics).
  // Zeroed by every initialization.
  uint64_t instream_launches;
  uint64_t instream_stale;
  uint8_t reserved1[256 - 88];
  // Two-shot barrier: barrier[0][r] is written by rank r's last block to arrive at a barrier
  // (st.release.sys) and polled by every block of this rank (ld.acquire.sys).
  uint32_t barrier[kMaxFusionBlocks][kMaxWorldSize];
  // One-shot: lamport_desc[epoch % 3][q] is rank q's FusionOpDesc of the call using that buffer
  // (written by q's first block; the slot is written again only three calls later, after this
  // rank finished the call that read it).
  FusionOpDesc lamport_desc[3][kMaxWorldSize];
  // Two-shot: rank q's FusionOpDesc of its current call, written by every block of q before its
  // barrier-A signal (which publishes it) and read after that barrier; q writes it again only in
  // its next call, which starts after this rank's blocks all passed barrier B.
  FusionOpDesc twoshot_desc[kMaxWorldSize];
  // In-stream launches that passed the generation check, by attachment slot, pattern - 1 and
  // token bucket (instream::OpTokenBucket of num_tokens; the layout of instream::InStreamOpTable):
  // counted by block 0's thread 0 of each launch beside instream_launches (a relaxed atomic add in
  // this rank's own memory: no PCIe write, nothing the op waits for), read by the sidecar. A
  // graph's replays never pass through the client library, so these are the only per-attachment
  // count of them. Zeroed by every initialization; the sidecar takes differences, so a slot handed
  // to a new attachment starts from the value it last read.
  uint64_t instream_ops[instream::kInStreamCounterSlots][instream::kOpPatterns]
                       [instream::kOpBucketSlots];
};
static_assert(offsetof(FusionControl, error) == 0);
static_assert(offsetof(FusionControl, abort) == 4);
static_assert(offsetof(FusionControl, lamport_used_elems) == 32);
static_assert(offsetof(FusionControl, host_check_ns) == 56);
static_assert(offsetof(FusionControl, generation) == 64);
static_assert(offsetof(FusionControl, instream_launches) == 72);
static_assert(offsetof(FusionControl, instream_stale) == 80);
static_assert(offsetof(FusionControl, barrier) == 256);
constexpr size_t kFusionBarrierBytes = kMaxFusionBlocks * kMaxWorldSize * 4;
static_assert(offsetof(FusionControl, lamport_desc) == 256 + kFusionBarrierBytes);
static_assert(offsetof(FusionControl, twoshot_desc) ==
              256 + kFusionBarrierBytes + 3 * kMaxWorldSize * sizeof(FusionOpDesc));
constexpr size_t kFusionInStreamOpsOffset =
    256 + kFusionBarrierBytes + 4 * kMaxWorldSize * sizeof(FusionOpDesc);
static_assert(offsetof(FusionControl, instream_ops) == kFusionInStreamOpsOffset);
static_assert(kFusionInStreamOpsOffset % 64 == 0);
constexpr size_t kFusionInStreamOpsBytes = sizeof(instream::InStreamOpTable);
static_assert(sizeof(FusionControl) == kFusionInStreamOpsOffset + kFusionInStreamOpsBytes);
// The op contract sizes the control section without CUDA (kernels/contract/op_contract.h).
static_assert(kFusionInStreamOpsBytes == kInStreamOpTableBytes);
static_assert(sizeof(FusionControl) == kFusionControlBytes);

}  // namespace arfuse
