// The fused allreduce kernels. docs/kernels.md has the protocol and the memory-ordering argument;
// the comments here say which step of it each piece is.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/allreduce_fusion/fusion_device.cuh"
#include "kernels/common/launch.cuh"

namespace arfuse {
namespace {

using namespace ::arfuse::fusion_device;  // NOLINT(build/namespaces): the kernel bodies

// ---------------------------------------------------------------------------------------------
// The by-value kernels (LaunchAllReduceFusion): the params are kernel parameters. kVec is the
// register-array size of the row layout (row_math.cuh), which also bounds the block size.
// Launched as programmatic dependents (own GPU only), they wait for the kernel before them and
// its stores, then let the kernel after them be scheduled early (it waits the same way).
// kQuant: what the norm epilogue quantizes (EpilogueQuant): each FP8 pattern has kernels of its
// own (kStatic, kPerToken, kPerGroup); the indirect kernels hold all three (kAny).
template <DType DT, bool kNorm, int kBucket, EpilogueQuant kQuant>
__global__ void __launch_bounds__(device::BucketMaxThreads(kBucket),
                                  device::BucketMinBlocks(kBucket))
    OneShotKernel(const FusionParams p, const KernelConfig cfg) {
  WaitForPrerequisiteGrid();
  AllowDependentLaunch();
  OneShotBody<DT, kNorm, kBucket, kQuant>(p, cfg, blockIdx.x, gridDim.x);
}

template <DType DT, bool kNorm, int kBucket, EpilogueQuant kQuant>
__global__ void __launch_bounds__(device::BucketMaxThreads(kBucket),
                                  device::BucketMinBlocks(kBucket))
    TwoShotKernel(const FusionParams p, const KernelConfig cfg) {
  WaitForPrerequisiteGrid();
  AllowDependentLaunch();
  TwoShotBody<DT, kNorm, kBucket, kQuant>(p, cfg);
}

// The indirect kernels (LaunchAllReduceFusionIndirect): every block copies the op's params from
// device memory into shared memory, then runs them if they belong to this launch. `tmpl` is the
// launch's template: params with no tokens (an idle waiter), another shape or another algorithm
// (a launch queued for another plan or for the other algorithm) make every block return before
// anything of the protocol is touched. The decision reads only the device params and the
// template, so it is the same in every block. One algorithm per kernel: a kernel holding both
// bodies spilled five times more registers (ptxas -v).
template <DType DT, bool kNorm, FusionAlgo kAlgo, int kBucket, EpilogueQuant kQuant>
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
    OneShotBody<DT, kNorm, kBucket, kQuant>(p, cfg, blockIdx.x, gridDim.x);
  } else {
    TwoShotBody<DT, kNorm, kBucket, kQuant>(p, cfg);
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
//   opcheck=0..3   one-shot op agreement: 3 auto (2 for launches of up to 4 blocks, else 1), 2 per
//                  thread, 1 thread 0 + block barrier, 0 off (measurement only: ranks running
//                  different ops then compute a wrong result)                           [3]
struct Tuning {
  int pdl = 1;
  int lookahead = 1;
  int ctas_per_sm = 0;
  int tight = 24;
  int backoff = 64;
  int twoshot_grid = 0;
  int opcheck = 3;
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
        if (key == "opcheck") t.opcheck = std::clamp(value, 0, 3);
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
                      static_cast<uint32_t>(t.backoff), t.twoshot_grid != 0 ? 0u : 1u,
                      static_cast<uint32_t>(t.opcheck)};
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

template <DType DT, bool kNorm, int kBucket, EpilogueQuant kQuant>
cudaError_t LaunchTyped(const FusionParams& p, cudaStream_t stream) {
  const Tuning& tuning = GetTuning();
  const uint32_t vecs_per_row = p.hidden / device::VecTraits<DT>::kElems;
  const int threads = device::RowBlockThreads(vecs_per_row);
  // PDL only when the GPU is not shared: a dependent grid waiting on its SMs must never keep
  // another rank's grid on the same GPU from becoming resident.
  const bool pdl = tuning.pdl != 0 && p.sm_budget == 0;
  const KernelConfig cfg = ConfigFromTuning();
  if (p.algo == FusionAlgo::kOneShot) {
    auto* kernel = &OneShotKernel<DT, kNorm, kBucket, kQuant>;
    const uint32_t resident =
        ResidentBlocks(reinterpret_cast<const void*>(kernel), threads, p.sm_budget);
    if (resident == 0) return cudaErrorInvalidDevice;
    const unsigned grid = std::max<uint32_t>(1u, std::min(p.num_tokens, resident));
    return LaunchKernel(kernel, grid, static_cast<unsigned>(threads), pdl, stream, p, cfg);
  }
  auto* kernel = &TwoShotKernel<DT, kNorm, kBucket, kQuant>;
  const uint32_t resident =
      ResidentBlocks(reinterpret_cast<const void*>(kernel), threads, p.sm_budget);
  if (resident == 0) return cudaErrorInvalidDevice;
  const uint32_t rows = (p.num_tokens + p.world_size - 1) / p.world_size;
  const unsigned grid = std::max<uint32_t>(1u, std::min(rows, resident));
  return LaunchKernel(kernel, grid, static_cast<unsigned>(threads), pdl, stream, p, cfg);
}

template <DType DT, bool kNorm, EpilogueQuant kQuant>
cudaError_t LaunchBucket(const FusionParams& p, cudaStream_t stream) {
  return device::WithRowBucket(p.hidden / device::VecTraits<DT>::kElems, [&](auto bucket) {
    return LaunchTyped<DT, kNorm, decltype(bucket)::value, kQuant>(p, stream);
  });
}

// The FP8 patterns have kernels for bf16 and fp16 only (IsFusionSupported).
template <DType DT>
inline constexpr bool kHasQuantKernels = DT != DType::kFP32;

template <DType DT>
cudaError_t LaunchForDType(const FusionParams& p, cudaStream_t stream) {
  const PatternTraits traits = TraitsOf(p.pattern);
  if (!traits.valid) return cudaErrorInvalidValue;
  if (!traits.norm) return LaunchBucket<DT, false, EpilogueQuant::kNone>(p, stream);
  if (traits.quant == QuantKind::kNone) {
    return LaunchBucket<DT, true, EpilogueQuant::kNone>(p, stream);
  }
  if constexpr (kHasQuantKernels<DT>) {
    switch (traits.quant) {
      case QuantKind::kStatic:
        return LaunchBucket<DT, true, EpilogueQuant::kStatic>(p, stream);
      case QuantKind::kPerToken:
        return LaunchBucket<DT, true, EpilogueQuant::kPerToken>(p, stream);
      case QuantKind::kPerGroup:
        return LaunchBucket<DT, true, EpilogueQuant::kPerGroup>(p, stream);
      case QuantKind::kNone:
        break;
    }
  }
  return cudaErrorInvalidValue;
}

// The indirect launch's geometry: from the template only (see allreduce_fusion.h).
template <DType DT, bool kNorm, int kBucket, EpilogueQuant kQuant>
cudaError_t LaunchIndirectTyped(const FusionParams& t, const FusionParams* device_params,
                                cudaStream_t stream, bool programmatic) {
  const uint32_t vecs_per_row = t.hidden / device::VecTraits<DT>::kElems;
  const int threads = device::RowBlockThreads(vecs_per_row);
  const bool one_shot = t.algo == FusionAlgo::kOneShot;
  auto* const one_shot_kernel = &IndirectKernel<DT, kNorm, FusionAlgo::kOneShot, kBucket, kQuant>;
  auto* const two_shot_kernel = &IndirectKernel<DT, kNorm, FusionAlgo::kTwoShot, kBucket, kQuant>;
  const void* kernel = one_shot ? reinterpret_cast<const void*>(one_shot_kernel)
                                : reinterpret_cast<const void*>(two_shot_kernel);
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
  const unsigned block = static_cast<unsigned>(threads);
  return one_shot
             ? LaunchKernel(one_shot_kernel, grid, block, programmatic, stream, t, device_params)
             : LaunchKernel(two_shot_kernel, grid, block, programmatic, stream, t, device_params);
}

template <DType DT, bool kNorm, EpilogueQuant kQuant>
cudaError_t LaunchIndirectBucket(const FusionParams& t, const FusionParams* device_params,
                                 cudaStream_t stream, bool programmatic) {
  return device::WithRowBucket(t.hidden / device::VecTraits<DT>::kElems, [&](auto bucket) {
    return LaunchIndirectTyped<DT, kNorm, decltype(bucket)::value, kQuant>(t, device_params, stream,
                                                                           programmatic);
  });
}

template <DType DT>
cudaError_t LaunchIndirectForDType(const FusionParams& t, const FusionParams* device_params,
                                   cudaStream_t stream, bool programmatic) {
  const PatternTraits traits = TraitsOf(t.pattern);
  if (!traits.valid) return cudaErrorInvalidValue;
  if (!traits.norm) {
    return LaunchIndirectBucket<DT, false, EpilogueQuant::kNone>(t, device_params, stream,
                                                                 programmatic);
  }
  if (traits.quant == QuantKind::kNone) {
    return LaunchIndirectBucket<DT, true, EpilogueQuant::kNone>(t, device_params, stream,
                                                                programmatic);
  }
  if constexpr (kHasQuantKernels<DT>) {
    return LaunchIndirectBucket<DT, true, EpilogueQuant::kAny>(t, device_params, stream,
                                                               programmatic);
  }
  return cudaErrorInvalidValue;
}

// Direct: the by-value kernels; indirect: the indirect ones (whose FP8 kernel is kAny).
template <DType DT, bool kNorm, int kBucket, EpilogueQuant kQuant, bool kIndirect>
cudaError_t LoadBucketKernels() {
  if constexpr (kIndirect) {
    return LoadKernelFunctions(
        {reinterpret_cast<const void*>(
             &IndirectKernel<DT, kNorm, FusionAlgo::kOneShot, kBucket, kQuant>),
         reinterpret_cast<const void*>(
             &IndirectKernel<DT, kNorm, FusionAlgo::kTwoShot, kBucket, kQuant>)});
  } else {
    return LoadKernelFunctions(
        {reinterpret_cast<const void*>(&OneShotKernel<DT, kNorm, kBucket, kQuant>),
         reinterpret_cast<const void*>(&TwoShotKernel<DT, kNorm, kBucket, kQuant>)});
  }
}

template <DType DT, bool kNorm, EpilogueQuant kQuant, bool kIndirect>
cudaError_t LoadPatternKernels() {
  return FirstError({LoadBucketKernels<DT, kNorm, 0, kQuant, kIndirect>(),
                     LoadBucketKernels<DT, kNorm, 1, kQuant, kIndirect>(),
                     LoadBucketKernels<DT, kNorm, 2, kQuant, kIndirect>(),
                     LoadBucketKernels<DT, kNorm, 3, kQuant, kIndirect>()});
}

// Every kernel one pattern family launches, direct and indirect.
template <DType DT, bool kNorm, EpilogueQuant kQuant>
cudaError_t LoadBothKernels() {
  return FirstError({LoadPatternKernels<DT, kNorm, kQuant, false>(),
                     LoadPatternKernels<DT, kNorm, kQuant, true>()});
}

template <DType DT>
cudaError_t LoadDTypeKernels() {
  cudaError_t quant = cudaSuccess;
  if constexpr (kHasQuantKernels<DT>) {
    quant = FirstError({LoadPatternKernels<DT, true, EpilogueQuant::kStatic, false>(),
                        LoadPatternKernels<DT, true, EpilogueQuant::kPerToken, false>(),
                        LoadPatternKernels<DT, true, EpilogueQuant::kPerGroup, false>(),
                        LoadPatternKernels<DT, true, EpilogueQuant::kAny, true>()});
  }
  return FirstError(
      {LoadBothKernels<DT, false, EpilogueQuant::kNone>(),
       LoadBothKernels<DT, true, EpilogueQuant::kNone>(), quant,
       LoadKernelFunctions({reinterpret_cast<const void*>(&WorkspaceInitKernel<DT>)})});
}

}  // namespace

void CurrentFusionKernelConfig(uint32_t config[5], bool* pdl) {
  const KernelConfig c = ConfigFromTuning();
  static_assert(sizeof(KernelConfig) == 5 * sizeof(uint32_t));
  config[0] = c.lookahead;
  config[1] = c.tight_polls;
  config[2] = c.backoff_ns;
  config[3] = c.twoshot_block_barriers;
  config[4] = c.op_check;
  if (pdl != nullptr) *pdl = GetTuning().pdl != 0;
}

cudaError_t PrepareAllReduceFusionKernels() {
  return FirstError({LoadDTypeKernels<DType::kBF16>(), LoadDTypeKernels<DType::kFP16>(),
                     LoadDTypeKernels<DType::kFP32>()});
}

uint32_t FusionResidentBlocks(const void* kernel, int threads, uint32_t sm_budget) {
  return ResidentBlocks(kernel, threads, sm_budget);
}

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
