// The fused allreduce kernels. docs/kernels.md has the protocol and the memory-ordering argument;
// the comments here say which step of it each piece is.
#include <algorithm>
#include <atomic>
#include <mutex>

#include "kernels/add_rmsnorm/row_math.cuh"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/allreduce_fusion/fusion_control.h"

namespace arfuse {
namespace {

using device::kMaxVecPerThread;
using device::Raw16;

// How many polls between checks of the abort words and the clock: the checks cost loads of
// other cache lines, the polls are what makes the latency.
constexpr uint32_t kPollsPerCheck = 64;

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

__device__ __forceinline__ FusionControl* ControlOf(void* workspace, const WorkspaceLayout& l) {
  return reinterpret_cast<FusionControl*>(static_cast<char*>(workspace) + l.control_offset);
}

// Records the first error of this workspace, mirrors it to the host word, and tells every peer
// to stop spinning (they would otherwise wait for their own deadline). A peer's own failure
// (kPeerAbort) is not forwarded again.
__device__ void RecordError(const FusionParams& p, uint32_t code) {
  FusionControl* ctrl = ControlOf(p.peer_workspace[p.rank], p.layout);
  const uint32_t previous = atomicCAS(&ctrl->error, 0u, code);
  if (previous == 0u && p.host_error != nullptr) StoreVolatile32(p.host_error, code);
  if (code == static_cast<uint32_t>(FusionError::kPeerAbort)) return;
  for (int q = 0; q < p.world_size; ++q) {
    if (q == p.rank) continue;
    StoreVolatile32(&ControlOf(p.peer_workspace[q], p.layout)->abort,
                    static_cast<uint32_t>(FusionError::kPeerAbort));
  }
  __threadfence_system();
}

// Bounded spin bookkeeping: every kPollsPerCheck polls, looks at the host abort word, this
// workspace's abort and error words, and the clock.
struct SpinWatch {
  uint64_t start_ns = 0;
  uint32_t polls = 0;

  __device__ __forceinline__ uint32_t Check(const FusionParams& p, FusionControl* ctrl) {
    if (++polls % kPollsPerCheck != 0) return 0;
    if (p.host_abort != nullptr && LoadVolatile32(p.host_abort) != 0) {
      return static_cast<uint32_t>(FusionError::kHostAbort);
    }
    const uint32_t abort = LoadVolatile32(&ctrl->abort);
    if (abort != 0) {
      return abort == static_cast<uint32_t>(FusionError::kPeerAbort)
                 ? abort
                 : static_cast<uint32_t>(FusionError::kHostAbort);
    }
    // Another thread of this rank already failed: leave quietly (its code is recorded).
    if (LoadVolatile32(&ctrl->error) != 0) return static_cast<uint32_t>(FusionError::kPoisoned);
    const uint64_t now = GlobalTimerNs();
    if (start_ns == 0) {
      start_ns = now;
    } else if (now - start_ns > p.spin_timeout_ns) {
      return static_cast<uint32_t>(FusionError::kTimeout);
    }
    return 0;
  }
};

// Entry check shared by both kernels: a poisoned workspace runs nothing. Returns true when the
// block must exit. Block 0 forwards the abort to the peers so they do not wait for a deadline.
__device__ bool ExitIfPoisoned(const FusionParams& p, FusionControl* ctrl) {
  __shared__ uint32_t s_error;
  if (threadIdx.x == 0) s_error = LoadVolatile32(&ctrl->error);
  __syncthreads();
  if (s_error == 0) return false;
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    RecordError(p, static_cast<uint32_t>(FusionError::kPoisoned));
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// One-shot Lamport. Call k (k = this workspace's epoch) uses buffer k % 3 on every rank:
//   1. push: this rank's sanitized input rows go into slot `rank` of buffer k % 3 of every peer;
//   2. clear: this rank's own buffer (k + 2) % 3, used by call k - 1, is reset to the sentinel
//      for the elements call k - 1 wrote (peers write into it again only in call k + 2, which
//      needs this rank's call-k+1 data, which this rank stores only after this kernel ended);
//   3. for each row: spin until no element of any peer's slot holds the sentinel (raw bits),
//      sum in rank order (own input at position `rank`), then the row's epilogue.
// Block b handles rows b, b + grid, ... on every rank; it pushes all its rows before reading any.
template <DType DT, bool kNorm>
__device__ __forceinline__ void OneShotBody(const FusionParams& p) {
  using Tr = device::VecTraits<DT>;
  __shared__ float scratch[32];
  __shared__ uint32_t s_epoch;
  __shared__ uint64_t s_clear_elems;
  char* const local = static_cast<char*>(p.peer_workspace[p.rank]);
  FusionControl* const ctrl = ControlOf(local, p.layout);
  if (ExitIfPoisoned(p, ctrl)) return;
  if (threadIdx.x == 0) {
    s_epoch = LoadVolatile32(&ctrl->lamport_epoch);
    // Written by the previous call's last block: read past L1.
    s_clear_elems = *static_cast<volatile uint64_t*>(&ctrl->lamport_used_elems[(s_epoch + 2) % 3]);
  }
  __syncthreads();
  const uint32_t epoch = s_epoch;
  const uint32_t buf = epoch % 3;
  const uint32_t vecs_per_row = p.hidden / Tr::kElems;
  const uint64_t row_bytes = static_cast<uint64_t>(p.hidden) * (16 / Tr::kElems);
  const uint64_t my_slot = p.layout.lamport_offset + buf * p.layout.lamport_buffer_bytes +
                           static_cast<uint64_t>(p.rank) * p.layout.lamport_slot_bytes;

  // 1. push.
  for (uint32_t row = blockIdx.x; row < p.num_tokens; row += gridDim.x) {
    for (uint32_t v = threadIdx.x; v < vecs_per_row; v += blockDim.x) {
      const uint64_t off = row * row_bytes + v * 16ull;
      const Raw16 x = device::SanitizeNegativeZero<DT>(
          device::LoadRaw(static_cast<const char*>(p.input) + off));
      for (int q = 0; q < p.world_size; ++q) {
        if (q == p.rank) continue;
        device::StoreRaw(static_cast<char*>(p.peer_workspace[q]) + my_slot + off, x);
      }
    }
  }

  // 2. clear the previous call's buffer (its peers' slots; this rank's own slot stays clean).
  {
    const uint64_t clear_vecs = s_clear_elems / Tr::kElems;
    char* const clear_base =
        local + p.layout.lamport_offset + ((epoch + 2) % 3) * p.layout.lamport_buffer_bytes;
    const Raw16 sentinel = device::SentinelVector<DT>();
    for (int q = 0; q < p.world_size; ++q) {
      if (q == p.rank) continue;
      char* const slot = clear_base + q * p.layout.lamport_slot_bytes;
      for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
           i < clear_vecs; i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
        device::StoreRaw(slot + i * 16ull, sentinel);
      }
    }
  }

  // 3. wait, reduce, epilogue.
  const uint64_t data_base = p.layout.lamport_offset + buf * p.layout.lamport_buffer_bytes;
  SpinWatch watch;
  uint32_t failure = 0;       // this thread's
  bool block_failed = false;  // any thread's: uniform across the block
  for (uint32_t row = blockIdx.x; row < p.num_tokens; row += gridDim.x) {
    Raw16 reduced[kMaxVecPerThread];
#pragma unroll
    for (int k = 0; k < kMaxVecPerThread; ++k) {
      const uint32_t v = threadIdx.x + k * blockDim.x;
      if (v >= vecs_per_row || failure != 0) continue;
      const uint64_t off = row * row_bytes + v * 16ull;
      float acc[Tr::kElems];
      for (int q = 0; q < p.world_size; ++q) {
        Raw16 x;
        if (q == p.rank) {
          x = device::SanitizeNegativeZero<DT>(
              device::LoadRaw(static_cast<const char*>(p.input) + off));
        } else {
          const char* src = local + data_base + q * p.layout.lamport_slot_bytes + off;
          x = device::LoadRawVolatile(src);
          while (device::HasSentinel<DT>(x)) {
            failure = watch.Check(p, ctrl);
            if (failure != 0) break;
            x = device::LoadRawVolatile(src);
          }
          if (failure != 0) break;
        }
        device::Accumulate<DT>(acc, x, q == 0);
      }
      if (failure != 0) continue;
      reduced[k] = device::RoundSum<DT>(acc);
      if constexpr (!kNorm) {
        device::StoreRaw(static_cast<char*>(p.output) + off, reduced[k]);
      }
    }
    block_failed = __syncthreads_or(failure != 0) != 0;
    if (block_failed) break;
    if constexpr (kNorm) {
      const uint64_t off = row * row_bytes;
      device::ResidualRmsNormRow<DT>(reduced, vecs_per_row, p.hidden, p.eps,
                                     static_cast<const char*>(p.residual_in) + off,
                                     static_cast<char*>(p.residual_out) + off,
                                     static_cast<char*>(p.norm_out) + off, p.gamma, scratch);
    }
  }
  if (block_failed) {
    // Only threads that saw the failure record it; the epoch does not advance: the workspace
    // is poisoned until re-initialized.
    if (failure != 0 && failure != static_cast<uint32_t>(FusionError::kPoisoned)) {
      RecordError(p, failure);
    }
    return;
  }
  // 4. the last block to finish advances the epoch and records what buffer `buf` now holds.
  //    The next call (a later kernel on this stream) reads both.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t arrived = atomicAdd(&ctrl->lamport_arrived, 1u);
    if (arrived == gridDim.x - 1) {
      ctrl->lamport_arrived = 0;
      ctrl->lamport_used_elems[buf] = static_cast<uint64_t>(p.num_tokens) * p.hidden;
      StoreVolatile32(&ctrl->lamport_epoch, epoch + 1);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Two-shot: rank q owns the token slice [q * S, (q + 1) * S), S = ceil(T / N). Block b handles
// slice rows b, b + grid, ... (same on every rank, the grid depends only on the shape):
//   1. scatter: rows of slice q go to slot `rank` of q's scatter inbox;
//   2. barrier 1 (per block, release/acquire at system scope, value seq + 1);
//   3. the owner sums its slice rows in rank order, rounds (step 3), and writes the reduced row
//      into every rank's gather inbox at the row's global position;
//   4. barrier 2 (value seq + 2);
//   5. every rank reads the gathered rows of block b and runs the epilogue with its own
//      residual_in: the same bits on every rank because the reduced rows are identical.
// Inbox reuse by the next call is safe: a peer starts call k + 1 only after its call-k kernel
// ended, i.e. after all of this rank's blocks passed barrier 2 of call k (done reading scatter);
// and a peer's block b writes gather in call k + 1 only after this rank's block b arrived at
// barrier 1 of call k + 1, i.e. after this rank's whole call-k kernel ended.
template <DType DT, bool kNorm>
__device__ __forceinline__ void TwoShotBody(const FusionParams& p) {
  using Tr = device::VecTraits<DT>;
  __shared__ float scratch[32];
  __shared__ uint32_t s_seq;
  char* const local = static_cast<char*>(p.peer_workspace[p.rank]);
  FusionControl* const ctrl = ControlOf(local, p.layout);
  if (ExitIfPoisoned(p, ctrl)) return;
  if (threadIdx.x == 0) s_seq = LoadVolatile32(&ctrl->twoshot_seq);
  __syncthreads();
  const uint32_t seq = s_seq;
  const uint32_t n = static_cast<uint32_t>(p.world_size);
  const uint32_t slice = (p.num_tokens + n - 1) / n;
  const uint32_t vecs_per_row = p.hidden / Tr::kElems;
  const uint64_t row_bytes = static_cast<uint64_t>(p.hidden) * (16 / Tr::kElems);
  SpinWatch watch;
  uint32_t failure = 0;       // this thread's
  bool block_failed = false;  // any thread's: uniform across the block

  // Per-block barrier: thread q (< N) signals rank q and waits for rank q's signal.
  auto barrier = [&](uint32_t value) -> bool {
    __syncthreads();
    const uint32_t q = threadIdx.x;
    if (q < n && q != static_cast<uint32_t>(p.rank)) {
      StoreReleaseSys(&ControlOf(p.peer_workspace[q], p.layout)->barrier[blockIdx.x][p.rank],
                      value);
      const uint32_t* flag = &ctrl->barrier[blockIdx.x][q];
      // Peers may already be one barrier further (value + 1): compare as a sequence number.
      while (static_cast<int32_t>(LoadAcquireSys(flag) - value) < 0) {
        failure = watch.Check(p, ctrl);
        if (failure != 0) break;
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
      for (uint32_t v = threadIdx.x; v < vecs_per_row; v += blockDim.x) {
        const Raw16 x = device::SanitizeNegativeZero<DT>(device::LoadRaw(
            static_cast<const char*>(p.input) + token * row_bytes + v * 16ull));
        device::StoreRaw(inbox + i * row_bytes + v * 16ull, x);
      }
    }
  }
  if (!barrier(seq + 1)) {
    // 3. reduce the own slice and all-gather it.
    const char* const scatter = local + p.layout.scatter_offset;
    for (uint32_t i = blockIdx.x; i < slice; i += gridDim.x) {
      const uint32_t token = static_cast<uint32_t>(p.rank) * slice + i;
      if (token >= p.num_tokens) break;
      for (uint32_t v = threadIdx.x; v < vecs_per_row; v += blockDim.x) {
        float acc[Tr::kElems];
        for (uint32_t q = 0; q < n; ++q) {
          const Raw16 x =
              q == static_cast<uint32_t>(p.rank)
                  ? device::SanitizeNegativeZero<DT>(device::LoadRaw(
                        static_cast<const char*>(p.input) + token * row_bytes + v * 16ull))
                  : device::LoadRawCg(scatter + q * p.layout.scatter_slot_bytes +
                                      i * row_bytes + v * 16ull);
          device::Accumulate<DT>(acc, x, q == 0);
        }
        const Raw16 reduced = device::RoundSum<DT>(acc);
        for (uint32_t step = 0; step < n; ++step) {
          const uint32_t q = (static_cast<uint32_t>(p.rank) + step) % n;
          device::StoreRaw(static_cast<char*>(p.peer_workspace[q]) + p.layout.gather_offset +
                               token * row_bytes + v * 16ull,
                           reduced);
        }
      }
    }
    if (!barrier(seq + 2)) {
      // 5. epilogue over the gathered rows this block's peers wrote.
      const char* const gather = local + p.layout.gather_offset;
      for (uint32_t s = 0; s < n; ++s) {
        for (uint32_t i = blockIdx.x; i < slice; i += gridDim.x) {
          const uint32_t token = s * slice + i;
          if (token >= p.num_tokens) break;
          const uint64_t off = token * row_bytes;
          if constexpr (kNorm) {
            Raw16 reduced[kMaxVecPerThread];
#pragma unroll
            for (int k = 0; k < kMaxVecPerThread; ++k) {
              const uint32_t v = threadIdx.x + k * blockDim.x;
              if (v < vecs_per_row) reduced[k] = device::LoadRawCg(gather + off + v * 16ull);
            }
            device::ResidualRmsNormRow<DT>(reduced, vecs_per_row, p.hidden, p.eps,
                                           static_cast<const char*>(p.residual_in) + off,
                                           static_cast<char*>(p.residual_out) + off,
                                           static_cast<char*>(p.norm_out) + off, p.gamma,
                                           scratch);
          } else {
            for (uint32_t v = threadIdx.x; v < vecs_per_row; v += blockDim.x) {
              device::StoreRaw(static_cast<char*>(p.output) + off + v * 16ull,
                               device::LoadRawCg(gather + off + v * 16ull));
            }
          }
        }
      }
    }
  }
  if (block_failed) {
    if (failure != 0 && failure != static_cast<uint32_t>(FusionError::kPoisoned)) {
      RecordError(p, failure);
    }
    return;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t arrived = atomicAdd(&ctrl->twoshot_arrived, 1u);
    if (arrived == gridDim.x - 1) {
      ctrl->twoshot_arrived = 0;
      StoreVolatile32(&ctrl->twoshot_seq, seq + 2);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The by-value kernels (LaunchAllReduceFusion): the params are kernel parameters.
template <DType DT, bool kNorm>
__global__ void __launch_bounds__(1024) OneShotKernel(const FusionParams p) {
  OneShotBody<DT, kNorm>(p);
}

template <DType DT, bool kNorm>
__global__ void __launch_bounds__(1024) TwoShotKernel(const FusionParams p) {
  TwoShotBody<DT, kNorm>(p);
}

// The indirect kernels (LaunchAllReduceFusionIndirect): every block copies the op's params from
// device memory into shared memory, then runs them if they belong to this launch. `tmpl` is the
// launch's template: params with no tokens (an idle waiter), another shape or another algorithm
// (a launch queued for another plan or for the other algorithm) make every block return before
// anything of the protocol is touched. The decision reads only the device params and the
// template, so it is the same in every block. One algorithm per kernel: a kernel holding both
// bodies spilled five times more registers (ptxas -v).
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

template <DType DT, bool kNorm, FusionAlgo kAlgo>
__global__ void __launch_bounds__(1024)
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
  if (p.num_tokens == 0 || p.algo != kAlgo || p.dtype != tmpl.dtype ||
      p.pattern != tmpl.pattern || p.hidden != tmpl.hidden || p.world_size != tmpl.world_size ||
      p.rank != tmpl.rank || p.sm_budget != tmpl.sm_budget ||
      elems * DTypeSize(DT) > tmpl.layout.lamport_slot_bytes ||
      slice_elems * DTypeSize(DT) > tmpl.layout.scatter_slot_bytes) {
    return;
  }
  if constexpr (kAlgo == FusionAlgo::kOneShot) {
    OneShotBody<DT, kNorm>(p);
  } else {
    TwoShotBody<DT, kNorm>(p);
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
  static Entry cache[128];
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
  if (used < 128) cache[used++] = Entry{kernel, threads, device, blocks};
  return blocks;
}

template <DType DT, bool kNorm>
cudaError_t LaunchTyped(const FusionParams& p, cudaStream_t stream) {
  const uint32_t vecs_per_row = p.hidden / device::VecTraits<DT>::kElems;
  const int threads = device::RowBlockThreads(vecs_per_row);
  const void* kernel = p.algo == FusionAlgo::kOneShot
                           ? reinterpret_cast<const void*>(&OneShotKernel<DT, kNorm>)
                           : reinterpret_cast<const void*>(&TwoShotKernel<DT, kNorm>);
  int sms = DeviceSmCount();
  if (sms <= 0) return cudaErrorInvalidDevice;
  if (p.sm_budget > 0) sms = std::min<int>(sms, static_cast<int>(p.sm_budget));
  // Every block of a rank must be resident at once: blocks spin on peers' blocks of the same
  // index, so a block waiting for an SM could starve a spinning peer.
  const uint32_t resident = static_cast<uint32_t>(
      std::min(kMaxFusionBlocks, std::max(1, sms * BlocksPerSm(kernel, threads))));
  const uint32_t rows = p.algo == FusionAlgo::kOneShot
                            ? p.num_tokens
                            : (p.num_tokens + p.world_size - 1) / p.world_size;
  const unsigned grid = std::max<uint32_t>(1u, std::min(rows, resident));
  if (p.algo == FusionAlgo::kOneShot) {
    OneShotKernel<DT, kNorm><<<grid, threads, 0, stream>>>(p);
  } else {
    TwoShotKernel<DT, kNorm><<<grid, threads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <DType DT>
cudaError_t LaunchForDType(const FusionParams& p, cudaStream_t stream) {
  switch (p.pattern) {
    case Pattern::kAllReduce: return LaunchTyped<DT, false>(p, stream);
    case Pattern::kAllReduceResidualRmsNorm: return LaunchTyped<DT, true>(p, stream);
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

template <DType DT, bool kNorm>
cudaError_t LaunchIndirectTyped(const FusionParams& t, const FusionParams* device_params,
                                cudaStream_t stream, bool programmatic) {
  const uint32_t vecs_per_row = t.hidden / device::VecTraits<DT>::kElems;
  const int threads = device::RowBlockThreads(vecs_per_row);
  const bool one_shot = t.algo == FusionAlgo::kOneShot;
  const void* kernel =
      one_shot ? reinterpret_cast<const void*>(&IndirectKernel<DT, kNorm, FusionAlgo::kOneShot>)
               : reinterpret_cast<const void*>(&IndirectKernel<DT, kNorm, FusionAlgo::kTwoShot>);
  int sms = DeviceSmCount();
  if (sms <= 0) return cudaErrorInvalidDevice;
  if (t.sm_budget > 0) sms = std::min<int>(sms, static_cast<int>(t.sm_budget));
  const uint32_t resident = static_cast<uint32_t>(
      std::min(kMaxFusionBlocks, std::max(1, sms * BlocksPerSm(kernel, threads))));
  // The most rows any op of this hidden may have (one-shot: a block per token; two-shot: a block
  // per slice row), at the largest token count the workspace fits at this hidden.
  const uint64_t max_tokens =
      static_cast<uint64_t>(t.layout.max_tokens) * t.layout.hidden / t.hidden;
  const uint64_t n = static_cast<uint64_t>(t.world_size);
  const uint64_t max_rows = one_shot ? max_tokens : (max_tokens + n - 1) / n;
  const unsigned grid =
      static_cast<unsigned>(std::max<uint64_t>(1, std::min<uint64_t>(max_rows, resident)));
  return one_shot ? LaunchIndirectKernel(IndirectKernel<DT, kNorm, FusionAlgo::kOneShot>, grid,
                                         threads, t, device_params, stream, programmatic)
                  : LaunchIndirectKernel(IndirectKernel<DT, kNorm, FusionAlgo::kTwoShot>, grid,
                                         threads, t, device_params, stream, programmatic);
}

template <DType DT>
cudaError_t LaunchIndirectForDType(const FusionParams& t, const FusionParams* device_params,
                                   cudaStream_t stream, bool programmatic) {
  switch (t.pattern) {
    case Pattern::kAllReduce:
      return LaunchIndirectTyped<DT, false>(t, device_params, stream, programmatic);
    case Pattern::kAllReduceResidualRmsNorm:
      return LaunchIndirectTyped<DT, true>(t, device_params, stream, programmatic);
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
      return LaunchIndirectForDType<DType::kBF16>(t, device_params, stream,
                                                 programmatic_dependent);
    case DType::kFP16:
      return LaunchIndirectForDType<DType::kFP16>(t, device_params, stream,
                                                 programmatic_dependent);
    case DType::kFP32:
      return LaunchIndirectForDType<DType::kFP32>(t, device_params, stream,
                                                 programmatic_dependent);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchAllReduceFusion(const FusionParams& p, cudaStream_t stream) {
  if (cudaError_t err = CheckFusionParams(p, nullptr); err != cudaSuccess) return err;
  if (p.num_tokens == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kBF16: return LaunchForDType<DType::kBF16>(p, stream);
    case DType::kFP16: return LaunchForDType<DType::kFP16>(p, stream);
    case DType::kFP32: return LaunchForDType<DType::kFP32>(p, stream);
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
    case DType::kBF16: WorkspaceInitKernel<DType::kBF16><<<grid, 512, 0, stream>>>(ws, layout); break;
    case DType::kFP16: WorkspaceInitKernel<DType::kFP16><<<grid, 512, 0, stream>>>(ws, layout); break;
    case DType::kFP32: WorkspaceInitKernel<DType::kFP32><<<grid, 512, 0, stream>>>(ws, layout); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace arfuse
