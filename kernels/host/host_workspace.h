// Layout of the host-mode workspace: one POSIX shared-memory object per group and generation,
// created by rank 0's host engine and mapped by every rank of the node, and by the clients that
// attached to it (libarfuse_client's host mode). Shared between processes (and between builds:
// the sidecar and a framework's copy of the client library), so every field's size and offset is
// pinned here. kernels/host/host_collective.h runs the protocol on it.
//
//   [HostWsHeader][HostRankSync x world_size] ... page ... [slot(buf 0, rank 0)] ... [slot(buf 1,
//   rank world_size-1)]
//
// Two buffers alternate by call parity (seq & 1). A rank writes call s into buffer s & 1 only
// after every rank finished reading call s - 2 from it (done_seq), so a fast rank never
// overwrites a slot a slow rank still reads.
//
// Sequence numbers: every op of a rank, whoever launches it (the rank's host engine or a client
// attached to it), claims the next number from the rank's launch_seq in shared memory, so a
// number is never used twice on a rank, not even after its launcher died mid-op. No rank reads
// any slot of call s until every rank confirmed (ack_seq) that it saw every rank's input of call
// s: a slot published by a launcher that died before confirming is never consumed, whichever
// rank arrives first.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/contract/device_errors.h"

namespace arfuse::host {

inline constexpr uint64_t kHostWsMagic = 0x5753484653465241ull;  // "ARFSHFSW"
// 2: abort_seq. 3: retired, error; an op's sequence number comes from done_seq.
// 4: HostSlotDesc::flags. 5: HostRankSync::launch_seq, ack_seq, launcher (two cache lines).
// 6: HostSlotDesc::scale_layout (the FP8 patterns), flags one byte. 7: HostRankSync::program_key.
inline constexpr uint32_t kHostWsLayoutVersion = 7;
inline constexpr int kHostWsBuffers = 2;
inline constexpr size_t kHostWsSlotAlign = 64;
inline constexpr size_t kHostWsDataAlign = 4096;

// HostSlotDesc::flags: the rank could not read its client's input (the memory faulted), so its
// slot holds no input and every rank drops the op.
inline constexpr uint8_t kHostSlotInputFaulted = 1;

// What a rank ran, so ranks can check they run the same op (a mismatch is refused on every
// rank instead of summing unlike tensors).
struct HostSlotDesc {
  uint32_t hidden;
  uint32_t num_tokens;
  uint32_t eps_bits;
  uint8_t pattern;
  uint8_t dtype;
  uint8_t flags;
  // The per-group FP8 pattern's scale layout (0 for every other pattern): ranks writing their
  // scales in different layouts run different ops.
  uint8_t scale_layout;
};
static_assert(sizeof(HostSlotDesc) == 16);
static_assert(std::is_trivially_copyable_v<HostSlotDesc>);

struct alignas(64) HostWsHeader {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t world_size;
  uint64_t generation;
  uint64_t slot_bytes;  // per rank per buffer, a multiple of kHostWsSlotAlign
  uint64_t total_bytes;
  // 0 while healthy; rank + 1 of the first rank that gave up (timeout or abort): every other
  // rank's spin sees it and leaves at once instead of waiting out its own deadline.
  std::atomic<uint32_t> abort_word;
  // Nonzero once a host engine dropped this workspace generation (re-initialization, shutdown):
  // an attached client's op then fails with a stale generation before touching anything, and a
  // client spinning on it stops. Never cleared (the next generation is a new object).
  std::atomic<uint32_t> retired;
  // The lowest op sequence any rank gave up on, stored before abort_word is raised (so a rank that
  // acquires abort_word sees it). Ops before it had every rank's input when the failure came and
  // still run on the ranks that reach them; ops from it on are dropped alike on every rank.
  std::atomic<uint64_t> abort_seq;
  // The first failure's code (HostWsError), stored before abort_word is raised: what the
  // sidecar reports for the workspace (InStreamStatus), whoever failed (engine or client).
  std::atomic<uint32_t> error;
  uint32_t reserved;
};
static_assert(sizeof(HostWsHeader) == 64);
static_assert(offsetof(HostWsHeader, abort_word) == 40);
static_assert(offsetof(HostWsHeader, retired) == 44);
static_assert(offsetof(HostWsHeader, abort_seq) == 48);
static_assert(offsetof(HostWsHeader, error) == 56);

// Codes of HostWsHeader::error: the host collective's part of the one device error table
// (kernels/contract/device_errors.h), so the sidecar and the client report a host failure as
// they report a kernel's.
enum class HostWsError : uint32_t {
  kNone = static_cast<uint32_t>(DeviceError::kNone),
  kTimeout = static_cast<uint32_t>(DeviceError::kTimeout),  // a rank missed the spin deadline
  // This process aborted the wait (Engine::Abort, InStreamHost::AbortInStream).
  kHostAbort = static_cast<uint32_t>(DeviceError::kHostAbort),
  kPeerAbort = static_cast<uint32_t>(DeviceError::kPeerAbort),  // another rank gave up first
  // (reported, never stored) the workspace was poisoned for a reason not recorded
  kPoisoned = static_cast<uint32_t>(DeviceError::kPoisoned),
  // (DeviceError::kOpMismatch is the GPU kernels'; host mode refuses such an op with
  // INVALID_ARGUMENT, unstored.)
  // An op's launcher ended (its process died, or its session closed) after it claimed the op and
  // before the op completed: its sequence number and published slot are retired by poisoning.
  kAbandoned = static_cast<uint32_t>(DeviceError::kAbandoned),
};

// The short name of a HostWsError code (DeviceErrorName), "poisoned" for a code host mode never
// stores.
inline const char* HostWsErrorName(uint32_t code) {
  switch (static_cast<HostWsError>(code)) {
    case HostWsError::kNone:
    case HostWsError::kTimeout:
    case HostWsError::kHostAbort:
    case HostWsError::kPeerAbort:
    case HostWsError::kAbandoned:
      return DeviceErrorName(code);
    default:
      return DeviceErrorName(static_cast<uint32_t>(DeviceError::kPoisoned));
  }
}

// Whether a rank that found every rank's input for op `seq` must drop it because a rank gave up:
// only when the failure was at this op or an earlier one. (A rank that gave up on a later op
// completed this one with everyone's input; dropping it here would make the ranks disagree on its
// outcome.)
inline bool DropsOpAfterAbort(uint32_t abort_word, uint64_t abort_seq, uint64_t seq) {
  return abort_word != 0 && (abort_seq == 0 || seq >= abort_seq);
}

// Two cache lines per rank so ranks' flags never share a line.
struct alignas(64) HostRankSync {
  // The call (seq) whose input this rank's slot in buffer b holds; release-stored after the
  // input and desc are written, acquire-loaded by readers.
  std::atomic<uint64_t> written_seq[kHostWsBuffers];
  // The last call this rank is finished with (read, or gave up on); release-stored at the end of
  // every op that claimed a number, acquire-loaded by a writer before it reuses a buffer. Equal to
  // launch_seq between ops: a launch_seq ahead of it with nobody running an op is an op whose
  // launcher ended mid-op (abandoned).
  std::atomic<uint64_t> done_seq;
  // Ops of this rank run by attached clients (libarfuse_client), for the sidecar's metrics.
  std::atomic<uint64_t> client_ops;
  HostSlotDesc desc[kHostWsBuffers];
  // The last sequence number an op of this rank claimed (compare-exchanged from done_seq by the
  // launcher before it touches anything else): the rank's next op is launch_seq + 1, whoever
  // runs it, and a number is never claimed twice.
  std::atomic<uint64_t> launch_seq;
  // The last call for which this rank saw every rank's input (release-stored after that wait);
  // every rank waits for every rank's ack_seq before it reads a slot of the call.
  std::atomic<uint64_t> ack_seq;
  // Who claimed launch_seq: the attach id of the client (libarfuse_client), 0 for the rank's host
  // engine. Stored before the claim, so a sidecar that acquires launch_seq sees the launcher of
  // that op; the sidecar retires the op when the attachment that launched it ends mid-op.
  std::atomic<uint64_t> launcher;
  // The program key of the launcher of the op in buffer b (a client's arfuse_set_program_key, 0
  // for the host engine and for clients that set none), written with desc[b]: ranks whose
  // launchers belong to different programs refuse the op as they refuse unlike ops.
  uint32_t program_key[kHostWsBuffers];
  uint64_t reserved[4];
};
static_assert(sizeof(HostRankSync) == 128);
static_assert(offsetof(HostRankSync, done_seq) == 16);
static_assert(offsetof(HostRankSync, desc) == 32);
static_assert(offsetof(HostRankSync, launch_seq) == 64);
static_assert(offsetof(HostRankSync, ack_seq) == 72);
static_assert(offsetof(HostRankSync, launcher) == 80);
static_assert(offsetof(HostRankSync, program_key) == 88);
// Cross-process atomics must be lock-free (a lock would live in one process only).
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<uint64_t>) == 8 && sizeof(std::atomic<uint32_t>) == 4);

inline constexpr size_t AlignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

inline constexpr size_t HostWsDataOffset(int world_size) {
  return AlignUp(sizeof(HostWsHeader) + sizeof(HostRankSync) * static_cast<size_t>(world_size),
                 kHostWsDataAlign);
}

inline constexpr size_t HostWsTotalBytes(int world_size, size_t slot_bytes) {
  return HostWsDataOffset(world_size) +
         slot_bytes * static_cast<size_t>(world_size) * kHostWsBuffers;
}

}  // namespace arfuse::host
