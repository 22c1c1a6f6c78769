// The in-stream kernel image: the fused one-shot and two-shot kernels as plain C-named entry
// points taking one InStreamLaunchArgs by value (launch_abi.h). This file is compiled only into
// a fatbin (machine code for every architecture of the build, never PTX alone) that the sidecar
// embeds and hands to clients at attach; instream_image.h names its entries.
//
// Each entry runs the body the sidecar's own launches run (fusion_device.cuh) with these
// additions, all in block 0's thread 0 or folded into loads and stores the body makes anyway:
//   * the launch ABI version is checked first (a client built for another layout of the
//     arguments would otherwise run garbage);
//   * the workspace's generation tag is compared with the launch's inside the body's first
//     control-word access, so a launch captured before a re-initialization (or replayed on a
//     workspace the sidecar dropped) stores nothing and records nothing in the workspace;
//   * the launch's origin and the client's program key go into the op descriptor, so it pairs
//     only with in-stream launches of the same program (fusion_sync.cuh's MakeOpDesc);
//   * the outcome is counted in the workspace (instream_launches / instream_stale, and the launch
//     per attachment, pattern and token bucket in instream_ops, read by the sidecar for metrics)
//     and mirrored into the client's host-mapped error word, so the client
//     sees a failed launch without a copy (FusionParams::host_error).
#include <cstdint>

#include "kernels/allreduce_fusion/fusion_device.cuh"
#include "kernels/instream/launch_abi.h"
#include "kernels/instream/op_counters.h"

namespace arfuse::instream {
namespace {

using namespace ::arfuse::fusion_device;  // NOLINT(build/namespaces): the kernel bodies

static_assert(kStaleGenerationRefusal == kErrorStaleGeneration);

template <DType DT, bool kNorm, FusionAlgo kAlgo, int kBucket, EpilogueQuant kQuant>
__device__ __forceinline__ void InStreamEntry(const InStreamLaunchArgs& a) {
  const FusionParams& p = a.fusion;
  const bool reporter = blockIdx.x == 0 && threadIdx.x == 0;
  if (a.abi_version != kLaunchAbiVersion) {
    if (reporter && p.host_error != nullptr) StoreVolatile32(p.host_error, kErrorLaunchAbi);
    return;
  }
  // Launched as a programmatic dependent, this grid may start while the kernel before it still
  // runs: wait for it and its stores before touching anything, then let the next kernel be
  // scheduled early (it waits the same way).
  WaitForPrerequisiteGrid();
  AllowDependentLaunch();
  const KernelConfig cfg{a.kernel_config[0], a.kernel_config[1], a.kernel_config[2],
                         a.kernel_config[3], a.kernel_config[4]};
  const LaunchOrigin origin{GenerationTag(a.generation), a.program_key};
  uint32_t code;
  if constexpr (kAlgo == FusionAlgo::kOneShot) {
    code = OneShotBody<DT, kNorm, kBucket, kQuant>(p, cfg, blockIdx.x, gridDim.x, origin);
  } else {
    code = TwoShotBody<DT, kNorm, kBucket, kQuant>(p, cfg, origin);
  }
  if (!reporter) return;
  FusionControl* const ctrl = ControlOf(p.peer_workspace[p.rank], p.layout);
  if (code == kStaleGenerationRefusal) {
    atomicAdd(reinterpret_cast<unsigned long long*>(&ctrl->instream_stale), 1ull);
  } else {
    atomicAdd(reinterpret_cast<unsigned long long*>(&ctrl->instream_launches), 1ull);
    // The index comes from the client: bounded here, so a garbage one lands in the unattributed
    // slot instead of outside the control block. The FP8 patterns count with the norm pattern
    // (the table has kOpPatterns = 2 columns: docs/instream.md).
    const uint32_t slot =
        a.counter_slot < kInStreamAttachSlots ? a.counter_slot : kInStreamUnattributedSlot;
    atomicAdd(reinterpret_cast<unsigned long long*>(
                  &ctrl->instream_ops[slot][kNorm ? 1 : 0][OpTokenBucket(p.num_tokens)]),
              1ull);
  }
  // Other blocks' failures reach the word through RecordError (the workspace's first error);
  // this covers a refused launch (poisoned, aborted, stale), which RecordError does not mirror.
  if (code != 0 && p.host_error != nullptr && LoadVolatile32(p.host_error) == 0) {
    StoreVolatile32(p.host_error, code);
  }
}

}  // namespace
}  // namespace arfuse::instream

// The entry points: arfuse_is_<dtype>_<pattern>_<algorithm>_b<bucket> (instream_image.h builds
// the same names). C names, so the client finds them in the image without C++ mangling. Each
// FP8 pattern has functions of its own, holding only their kind's epilogue, as the by-value
// kernels do (measured faster than one function for all three, docs/performance.md).
#define ARFUSE_INSTREAM_ENTRY(dname, DT, pname, kNorm, kQuant, aname, kAlgo, b)                   \
  extern "C" __global__ void __launch_bounds__(::arfuse::device::BucketMaxThreads(b),             \
                                               ::arfuse::device::BucketMinBlocks(b))              \
      arfuse_is_##dname##_##pname##_##aname##_b##b(                                               \
          const ::arfuse::instream::InStreamLaunchArgs a) {                                       \
    ::arfuse::instream::InStreamEntry<::arfuse::DType::DT, kNorm, ::arfuse::FusionAlgo::kAlgo, b, \
                                      ::arfuse::fusion_device::EpilogueQuant::kQuant>(a);         \
  }
#define ARFUSE_INSTREAM_BUCKETS(dname, DT, pname, kNorm, kQuant, aname, kAlgo) \
  ARFUSE_INSTREAM_ENTRY(dname, DT, pname, kNorm, kQuant, aname, kAlgo, 0)      \
  ARFUSE_INSTREAM_ENTRY(dname, DT, pname, kNorm, kQuant, aname, kAlgo, 1)      \
  ARFUSE_INSTREAM_ENTRY(dname, DT, pname, kNorm, kQuant, aname, kAlgo, 2)      \
  ARFUSE_INSTREAM_ENTRY(dname, DT, pname, kNorm, kQuant, aname, kAlgo, 3)
#define ARFUSE_INSTREAM_ALGOS(dname, DT, pname, kNorm, kQuant)                \
  ARFUSE_INSTREAM_BUCKETS(dname, DT, pname, kNorm, kQuant, oneshot, kOneShot) \
  ARFUSE_INSTREAM_BUCKETS(dname, DT, pname, kNorm, kQuant, twoshot, kTwoShot)
#define ARFUSE_INSTREAM_PATTERNS(dname, DT)                 \
  ARFUSE_INSTREAM_ALGOS(dname, DT, allreduce, false, kNone) \
  ARFUSE_INSTREAM_ALGOS(dname, DT, arnorm, true, kNone)

ARFUSE_INSTREAM_PATTERNS(bf16, kBF16)
ARFUSE_INSTREAM_PATTERNS(fp16, kFP16)
ARFUSE_INSTREAM_PATTERNS(fp32, kFP32)
ARFUSE_INSTREAM_ALGOS(bf16, kBF16, arnormfp8static, true, kStatic)
ARFUSE_INSTREAM_ALGOS(fp16, kFP16, arnormfp8static, true, kStatic)
ARFUSE_INSTREAM_ALGOS(bf16, kBF16, arnormfp8token, true, kPerToken)
ARFUSE_INSTREAM_ALGOS(fp16, kFP16, arnormfp8token, true, kPerToken)
ARFUSE_INSTREAM_ALGOS(bf16, kBF16, arnormfp8group, true, kPerGroup)
ARFUSE_INSTREAM_ALGOS(fp16, kFP16, arnormfp8group, true, kPerGroup)
