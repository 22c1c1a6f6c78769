// The two-shot (reduce-scatter + all-gather) body of the fused kernels. CUDA only; included
// through fusion_device.cuh. docs/kernels.md has the protocol and the memory-ordering argument.
#pragma once

#include "kernels/allreduce_fusion/fusion_epilogue.cuh"
#include "kernels/allreduce_fusion/fusion_sync.cuh"

namespace arfuse {
namespace fusion_device {

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
template <DType DT, bool kNorm, int kBucket, EpilogueQuant kQuant = EpilogueQuant::kNone>
__device__ __forceinline__ uint32_t TwoShotBody(const FusionParams& p, const KernelConfig& cfg,
                                                const LaunchOrigin origin = {}) {
  const uint32_t expected_generation = origin.expected_generation;
  using Tr = device::VecTraits<DT>;
  constexpr int kVec = device::BucketVecs(kBucket);
  __shared__ float scratch[2][32];
  __shared__ QuantScratch qscratch;  // the FP8 epilogue's (kQuant)
  __shared__ BlockWatch watch;
  __shared__ uint32_t s_error, s_seq;
  char* const local = static_cast<char*>(p.peer_workspace[p.rank]);
  FusionControl* const ctrl = ControlOf(local, p.layout);
  const uint32_t vecs_per_row = p.hidden / Tr::kElems;
  const uint32_t t0 = threadIdx.x;
  const uint32_t stride = blockDim.x;
  Raw16 gamma[kVec];
  if constexpr (kNorm) device::LoadRowVectors<kVec>(gamma, p.gamma, t0, stride, vecs_per_row);
  // The static FP8 pattern's scale, loaded with gamma: a load in the epilogue would be a
  // dependent round trip at the end of every row.
  const float static_inv_scale = StaticInvScaleOf<kQuant>(p);
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
  MakeOpDesc(p, seq + 1, origin, desc);
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
            const uint32_t row_parity = parity;
            const float total = RowSumOfSquares(mine, scratch[parity]);
            parity ^= 1u;
            NormEpilogue<DT, kVec, kQuant>(p, true, token, reduced, total, t0, stride, vecs_per_row,
                                           gamma, &qscratch, row_parity, static_inv_scale);
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
