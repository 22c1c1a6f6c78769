// The sidecar's serving launch (doorbell.h, LaunchDoorbellServe): one resident grid that takes
// rings and runs their one-shot ops in place, with no launch per op, and hands what it cannot run
// to the fused launches queued behind it. The waiter, completion and slot kernels are in
// doorbell_waiter.cu; the steps both take a ring with are in ring_service.cuh.
// docs/doorbell.md has the protocol and the memory-ordering argument.
#include <algorithm>

#include "kernels/add_rmsnorm/row_math.cuh"
#include "kernels/allreduce_fusion/fusion_device.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/doorbell/doorbell.h"
#include "kernels/doorbell/doorbell_device.cuh"
#include "kernels/doorbell/ring_service.cuh"

namespace arfuse {
namespace {

// The ring's steps and, through them, the memory-model helpers.
using namespace ring_service;  // NOLINT(build/namespaces)
using fusion_device::EpilogueQuant;

// The serving launch. Block 0's first warp polls; per ring it
// either announces an in-place op or ends the launch, in one ticket word. Every block runs an
// announced op's one-shot body over its rows, then counts itself in `finished`; the block whose
// count is the op's last completes it, and block 0 waits for that before it polls again, so:
//   * the client's completion acquire sees every block's output stores (each block's stores, its
//     bar.sync, its acq_rel count; the last block's acq_rel count reads from that release
//     sequence, then its release of the completion word: a causality chain);
//   * op k + 1 is announced only after op k was completed, which is what the kernel boundary
//     guarantees between two one-shot launches (the epoch advanced by op k and the sentinels
//     written back by every block are visible to every block of op k + 1: the completing block's
//     release of `done`, block 0's acquire of it, block 0's fence and ticket store, the other
//     blocks' acquire of the ticket; the Lamport buffer argument of docs/kernels.md holds
//     unchanged).
// Completing in the last block, not in block 0 after it saw every count, saves the client one
// poll of block 0 (its sleep and its load's way back) per op of more than one block.
// Idle blocks wait for the ticket with __nanosleep between polls of one L2 word: they hold their
// SM slots (registers, threads) but issue almost nothing. 32 ns rather than 100: on 2x H200 the
// shorter sleep was no slower at 1-128 tokens and up to 0.3 us faster at 16, and a client's
// kernel running beside the idle launch was as fast with either (docs/doorbell.md, "Ninth
// session").
constexpr uint32_t kCmdRun = 1;
constexpr uint32_t kCmdLeave = 2;
constexpr uint32_t kTicketBackoffNs = 32;
constexpr uint32_t kNoSlot = 0xffffffffu;

// Ticket: bits 0-31 the op's number in the launch (1, 2, ..., wrapping: blocks compare it for
// equality with the last number they saw), 32-55 the token count, 56-60 the slot, 61 the ring was
// local (kDoorbellRequestLocal), 62 leave. Every field of the op in the word that announces it:
// a block that sees a number reads that op, never a mix of two.
constexpr uint32_t kTicketMaxTokens = (1u << 24) - 1u;
constexpr uint64_t kTicketLocal = uint64_t{1} << 61;
constexpr uint64_t kTicketLeave = uint64_t{1} << 62;
static_assert(kMaxDoorbellSlots <= 32, "the ticket's slot field has 5 bits");

__device__ __forceinline__ uint64_t RunTicket(uint32_t op, uint32_t slot, uint32_t tokens,
                                              bool local) {
  return uint64_t{op} | (uint64_t{tokens} << 32) | (uint64_t{slot} << 56) |
         (local ? kTicketLocal : 0u);
}
__device__ __forceinline__ uint64_t LeaveTicket(uint32_t op) { return uint64_t{op} | kTicketLeave; }
__device__ __forceinline__ uint32_t TicketOp(uint64_t t) { return static_cast<uint32_t>(t); }
__device__ __forceinline__ uint32_t TicketTokens(uint64_t t) {
  return static_cast<uint32_t>(t >> 32) & kTicketMaxTokens;
}
__device__ __forceinline__ uint32_t TicketSlot(uint64_t t) {
  return static_cast<uint32_t>(t >> 56) & 31u;
}

// The most tokens a ring on `slot` may have to run in place in a launch of the template's shape
// (0: never): the op record's checks (token count within the plan's maximum, below its two-shot
// threshold) and the shape of the launch. The plan table does not change while a launch that has
// the slot in its mask runs (docs/doorbell.md, "Plan changes"), so block 0's first warp works
// this out once per launch (lane i for slot i) instead of reading the plan entry after each CAS.
static_assert(kMaxDoorbellSlots == 32, "one lane of block 0's first warp per slot");
__device__ uint32_t InPlaceTokenLimit(const DoorbellServeParams& sp, uint32_t slot) {
  if (((sp.inplace_mask >> slot) & 1u) == 0) return 0;
  const DoorbellPlanEntry& e = sp.wait.plans[slot];
  const FusionParams& p = e.params;
  const FusionParams& t = sp.inplace_template;
  if (e.twoshot_min_tokens == 0 || p.dtype != t.dtype || p.pattern != t.pattern ||
      p.hidden != t.hidden || p.world_size != t.world_size || p.rank != t.rank ||
      p.sm_budget != t.sm_budget) {
    return 0;
  }
  const uint64_t row_bytes = static_cast<uint64_t>(p.hidden) * DTypeSize(p.dtype);
  const uint64_t rows_in_slot = t.layout.lamport_slot_bytes / row_bytes;
  const uint32_t by_plan = min(min(e.max_tokens, e.twoshot_min_tokens - 1), kTicketMaxTokens);
  return static_cast<uint32_t>(min(static_cast<uint64_t>(by_plan), rows_in_slot));
}

// Thread 0 of the block that completes an in-place op (block 0 for a one-block op, else the last
// block to count in). `maybe_failed`: some block reported a failure (or the op timed out): only
// then is the workspace error word read (a round trip the successful op does not pay; every way
// the word gets set during an op goes through a failing block, and an error left by an earlier op
// makes every block fail at once). Returns the DoorbellError written to the slot (0: the op
// succeeded).
__device__ uint32_t CompleteInPlace(DoorbellSlot* slot, const FusionParams& p, bool maybe_failed,
                                    bool local) {
  const uint32_t error =
      maybe_failed ? FusionSlotError(LoadRelaxedSys(
                         &fusion_device::ControlOf(p.peer_workspace[p.rank], p.layout)->error))
                   : 0u;
  CompleteSlot(slot, error, local);
  return error;
}

// DoorbellServeState::finished, per op (zeroed by block 0 after the op, before it announces the
// next): bits 0-15 count the blocks in, bit 16 says block 0 gave up waiting (a block that never
// became resident), bits 24-31 count failed blocks (at most kMaxDoorbellServeBlocks, so they never
// wrap to zero). Only block 0 zeroes it, in program order with its closing add: a zeroing by the
// completing block could land between block 0's deadline and its add, which would then read zero
// and fail (and complete a second time) an op that had just completed.
constexpr uint32_t kFinishedOne = 1u;
constexpr uint32_t kFinishedCountMask = 0xffffu;
constexpr uint32_t kFinishedClosed = 1u << 16;
constexpr uint32_t kFinishedFail = 1u << 24;
static_assert(kMaxDoorbellServeBlocks <= kFinishedCountMask, "the count fits its bits");
static_assert(kMaxDoorbellServeBlocks <= (0xffffffffu >> 24), "the failure count fits its bits");

// Thread 0 of the block whose count made `finished` reach the op's blocks: completes op `op`,
// then, behind the completion (off the client's path), releases `done`, which block 0 waits for
// before it zeroes `finished` and polls again.
__device__ void CompleteAsLastBlock(DoorbellServeState* st, DoorbellSlot* slot,
                                    const FusionParams& p, bool maybe_failed, bool local,
                                    uint32_t op, bool trace) {
  const uint32_t error = CompleteInPlace(slot, p, maybe_failed, local);
  StoreVolatile32(&st->error, error);
  if (trace) {
    *static_cast<volatile uint64_t*>(&st->completed_ns) = GlobalTimerNs();
  }
  StoreReleaseGpu32(&st->done, op);
}

// Block 0, thread 0: waits until op `op` of `active` blocks was completed and returns the error
// it was completed with. Every resident block ends its op within its spins' deadline; a block
// that never became resident (SMs taken by other contexts' spinning kernels) must not wedge the
// launch: past twice that deadline block 0 closes the count (a late block's add then cannot be
// the last) and, unless the last block had already counted in, fails the op as a timeout and
// completes it itself (the late block sees the leave ticket that follows and does not run it).
__device__ uint32_t AwaitCompletion(DoorbellServeState* st, DoorbellSlot* slot,
                                    const FusionParams& p, uint32_t active, bool local,
                                    uint32_t op) {
  const uint64_t wait_start = GlobalTimerNs();
  bool closed = false;
  while (LoadAcquireGpu32(&st->done) != op) {
    __nanosleep(32);
    if (!closed && GlobalTimerNs() - wait_start > 2 * p.spin_timeout_ns) {
      closed = true;
      const uint32_t before = atomicAdd(&st->finished, kFinishedClosed);
      // The last block already counted in: it completes the op and releases `done` within a
      // few instructions (it is resident and past its body); the zeroing after the op clears
      // the closed bit.
      if ((before & kFinishedCountMask) == active) continue;
      atomicCAS(&fusion_device::ControlOf(p.peer_workspace[p.rank], p.layout)->error, 0u,
                static_cast<uint32_t>(FusionError::kTimeout));
      // `finished` keeps the closed bit: the launch ends, and a block still in the op counts
      // in behind this without completing it. The last block to leave zeroes the word.
      return CompleteInPlace(slot, p, /*maybe_failed=*/true, local);
    }
  }
  // Every block of the op counted in: zeroed for the next op (the fence after the op orders
  // this before the next ticket, so before the next op's counts).
  StoreVolatile32(&st->finished, 0u);
  return LoadVolatile32(&st->error);
}

// Every block: the op's params into shared memory, from the plan table (read-only while the
// launch runs: cached loads), with the ring's token count. A block keeps them for the next op:
// when that op is on the same slot only the token count changes (set with the op's announcement,
// before the barrier that follows it), so the copy and its two barriers are off the path of a
// client that rings one plan.
__device__ void LoadInPlaceParams(const DoorbellServeParams& sp, uint32_t slot, uint32_t n,
                                  FusionParams* out) {
  const uint64_t* src = reinterpret_cast<const uint64_t*>(&sp.wait.plans[slot].params);
  uint64_t* dst = reinterpret_cast<uint64_t*>(out);
  for (uint32_t i = threadIdx.x; i < sizeof(FusionParams) / sizeof(uint64_t); i += blockDim.x) {
    dst[i] = __ldg(src + i);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    out->num_tokens = n;
    out->algo = FusionAlgo::kOneShot;
  }
  __syncthreads();
}

// kQuant: kAny for the FP8 patterns (the one-shot body's norm epilogue quantizes; each plan's
// params say how), bf16 and fp16 only, as the fused kernels.
template <DType DT, bool kNorm, int kBucket, EpilogueQuant kQuant>
__global__ void __launch_bounds__(device::BucketMaxThreads(kBucket), 1)
    DoorbellServeKernel(const DoorbellServeParams sp) {
  // As the waiter: the op record must not be overwritten before the kernel before it finished.
  WaitForPrerequisiteGrid();
  __shared__ FusionParams s_params;
  __shared__ uint32_t s_cmd, s_op, s_slot, s_tokens, s_active, s_local;
  __shared__ uint32_t s_params_slot;  // the slot s_params belongs to (kNoSlot: none yet)
  DoorbellServeState* const st = sp.state;
  const uint32_t units = gridDim.x;
  const fusion_device::KernelConfig cfg = fusion_device::DefaultKernelConfig();
  uint32_t ops = 0;             // thread 0: the number of the last op this block saw announced
  bool ticket_due = false;      // block 0, thread 0: the current op's ticket follows its completion
  uint64_t since = 0;           // block 0, lane 0: the idle deadline counts from here
  uint32_t error_in_place = 0;  // block 0, thread 0: the failed in-place op's error, slot and
  uint32_t failed_slot = 0;     // token count
  uint32_t failed_tokens = 0;
  DoorbellTraceRecord stamp{};  // block 0, thread 0, with a trace
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    since = GlobalTimerNs();
    // The release pattern of the first ticket (see the fence after each op below).
    FenceAcqRelGpu();
  }
  if (threadIdx.x == 0) s_params_slot = kNoSlot;  // read after the loop's first barrier
  // Block 0's first warp: lane i holds the in-place token limit of slot i.
  const uint32_t inplace_limit =
      blockIdx.x == 0 && threadIdx.x < kMaxDoorbellSlots ? InPlaceTokenLimit(sp, threadIdx.x) : 0u;
  for (;;) {
    if (blockIdx.x == 0) {
      if (threadIdx.x < 32) {
        const uint32_t failed = __shfl_sync(0xffffffffu, error_in_place, 0);
        RingPoll r{-1, static_cast<uint32_t>(DoorbellOutcome::kFailedInPlace), 0, false};
        bool in_place = false;
        uint32_t n = 0;
        if (failed == 0) {
          r = PollForRing(sp.wait, since, /*check_first=*/ops == 0);
          if (sp.trace != nullptr && threadIdx.x == 0) {
            stamp.taken = clock64();
            stamp.taken_ns = GlobalTimerNs();
            if (r.served >= 0) {
              // The ring's stamps (zero unless the client runs with ARFUSE_RING_TRACE=1): on the
              // request line, ordered before the request this warp acquired.
              const uint64_t* words = reinterpret_cast<const uint64_t*>(
                  &sp.wait.slots[r.served].reserved0[kDoorbellRingStampWord]);
              stamp.ring_start_ns = LoadRelaxedSys64(words);
              stamp.ring_release_ns = LoadRelaxedSys64(words + 1);
            }
          }
          if (r.served >= 0) {
            n = r.tokens;
            const uint32_t limit = __shfl_sync(0xffffffffu, inplace_limit, r.served);
            in_place = n > 0 && n <= limit;
          }
          // Anything else goes to the kernels behind through the op record, as from the waiter.
          if (!in_place) WriteOpRecord(sp.wait, r);
        } else if (threadIdx.x == 0) {
          // The failed op's slot and token count stay in the record for the host's report;
          // nothing is left to run.
          sp.wait.op->params.num_tokens = 0;
          sp.wait.op->outcome = r.outcome;
          sp.wait.op->slot = failed_slot;
          sp.wait.op->num_tokens = failed_tokens;
        }
        __syncwarp();
        if (threadIdx.x == 0) {
          const uint32_t active = in_place ? min(units, n) : 0u;
          const uint32_t slot = static_cast<uint32_t>(r.served);
          const uint64_t ticket =
              in_place ? RunTicket(ops + 1, slot, n, r.local) : LeaveTicket(ops + 1);
          // With one active block (one token, or a one-block grid) nobody else runs the op: its
          // ticket, which then only tells the other blocks to sit it out, is stored after the
          // completion. Otherwise now: a plain store, released by the fence after the last op
          // (or at the launch's start), which this thread issued before it polled.
          ticket_due = in_place && active == 1;
          if (!ticket_due) StoreRelaxedGpu64(&st->ticket, ticket);
          s_cmd = in_place ? kCmdRun : kCmdLeave;
          s_op = ops + 1;
          s_slot = slot;
          s_tokens = n;
          s_active = active;
          s_local = r.local ? 1u : 0u;
          if (in_place && s_params_slot == s_slot) s_params.num_tokens = n;
        }
      }
      __syncthreads();
    } else {
      if (threadIdx.x == 0) {
        // A block sees every op it runs: block 0 announces op k + 1 only after op k was
        // completed, which needs the count of every block that runs op k. It may miss ops it
        // sits out (a newer ticket replaced the word before this block looked).
        uint64_t t;
        while (TicketOp(t = LoadAcquireGpu64(&st->ticket)) == ops) __nanosleep(kTicketBackoffNs);
        const uint32_t n = TicketTokens(t);
        s_cmd = (t & kTicketLeave) != 0 ? kCmdLeave : kCmdRun;
        s_op = TicketOp(t);
        s_slot = TicketSlot(t);
        s_tokens = n;
        s_active = min(units, n);
        s_local = (t & kTicketLocal) != 0 ? 1u : 0u;
        if (s_cmd == kCmdRun && s_params_slot == s_slot) s_params.num_tokens = n;
      }
      __syncthreads();
    }
    if (s_cmd == kCmdLeave) break;
    ops = s_op;
    const uint32_t active = s_active;
    if (sp.trace != nullptr && blockIdx.x == 0 && threadIdx.x == 0) stamp.announced = clock64();
    // Blocks beyond the op's rows sit it out: they neither run it nor count (the one-shot
    // body's own counting and epoch advance use `active` as the grid).
    bool block_failed = false;
    if (blockIdx.x < active) {
      if (s_params_slot != s_slot) {
        LoadInPlaceParams(sp, s_slot, s_tokens, &s_params);
        if (threadIdx.x == 0) s_params_slot = s_slot;  // read after the op's last barrier
      }
      const uint32_t failure =
          fusion_device::OneShotBody<DT, kNorm, kBucket, kQuant>(s_params, cfg, blockIdx.x, active);
      // Every thread's stores of this block before its count (or, for a one-block op, the
      // completion); the OR says whether any thread of the block failed.
      block_failed = __syncthreads_or(failure != 0) != 0;
      if (sp.trace != nullptr && blockIdx.x == 0 && threadIdx.x == 0) stamp.rows_done = clock64();
      if (threadIdx.x == 0 && active > 1) {
        const uint32_t add = kFinishedOne + (block_failed ? kFinishedFail : 0u);
        const uint32_t now = AtomicAddAcqRelGpu(&st->finished, add) + add;
        if ((now & kFinishedClosed) == 0 && (now & kFinishedCountMask) == active) {
          CompleteAsLastBlock(st, &sp.wait.slots[s_slot], s_params, now >= kFinishedFail,
                              s_local != 0, ops, sp.trace != nullptr);
        }
      }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      DoorbellSlot* const slot = &sp.wait.slots[s_slot];
      if (active > 1) {
        error_in_place = AwaitCompletion(st, slot, s_params, active, s_local != 0, ops);
        if (sp.trace != nullptr) {
          stamp.all_done = clock64();
          stamp.completed = stamp.all_done;
          stamp.completed_ns = *static_cast<volatile uint64_t*>(&st->completed_ns);
        }
      } else {
        if (sp.trace != nullptr) stamp.all_done = clock64();
        error_in_place = CompleteInPlace(slot, s_params, block_failed, s_local != 0);
        // Keeps `done` current (a posted store): a stale number could otherwise match a later
        // op's after the numbers wrapped.
        StoreVolatile32(&st->done, ops);
        if (sp.trace != nullptr) {
          stamp.completed = clock64();
          stamp.completed_ns = GlobalTimerNs();
        }
      }
      if (sp.trace != nullptr) {
        stamp.tokens = s_tokens;
        stamp.op = ops;
        sp.trace[(ops - 1) % sp.trace_ops] = stamp;
      }
      if (ticket_due) {
        StoreRelaxedGpu64(&st->ticket, RunTicket(ops, s_slot, s_tokens, s_local != 0));
      }
      // The next ticket's release, issued now while the client works towards its next ring: this
      // thread acquired `done` from the block that completed the op (or completed it itself), so
      // the fence orders every block's op before whatever this thread stores next.
      FenceAcqRelGpu();
      failed_slot = s_slot;
      failed_tokens = s_tokens;
      // For the host's counters while the launch stays resident (a posted store to host
      // memory, after the completion: off the client's path).
      if (sp.report != nullptr) {
        static_cast<volatile DoorbellReport*>(sp.report)->served_in_place = ops;
      }
      since = GlobalTimerNs();
    }
    // s_params and the shared words are rewritten at the next op: nobody may still read them.
    __syncthreads();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (blockIdx.x == 0 && sp.report != nullptr) {
      volatile DoorbellReport* r = sp.report;
      r->served_in_place = ops;
      r->error_in_place = error_in_place;
    }
    // Every block read the words before it counts itself out; the next launch on the stream
    // starts after this one ended.
    if (AtomicAddAcqRelGpu(&st->left, 1u) == units - 1) {
      StoreRelaxedGpu64(&st->ticket, 0u);
      StoreVolatile32(&st->finished, 0u);
      StoreVolatile32(&st->done, 0u);
      StoreVolatile32(&st->error, 0u);
      StoreVolatile32(&st->left, 0u);
    }
  }
  // The launches behind (a handed-off op) may be scheduled now; they wait for this grid to end.
  AllowDependentLaunch();
}

// The serving launch's grid: at most max_blocks and kMaxDoorbellServeBlocks (the count's bits), and
// never more than can be resident at once within the template's SM budget (every block must be
// resident: an op completes when all of its blocks counted in).
template <DType DT, bool kNorm, int kBucket, EpilogueQuant kQuant>
cudaError_t LaunchServeTyped(const DoorbellServeParams& sp, cudaStream_t stream, bool pdl) {
  const FusionParams& t = sp.inplace_template;
  const uint32_t vecs_per_row = t.hidden / device::VecTraits<DT>::kElems;
  const int threads = device::RowBlockThreads(vecs_per_row);
  auto* kernel = &DoorbellServeKernel<DT, kNorm, kBucket, kQuant>;
  const uint32_t resident =
      FusionResidentBlocks(reinterpret_cast<const void*>(kernel), threads, t.sm_budget);
  if (resident == 0) return cudaErrorInvalidDevice;
  const unsigned grid = std::max(1u, std::min({sp.max_blocks, resident, kMaxDoorbellServeBlocks}));
  return LaunchKernel(kernel, grid, static_cast<unsigned>(threads), pdl, stream, sp);
}

template <DType DT, bool kNorm, EpilogueQuant kQuant>
cudaError_t LaunchServeBucket(const DoorbellServeParams& sp, cudaStream_t stream, bool pdl) {
  return device::WithRowBucket(
      sp.inplace_template.hidden / device::VecTraits<DT>::kElems, [&](auto bucket) {
        return LaunchServeTyped<DT, kNorm, decltype(bucket)::value, kQuant>(sp, stream, pdl);
      });
}

// The FP8 epilogue takes bf16 or fp16 input (the op contract refuses fp32 FP8 ops).
template <DType DT>
inline constexpr bool kHasQuantServe = DT != DType::kFP32;

template <DType DT>
cudaError_t LaunchServeForDType(const DoorbellServeParams& sp, cudaStream_t stream, bool pdl) {
  const PatternTraits traits = TraitsOf(sp.inplace_template.pattern);
  if (!traits.valid) return cudaErrorInvalidValue;
  if (!traits.norm) return LaunchServeBucket<DT, false, EpilogueQuant::kNone>(sp, stream, pdl);
  if (traits.quant == QuantKind::kNone)
    return LaunchServeBucket<DT, true, EpilogueQuant::kNone>(sp, stream, pdl);
  if constexpr (kHasQuantServe<DT>)
    return LaunchServeBucket<DT, true, EpilogueQuant::kAny>(sp, stream, pdl);
  return cudaErrorInvalidValue;
}

template <DType DT, bool kNorm, EpilogueQuant kQuant>
cudaError_t LoadServeKernels() {
  return LoadKernelFunctions(
      {reinterpret_cast<const void*>(&DoorbellServeKernel<DT, kNorm, 0, kQuant>),
       reinterpret_cast<const void*>(&DoorbellServeKernel<DT, kNorm, 1, kQuant>),
       reinterpret_cast<const void*>(&DoorbellServeKernel<DT, kNorm, 2, kQuant>),
       reinterpret_cast<const void*>(&DoorbellServeKernel<DT, kNorm, 3, kQuant>)});
}

template <DType DT>
cudaError_t LoadServeDTypeKernels() {
  cudaError_t quant = cudaSuccess;
  if constexpr (kHasQuantServe<DT>) quant = LoadServeKernels<DT, true, EpilogueQuant::kAny>();
  return FirstError({LoadServeKernels<DT, false, EpilogueQuant::kNone>(),
                     LoadServeKernels<DT, true, EpilogueQuant::kNone>(), quant});
}

}  // namespace

cudaError_t PrepareDoorbellSidecarKernels() {
  return FirstError({ring_service::PrepareDoorbellWaiterKernels(),
                     LoadServeDTypeKernels<DType::kBF16>(), LoadServeDTypeKernels<DType::kFP16>(),
                     LoadServeDTypeKernels<DType::kFP32>(), PrepareAllReduceFusionKernels()});
}

cudaError_t CheckDoorbellServeParams(const DoorbellServeParams& sp, const char** why) {
  const char* problem = nullptr;
  if (CheckDoorbellWaitParams(sp.wait, &problem) != cudaSuccess) {
    // problem names it
  } else if (sp.state == nullptr || !Aligned(sp.state, kDoorbellLineBytes)) {
    problem = "serving state is null or not 128-byte aligned";
  } else if (sp.report != nullptr && !Aligned(sp.report, 4)) {
    problem = "doorbell report is misaligned";
  } else if (sp.inplace_mask == 0 || (sp.inplace_mask & ~sp.wait.slot_mask) != 0) {
    problem = "in-place slot mask is empty or not within the waiter's slot mask";
  } else if (sp.max_blocks == 0) {
    problem = "serving launch has no blocks (max_blocks is 0)";
  } else if (sp.trace != nullptr && (sp.trace_ops == 0 || !Aligned(sp.trace, 8))) {
    problem = "serving trace has no records or is misaligned";
  } else {
    FusionParams t = sp.inplace_template;
    t.num_tokens = 0;
    t.algo = FusionAlgo::kOneShot;
    if (CheckFusionParams(t, &problem) != cudaSuccess && problem == nullptr) {
      problem = "in-place template is not a valid fused op";
    }
  }
  if (why != nullptr) *why = problem;
  return problem == nullptr ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t LaunchDoorbellServe(const DoorbellServeParams& params, cudaStream_t stream,
                                bool programmatic_dependent) {
  if (cudaError_t err = CheckDoorbellServeParams(params, nullptr); err != cudaSuccess) return err;
  switch (params.inplace_template.dtype) {
    case DType::kBF16:
      return LaunchServeForDType<DType::kBF16>(params, stream, programmatic_dependent);
    case DType::kFP16:
      return LaunchServeForDType<DType::kFP16>(params, stream, programmatic_dependent);
    case DType::kFP32:
      return LaunchServeForDType<DType::kFP32>(params, stream, programmatic_dependent);
  }
  return cudaErrorInvalidValue;
}

}  // namespace arfuse
