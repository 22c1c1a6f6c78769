// Device code of the fused allreduce (+ residual add + RMSNorm) kernels: the spin helpers and
// the one-shot and two-shot bodies. CUDA only; included by kernels/allreduce_fusion (the by-value
// and indirect kernels) and kernels/doorbell (the serving kernel that runs one-shot ops in place).
// docs/kernels.md has the protocol and the memory-ordering argument; the comments here say which
// step of it each piece is.
#pragma once

#include <cstdint>

#include "kernels/add_rmsnorm/row_math.cuh"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/allreduce_fusion/fusion_control.h"
#include "kernels/common/memory_model.cuh"

namespace arfuse {
namespace fusion_device {

using device::Raw16;
using namespace ::arfuse::device_sync;  // NOLINT(build/namespaces): the memory-model helpers

// Spins: a thread looks at the clock every kPollsPerCheck unsuccessful polls; a block reads its
// workspace's abort and error words at most every kWordCheckNs, and ONE thread of the rank (a
// CAS on FusionControl::host_check_ns) reads the host abort word (mapped host memory: a PCIe
// read) at most every kHostCheckNs. PCIe reads of one host word from every spinning thread (or
// block) queue behind each other: that stalled a 256-token one-shot for 2.4 ms per op and the
// two-shot at 1024-2048 tokens for 0.3-1 ms.
constexpr uint32_t kPollsPerCheck = 32;
constexpr uint64_t kWordCheckNs = 2'000;
constexpr uint64_t kHostCheckNs = 50'000;

// Launch-time knobs the kernels receive by value (see Tuning below for their defaults).
struct KernelConfig {
  uint32_t lookahead;    // one-shot: rows a block pushes ahead of the row it reduces (>= 1)
  uint32_t tight_polls;  // polls of one spin before it sleeps between polls
  uint32_t backoff_ns;   // that sleep (__nanosleep)
  // Two-shot: 1 = barriers between ranks per block (a system-scope release per block and
  // barrier, blocks run the phases at their own pace); 0 = one grid-wide barrier per rank.
  uint32_t twoshot_block_barriers;
  // One-shot op agreement (FusionControl's op descriptors), kOpCheck*: every thread checks its
  // peers' descriptors before its first store, or thread 0 does and a block barrier shares the
  // verdict, or (auto) the first for launches of up to kOpCheckThreadMaxUnits blocks and the
  // second otherwise: measured on 2x H200 the fastest at 1-4 tokens and at 16-256 tokens
  // respectively, the same at 8 (docs/kernels.md, "Op agreement").
  // kOpCheckOff skips the descriptors: for measurement only (ranks running different ops then
  // compute a wrong result instead of failing).
  uint32_t op_check;
};
constexpr uint32_t kOpCheckOff = 0;
constexpr uint32_t kOpCheckBlock = 1;
constexpr uint32_t kOpCheckThread = 2;
constexpr uint32_t kOpCheckAuto = 3;
constexpr uint32_t kOpCheckThreadMaxUnits = 4;
__host__ __device__ constexpr KernelConfig DefaultKernelConfig() {
  return KernelConfig{1, 24, 64, 1, kOpCheckAuto};
}

__device__ __forceinline__ FusionControl* ControlOf(void* workspace, const WorkspaceLayout& l) {
  return reinterpret_cast<FusionControl*>(static_cast<char*>(workspace) + l.control_offset);
}

// Records the first error of this workspace, mirrors it to the host word, and tells every peer
// to stop spinning (they would otherwise wait for their own deadline). A peer's own failure
// (kPeerAbort) is not forwarded again; a thread that lost the race to record is quiet unless
// `forward_always` (a launch on a poisoned workspace forwards every time).
__device__ inline void RecordError(const FusionParams& p, uint32_t code, bool forward_always) {
  FusionControl* ctrl = ControlOf(p.peer_workspace[p.rank], p.layout);
  const uint32_t previous = atomicCAS(&ctrl->error, 0u, code);
  if (previous == 0u && p.host_error != nullptr) StoreVolatile32(p.host_error, code);
  if (code == static_cast<uint32_t>(FusionError::kPeerAbort)) return;
  if (previous != 0u && !forward_always) return;
  for (int q = 0; q < p.world_size; ++q) {
    if (q == p.rank) continue;
    StoreVolatile32(&ControlOf(p.peer_workspace[q], p.layout)->abort,
                    static_cast<uint32_t>(FusionError::kPeerAbort));
  }
  __threadfence_system();
}

// An in-stream launch whose generation tag is not the workspace's (instream::
// kErrorStaleGeneration): the bodies return it without touching or recording anything.
constexpr uint32_t kStaleGenerationRefusal = 16;

// Why a launch must not start, from the workspace's error and abort words as thread 0 of every
// block read them at launch: the first error (kPoisoned: an earlier call failed here) or the
// abort word. A peer that failed a call wrote kPeerAbort into it, possibly after it had pushed
// its data for the call: a rank arriving late (stalled, or stopped and continued) would otherwise
// find that data complete, never spin (the only place the abort word was looked at) and return OK
// for an op its peer had already failed.
__device__ __forceinline__ uint32_t RefusalOf(uint32_t error, uint32_t abort) {
  if (error != 0) return static_cast<uint32_t>(FusionError::kPoisoned);
  if (abort == 0) return 0;
  return abort == static_cast<uint32_t>(FusionError::kPeerAbort)
             ? abort
             : static_cast<uint32_t>(FusionError::kHostAbort);
}

// The same, reading both words in one aligned access (no extra round trip).
__device__ __forceinline__ uint32_t LaunchRefusal(FusionControl* ctrl) {
  static_assert(offsetof(FusionControl, abort) == offsetof(FusionControl, error) + 4);
  uint32_t error = 0, abort = 0;
  LoadVolatile32x2(&ctrl->error, error, abort);
  return RefusalOf(error, abort);
}

// Records a refused launch (thread 0 of each block): a poisoned workspace forwards the abort to
// the peers every time (from one block); a peer's abort is recorded without forwarding; a host
// abort is recorded and forwarded once.
__device__ __forceinline__ void RecordRefusal(const FusionParams& p, uint32_t refusal,
                                              bool first_block) {
  if (refusal == static_cast<uint32_t>(FusionError::kPoisoned)) {
    if (first_block) RecordError(p, refusal, true);
  } else {
    RecordError(p, refusal, false);
  }
}

// Per-block spin bookkeeping, in shared memory: the first failure any thread of the block saw,
// and when the block next looks at the abort/error words.
struct BlockWatch {
  unsigned long long next_word_check_ns;
  uint32_t fail;
  uint32_t reserved;
};

__device__ __forceinline__ void InitWatch(BlockWatch& w) {
  w.next_word_check_ns = 0;
  w.fail = 0;
}

// Per-thread: polls so far (all spins of this kernel) and the first check's time (the deadline
// is measured from there: graph replays need no new params).
struct SpinClock {
  uint64_t start_ns = 0;
  uint32_t polls = 0;
};

// Called every kPollsPerCheck unsuccessful polls. Returns a FusionError code (0: keep spinning).
// kPoisoned means "leave quietly": another thread of this rank failed and recorded it.
__device__ __forceinline__ uint32_t SpinCheck(const FusionParams& p, FusionControl* ctrl,
                                              BlockWatch& w, SpinClock& clock) {
  if (*static_cast<volatile uint32_t*>(&w.fail) != 0) {
    return static_cast<uint32_t>(FusionError::kPoisoned);
  }
  const uint64_t now = GlobalTimerNs();
  if (clock.start_ns == 0) {
    clock.start_ns = now;
    return 0;
  }
  uint32_t code = 0;
  if (now - clock.start_ns > p.spin_timeout_ns) {
    code = static_cast<uint32_t>(FusionError::kTimeout);
  } else {
    const unsigned long long due =
        *static_cast<volatile unsigned long long*>(&w.next_word_check_ns);
    // One thread of the block claims each check.
    if (now >= due && atomicCAS(&w.next_word_check_ns, due, now + kWordCheckNs) == due) {
      const uint32_t abort = LoadVolatile32(&ctrl->abort);
      if (abort != 0) {
        code = abort == static_cast<uint32_t>(FusionError::kPeerAbort)
                   ? abort
                   : static_cast<uint32_t>(FusionError::kHostAbort);
      } else if (LoadVolatile32(&ctrl->error) != 0) {
        code = static_cast<uint32_t>(FusionError::kPoisoned);
      } else if (p.host_abort != nullptr) {
        unsigned long long* const next =
            reinterpret_cast<unsigned long long*>(&ctrl->host_check_ns);
        const unsigned long long host_due = *static_cast<volatile unsigned long long*>(next);
        if (now >= host_due && atomicCAS(next, host_due, now + kHostCheckNs) == host_due &&
            LoadVolatile32(p.host_abort) != 0) {
          code = static_cast<uint32_t>(FusionError::kHostAbort);
        }
      }
    }
  }
  if (code != 0) atomicCAS(&w.fail, 0u, code);
  return code;
}

// One failed poll: back off after the first `tight_polls` of this spin, check every
// kPollsPerCheck. Returns a failure code or 0.
__device__ __forceinline__ uint32_t SpinStep(const FusionParams& p, FusionControl* ctrl,
                                             BlockWatch& w, SpinClock& clock, uint32_t& spin_polls,
                                             const KernelConfig& cfg) {
  if (++spin_polls > cfg.tight_polls) __nanosleep(cfg.backoff_ns);
  if (++clock.polls % kPollsPerCheck != 0) return 0;
  return SpinCheck(p, ctrl, w, clock);
}

// The sum of squares of one row over the block, with exactly the tree of device::BlockSum
// (lanes butterfly, then every warp butterflies the per-warp partials, zeros beyond the last).
// `scratch` (32 floats) alternates between two buffers row by row, so no trailing barrier is
// needed: a buffer is written again two rows later, after a barrier every reader of it passed.
// All threads of the block call it.
__device__ __forceinline__ float RowSumOfSquares(float v, float* scratch) {
  v = device::WarpButterflySum(v);
  const uint32_t lane = threadIdx.x & 31u;
  if (lane == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  return device::WarpButterflySum(lane < (blockDim.x >> 5) ? scratch[lane] : 0.0f);
}

// ---------------------------------------------------------------------------------------------
// Op agreement (FusionControl's op descriptors): each rank writes what it runs into every peer's
// control block before its data; every rank compares its peers' descriptors with its own before
// it stores any output of the call.
__device__ __forceinline__ void MakeOpDesc(const FusionParams& p, uint32_t tag, uint64_t (&w)[4]) {
  const uint64_t t = static_cast<uint64_t>(tag) << 32;
  w[0] = t | p.num_tokens;
  w[1] = t | p.hidden;
  w[2] = t | __float_as_uint(p.eps);
  w[3] = t | (static_cast<uint32_t>(p.dtype) | static_cast<uint32_t>(p.pattern) << 8 |
              static_cast<uint32_t>(p.algo) << 16 | static_cast<uint32_t>(p.world_size) << 24);
}

__device__ __forceinline__ void StoreOpDesc(FusionOpDesc* dst, const uint64_t* w) {
  StoreVolatile64x2(&dst->words[0], w[0], w[1]);
  StoreVolatile64x2(&dst->words[2], w[2], w[3]);
}

enum OpDescState : uint32_t { kDescPending = 0, kDescSame = 1, kDescDiffers = 2 };

// kDescPending while any word still carries another call's tag (not written yet for this call).
__device__ __forceinline__ uint32_t ReadOpDesc(const FusionOpDesc* src, const uint64_t* want) {
  uint64_t got[4];
  LoadVolatile64x2(&src->words[0], got[0], got[1]);
  LoadVolatile64x2(&src->words[2], got[2], got[3]);
  bool tagged = true;
  bool same = true;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    tagged = tagged && (got[k] >> 32) == (want[k] >> 32);
    same = same && got[k] == want[k];
  }
  return !tagged ? kDescPending : same ? kDescSame : kDescDiffers;
}

// The one-shot's check, done by thread 0 of each block while it waits for its first row, so the
// descriptors' arrival overlaps the data's: `pending` has a bit per peer not seen yet (none for
// the other threads, whose Poll is then free), `differs` a bit per peer that runs another op.
struct PeerDescPoll {
  const FusionOpDesc* slots;  // this call's lamport_desc row, indexed by rank
  const uint64_t* want;       // this rank's descriptor (shared memory: no registers held)
  uint32_t pending;
  uint32_t differs;
  // True once every peer's descriptor of this call was seen.
  __device__ __forceinline__ bool Poll() {
    for (uint32_t m = pending; m != 0; m &= m - 1) {
      const int q = __ffs(static_cast<int>(m)) - 1;
      const uint32_t state = ReadOpDesc(&slots[q], want);
      if (state == kDescPending) continue;
      pending &= ~(1u << q);
      if (state == kDescDiffers) differs |= 1u << q;
    }
    return pending == 0;
  }
};

// The Lamport spin shared by both waits: loads every vector j < kCount with `polled(j)` through
// `load(j)`, then reloads the ones still holding the sentinel (raw bits) until none does and
// `descs` has seen every peer's descriptor (its loads issued after the data loads, so both are in
// flight at once). Only the vectors still pending are reloaded: a vector without the sentinel
// holds the peer's data of this call, which nothing changes before this rank reads it. Returns a
// failure code (SpinStep: abort, peer error, deadline) or 0.
template <DType DT, int kCount, typename Polled, typename Load>
__device__ __forceinline__ uint32_t SpinUntilNoSentinel(Raw16 (&x)[kCount], Polled polled,
                                                        Load load, const FusionParams& p,
                                                        FusionControl* ctrl, BlockWatch& w,
                                                        SpinClock& clock, const KernelConfig& cfg,
                                                        PeerDescPoll& descs) {
#pragma unroll
  for (int j = 0; j < kCount; ++j) {
    if (polled(j)) x[j] = load(j);
  }
  uint32_t spin_polls = 0;
  while (true) {
    const bool descs_seen = descs.Poll();
    bool pending = false;
#pragma unroll
    for (int j = 0; j < kCount; ++j) {
      if (polled(j) && device::HasSentinel<DT>(x[j])) pending = true;
    }
    if (!pending && descs_seen) return 0;
    if (const uint32_t code = SpinStep(p, ctrl, w, clock, spin_polls, cfg); code != 0) {
      return code;
    }
#pragma unroll
    for (int j = 0; j < kCount; ++j) {
      if (polled(j) && device::HasSentinel<DT>(x[j])) x[j] = load(j);
    }
  }
}

// Polls the vectors of this thread (row thread t0, k < kVec) at `src`, all of them together,
// until they hold the peer's data. Returns a failure code or 0; `descs` is polled alongside.
template <DType DT, int kVec>
__device__ __forceinline__ uint32_t WaitVectors(Raw16 (&x)[kVec], const char* src, uint32_t t0,
                                                uint32_t stride, uint32_t vecs_per_row,
                                                const FusionParams& p, FusionControl* ctrl,
                                                BlockWatch& w, SpinClock& clock,
                                                const KernelConfig& cfg, PeerDescPoll& descs) {
  auto polled = [&](int k) { return t0 + k * stride < vecs_per_row; };
  auto load = [&](int k) { return device::LoadRawVolatile(src + (t0 + k * stride) * 16ull); };
  return SpinUntilNoSentinel<DT>(x, polled, load, p, ctrl, w, clock, cfg, descs);
}

// World sizes above 2: the rank-order sum of this thread's vectors of one row, each vector's
// ranks polled kWaitSpan at a time (the own vector taking its rank's place) instead of one peer
// after the other: a span's loads are in flight together and its vectors are added as soon as
// none holds the sentinel, so a vector costs one memory round trip per span, where it cost one
// per peer plus a re-read of every peer's vector for the sum. Vectors go one after the other
// and spans are 2 ranks wide: the one-shot runs near the 128-register cap of its 512-thread
// blocks, and wider spans or both vectors at once made ptxas spill (the 2-vector kernels: none
// at this width). `sum[k]` receives x_0 + x_1 + ... + x_{n-1} in rank order, rounded
// (RoundSum). Returns a failure code or 0; `descs` is polled alongside, as in WaitVectors.
constexpr int kWaitSpan = 2;
template <DType DT, int kVec>
__device__ __forceinline__ uint32_t WaitAndSumRanks(Raw16 (&sum)[kVec], const Raw16 (&own)[kVec],
                                                    const char* row_inbox, uint32_t t0,
                                                    uint32_t stride, uint32_t vecs_per_row,
                                                    const FusionParams& p, FusionControl* ctrl,
                                                    BlockWatch& w, SpinClock& clock,
                                                    const KernelConfig& cfg, PeerDescPoll& descs) {
  const int n = p.world_size;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const uint32_t v = t0 + k * stride;
    if (v >= vecs_per_row) continue;
    float acc[device::VecTraits<DT>::kElems];
    for (int q0 = 0; q0 < n; q0 += kWaitSpan) {
      Raw16 x[kWaitSpan];
#pragma unroll
      for (int j = 0; j < kWaitSpan; ++j) {
        if (q0 + j == p.rank) x[j] = own[k];  // unrolled: x stays in registers
      }
      auto polled = [&](int j) { return q0 + j < n && q0 + j != p.rank; };
      auto load = [&](int j) {
        return device::LoadRawVolatile(
            row_inbox + static_cast<uint64_t>(q0 + j) * p.layout.lamport_slot_bytes + v * 16ull);
      };
      if (const uint32_t code =
              SpinUntilNoSentinel<DT>(x, polled, load, p, ctrl, w, clock, cfg, descs);
          code != 0) {
        return code;
      }
#pragma unroll
      for (int j = 0; j < kWaitSpan; ++j) {
        if (q0 + j < n) device::Accumulate<DT>(acc, x[j], q0 + j == 0);
      }
    }
    sum[k] = device::RoundSum<DT>(acc);
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// One-shot Lamport. Call k (k = this workspace's epoch) uses buffer k % 3 on every rank.
// Block b handles rows b, b + grid, ... on every rank (the row layout of row_math.cuh).
//   1. push: this rank's sanitized input rows go into slot `rank` of buffer k % 3 of every peer,
//      `lookahead` rows ahead of the row being reduced;
//   2. for each row: spin until no element of any peer's slot holds the sentinel (raw bits),
//      write the sentinel back right after reading (the buffer is clean for call k + 3: peers
//      write it again only in call k + 3, which needs this rank's call-k+2 data, stored only
//      after this kernel ended), sum in rank order (own input at position `rank`), then the
//      row's epilogue (the block reduces the sum of squares);
//   3. every CTA counts itself in before it publishes anything; the last one advances the epoch
//      (every CTA read it before counting itself; the next call is a later kernel).
// Op agreement: block 0 writes this rank's op descriptor (tag epoch + 1) into every peer's
// lamport_desc[k % 3][rank] before its first push; thread 0 of every block polls the peers'
// descriptors while it waits for its first row, and the block stores nothing of the call until
// they are all here and equal to its own (a block barrier once per call). A peer running another
// op fails the call with kOpMismatch on every rank that has rows; no output is written.
// Pushing row r never waits for anything but reads of rows before r, on any rank: no cycle.
// Loads that depend on nothing (the first row's input and residual, gamma) are issued before
// the control words are read, and each row's successor is loaded while the row is finished.
// (Splitting small rows over the CTAs of a cluster, as FlashInfer does, was measured: 0.3 us
// slower at hidden 4096 and no faster at 8192, so rows stay within one CTA.)
template <DType DT, bool kNorm, int kBucket>
// `unit` / `units`: this block's index and the number of blocks taking part (blockIdx.x and
// gridDim.x for a kernel that runs one op; the doorbell's serving kernel passes its own).
// Returns this thread's failure (a FusionError code; kPoisoned when the workspace already held
// an error), 0 when it completed its part: a caller that finds 0 in every thread of every block
// knows the op succeeded without reading the error word.
// `expected_generation` (in-stream launches; 0 = unchecked): the workspace's generation tag
// (FusionControl::generation) the launch was made for; another tag makes the launch return
// kStaleGenerationRefusal at once, touching nothing and recording nothing in the workspace.
__device__ __forceinline__ uint32_t OneShotBody(const FusionParams& p, const KernelConfig& cfg,
                                                const uint32_t unit, const uint32_t units,
                                                const uint32_t expected_generation = 0) {
  using Tr = device::VecTraits<DT>;
  constexpr int kVec = device::BucketVecs(kBucket);
  __shared__ float scratch[2][32];
  __shared__ BlockWatch watch;
  __shared__ uint32_t s_error, s_epoch, s_differs;
  __shared__ uint64_t s_desc[4];
  char* const local = static_cast<char*>(p.peer_workspace[p.rank]);
  FusionControl* const ctrl = ControlOf(local, p.layout);
  const uint32_t stride = blockDim.x;  // row threads of a row
  const uint32_t t0 = threadIdx.x;     // this thread's row thread
  const uint32_t vecs_per_row = p.hidden / Tr::kElems;
  const uint64_t row_bytes = static_cast<uint64_t>(vecs_per_row) * 16ull;
  const uint32_t tokens = p.num_tokens;
  const int n = p.world_size;
  const char* const input = static_cast<const char*>(p.input);
  const char* const residual_in = static_cast<const char*>(p.residual_in);

  // This thread's vectors of the row being reduced: input (sanitized), residual_in; gamma.
  Raw16 own[kVec];
  Raw16 res[kVec];
  Raw16 gamma[kVec];
  auto load_row = [&](uint32_t row) {
    device::LoadRowVectors<kVec>(own, input + row * row_bytes, t0, stride, vecs_per_row);
    if constexpr (kNorm) {
      device::LoadRowVectors<kVec>(res, residual_in + row * row_bytes, t0, stride, vecs_per_row);
    }
  };
  // Thread 0 first reads the error, abort and epoch words in ONE access, issued before the row
  // loads (the two loads after the row loads that this replaces cost 0.03-0.65 us per op at
  // 1-256 tokens on 2x H200, docs/kernels.md). A plain (relaxed) load of the epoch is enough: its
  // last writer is the previous call's last block, ordered before this read by the kernel boundary
  // (griddepcontrol.wait with programmatic launches) or, inside the doorbell's serving launch,
  // by the acquire that separates two ops there (a block's acquire of the ticket; block 0's of
  // `done` from the block that completed the previous op, or its own program order when it ran
  // that op alone).
  static_assert(offsetof(FusionControl, error) == 0 && offsetof(FusionControl, abort) == 4 &&
                offsetof(FusionControl, lamport_epoch) == 8);
  uint32_t control[4] = {0, 0, 0, 0};
  uint32_t generation = expected_generation;
  if (threadIdx.x == 0) {
    LoadVolatile32x4(&ctrl->error, control);
    // Issued right behind the control words: the two loads are in flight together.
    if (expected_generation != 0) generation = LoadVolatile32(&ctrl->generation);
  }
  // Then the loads that depend on nothing.
  if (unit < tokens) load_row(unit);
  if constexpr (kNorm) device::LoadRowVectors<kVec>(gamma, p.gamma, t0, stride, vecs_per_row);
  uint32_t arrived = 0;
  if (threadIdx.x == 0) {
    InitWatch(watch);
    s_error = generation != expected_generation ? kStaleGenerationRefusal
                                                : RefusalOf(control[0], control[1]);
    s_epoch = control[2];
    // Count this CTA in (step 3) before anything of the call reaches a peer, so that
    // lamport_arrived is nonzero whenever a call may have published something: the owning
    // sidecar reads it when an in-stream client's session ends. The epoch was read (s_error
    // depends on that load); the atomic's result is needed only at the end, so it costs no wait.
    if (s_error == 0) arrived = atomicAdd(&ctrl->lamport_arrived, 1u);
    uint64_t desc[4];
    MakeOpDesc(p, s_epoch + 1, desc);
#pragma unroll
    for (int k = 0; k < 4; ++k) s_desc[k] = desc[k];
  }
  __syncthreads();
  // A poisoned or aborted workspace: nothing is touched. A stale generation: not even recorded.
  if (s_error != 0) {
    if (threadIdx.x == 0 && s_error != kStaleGenerationRefusal) {
      RecordRefusal(p, s_error, unit == 0);
    }
    return s_error;
  }
  const uint32_t buffer = s_epoch % 3;
  const uint64_t buffer_offset = p.layout.lamport_offset + buffer * p.layout.lamport_buffer_bytes;
  PeerDescPoll descs;
  descs.slots = ctrl->lamport_desc[buffer];
  descs.want = s_desc;
  const uint32_t op_check = cfg.op_check == kOpCheckAuto
                                ? (units <= kOpCheckThreadMaxUnits ? kOpCheckThread : kOpCheckBlock)
                                : cfg.op_check;
  const bool checker =
      op_check == kOpCheckThread || (op_check == kOpCheckBlock && threadIdx.x == 0);
  descs.pending = checker && unit < tokens ? ((1u << n) - 1u) & ~(1u << p.rank) : 0u;
  descs.differs = 0;
  if (op_check != kOpCheckOff && threadIdx.x == 0 && unit == 0) {
    for (int q = 0; q < n; ++q) {
      if (q == p.rank) continue;
      StoreOpDesc(&ControlOf(p.peer_workspace[q], p.layout)->lamport_desc[buffer][p.rank],
                  descs.want);
    }
  }
  const uint64_t push_offset =
      buffer_offset + static_cast<uint64_t>(p.rank) * p.layout.lamport_slot_bytes;
  SpinClock clock;
  uint32_t failure = 0;

  auto push_vectors = [&](uint32_t row, const Raw16(&x)[kVec]) {
    for (int s = 1; s < n; ++s) {
      const int q = (p.rank + s) % n;  // start with the next rank: links loaded evenly
      char* const dst = static_cast<char*>(p.peer_workspace[q]) + push_offset + row * row_bytes;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const uint32_t v = t0 + k * stride;
        if (v < vecs_per_row) device::StoreRaw(dst + v * 16ull, x[k]);
      }
    }
  };
  auto push_row = [&](uint32_t row) {
    Raw16 x[kVec];
    device::LoadRowVectors<kVec>(x, input + row * row_bytes, t0, stride, vecs_per_row);
#pragma unroll
    for (int k = 0; k < kVec; ++k) x[k] = device::SanitizeNegativeZero<DT>(x[k]);
    push_vectors(row, x);
  };

  // 1. the first pushes (the first row's input is already here; the CTA counted itself in).
#pragma unroll
  for (int k = 0; k < kVec; ++k) own[k] = device::SanitizeNegativeZero<DT>(own[k]);
  uint32_t ahead = unit;
  if (ahead < tokens) {
    push_vectors(ahead, own);
    ahead += units;
    for (uint32_t j = 1; j < cfg.lookahead && ahead < tokens; ++j, ahead += units) push_row(ahead);
  }

  // 2. rows.
  const Raw16 sentinel = device::SentinelVector<DT>();
  uint32_t parity = 0;
  for (uint32_t row = unit; row < tokens; row += units) {
    Raw16 sum[kVec];  // the rounded sum, then the pre-norm sum
    const bool failed_before = failure != 0;
    const char* const row_inbox = local + buffer_offset + row * row_bytes;
    if (failure == 0) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) own[k] = device::SanitizeNegativeZero<DT>(own[k]);
      if (ahead < tokens) {
        push_row(ahead);
        ahead += units;
      }
      // Wait until every peer's vectors of this row are here and sum them (registers only:
      // nothing is stored before the op check below). Two ranks: the peer's vectors, polled
      // together, then x_0 + x_1, which both ranks compute as own + peer (IEEE addition
      // commutes: the same bits, and no per-rank selection on the common path, whose
      // instructions are a small op's critical path, docs/kernels.md). More ranks: summed in
      // rank order while polled (WaitAndSumRanks).
      if (n == 2) {
        Raw16 peer[kVec];
        failure =
            WaitVectors<DT, kVec>(peer, row_inbox + (1 - p.rank) * p.layout.lamport_slot_bytes, t0,
                                  stride, vecs_per_row, p, ctrl, watch, clock, cfg, descs);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          if (failure != 0 || t0 + k * stride >= vecs_per_row) continue;
          float acc[Tr::kElems];
          device::Accumulate<DT>(acc, own[k], true);
          device::Accumulate<DT>(acc, peer[k], false);
          sum[k] = device::RoundSum<DT>(acc);
        }
      } else {
        failure = WaitAndSumRanks<DT, kVec>(sum, own, row_inbox, t0, stride, vecs_per_row, p, ctrl,
                                            watch, clock, cfg, descs);
      }
    }
    if (row == unit && op_check == kOpCheckThread) {
      // This thread's first row: it saw every peer's descriptor unless its wait failed, and it
      // has stored nothing yet.
      if (failure == 0 && descs.differs != 0) {
        failure = static_cast<uint32_t>(FusionError::kOpMismatch);
      }
    } else if (row == unit && op_check == kOpCheckBlock) {
      // The block's first row (every thread, uniform): nothing has been stored yet. Thread 0 saw
      // every peer's descriptor unless its own wait failed.
      if (threadIdx.x == 0) s_differs = descs.differs;
      __syncthreads();
      if (s_differs != 0 && failure == 0) {
        failure = threadIdx.x == 0 ? static_cast<uint32_t>(FusionError::kOpMismatch)
                                   : static_cast<uint32_t>(FusionError::kPoisoned);
      }
    }
    if (failure != 0) {
      if (!failed_before && failure != static_cast<uint32_t>(FusionError::kPoisoned)) {
        RecordError(p, failure, false);
      }
    } else {
      // `sum` holds the rank-order sum. Write the sentinel back into what was read.
      auto clear_slot = [&](int q) {
        char* const src = const_cast<char*>(row_inbox) + q * p.layout.lamport_slot_bytes;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const uint32_t v = t0 + k * stride;
          if (v < vecs_per_row) device::StoreRaw(src + v * 16ull, sentinel);
        }
      };
      if (n == 2) {
        clear_slot(1 - p.rank);
      } else {
        for (int q = 0; q < n; ++q) {
          if (q != p.rank) clear_slot(q);
        }
      }
      if constexpr (!kNorm) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const uint32_t v = t0 + k * stride;
          if (v < vecs_per_row) {
            device::StoreRaw(static_cast<char*>(p.output) + row * row_bytes + v * 16ull, sum[k]);
          }
        }
      }
    }
    if constexpr (kNorm) {
      // Every thread of the block takes part in the reduction, failed or not (barrier).
      const bool ok = failure == 0;
      const float mine = ok ? device::ResidualAddRow<DT, kVec>(
                                  sum, res, t0, stride, vecs_per_row,
                                  static_cast<char*>(p.residual_out) + row * row_bytes)
                            : 0.0f;
      // The next row's loads overlap the reduction (sanitized when the row starts).
      if (ok && row + units < tokens) load_row(row + units);
      const float total = RowSumOfSquares(mine, scratch[parity]);
      parity ^= 1u;
      if (ok) {
        device::NormRowStore<DT, kVec>(sum, total, t0, stride, vecs_per_row, p.hidden, p.eps, gamma,
                                       static_cast<char*>(p.norm_out) + row * row_bytes);
      }
    } else {
      if (failure != 0) break;
      if (row + units < tokens) load_row(row + units);
    }
  }
  // 3. the last CTA to count itself in advances the epoch.
  if (threadIdx.x == 0 && failure == 0 && arrived == units - 1) {
    StoreVolatile32(&ctrl->lamport_arrived, 0u);
    StoreVolatile32(&ctrl->lamport_epoch, s_epoch + 1);
  }
  return failure;
}

// ---------------------------------------------------------------------------------------------
// Two-shot: rank q owns the token slice [q * S, (q + 1) * S), S = ceil(T / N). Block b handles
// slice rows b, b + grid, ... (same on every rank, the grid depends only on the shape):
//   1. scatter: rows of slice q go to slot `rank` of q's scatter inbox;
//   2. barrier A between ranks (value seq + 1): per block, or grid-wide (see barrier below);
//   3. the owner sums its slice rows in rank order, rounds (step 3), and writes the reduced row
//      into every rank's gather inbox at the row's global position;
//   4. barrier B (value seq + 2);
//   5. every rank reads the gathered rows of block b and runs the epilogue with its own
//      residual_in: the same bits on every rank because the reduced rows are identical.
// Op agreement: every block writes this rank's op descriptor (tag seq + 1) into every peer's
// twoshot_desc[rank] before it scatters, so barrier A's release publishes it; whoever acquires a
// peer's barrier-A signal compares that peer's descriptor with its own, and a block that finds
// another op stops before step 3 (nothing stored) with kOpMismatch.
// Inbox reuse by the next call is safe: a peer starts call k + 1 only after its call-k kernel
// ended, i.e. after this rank's blocks all signalled barrier B of call k (done reading
// scatter); a peer's block writes gather in call k + 1 only after this rank's matching block
// (or, grid-wide, all of its blocks) signalled barrier A of call k + 1, i.e. after this rank's
// call-k kernel ended. The last block to count itself in at barrier B (every block read the
// sequence long before) resets the counters and advances the sequence.
// Returns this thread's failure like OneShotBody (kStaleGenerationRefusal: see there).
template <DType DT, bool kNorm, int kBucket>
__device__ __forceinline__ uint32_t TwoShotBody(const FusionParams& p, const KernelConfig& cfg,
                                                const uint32_t expected_generation = 0) {
  using Tr = device::VecTraits<DT>;
  constexpr int kVec = device::BucketVecs(kBucket);
  __shared__ float scratch[2][32];
  __shared__ BlockWatch watch;
  __shared__ uint32_t s_error, s_seq;
  char* const local = static_cast<char*>(p.peer_workspace[p.rank]);
  FusionControl* const ctrl = ControlOf(local, p.layout);
  const uint32_t vecs_per_row = p.hidden / Tr::kElems;
  const uint32_t t0 = threadIdx.x;
  const uint32_t stride = blockDim.x;
  Raw16 gamma[kVec];
  if constexpr (kNorm) device::LoadRowVectors<kVec>(gamma, p.gamma, t0, stride, vecs_per_row);
  if (threadIdx.x == 0) {
    InitWatch(watch);
    const uint32_t generation =
        expected_generation != 0 ? LoadVolatile32(&ctrl->generation) : expected_generation;
    s_error = generation != expected_generation ? kStaleGenerationRefusal : LaunchRefusal(ctrl);
    s_seq = LoadAcquireGpu32(&ctrl->twoshot_seq);
    // In flight from here until the last block at barrier B resets it (before this block writes
    // anything into a peer): what the owning sidecar reads when an in-stream client's session
    // ends. Fire-and-forget (no result), ordered before that reset by barrier B's acq_rel count.
    if (s_error == 0) atomicAdd(&ctrl->twoshot_arrived, 1u);
  }
  __syncthreads();
  if (s_error != 0) {
    if (threadIdx.x == 0 && s_error != kStaleGenerationRefusal) {
      RecordRefusal(p, s_error, blockIdx.x == 0);
    }
    return s_error;
  }
  const uint32_t seq = s_seq;
  const uint32_t n = static_cast<uint32_t>(p.world_size);
  uint64_t desc[4];
  MakeOpDesc(p, seq + 1, desc);
  if (threadIdx.x == 0) {
    for (uint32_t q = 0; q < n; ++q) {
      if (q == static_cast<uint32_t>(p.rank)) continue;
      StoreOpDesc(&ControlOf(p.peer_workspace[q], p.layout)->twoshot_desc[p.rank], desc);
    }
  }
  const uint32_t slice = (p.num_tokens + n - 1) / n;
  const uint64_t row_bytes = static_cast<uint64_t>(vecs_per_row) * 16ull;
  const char* const input = static_cast<const char*>(p.input);
  SpinClock clock;
  uint32_t failure = 0;                            // this thread's
  bool block_failed = false;                       // any thread's: uniform across the block
  uint32_t* const counters = ctrl->twoshot_count;  // barrier A, B: zero between calls
  bool last_at_b = false;

  // Barrier between ranks, value seq + 1 (A) or seq + 2 (B); peers may already be one barrier
  // further (value + 1): flags compare as sequence numbers. At A, the thread that acquired peer
  // q's signal checks q's op descriptor (published by that signal). Every block also counts itself
  // in (acq_rel at GPU scope); the last one at B resets the counters and advances the sequence.
  //  * per block (default): thread q (< N) of block b signals rank q (st.release.sys of
  //    barrier[b][rank]; bar.sync orders the block's stores before it) and polls barrier[b][q];
  //    blocks go through the phases at their own pace.
  //  * grid-wide: the last block of this rank to count itself in signals every peer with ONE
  //    release at system scope (cumulative over the GPU-scope counting chain, so it publishes
  //    every block's stores, NVLink ones included); every block's thread 0 polls barrier[0][q].
  const bool per_block = cfg.twoshot_block_barriers != 0;
  // This thread waits for peer q's signal `value` at `flag`; at A it then checks q's descriptor.
  auto await_peer = [&](const uint32_t* flag, uint32_t q, uint32_t phase, uint32_t value) {
    uint32_t spin_polls = 0;
    while (static_cast<int32_t>(LoadAcquireSys(flag) - value) < 0) {
      failure = SpinStep(p, ctrl, watch, clock, spin_polls, cfg);
      if (failure != 0) return;
    }
    if (phase == 0 && ReadOpDesc(&ctrl->twoshot_desc[q], desc) != kDescSame) {
      failure = static_cast<uint32_t>(FusionError::kOpMismatch);
    }
  };
  auto barrier = [&](uint32_t phase, uint32_t value) -> bool {
    __syncthreads();
    if (per_block) {
      if (threadIdx.x == 0 && phase == 1 && AtomicAddAcqRelGpu(&counters[1], 1u) == gridDim.x - 1) {
        last_at_b = true;
      }
      const uint32_t q = threadIdx.x;
      if (q < n && q != static_cast<uint32_t>(p.rank)) {
        StoreReleaseSys(&ControlOf(p.peer_workspace[q], p.layout)->barrier[blockIdx.x][p.rank],
                        value);
        await_peer(&ctrl->barrier[blockIdx.x][q], q, phase, value);
      }
    } else if (threadIdx.x == 0) {
      const uint32_t old = AtomicAddAcqRelGpu(&counters[phase], 1u);
      if (old == gridDim.x - 1) {
        if (phase == 1) last_at_b = true;
        for (uint32_t q = 0; q < n; ++q) {
          if (q == static_cast<uint32_t>(p.rank)) continue;
          StoreReleaseSys(&ControlOf(p.peer_workspace[q], p.layout)->barrier[0][p.rank], value);
        }
      }
      for (uint32_t q = 0; q < n && failure == 0; ++q) {
        if (q == static_cast<uint32_t>(p.rank)) continue;
        await_peer(&ctrl->barrier[0][q], q, phase, value);
      }
    }
    block_failed = __syncthreads_or(failure != 0) != 0;
    return block_failed;
  };

  // 1. scatter, starting with the next rank so the N - 1 links are loaded evenly.
  for (uint32_t step = 1; step < n; ++step) {
    const uint32_t q = (static_cast<uint32_t>(p.rank) + step) % n;
    char* const inbox = static_cast<char*>(p.peer_workspace[q]) + p.layout.scatter_offset +
                        static_cast<uint64_t>(p.rank) * p.layout.scatter_slot_bytes;
    for (uint32_t i = blockIdx.x; i < slice; i += gridDim.x) {
      const uint32_t token = q * slice + i;
      if (token >= p.num_tokens) break;
      Raw16 x[kVec];
      device::LoadRowVectors<kVec>(x, input + token * row_bytes, t0, stride, vecs_per_row);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const uint32_t v = t0 + k * stride;
        if (v < vecs_per_row) {
          device::StoreRaw(inbox + i * row_bytes + v * 16ull,
                           device::SanitizeNegativeZero<DT>(x[k]));
        }
      }
    }
  }
  if (!barrier(0, seq + 1)) {
    // 3. reduce the own slice and all-gather it.
    const char* const scatter = local + p.layout.scatter_offset;
    for (uint32_t i = blockIdx.x; i < slice; i += gridDim.x) {
      const uint32_t token = static_cast<uint32_t>(p.rank) * slice + i;
      if (token >= p.num_tokens) break;
      float acc[kVec][Tr::kElems];
      for (uint32_t q = 0; q < n; ++q) {
        Raw16 x[kVec];
        if (q == static_cast<uint32_t>(p.rank)) {
          device::LoadRowVectors<kVec>(x, input + token * row_bytes, t0, stride, vecs_per_row);
#pragma unroll
          for (int k = 0; k < kVec; ++k) x[k] = device::SanitizeNegativeZero<DT>(x[k]);
        } else {
          // Written by a peer before barrier A: read past L1.
          const char* const src = scatter + q * p.layout.scatter_slot_bytes + i * row_bytes;
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            const uint32_t v = t0 + k * stride;
            if (v < vecs_per_row) x[k] = device::LoadRawCg(src + v * 16ull);
          }
        }
#pragma unroll
        for (int k = 0; k < kVec; ++k) device::Accumulate<DT>(acc[k], x[k], q == 0);
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const uint32_t v = t0 + k * stride;
        if (v >= vecs_per_row) continue;
        const Raw16 reduced = device::RoundSum<DT>(acc[k]);
        for (uint32_t step = 0; step < n; ++step) {
          const uint32_t q = (static_cast<uint32_t>(p.rank) + step) % n;
          device::StoreRaw(static_cast<char*>(p.peer_workspace[q]) + p.layout.gather_offset +
                               token * row_bytes + v * 16ull,
                           reduced);
        }
      }
    }
    if (!barrier(1, seq + 2)) {
      // 5. epilogue over the gathered rows this block's peers wrote.
      const char* const gather = local + p.layout.gather_offset;
      uint32_t parity = 0;
      for (uint32_t s = 0; s < n; ++s) {
        for (uint32_t i = blockIdx.x; i < slice; i += gridDim.x) {
          const uint32_t token = s * slice + i;
          if (token >= p.num_tokens) break;
          const uint64_t off = token * row_bytes;
          Raw16 reduced[kVec];
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            const uint32_t v = t0 + k * stride;
            if (v < vecs_per_row) reduced[k] = device::LoadRawCg(gather + off + v * 16ull);
          }
          if constexpr (kNorm) {
            Raw16 res[kVec];
            device::LoadRowVectors<kVec>(res, static_cast<const char*>(p.residual_in) + off, t0,
                                         stride, vecs_per_row);
            const float mine = device::ResidualAddRow<DT, kVec>(
                reduced, res, t0, stride, vecs_per_row, static_cast<char*>(p.residual_out) + off);
            const float total = RowSumOfSquares(mine, scratch[parity]);
            parity ^= 1u;
            device::NormRowStore<DT, kVec>(reduced, total, t0, stride, vecs_per_row, p.hidden,
                                           p.eps, gamma, static_cast<char*>(p.norm_out) + off);
          } else {
#pragma unroll
            for (int k = 0; k < kVec; ++k) {
              const uint32_t v = t0 + k * stride;
              if (v < vecs_per_row) {
                device::StoreRaw(static_cast<char*>(p.output) + off + v * 16ull, reduced[k]);
              }
            }
          }
        }
      }
    }
  }
  if (block_failed) {
    if (failure != 0 && failure != static_cast<uint32_t>(FusionError::kPoisoned)) {
      RecordError(p, failure, false);
    }
    return failure != 0 ? failure : static_cast<uint32_t>(FusionError::kPoisoned);
  }
  if (threadIdx.x == 0 && last_at_b) {
    // Every block counted itself in at both barriers: no more increments in this call.
    StoreVolatile32(&counters[0], 0u);
    StoreVolatile32(&counters[1], 0u);
    StoreVolatile32(&ctrl->twoshot_arrived, 0u);
    StoreVolatile32(&ctrl->twoshot_seq, seq + 2);
  }
  return 0;
}

}  // namespace fusion_device
}  // namespace arfuse
