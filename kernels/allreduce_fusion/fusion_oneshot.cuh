// The one-shot Lamport body of the fused kernels. CUDA only; included through fusion_device.cuh.
// docs/kernels.md has the protocol and the memory-ordering argument; the comments here say which
// step of it each piece is.
#pragma once

#include "kernels/allreduce_fusion/fusion_epilogue.cuh"
#include "kernels/allreduce_fusion/fusion_sync.cuh"

namespace arfuse {
namespace fusion_device {

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
template <DType DT, bool kNorm, int kBucket, EpilogueQuant kQuant = EpilogueQuant::kNone>
// `unit` / `units`: this block's index and the number of blocks taking part (blockIdx.x and
// gridDim.x for a kernel that runs one op; the doorbell's serving kernel passes its own).
// Returns this thread's failure (a FusionError code; kPoisoned when the workspace already held
// an error), 0 when it completed its part: a caller that finds 0 in every thread of every block
// knows the op succeeded without reading the error word.
// `origin` (in-stream launches; the default for the sidecar's): its expected_generation is the
// workspace's generation tag (FusionControl::generation) the launch was made for, and another tag
// makes the launch return kStaleGenerationRefusal at once, touching nothing and recording nothing
// in the workspace; its program key goes into the op descriptor (MakeOpDesc).
__device__ __forceinline__ uint32_t OneShotBody(const FusionParams& p, const KernelConfig& cfg,
                                                const uint32_t unit, const uint32_t units,
                                                const LaunchOrigin origin = {}) {
  using Tr = device::VecTraits<DT>;
  constexpr int kVec = device::BucketVecs(kBucket);
  __shared__ float scratch[2][32];
  __shared__ QuantScratch qscratch;  // the FP8 epilogue's (kQuant)
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
  const uint32_t expected_generation = origin.expected_generation;
  uint32_t generation = expected_generation;
  if (threadIdx.x == 0) {
    LoadVolatile32x4(&ctrl->error, control);
    // Issued right behind the control words: the two loads are in flight together.
    if (expected_generation != 0) generation = LoadVolatile32(&ctrl->generation);
  }
  // Then the loads that depend on nothing.
  if (unit < tokens) load_row(unit);
  if constexpr (kNorm) device::LoadRowVectors<kVec>(gamma, p.gamma, t0, stride, vecs_per_row);
  // The static FP8 pattern's scale, loaded with gamma: a load in the epilogue would be a
  // dependent round trip at the end of every row.
  const float static_inv_scale = StaticInvScaleOf<kQuant>(p);
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
    MakeOpDesc(p, s_epoch + 1, origin, desc);
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
      const uint32_t row_parity = parity;
      const float total = RowSumOfSquares(mine, scratch[parity]);
      parity ^= 1u;
      NormEpilogue<DT, kVec, kQuant>(p, ok, row, sum, total, t0, stride, vecs_per_row, gamma,
                                     &qscratch, row_parity, static_inv_scale);
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

}  // namespace fusion_device
}  // namespace arfuse
