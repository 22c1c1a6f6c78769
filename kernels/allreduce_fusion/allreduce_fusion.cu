// The fused allreduce kernels. docs/kernels.md has the protocol and the memory-ordering argument;
// the comments here say which step of it each piece is.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "kernels/add_rmsnorm/row_math.cuh"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/allreduce_fusion/fusion_control.h"

namespace arfuse {
namespace {

using device::Raw16;

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
};
__host__ __device__ constexpr KernelConfig DefaultKernelConfig() {
  return KernelConfig{1, 24, 64, 1};
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t LoadVolatile32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreVolatile32(uint32_t* p, uint32_t v) {
  asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The protocol words a kernel reads at its start (epoch, sequence): acquire, so the arrival
// counter's atomic below cannot be performed before the read.
__device__ __forceinline__ uint32_t LoadAcquireGpu32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Barrier signal: the release makes every store this block made before (ordered by the
// preceding __syncthreads) visible to a peer that acquires the flag, at system scope because
// the reader is another GPU.
__device__ __forceinline__ void StoreReleaseSys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t LoadAcquireSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Programmatic dependent launch (sm_90+). Both are no-ops for a kernel that was not launched as a
// dependent (wait) or has no dependent launched that way (launch_dependents).
__device__ __forceinline__ void WaitForPrerequisiteGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ FusionControl* ControlOf(void* workspace, const WorkspaceLayout& l) {
  return reinterpret_cast<FusionControl*>(static_cast<char*>(workspace) + l.control_offset);
}

// Records the first error of this workspace, mirrors it to the host word, and tells every peer
// to stop spinning (they would otherwise wait for their own deadline). A peer's own failure
// (kPeerAbort) is not forwarded again; a thread that lost the race to record is quiet unless
// `forward_always` (a launch on a poisoned workspace forwards every time).
__device__ void RecordError(const FusionParams& p, uint32_t code, bool forward_always) {
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

// Polls the vectors of this thread (row thread t0, k < kVec) at `src` until no element of any
// holds the sentinel (raw bits). Returns a failure code or 0.
template <DType DT, int kVec>
__device__ __forceinline__ uint32_t WaitVectors(Raw16 (&x)[kVec], const char* src, uint32_t t0,
                                                uint32_t stride, uint32_t vecs_per_row,
                                                const FusionParams& p, FusionControl* ctrl,
                                                BlockWatch& w, SpinClock& clock,
                                                const KernelConfig& cfg) {
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const uint32_t v = t0 + k * stride;
    if (v < vecs_per_row) x[k] = device::LoadRawVolatile(src + v * 16ull);
  }
  uint32_t spin_polls = 0;
  while (true) {
    bool pending = false;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const uint32_t v = t0 + k * stride;
      if (v < vecs_per_row && device::HasSentinel<DT>(x[k])) pending = true;
    }
    if (!pending) return 0;
    if (const uint32_t code = SpinStep(p, ctrl, w, clock, spin_polls, cfg); code != 0) {
      return code;
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const uint32_t v = t0 + k * stride;
      if (v < vecs_per_row && device::HasSentinel<DT>(x[k])) {
        x[k] = device::LoadRawVolatile(src + v * 16ull);
      }
    }
  }
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
//   3. every CTA counts itself in right after its first pushes; the last one advances the epoch
//      (every CTA read it before counting itself; the next call is a later kernel).
// Pushing row r never waits for anything but reads of rows before r, on any rank: no cycle.
// Loads that depend on nothing (the first row's input and residual, gamma) are issued before
// the control words are read, and each row's successor is loaded while the row is finished.
// (Splitting small rows over the CTAs of a cluster, as FlashInfer does, was measured: 0.3 us
// slower at hidden 4096 and no faster at 8192, so rows stay within one CTA.)
template <DType DT, bool kNorm, int kBucket>
__device__ __forceinline__ void OneShotBody(const FusionParams& p, const KernelConfig& cfg) {
  using Tr = device::VecTraits<DT>;
  constexpr int kVec = device::BucketVecs(kBucket);
  __shared__ float scratch[2][32];
  __shared__ BlockWatch watch;
  __shared__ uint32_t s_error, s_epoch;
  char* const local = static_cast<char*>(p.peer_workspace[p.rank]);
  FusionControl* const ctrl = ControlOf(local, p.layout);
  const uint32_t unit = blockIdx.x;
  const uint32_t units = gridDim.x;
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
  // First the loads that depend on nothing, then the control words (thread 0).
  if (unit < tokens) load_row(unit);
  if constexpr (kNorm) device::LoadRowVectors<kVec>(gamma, p.gamma, t0, stride, vecs_per_row);
  if (threadIdx.x == 0) {
    InitWatch(watch);
    s_error = LoadVolatile32(&ctrl->error);
    s_epoch = LoadAcquireGpu32(&ctrl->lamport_epoch);
  }
  __syncthreads();
  // A poisoned workspace: nothing is touched; block 0 forwards the abort.
  if (s_error != 0) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
      RecordError(p, static_cast<uint32_t>(FusionError::kPoisoned), true);
    }
    return;
  }
  const uint64_t buffer_offset =
      p.layout.lamport_offset + (s_epoch % 3) * p.layout.lamport_buffer_bytes;
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

  // 1. the first pushes (the first row's input is already here), then count this CTA in.
#pragma unroll
  for (int k = 0; k < kVec; ++k) own[k] = device::SanitizeNegativeZero<DT>(own[k]);
  uint32_t ahead = unit;
  if (ahead < tokens) {
    push_vectors(ahead, own);
    ahead += units;
    for (uint32_t j = 1; j < cfg.lookahead && ahead < tokens; ++j, ahead += units) push_row(ahead);
  }
  uint32_t arrived = 0;
  if (threadIdx.x == 0) arrived = atomicAdd(&ctrl->lamport_arrived, 1u);

  // 2. rows.
  const Raw16 sentinel = device::SentinelVector<DT>();
  uint32_t parity = 0;
  for (uint32_t row = unit; row < tokens; row += units) {
    Raw16 sum[kVec];  // the rounded sum, then the pre-norm sum
    if (failure == 0) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) own[k] = device::SanitizeNegativeZero<DT>(own[k]);
      if (ahead < tokens) {
        push_row(ahead);
        ahead += units;
      }
      const char* const row_inbox = local + buffer_offset + row * row_bytes;
      // Wait until every peer's vectors of this row are here (polls batched over k). With two
      // ranks the polled vectors are the peer's data; with more they are re-read below.
      Raw16 peer[kVec];
      for (int s = 1; s < n && failure == 0; ++s) {
        const int q = (p.rank + s) % n;
        failure = WaitVectors<DT, kVec>(peer, row_inbox + q * p.layout.lamport_slot_bytes, t0,
                                        stride, vecs_per_row, p, ctrl, watch, clock, cfg);
      }
      if (failure != 0) {
        if (failure != static_cast<uint32_t>(FusionError::kPoisoned)) {
          RecordError(p, failure, false);
        }
      } else {
        // Sum in rank order (own input at position `rank`), then write the sentinel back.
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const uint32_t v = t0 + k * stride;
          if (v >= vecs_per_row) continue;
          float acc[Tr::kElems];
          for (int q = 0; q < n; ++q) {
            const Raw16 x = q == p.rank ? own[k]
                            : n == 2    ? peer[k]
                                        : device::LoadRawVolatile(
                                              row_inbox + q * p.layout.lamport_slot_bytes + v * 16ull);
            device::Accumulate<DT>(acc, x, q == 0);
          }
          sum[k] = device::RoundSum<DT>(acc);
        }
        for (int q = 0; q < n; ++q) {
          if (q == p.rank) continue;
          char* const src = const_cast<char*>(row_inbox) + q * p.layout.lamport_slot_bytes;
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            const uint32_t v = t0 + k * stride;
            if (v < vecs_per_row) device::StoreRaw(src + v * 16ull, sentinel);
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
  if (threadIdx.x == 0 && failure == 0 && arrived == gridDim.x - 1) {
    StoreVolatile32(&ctrl->lamport_arrived, 0u);
    StoreVolatile32(&ctrl->lamport_epoch, s_epoch + 1);
  }
}

// The two-shot's counting of blocks: acq_rel at GPU scope, so the counting chain orders every
// block's earlier stores before the operations of the block that sees the last count.
__device__ __forceinline__ uint32_t AtomicAddAcqRelGpu(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
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
// Inbox reuse by the next call is safe: a peer starts call k + 1 only after its call-k kernel
// ended, i.e. after this rank's blocks all signalled barrier B of call k (done reading
// scatter); a peer's block writes gather in call k + 1 only after this rank's matching block
// (or, grid-wide, all of its blocks) signalled barrier A of call k + 1, i.e. after this rank's
// call-k kernel ended. The last block to count itself in at barrier B (every block read the
// sequence long before) resets the counters and advances the sequence.
template <DType DT, bool kNorm, int kBucket>
__device__ __forceinline__ void TwoShotBody(const FusionParams& p, const KernelConfig& cfg) {
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
    s_error = LoadVolatile32(&ctrl->error);
    s_seq = LoadAcquireGpu32(&ctrl->twoshot_seq);
  }
  __syncthreads();
  if (s_error != 0) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
      RecordError(p, static_cast<uint32_t>(FusionError::kPoisoned), true);
    }
    return;
  }
  const uint32_t seq = s_seq;
  const uint32_t n = static_cast<uint32_t>(p.world_size);
  const uint32_t slice = (p.num_tokens + n - 1) / n;
  const uint64_t row_bytes = static_cast<uint64_t>(vecs_per_row) * 16ull;
  const char* const input = static_cast<const char*>(p.input);
  SpinClock clock;
  uint32_t failure = 0;                            // this thread's
  bool block_failed = false;                       // any thread's: uniform across the block
  uint32_t* const counters = ctrl->twoshot_count;  // barrier A, B: zero between calls
  bool last_at_b = false;

  // Barrier between ranks, value seq + 1 (A) or seq + 2 (B); peers may already be one barrier
  // further (value + 1): flags compare as sequence numbers. Every block also counts itself in
  // (acq_rel at GPU scope); the last one at B resets the counters and advances the sequence.
  //  * per block (default): thread q (< N) of block b signals rank q (st.release.sys of
  //    barrier[b][rank]; bar.sync orders the block's stores before it) and polls barrier[b][q];
  //    blocks go through the phases at their own pace.
  //  * grid-wide: the last block of this rank to count itself in signals every peer with ONE
  //    release at system scope (cumulative over the GPU-scope counting chain, so it publishes
  //    every block's stores, NVLink ones included); every block's thread 0 polls barrier[0][q].
  const bool per_block = cfg.twoshot_block_barriers != 0;
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
        const uint32_t* flag = &ctrl->barrier[blockIdx.x][q];
        uint32_t spin_polls = 0;
        while (static_cast<int32_t>(LoadAcquireSys(flag) - value) < 0) {
          failure = SpinStep(p, ctrl, watch, clock, spin_polls, cfg);
          if (failure != 0) break;
        }
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
        const uint32_t* flag = &ctrl->barrier[0][q];
        uint32_t spin_polls = 0;
        while (static_cast<int32_t>(LoadAcquireSys(flag) - value) < 0) {
          failure = SpinStep(p, ctrl, watch, clock, spin_polls, cfg);
          if (failure != 0) break;
        }
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
    return;
  }
  if (threadIdx.x == 0 && last_at_b) {
    // Every block counted itself in at both barriers: no more increments in this call.
    StoreVolatile32(&counters[0], 0u);
    StoreVolatile32(&counters[1], 0u);
    StoreVolatile32(&ctrl->twoshot_seq, seq + 2);
  }
}

// ---------------------------------------------------------------------------------------------
// The by-value kernels (LaunchAllReduceFusion): the params are kernel parameters. kVec is the
// register-array size of the row layout (row_math.cuh), which also bounds the block size.
// Launched as programmatic dependents (own GPU only), they wait for the kernel before them and
// its stores, then let the kernel after them be scheduled early (it waits the same way).
template <DType DT, bool kNorm, int kBucket>
__global__ void __launch_bounds__(device::BucketMaxThreads(kBucket),
                                  device::BucketMinBlocks(kBucket))
    OneShotKernel(const FusionParams p, const KernelConfig cfg) {
  WaitForPrerequisiteGrid();
  AllowDependentLaunch();
  OneShotBody<DT, kNorm, kBucket>(p, cfg);
}

template <DType DT, bool kNorm, int kBucket>
__global__ void __launch_bounds__(device::BucketMaxThreads(kBucket),
                                  device::BucketMinBlocks(kBucket))
    TwoShotKernel(const FusionParams p, const KernelConfig cfg) {
  WaitForPrerequisiteGrid();
  AllowDependentLaunch();
  TwoShotBody<DT, kNorm, kBucket>(p, cfg);
}

// The indirect kernels (LaunchAllReduceFusionIndirect): every block copies the op's params from
// device memory into shared memory, then runs them if they belong to this launch. `tmpl` is the
// launch's template: params with no tokens (an idle waiter), another shape or another algorithm
// (a launch queued for another plan or for the other algorithm) make every block return before
// anything of the protocol is touched. The decision reads only the device params and the
// template, so it is the same in every block. One algorithm per kernel: a kernel holding both
// bodies spilled five times more registers (ptxas -v).
template <DType DT, bool kNorm, FusionAlgo kAlgo, int kBucket>
__global__ void __launch_bounds__(device::BucketMaxThreads(kBucket),
                                  device::BucketMinBlocks(kBucket))
    IndirectKernel(const FusionParams tmpl, const FusionParams* __restrict__ device_params) {
  __shared__ FusionParams s_params;
  // Launched as a programmatic dependent, this block may start before the kernel that writes
  // the params has finished: wait for it (and for its stores) before reading them. Then let the
  // kernel queued behind (the doorbell's completion) be scheduled early: it waits for this grid
  // to finish in the same way.
  WaitForPrerequisiteGrid();
  AllowDependentLaunch();
  static_assert(sizeof(FusionParams) % sizeof(uint64_t) == 0);
  {
    // Plain (not .nc) loads: the waiter kernel wrote these words just before this launch.
    const uint64_t* src = reinterpret_cast<const uint64_t*>(device_params);
    uint64_t* dst = reinterpret_cast<uint64_t*>(&s_params);
    for (uint32_t i = threadIdx.x; i < sizeof(FusionParams) / sizeof(uint64_t); i += blockDim.x) {
      dst[i] = src[i];
    }
  }
  __syncthreads();
  const FusionParams& p = s_params;
  const uint64_t n = static_cast<uint64_t>(p.world_size > 0 ? p.world_size : 1);
  const uint64_t elems = static_cast<uint64_t>(p.num_tokens) * p.hidden;
  const uint64_t slice_elems = (p.num_tokens + n - 1) / n * p.hidden;
  if (p.num_tokens == 0 || p.algo != kAlgo || p.dtype != tmpl.dtype || p.pattern != tmpl.pattern ||
      p.hidden != tmpl.hidden || p.world_size != tmpl.world_size || p.rank != tmpl.rank ||
      p.sm_budget != tmpl.sm_budget || elems * DTypeSize(DT) > tmpl.layout.lamport_slot_bytes ||
      slice_elems * DTypeSize(DT) > tmpl.layout.scatter_slot_bytes) {
    return;
  }
  const KernelConfig cfg = DefaultKernelConfig();
  if constexpr (kAlgo == FusionAlgo::kOneShot) {
    OneShotBody<DT, kNorm, kBucket>(p, cfg);
  } else {
    TwoShotBody<DT, kNorm, kBucket>(p, cfg);
  }
}

// ---------------------------------------------------------------------------------------------
template <DType DT>
__global__ void WorkspaceInitKernel(char* workspace, WorkspaceLayout layout) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t first = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  // Control block: zero (error, abort, counters, barrier slots).
  uint32_t* control = reinterpret_cast<uint32_t*>(workspace + layout.control_offset);
  for (uint64_t i = first; i < sizeof(FusionControl) / 4; i += stride) control[i] = 0;
  // The three Lamport buffers: every element the dtype's -0.0.
  const Raw16 sentinel = device::SentinelVector<DT>();
  const uint64_t vecs = 3 * layout.lamport_buffer_bytes / 16;
  for (uint64_t i = first; i < vecs; i += stride) {
    device::StoreRaw(workspace + layout.lamport_offset + i * 16, sentinel);
  }
}

// ---------------------------------------------------------------------------------------------
// Launch geometry: depends only on the shape, the kernel and the device (and sm_budget, which
// every rank passes alike).

// Process-wide knobs, read once from ARFUSE_FUSION_TUNING ("key=value,..."), for benchmarking
// variants without rebuilding. Every rank of a group must run with the same value (the two-shot
// grid depends on ctas_per_sm). Unknown keys are ignored.
//   pdl=0|1        programmatic dependent launch when the GPU is not shared             [1]
//   lookahead=L    one-shot rows pushed ahead of the row being reduced                  [1]
//   ctas_per_sm=M  cap on resident CTAs per SM (0: occupancy)                           [0]
//   tight=P        polls of a spin before it backs off                                  [24]
//   twoshot_grid=0|1  two-shot barriers: per block (0) or one per rank (1)              [0]
//   backoff=NS     the back-off sleep                                                   [64]
struct Tuning {
  int pdl = 1;
  int lookahead = 1;
  int ctas_per_sm = 0;
  int tight = 24;
  int backoff = 64;
  int twoshot_grid = 0;
};

const Tuning& GetTuning() {
  static const Tuning tuning = [] {
    Tuning t;
    const char* env = std::getenv("ARFUSE_FUSION_TUNING");
    if (env == nullptr) return t;
    const char* s = env;
    while (*s != '\0') {
      const char* end = std::strchr(s, ',');
      const size_t len = end == nullptr ? std::strlen(s) : static_cast<size_t>(end - s);
      const char* eq = static_cast<const char*>(std::memchr(s, '=', len));
      if (eq != nullptr) {
        const std::string key(s, static_cast<size_t>(eq - s));
        const int value =
            std::atoi(std::string(eq + 1, len - static_cast<size_t>(eq + 1 - s)).c_str());
        if (key == "pdl") t.pdl = value != 0;
        if (key == "lookahead") t.lookahead = std::clamp(value, 1, 16);
        if (key == "ctas_per_sm") t.ctas_per_sm = std::max(0, value);
        if (key == "tight") t.tight = std::max(0, value);
        if (key == "twoshot_grid") t.twoshot_grid = value != 0;
        if (key == "backoff") t.backoff = std::clamp(value, 0, 1000000);
      }
      if (end == nullptr) break;
      s = end + 1;
    }
    return t;
  }();
  return tuning;
}

KernelConfig ConfigFromTuning() {
  const Tuning& t = GetTuning();
  return KernelConfig{static_cast<uint32_t>(t.lookahead), static_cast<uint32_t>(t.tight),
                      static_cast<uint32_t>(t.backoff), t.twoshot_grid != 0 ? 0u : 1u};
}

int DeviceSmCount() {
  static std::atomic<int> cached[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 0;
  int count = cached[device].load(std::memory_order_relaxed);
  if (count == 0) {
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      return 0;
    }
    cached[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

// Blocks of `kernel` with `threads` threads that fit one SM at once (>= 1).
int BlocksPerSm(const void* kernel, int threads) {
  struct Entry {
    const void* kernel;
    int threads;
    int device;
    int blocks;
  };
  static std::mutex mu;
  static Entry cache[256];
  static int used = 0;
  int device = 0;
  cudaGetDevice(&device);
  {
    std::lock_guard<std::mutex> lock(mu);
    for (int i = 0; i < used; ++i) {
      if (cache[i].kernel == kernel && cache[i].threads == threads && cache[i].device == device) {
        return cache[i].blocks;
      }
    }
  }
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0) != cudaSuccess ||
      blocks < 1) {
    blocks = 1;
  }
  std::lock_guard<std::mutex> lock(mu);
  if (used < 256) cache[used++] = Entry{kernel, threads, device, blocks};
  return blocks;
}

// Resident blocks of `kernel` the launch may count on: every block of a rank must be resident
// at once (blocks spin on peers' blocks), so grids never exceed this.
uint32_t ResidentBlocks(const void* kernel, int threads, uint32_t sm_budget) {
  int sms = DeviceSmCount();
  if (sms <= 0) return 0;
  if (sm_budget > 0) sms = std::min<int>(sms, static_cast<int>(sm_budget));
  int per_sm = BlocksPerSm(kernel, threads);
  if (GetTuning().ctas_per_sm > 0) per_sm = std::min(per_sm, GetTuning().ctas_per_sm);
  return static_cast<uint32_t>(std::min(kMaxFusionBlocks, std::max(1, sms * per_sm)));
}

// One launch, with programmatic stream serialization (PDL) when asked.
template <typename Kernel, typename... Args>
cudaError_t LaunchWithAttributes(Kernel kernel, unsigned grid, int threads, bool pdl,
                                 cudaStream_t stream, Args... args) {
  if (!pdl) {
    kernel<<<grid, threads, 0, stream>>>(args...);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

template <DType DT, bool kNorm, int kBucket>
cudaError_t LaunchTyped(const FusionParams& p, cudaStream_t stream) {
  const Tuning& tuning = GetTuning();
  const uint32_t vecs_per_row = p.hidden / device::VecTraits<DT>::kElems;
  const int threads = device::RowBlockThreads(vecs_per_row);
  // PDL only when the GPU is not shared: a dependent grid waiting on its SMs must never keep
  // another rank's grid on the same GPU from becoming resident.
  const bool pdl = tuning.pdl != 0 && p.sm_budget == 0;
  const KernelConfig cfg = ConfigFromTuning();
  if (p.algo == FusionAlgo::kOneShot) {
    auto* kernel = &OneShotKernel<DT, kNorm, kBucket>;
    const uint32_t resident =
        ResidentBlocks(reinterpret_cast<const void*>(kernel), threads, p.sm_budget);
    if (resident == 0) return cudaErrorInvalidDevice;
    const unsigned grid = std::max<uint32_t>(1u, std::min(p.num_tokens, resident));
    return LaunchWithAttributes(kernel, grid, threads, pdl, stream, p, cfg);
  }
  auto* kernel = &TwoShotKernel<DT, kNorm, kBucket>;
  const uint32_t resident =
      ResidentBlocks(reinterpret_cast<const void*>(kernel), threads, p.sm_budget);
  if (resident == 0) return cudaErrorInvalidDevice;
  const uint32_t rows = (p.num_tokens + p.world_size - 1) / p.world_size;
  const unsigned grid = std::max<uint32_t>(1u, std::min(rows, resident));
  return LaunchWithAttributes(kernel, grid, threads, pdl, stream, p, cfg);
}

template <DType DT, bool kNorm>
cudaError_t LaunchBucket(const FusionParams& p, cudaStream_t stream) {
  switch (device::RowBucket(p.hidden / device::VecTraits<DT>::kElems)) {
    case 0:
      return LaunchTyped<DT, kNorm, 0>(p, stream);
    case 1:
      return LaunchTyped<DT, kNorm, 1>(p, stream);
    case 2:
      return LaunchTyped<DT, kNorm, 2>(p, stream);
    default:
      return LaunchTyped<DT, kNorm, 3>(p, stream);
  }
}

template <DType DT>
cudaError_t LaunchForDType(const FusionParams& p, cudaStream_t stream) {
  switch (p.pattern) {
    case Pattern::kAllReduce:
      return LaunchBucket<DT, false>(p, stream);
    case Pattern::kAllReduceResidualRmsNorm:
      return LaunchBucket<DT, true>(p, stream);
  }
  return cudaErrorInvalidValue;
}

// The indirect launch's geometry: from the template only (see allreduce_fusion.h).
template <typename Kernel>
cudaError_t LaunchIndirectKernel(Kernel kernel, unsigned grid, int threads, const FusionParams& t,
                                 const FusionParams* device_params, cudaStream_t stream,
                                 bool programmatic) {
  if (!programmatic) {
    kernel<<<grid, threads, 0, stream>>>(t, device_params);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, t, device_params);
}

template <DType DT, bool kNorm, int kBucket>
cudaError_t LaunchIndirectTyped(const FusionParams& t, const FusionParams* device_params,
                                cudaStream_t stream, bool programmatic) {
  const uint32_t vecs_per_row = t.hidden / device::VecTraits<DT>::kElems;
  const int threads = device::RowBlockThreads(vecs_per_row);
  const bool one_shot = t.algo == FusionAlgo::kOneShot;
  const void* kernel =
      one_shot
          ? reinterpret_cast<const void*>(&IndirectKernel<DT, kNorm, FusionAlgo::kOneShot, kBucket>)
          : reinterpret_cast<const void*>(
                &IndirectKernel<DT, kNorm, FusionAlgo::kTwoShot, kBucket>);
  const uint32_t resident = ResidentBlocks(kernel, threads, t.sm_budget);
  if (resident == 0) return cudaErrorInvalidDevice;
  // The most rows any op of this hidden may have (one-shot: a block per token; two-shot: a block
  // per slice row), at the largest token count the workspace fits at this hidden.
  const uint64_t max_tokens =
      static_cast<uint64_t>(t.layout.max_tokens) * t.layout.hidden / t.hidden;
  const uint64_t n = static_cast<uint64_t>(t.world_size);
  const uint64_t max_rows = one_shot ? max_tokens : (max_tokens + n - 1) / n;
  const unsigned grid =
      static_cast<unsigned>(std::max<uint64_t>(1, std::min<uint64_t>(max_rows, resident)));
  return one_shot ? LaunchIndirectKernel(IndirectKernel<DT, kNorm, FusionAlgo::kOneShot, kBucket>,
                                         grid, threads, t, device_params, stream, programmatic)
                  : LaunchIndirectKernel(IndirectKernel<DT, kNorm, FusionAlgo::kTwoShot, kBucket>,
                                         grid, threads, t, device_params, stream, programmatic);
}

template <DType DT, bool kNorm>
cudaError_t LaunchIndirectBucket(const FusionParams& t, const FusionParams* device_params,
                                 cudaStream_t stream, bool programmatic) {
  switch (device::RowBucket(t.hidden / device::VecTraits<DT>::kElems)) {
    case 0:
      return LaunchIndirectTyped<DT, kNorm, 0>(t, device_params, stream, programmatic);
    case 1:
      return LaunchIndirectTyped<DT, kNorm, 1>(t, device_params, stream, programmatic);
    case 2:
      return LaunchIndirectTyped<DT, kNorm, 2>(t, device_params, stream, programmatic);
    default:
      return LaunchIndirectTyped<DT, kNorm, 3>(t, device_params, stream, programmatic);
  }
}

template <DType DT>
cudaError_t LaunchIndirectForDType(const FusionParams& t, const FusionParams* device_params,
                                   cudaStream_t stream, bool programmatic) {
  switch (t.pattern) {
    case Pattern::kAllReduce:
      return LaunchIndirectBucket<DT, false>(t, device_params, stream, programmatic);
    case Pattern::kAllReduceResidualRmsNorm:
      return LaunchIndirectBucket<DT, true>(t, device_params, stream, programmatic);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchAllReduceFusionIndirect(const FusionParams& grid_template,
                                          const FusionParams* device_params, cudaStream_t stream,
                                          bool programmatic_dependent) {
  if (device_params == nullptr || (reinterpret_cast<uintptr_t>(device_params) & 7u) != 0) {
    return cudaErrorInvalidValue;
  }
  FusionParams t = grid_template;
  t.num_tokens = 0;  // the template's shape class only: its pointers are not used by the launch
  if (cudaError_t err = CheckFusionParams(t, nullptr); err != cudaSuccess) return err;
  switch (t.dtype) {
    case DType::kBF16:
      return LaunchIndirectForDType<DType::kBF16>(t, device_params, stream, programmatic_dependent);
    case DType::kFP16:
      return LaunchIndirectForDType<DType::kFP16>(t, device_params, stream, programmatic_dependent);
    case DType::kFP32:
      return LaunchIndirectForDType<DType::kFP32>(t, device_params, stream, programmatic_dependent);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchAllReduceFusion(const FusionParams& p, cudaStream_t stream) {
  if (cudaError_t err = CheckFusionParams(p, nullptr); err != cudaSuccess) return err;
  if (p.num_tokens == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kBF16:
      return LaunchForDType<DType::kBF16>(p, stream);
    case DType::kFP16:
      return LaunchForDType<DType::kFP16>(p, stream);
    case DType::kFP32:
      return LaunchForDType<DType::kFP32>(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchWorkspaceInit(void* local_workspace, const WorkspaceLayout& layout,
                                cudaStream_t stream) {
  if (local_workspace == nullptr || layout.total_bytes == 0 ||
      (reinterpret_cast<uintptr_t>(local_workspace) & 15u) != 0) {
    return cudaErrorInvalidValue;
  }
  char* ws = static_cast<char*>(local_workspace);
  const int sms = std::max(1, DeviceSmCount());
  const unsigned grid = static_cast<unsigned>(sms * 4);
  switch (layout.dtype) {
    case DType::kBF16:
      WorkspaceInitKernel<DType::kBF16><<<grid, 512, 0, stream>>>(ws, layout);
      break;
    case DType::kFP16:
      WorkspaceInitKernel<DType::kFP16><<<grid, 512, 0, stream>>>(ws, layout);
      break;
    case DType::kFP32:
      WorkspaceInitKernel<DType::kFP32><<<grid, 512, 0, stream>>>(ws, layout);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace arfuse
