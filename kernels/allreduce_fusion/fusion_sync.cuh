// Device code shared by the fused allreduce kernels' bodies: the launch-time knobs, the error
// and abort words, the spins and their deadline, the op agreement (op descriptors) and the
// Lamport waits. CUDA only; fusion_device.cuh includes it with the bodies. docs/kernels.md has
// the protocol and the memory-ordering argument.
#pragma once

#include <cstdint>

#include "kernels/add_rmsnorm/row_math.cuh"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/allreduce_fusion/fusion_control.h"
#include "kernels/common/memory_model.cuh"
#include "kernels/contract/op_contract.h"
#include "kernels/contract/program_key.h"

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
// The descriptor also says who launched the op: an attached client's in-stream launch (it passes
// the generation tag it was made for) or the sidecar's own (an eager op, the doorbell's serving
// kernel). The two never pair: a client that died with its op published leaves that op for a
// peer to find until its sidecar retires it, and a peer's eager op landing in that window would
// otherwise sum the dead client's input and finish OK. With the origin in the descriptor it
// fails with kOpMismatch on every rank, at no cost (the word is compared anyway).
// An in-stream launch also carries its program key (InStreamLaunchArgs::program_key: the value
// every rank of one client program set, 0 when none did), so that in the same window a client
// of another program (one that attached on a peer rank in those milliseconds) fails with
// kOpMismatch too instead of pairing with the dead client's op of the same sequence number.
inline constexpr uint32_t kOpDescInStream = 1u << 31;
// Where the key's bits go: its low 12 bits above the op's kind in word 3 (bits 20-31), its high
// 12 between the hidden size and the origin bit in word 1 (bits 19-30).
inline constexpr uint32_t kDescKindBits = 20;
inline constexpr uint32_t kDescHiddenBits = 19;
static_assert(MaxFusionHidden(DType::kFP32) < (1u << kDescHiddenBits) &&
                  MaxFusionHidden(DType::kBF16) < (1u << kDescHiddenBits) &&
                  MaxFusionHidden(DType::kFP16) < (1u << kDescHiddenBits),
              "the program key's high bits share the hidden word of the op descriptor");
static_assert(static_cast<uint32_t>(DType::kFP32) < 16 && kMaxPattern < 16 &&
                  static_cast<uint32_t>(FusionAlgo::kTwoShot) < 16 && kMaxWorldSize < 256,
              "the op's kind fits the low 20 bits of descriptor word 3");
static_assert(kDescHiddenBits + (kProgramKeyBits - (32 - kDescKindBits)) == 31,
              "the key's high bits end below the origin bit");

// Who launched an op: the sidecar's own launches pass the default (no generation check, no key);
// an in-stream entry passes the generation tag its client attached to and the client's key.
struct LaunchOrigin {
  uint32_t expected_generation = 0;  // 0: not an in-stream launch (generation unchecked)
  uint32_t program_key = 0;          // kProgramKeyMax at most; 0 for every sidecar launch
  __device__ __forceinline__ bool in_stream() const { return expected_generation != 0; }
};

__device__ __forceinline__ void MakeOpDesc(const FusionParams& p, uint32_t tag,
                                           const LaunchOrigin& origin, uint64_t (&w)[4]) {
  const uint64_t t = static_cast<uint64_t>(tag) << 32;
  const uint32_t key = origin.program_key & kProgramKeyMax;
  constexpr uint32_t key_low_bits = 32 - kDescKindBits;
  w[0] = t | p.num_tokens;
  w[1] = t | p.hidden | (key >> key_low_bits) << kDescHiddenBits |
         (origin.in_stream() ? kOpDescInStream : 0u);
  w[2] = t | __float_as_uint(p.eps);
  w[3] = t | (static_cast<uint32_t>(p.dtype) | static_cast<uint32_t>(p.pattern) << 4 |
              static_cast<uint32_t>(p.algo) << 8 | static_cast<uint32_t>(p.world_size) << 12 |
              (key & ((1u << key_low_bits) - 1)) << kDescKindBits);
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

}  // namespace fusion_device
}  // namespace arfuse
