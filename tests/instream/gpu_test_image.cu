// A kernel image for libarfuse_client's GPU tests: the fused kernels' one-shot and two-shot
// bodies (kernels/allreduce_fusion/fusion_device.cuh) behind the in-stream launch ABI (one
// InStreamLaunchArgs by value), bf16, rows of bucket 0 (hidden up to 4096). Compiled to a fatbin
// and embedded (gpu_test_image.h), so the tests load it exactly as a client loads the sidecar's
// image. The sidecar's own image (kernels/instream) also checks the workspace generation; this
// one checks the launch ABI only.
#include "kernels/allreduce_fusion/fusion_device.cuh"
#include "kernels/instream/launch_abi.h"

namespace {

using ::arfuse::DType;
using ::arfuse::FusionAlgo;
using ::arfuse::instream::InStreamLaunchArgs;

template <bool kNorm, FusionAlgo kAlgo>
__device__ __forceinline__ void Run(const InStreamLaunchArgs& a) {
  ::arfuse::device_sync::WaitForPrerequisiteGrid();
  ::arfuse::device_sync::AllowDependentLaunch();
  if (a.abi_version != ::arfuse::instream::kLaunchAbiVersion) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && a.fusion.host_error != nullptr) {
      *a.fusion.host_error = ::arfuse::instream::kErrorLaunchAbi;
    }
    return;
  }
  const ::arfuse::fusion_device::KernelConfig cfg{a.kernel_config[0], a.kernel_config[1],
                                                  a.kernel_config[2], a.kernel_config[3],
                                                  a.kernel_config[4]};
  if constexpr (kAlgo == FusionAlgo::kOneShot) {
    ::arfuse::fusion_device::OneShotBody<DType::kBF16, kNorm, 0>(a.fusion, cfg, blockIdx.x,
                                                                 gridDim.x);
  } else {
    ::arfuse::fusion_device::TwoShotBody<DType::kBF16, kNorm, 0>(a.fusion, cfg);
  }
}

}  // namespace

#define ARFUSE_TEST_ENTRY(name, norm, algo)                                               \
  extern "C" __global__ void __launch_bounds__(512, 1) name(const InStreamLaunchArgs a) { \
    Run<norm, algo>(a);                                                                   \
  }
ARFUSE_TEST_ENTRY(arfuse_test_bf16_sum_oneshot, false, FusionAlgo::kOneShot)
ARFUSE_TEST_ENTRY(arfuse_test_bf16_sum_twoshot, false, FusionAlgo::kTwoShot)
ARFUSE_TEST_ENTRY(arfuse_test_bf16_norm_oneshot, true, FusionAlgo::kOneShot)
ARFUSE_TEST_ENTRY(arfuse_test_bf16_norm_twoshot, true, FusionAlgo::kTwoShot)
