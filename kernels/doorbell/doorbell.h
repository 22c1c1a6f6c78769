// The doorbell data plane's device words and kernels (docs/doorbell.md).
// Host-includable: no device code here, only layouts shared between processes and the launch
// contract.
//
// One DoorbellSlot per doorbell plan, in sidecar-owned device memory that the client maps by
// legacy CUDA IPC. Per op:
//
//   client (ring kernel, captured in its graph)      sidecar (kernels queued ahead on its stream)
//   ───────────────────────────────────────────      ─────────────────────────────────────────────
//   num_tokens = n                                     waiter: poll request == kDoorbellRequest
//   st.release.sys request = kDoorbellRequest   ───►           CAS request -> kDoorbellReset
//   poll ld.acquire.sys complete == kDoorbellComplete          (acquire), copy the plan's params
//                                                      fused kernel (indirect): run the op
//                                               ◄───   completion: st.release.sys complete =
//   complete = kDoorbellReset (re-arm)                             kDoorbellComplete
//
// Every handshake value is a constant, so a captured graph replays forever. Each side resets
// the word the OTHER side set (the sidecar the request word, the client the completion word), and
// does so before the other side can set it again: the next request is stored only after the
// client saw this op's completion, the next completion only after the sidecar saw the next
// request.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/allreduce_fusion/allreduce_fusion.h"

namespace arfuse {

// Fixed handshake values (they travel to the client in CreatePlan's Doorbell message). Reset is
// zero so that a freshly cudaMemset slot is armed.
inline constexpr uint32_t kDoorbellReset = 0u;
inline constexpr uint32_t kDoorbellRequest = 0x52494e47u;   // "RING"
inline constexpr uint32_t kDoorbellComplete = 0x444f4e45u;  // "DONE"
// A request rung from the GPU that holds the slot (the ring library checks the slot's
// owner_uuid against the device of the ring's stream). Both sides then order the op's memory at
// GPU scope instead of system scope: the ring's release and the sidecar's completion each skip
// a system-scope fence (about 1.2 us per op measured on one H200, docs/doorbell.md). A ring from
// any other GPU stores kDoorbellRequest and everything stays at system scope.
inline constexpr uint32_t kDoorbellRequestLocal = 0x524e474cu;  // "RNGL"

// Which scope a ring orders the op's memory at (LaunchDoorbellRing).
enum class DoorbellScope : uint32_t {
  kSystem = 0,  // the ring may run on another GPU than the slot's, or the host may be involved
  kDevice = 1,  // the ring runs on the GPU whose memory holds the slot (kDoorbellRequestLocal)
};

// Most plans (slots) one doorbell block serves: the waiter polls them with one warp.
inline constexpr uint32_t kMaxDoorbellSlots = 32;
// One cache line per hot word: the two sides poll different lines, so a poll by one never
// fetches the line the other is storing to.
inline constexpr size_t kDoorbellLineBytes = 128;

// Codes of a slot's sticky error word (0 = healthy). Values below 0x100 are the doorbell's own;
// kDoorbellFusionFailed | FusionError is an op the sidecar ran that failed in the fused kernel.
enum class DoorbellError : uint32_t {
  kNone = 0,
  // The client's ring timed out before the sidecar took the request; the request was withdrawn
  // and the op did NOT run.
  kRingTimeout = 1,
  // The client's ring timed out after the sidecar took the request: the op may still run and
  // complete later. The slot must be reset by the sidecar before it is used again.
  kRingTimeoutInFlight = 2,
  // The sidecar's doorbell plane stopped (shutdown or the plan was removed).
  kStopped = 3,
  // The ring asked for more tokens than the plan's maximum; the op did not run.
  kBadTokenCount = 4,
  // Ring found a completion word that was already set: a late completion of an op whose ring
  // timed out. The op did not run.
  kDesynchronized = 5,
  // The fused kernel failed (low byte: the FusionError, a code of the one device error table,
  // kernels/contract/device_errors.h); outputs are not valid and the sidecar's workspace is
  // poisoned until every rank re-initializes.
  kFusionFailed = kDoorbellFusionFailed,
};
static_assert(static_cast<uint32_t>(DoorbellError::kFusionFailed) == 0x100,
              "slot codes cross the sidecar and the client's ring");
// A static description of a slot error code (never NULL); a kFusionFailed code's from the device
// error table's doorbell_text.
const char* DoorbellErrorName(uint32_t code);

// One plan's doorbell words. Shared between the client process (over IPC) and the sidecar's
// kernels, so the layout is fixed.
struct alignas(kDoorbellLineBytes) DoorbellSlot {
  // Line 0: written by the client, polled by the sidecar's waiter. num_tokens shares the line
  // with request on purpose: it is stored before the release of request and read after the
  // acquire, so one line transfer carries both.
  uint32_t request;
  uint32_t num_tokens;
  uint32_t reserved0[30];
  // Line 1: written (kDoorbellComplete) by the sidecar, polled and re-armed by the client.
  uint32_t complete;
  uint32_t reserved1[31];
  // Line 2: cold. `error` is sticky (first DoorbellError wins, by CAS from either side); while it
  // is set the ring kernel does not ring. Only the sidecar clears it (DoorbellPlane::ResetSlots).
  // `served` counts the ops the sidecar completed on this slot (wraps).
  uint32_t error;
  uint32_t served;
  // The UUID of the GPU whose memory holds the block (cudaDeviceProp::uuid), written by the
  // sidecar when it creates the block and never changed: the client library compares it with
  // the device of the ring's stream to pick DoorbellScope::kDevice.
  uint8_t owner_uuid[16];
  uint32_t reserved2[26];
};
static_assert(sizeof(DoorbellSlot) == 3 * kDoorbellLineBytes, "DoorbellSlot is shared over IPC");
static_assert(alignof(DoorbellSlot) == kDoorbellLineBytes);
static_assert(offsetof(DoorbellSlot, request) == 0);
static_assert(offsetof(DoorbellSlot, num_tokens) == 4);
static_assert(offsetof(DoorbellSlot, complete) == kDoorbellLineBytes);
static_assert(offsetof(DoorbellSlot, error) == 2 * kDoorbellLineBytes);
static_assert(offsetof(DoorbellSlot, served) == 2 * kDoorbellLineBytes + 4);
static_assert(offsetof(DoorbellSlot, owner_uuid) == 2 * kDoorbellLineBytes + 8);
// Ring stamps (diagnostics, ARFUSE_RING_TRACE=1): two %globaltimer values on the request line.
inline constexpr size_t kDoorbellRingStampWord = 2;  // reserved0[2..5]: start, release (64-bit)

// The exported allocation: slot i of plan i. The client gets (IPC handle of the block, byte
// offset of its slot); the offset is i * sizeof(DoorbellSlot).
struct DoorbellBlock {
  DoorbellSlot slots[kMaxDoorbellSlots];
};
static_assert(sizeof(DoorbellBlock) == kMaxDoorbellSlots * 3 * kDoorbellLineBytes);
inline constexpr uint64_t DoorbellSlotOffset(uint32_t slot) {
  return static_cast<uint64_t>(slot) * sizeof(DoorbellSlot);
}

// ---------------------------------------------------------------------------------------------
// Client side.

// Enqueues the ring kernel (one block): unless the slot's error word is set, stores num_tokens,
// release-stores kDoorbellRequest, acquire-polls for kDoorbellComplete (bounded by timeout_ns of
// %globaltimer, and by the slot's error word, which the sidecar sets when it stops), then
// re-arms the completion word. On timeout it withdraws the request when the sidecar has not
// taken it yet, records kRingTimeout or kRingTimeoutInFlight in the error word and exits: it
// never hangs. Capturable in a CUDA graph (no host state). cudaErrorInvalidValue (nothing
// launched, no CUDA call made) for a null or misaligned slot or a zero timeout.
// `scope`: kDevice only when the stream's device is the GPU that holds the slot
// (DoorbellRingScopeFor); the ring then stores kDoorbellRequestLocal and releases at GPU scope.
// With ARFUSE_RING_TRACE=1 in the environment the ring also stores two %globaltimer stamps on
// the request line (when it started, when it released), which a traced serving launch records.
cudaError_t LaunchDoorbellRing(DoorbellSlot* slot, uint32_t num_tokens, uint64_t timeout_ns,
                               cudaStream_t stream, DoorbellScope scope = DoorbellScope::kSystem);
// The scope a ring launched now may use for a slot whose block belongs to `owner_uuid` (read from
// the slot once, outside capture): kDevice when the current device (a kernel launch goes to a
// stream of the current device, or fails) has that UUID. The UUIDs come from
// PrepareDoorbellRing; before it ran this answers kSystem. Makes no call a graph capture
// forbids. cudaErrorInvalidValue for a null uuid or scope.
cudaError_t DoorbellRingScopeFor(const uint8_t* owner_uuid, DoorbellScope* scope);
// The same for a slot in device memory: reads its owner UUID (a synchronous copy, so not while
// a stream captures) and answers as DoorbellRingScopeFor. For a caller that holds only the slot
// pointer (libarfuse_ring keeps the UUID from the block it opened and calls the one above).
// cudaErrorInvalidValue, with no CUDA call made, for a null slot or scope.
cudaError_t DoorbellRingScopeForSlot(const DoorbellSlot* slot, DoorbellScope* scope);
// Loads the ring kernel's module into the current context now (cudaFuncGetAttributes), so that
// the first ring is not what loads it (lazy module loading inside a graph capture), and reads the
// UUID of every device for DoorbellRingScopeFor. Call once per device outside capture, e.g. when
// opening the doorbell.
cudaError_t PrepareDoorbellRing();
// The same checks as LaunchDoorbellRing without launching; `why` (optional) gets a static message.
cudaError_t CheckDoorbellRingArgs(const DoorbellSlot* slot, uint64_t timeout_ns,
                                  const char** why = nullptr);

// ---------------------------------------------------------------------------------------------
// Sidecar side. The sidecar keeps triples queued on its stream:
//   LaunchDoorbellWait -> LaunchAllReduceFusionIndirect (one per plan shape) ->
//   LaunchDoorbellComplete
// The waiter writes a DoorbellOp that the two kernels behind it read.

// One entry of the device-side plan table (indexed like the slots).
struct DoorbellPlanEntry {
  // The op's params with every field set except num_tokens and algo (the waiter fills those).
  FusionParams params;
  // Largest token count a ring may ask for (<= what the workspace fits at params.hidden).
  uint32_t max_tokens;
  // Rings with num_tokens >= this run two-shot, others one-shot (0xffffffff: always one-shot).
  uint32_t twoshot_min_tokens;
};
static_assert(sizeof(DoorbellPlanEntry) == 336, "DoorbellPlanEntry is read by the waiter");
static_assert(offsetof(DoorbellPlanEntry, max_tokens) == sizeof(FusionParams));

// What one waiter decided.
enum class DoorbellOutcome : uint32_t {
  kPending = 0,   // not written yet
  kServed = 1,    // took a ring; params hold the op
  kIdle = 2,      // deadline passed with no ring: nothing consumed
  kKicked = 3,    // the host bumped the generation (plan set changed, pause): nothing consumed
  kStopped = 4,   // the host's stop word: nothing consumed
  kAborted = 5,   // the workspace abort word or the host abort word: nothing consumed
  kRejected = 6,  // took a ring with num_tokens above the plan's maximum: the op does not run
  // A serving launch (LaunchDoorbellServe) ran an op in place and it failed: the op was completed
  // with its error; nothing is left for the kernels behind.
  kFailedInPlace = 7,
};
const char* DoorbellOutcomeName(uint32_t outcome);

// Written by the waiter, read by the kernels queued behind it on the same stream (stream order
// makes the waiter's stores visible to them). params is first: its address is what
// LaunchAllReduceFusionIndirect reads; params.num_tokens == 0 unless an op is to run.
struct DoorbellOp {
  FusionParams params;
  uint32_t outcome;     // DoorbellOutcome
  uint32_t slot;        // the slot served (kServed, kRejected)
  uint32_t num_tokens;  // as rung
  uint32_t local;       // 1: rung with kDoorbellRequestLocal (complete at GPU scope)
};
static_assert(offsetof(DoorbellOp, params) == 0);
static_assert(sizeof(DoorbellOp) == 344);

// Host-written control words, read by the waiter (host-mapped pinned memory: the host writes them
// with plain stores, no CUDA call, so stopping works even while the stream is busy).
struct DoorbellControl {
  uint32_t stop;        // nonzero: every waiter exits kStopped
  uint32_t generation;  // a waiter launched with another generation exits kKicked
  uint32_t reserved[2];
};
static_assert(sizeof(DoorbellControl) == 16);

// Written for the host (host-mapped), one per queued triple: the first four words by the
// completion kernel, the last two by a serving launch (zero for a plain waiter).
struct DoorbellReport {
  uint32_t outcome;  // DoorbellOutcome
  uint32_t slot;
  uint32_t num_tokens;
  uint32_t error;            // the DoorbellError written to the slot (0: the op succeeded)
  uint32_t served_in_place;  // ops the serving launch ran and completed itself
  uint32_t error_in_place;   // the DoorbellError of the in-place op that failed (0: none)
  uint32_t reserved[2];
};
static_assert(sizeof(DoorbellReport) == 32);
static_assert(offsetof(DoorbellReport, served_in_place) == 16);

struct DoorbellWaitParams {
  DoorbellSlot* slots;              // the block (kMaxDoorbellSlots slots)
  const DoorbellPlanEntry* plans;   // device plan table, kMaxDoorbellSlots entries
  DoorbellOp* op;                   // written for the kernels behind
  const DoorbellControl* control;   // device address of the host-mapped control words
  const uint32_t* workspace_abort;  // optional: WorkspaceAbortWord of this rank
  const uint32_t* host_abort;       // optional: FusionParams::host_abort
  uint64_t idle_timeout_ns;         // from the waiter's start; 0 is refused
  uint32_t slot_mask;               // bit i: slot i may be served by this waiter
  uint32_t generation;              // see DoorbellControl::generation
};
static_assert(sizeof(DoorbellWaitParams) == 64);

struct DoorbellCompleteParams {
  DoorbellSlot* slots;
  const DoorbellOp* op;
  const uint32_t* workspace_error;  // optional: WorkspaceErrorWord of this rank
  DoorbellReport* report;           // optional: device address of a host-mapped report
};
static_assert(sizeof(DoorbellCompleteParams) == 32, "DoorbellCompleteParams is a kernel parameter");

// Loads every sidecar-side doorbell kernel (waiter, completion, slot error and reset, the serving
// launch for each dtype, pattern and row bucket) and every fused kernel the plane launches
// (PrepareAllReduceFusionKernels) into the current context now. The plane keeps a waiter or a
// serving launch resident, spinning until the next ring: a kernel first launched behind it (a
// completion, a new plan's fused launch) would otherwise be loaded at its launch, and with lazy
// module loading that load may wait for the resident kernel, which waits for a ring the client
// cannot get served: a hang (kernels/common/launch.cuh). Call before the plane launches anything;
// not inside a graph capture. Returns the first load error.
cudaError_t PrepareDoorbellSidecarKernels();

// One block of one warp: polls the request words of the slots in slot_mask (and, every few
// microseconds, the control words, the abort words and the idle deadline), then writes the op.
// Right after it takes a ring it executes griddepcontrol.launch_dependents, so a fused launch
// queued behind it as a programmatic dependent (LaunchAllReduceFusionIndirect's flag) is
// scheduled at once instead of after this kernel ended.
// programmatic_dependent: launch it as a programmatic dependent of the kernel before it (the
// previous op's completion); it waits for that kernel before anything else.
cudaError_t LaunchDoorbellWait(const DoorbellWaitParams& params, cudaStream_t stream,
                               bool programmatic_dependent = false);
// One thread: for a served or rejected op records the slot's error (workspace error, bad token
// count), counts the op, release-stores kDoorbellComplete; then fills the report. Does nothing to
// any slot for an idle, kicked, stopped or aborted waiter. programmatic_dependent as above: it
// then waits (griddepcontrol.wait) for the fused kernel before it reads anything.
cudaError_t LaunchDoorbellComplete(const DoorbellCompleteParams& params, cudaStream_t stream,
                                   bool programmatic_dependent = false);
// Sets `code` into the error word of every slot in slot_mask whose error is still clear (CAS), so
// rings in progress stop polling and later rings do not ring. Used when the plane stops.
cudaError_t LaunchDoorbellSetError(DoorbellSlot* slots, uint32_t slot_mask, uint32_t code,
                                   cudaStream_t stream);
// Re-arms the slots in slot_mask: request, complete and error to their reset values. Only valid
// while no kernel of either side uses them (DoorbellPlane::ResetSlots pauses first).
cudaError_t LaunchDoorbellResetSlots(DoorbellSlot* slots, uint32_t slot_mask, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// The serving launch: a waiter that runs one-shot ops itself. One grid of `blocks` blocks stays
// resident between rings; block 0's first warp polls like LaunchDoorbellWait. A ring for a slot in
// inplace_mask whose token count is below the plan's two-shot threshold (and within its maximum)
// is run in place by every block (the one-shot body of kernels/allreduce_fusion, rows spread over
// the grid) and completed by the last of its blocks to finish (slot error, served count, release
// of kDoorbellComplete) without leaving the kernel: no launch and no kernel boundary per op. Any
// other ring (two-shot, another shape, a token count above the maximum) is written to the op record
// exactly as the waiter does, and the launch ends so the fused launches and the completion kernel
// behind it run it. The launch also ends on the waiter's conditions (idle deadline, now measured
// from the last op; generation; stop; abort words) and after an in-place op that failed
// (kFailedInPlace).
//
// Cross-rank: an in-place op is the same one-shot op as the indirect launch would run (same
// block size, so the same bits per row; the one-shot is independent of the grid size across
// ranks), so ranks may serve a given op in place or not independently.

// Per-launch words (device memory, 128 bytes, zeroed once by the host): every word is zero
// between launches (the last block to leave a launch zeroes them; the next launch on the stream
// starts after it ended).
struct DoorbellServeState {
  // The announced op in one word (block 0's thread 0 stores it, the other blocks' thread 0 polls
  // it): the op's number in the launch, its slot, token count, whether the ring was local, or
  // the end of the launch. One 64-bit store carries all of it, so the release that makes op k's
  // results visible to op k + 1's blocks is a fence issued right after op k (off the client's
  // path) instead of a release store after the ring is taken (kernels/doorbell/doorbell_sidecar.cu,
  // "Ticket").
  uint64_t ticket;
  // Blocks of the current multi-block op that counted in: each adds 1 (acq_rel) plus 1 << 24
  // when it failed; block 0 sets 1 << 16 when it gives up on a block that never came. The block
  // whose add makes the count reach the op's active blocks completes the op; block 0 zeroes the
  // word after it saw the op completed.
  uint32_t finished;
  uint32_t done;   // the number of the last op completed (release by the block that completed it)
  uint32_t error;  // the slot error that op was completed with (0: it succeeded)
  uint32_t left;   // blocks that left (the last one zeroes the words)
  uint64_t completed_ns;  // with a trace: %globaltimer at that op's completion
  uint32_t reserved[24];
};
static_assert(offsetof(DoorbellServeState, ticket) % 8 == 0, "the ticket is one 64-bit access");
static_assert(offsetof(DoorbellServeState, completed_ns) % 8 == 0, "one 64-bit store");
static_assert(sizeof(DoorbellServeState) == kDoorbellLineBytes);

// One in-place op of a serving launch as block 0's thread 0 saw it (a diagnostic trace, off unless
// DoorbellServeParams::trace is set): SM cycles (clock64 of that one SM, so the stamps of one
// record and of consecutive records compare) at each step, plus the global timer at the first and
// last step to convert cycles to time. Written after the op's completion (posted stores).
struct DoorbellTraceRecord {
  uint64_t taken;      // the poll returned the ring, its request taken by CAS
  uint64_t announced;  // block 0 passed the barrier after the poll (ticket published before)
  uint64_t rows_done;  // block 0's rows done (its barrier after the one-shot body)
  // One active block: block 0 is done (== rows_done), then after its completion's release
  // store. More: both when block 0 saw the op completed by the last block to finish.
  uint64_t all_done;
  uint64_t completed;
  uint64_t taken_ns;      // %globaltimer at `taken`
  uint64_t completed_ns;  // %globaltimer at the completion (by whichever block completed it)
  uint32_t tokens;
  uint32_t op;  // the launch's op count (1, 2, ...); 0: the record was never written
  // The ring's own %globaltimer stamps (ARFUSE_RING_TRACE=1 in the client; 0 otherwise): when
  // the ring kernel got past griddepcontrol.wait, and just before its release of the request.
  uint64_t ring_start_ns;
  uint64_t ring_release_ns;
};
static_assert(sizeof(DoorbellTraceRecord) == 80, "DoorbellTraceRecord is copied to the host");

// The most blocks a serving launch runs: its per-op count keeps the failed blocks in 8 bits.
inline constexpr uint32_t kMaxDoorbellServeBlocks = 128;

struct DoorbellServeParams {
  DoorbellWaitParams wait;
  // The shape served in place: dtype, pattern, hidden, rank, world size, sm_budget and layout as
  // in every plan of inplace_mask (pointers and num_tokens are not used).
  FusionParams inplace_template;
  DoorbellServeState* state;
  DoorbellReport* report;  // optional: device address of the triple's host-mapped report
  uint32_t inplace_mask;   // slots (subset of wait.slot_mask) whose plans match the template
  uint32_t max_blocks;     // the grid: at most this many blocks (capped by residency and
                           // kMaxDoorbellServeBlocks), >= 1
  // Optional trace: op k of a launch goes to trace[(k - 1) % trace_ops]; null: no trace.
  DoorbellTraceRecord* trace;
  uint32_t trace_ops;
  uint32_t reserved;
};
static_assert(sizeof(DoorbellServeParams) == 432, "DoorbellServeParams is a kernel parameter");

// Enqueues the serving launch. cudaErrorInvalidValue (nothing launched) when the wait params or
// the template are invalid, the masks are empty or inconsistent, the state is null or
// misaligned, or the template's shape has no kernel. programmatic_dependent as for the waiter.
cudaError_t LaunchDoorbellServe(const DoorbellServeParams& params, cudaStream_t stream,
                                bool programmatic_dependent = false);
cudaError_t CheckDoorbellServeParams(const DoorbellServeParams& params, const char** why = nullptr);

cudaError_t CheckDoorbellWaitParams(const DoorbellWaitParams& params, const char** why = nullptr);
cudaError_t CheckDoorbellCompleteParams(const DoorbellCompleteParams& params,
                                        const char** why = nullptr);

}  // namespace arfuse
