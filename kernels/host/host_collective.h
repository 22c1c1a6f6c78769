// The host-mode collective: the cross-rank protocol of the host workspace (host_workspace.h) and
// the CPU implementation of the op (reference_op.h), as one rank runs it. Two callers share it:
// the host engine (server/host, --device=host), which owns the workspace, and libarfuse_client's
// host mode (client/instream), which maps the engine's workspace through an attach and runs ops
// of the same rank in the caller's process. They take turns on a rank, never run one rank's ops
// concurrently.
//
// Per op, on rank r:
//   0. claim: s = launch_seq(r) + 1, compare-exchanged into launch_seq (a number is never claimed
//      twice, whoever launches). A launch_seq ahead of done_seq means the op before was claimed
//      and never finished while nobody runs one: its launcher ended mid-op (a client that died).
//      That op is abandoned: the workspace is poisoned (kAbandoned) and this op fails, so nothing
//      ever pairs with what the dead launcher published. Buffer b = s & 1;
//   1. wait until every rank finished reading call s - 2 (its done_seq), which used buffer b;
//   2. copy the input into r's slot of buffer b with the op's description, then publish
//      written_seq[b] = s (release);
//   3. wait until every rank published s (acquire);
//   4. confirm: ack_seq = s (release), then wait until every rank confirmed s. No rank reads a slot
//      of call s before every rank saw every input of s, so a slot whose launcher died before it
//      confirmed is never read, whichever rank arrives first;
//   5. check every rank runs the same op: pattern, dtype, tokens, hidden, eps, the per-group
//      FP8 pattern's scale layout and the launchers' program key (else INVALID_ARGUMENT "ranks
//      disagree on the op" on every rank, not poisoned). Each rank's tensors are its own: the
//      static FP8 scale is read from the rank's scale pointer, and norm_out may be given on one
//      rank and not another;
//   6. run the op over the slots in rank order, then publish done_seq = s (release; also after a
//      failure from step 1 on: the rank is finished with s either way).
// A wait that passes its deadline, or sees the local abort flag or a peer's abort word, gives up:
// it records the op and its error in the header, raises the abort word (the workspace is then
// poisoned for every rank until the engines re-initialize) and returns DEADLINE_EXCEEDED or
// ABORTED. A workspace the engines retired, or of another generation than the caller's, fails
// with FAILED_PRECONDITION ("stale generation") before anything is touched.
//
// Statuses are plain::Status (kernels/common/plain_status.h; plain_status_absl.h converts), so
// that libarfuse_client links no abseil.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "kernels/common/op_types.h"
#include "kernels/common/plain_status.h"
#include "kernels/host/host_workspace.h"

namespace arfuse::host {

// RAII owner of one shared mapping of a host workspace object. munmap never blocks. Move-only.
class HostWsMapping {
 public:
  // Maps `fd` (not taken: the caller closes its descriptor; the mapping keeps the object alive)
  // read-write and shared. FAILED_PRECONDITION when the object does not have exactly `bytes`
  // bytes, RESOURCE_EXHAUSTED when it cannot be mapped.
  static plain::StatusOr<HostWsMapping> Map(int fd, size_t bytes);

  HostWsMapping() = default;
  HostWsMapping(HostWsMapping&& other) noexcept;
  HostWsMapping& operator=(HostWsMapping&& other) noexcept;
  HostWsMapping(const HostWsMapping&) = delete;
  HostWsMapping& operator=(const HostWsMapping&) = delete;
  ~HostWsMapping();

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool valid() const { return data_ != nullptr; }

 private:
  HostWsMapping(uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Bytes of one rank's slot in one buffer for ops up to max_tokens x max_hidden of dtype.
inline constexpr size_t HostWsSlotBytes(uint32_t max_tokens, uint32_t max_hidden, DType dtype) {
  return AlignUp(static_cast<size_t>(max_tokens) * max_hidden * DTypeSize(dtype), kHostWsSlotAlign);
}

// Writes a fresh header and every rank's sync block at `base` (HostWsTotalBytes(world_size,
// slot_bytes) mapped bytes): what rank 0's engine does for each generation.
void InitHostWorkspace(uint8_t* base, int world_size, uint64_t generation, size_t slot_bytes);

// Whether a mapped object is the workspace a rank expects: FAILED_PRECONDITION naming the first
// field that differs (magic, layout_version, world_size, slot_bytes, total_bytes), or, for a
// generation that differs or a retired header, one starting "stale generation".
plain::Status CheckHostWorkspace(const uint8_t* base, int world_size, size_t slot_bytes,
                                 uint64_t generation);

// Marks the workspace dropped by its engines (re-initialization, shutdown): clients' ops on it
// fail with a stale generation from now on. Never blocks.
void RetireHostWorkspace(uint8_t* base);

// Makes every wait on the workspace give up with ABORTED, on every rank (its error becomes
// kHostAbort unless an earlier failure set one): the workspace is poisoned. Never blocks.
void AbortHostWorkspace(uint8_t* base, int rank);

// One op as the collective runs it: this rank's tensors (host memory of the calling process).
using HostOpArgs = FusedOpArgs;

struct HostWaitLimits {
  // On the monotonic clock: a wall-clock step neither ends a wait early nor stretches it.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  // Whether `deadline` is the caller's (the op's own deadline) rather than the spin timeout: it
  // only changes the message.
  bool deadline_is_callers = false;
  // Optional: a flag of the calling process that makes every wait give up (Engine::Abort).
  const std::atomic<bool>* local_abort = nullptr;
};

struct HostOpResult {
  plain::Status status;
  // This op gave up or found that a rank gave up: the workspace is now poisoned for every rank.
  bool poisoned = false;
  // kErrorStaleGeneration (kernels/instream/attach_abi.h) for a stale workspace, else the
  // HostWsError of a poisoning; 0 otherwise.
  uint32_t error = 0;
};

// Copies `bytes` from `from` to `to` where the source or destination may fault, as an error
// naming `what` instead of a signal (server/host/guarded_copy.h's GuardedCopy).
using HostCopy = plain::Status (*)(void* to, const void* from, size_t bytes, const char* what);

// One rank's view of a mapped workspace (not owned).
class HostCollective {
 public:
  HostCollective(uint8_t* base, int rank, int world_size, size_t slot_bytes)
      : base_(base), rank_(rank), world_size_(world_size), slot_bytes_(slot_bytes) {}

  // Runs `op` on this rank (the protocol above). The op must fit a slot (the caller validated
  // it); `generation` is the caller's. Counts the op in client_ops when `client` is set.
  // `copy_input` (optional) copies the input into the slot where it may fault (another
  // process's memory): its error fails the op on this rank, and every other rank drops it too.
  // `launcher`: who runs the op (the client's attach id; 0 for the rank's host engine), recorded
  // with the claim for RetireAbandoned. `program_key`: the launcher's program key (0: none),
  // published with the op; ranks with different keys refuse the op alike.
  HostOpResult Run(const HostOpArgs& op, uint64_t generation, const HostWaitLimits& limits,
                   bool client = false, HostCopy copy_input = nullptr, uint64_t launcher = 0,
                   uint32_t program_key = 0);

  // The attachment `launcher` of this rank ended (its client exited or died). When the last op
  // this rank claimed is its and did not finish, that op is abandoned: poisons the workspace
  // (kAbandoned, ABORTED on every rank waiting for it) and returns true. Never blocks. Only for
  // a launcher that can run no more ops (its process or session is gone).
  bool RetireAbandoned(uint64_t launcher);

  HostWsHeader* header() const { return reinterpret_cast<HostWsHeader*>(base_); }
  HostRankSync* sync(int rank) const {
    return reinterpret_cast<HostRankSync*>(base_ + sizeof(HostWsHeader)) + rank;
  }
  uint8_t* slot(int buffer, int rank) const {
    return base_ + HostWsDataOffset(world_size_) +
           (static_cast<size_t>(buffer) * world_size_ + rank) * slot_bytes_;
  }

 private:
  template <typename Ready>
  HostOpResult WaitAll(Ready ready, const HostWaitLimits& limits, uint64_t seq, const char* what);
  HostOpResult Fail(plain::Status s, uint64_t seq, HostWsError error);
  // Steps 1-6 of an op whose number `s` this rank claimed.
  HostOpResult RunClaimed(const HostOpArgs& op, uint64_t s, const HostWaitLimits& limits,
                          HostCopy copy_input, uint32_t program_key);
  // Poisons the workspace for op `seq` of this rank, claimed by a launcher that ended before it
  // finished. An op every rank confirmed may have completed on the others: from seq + 1 then.
  HostOpResult Abandon(uint64_t seq, std::string_view why);
  // The op's failure when a rank gave up on it or an earlier one (DropsOpAfterAbort).
  std::optional<HostOpResult> DropIfGivenUp(uint64_t seq);

  uint8_t* base_;
  int rank_;
  int world_size_;
  size_t slot_bytes_;
};

}  // namespace arfuse::host
