#include "server/daemon/device_startup.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "server/cuda_device/mps.h"
#include "server/doorbell/doorbell_report.h"
#include "server/host/host_engine.h"
#include "spdlog/spdlog.h"
#if ARFUSE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "server/cuda_device/cuda_status.h"
#include "server/cuda_device/device_error.h"
#include "server/cuda_device/mps_driver.h"
#include "server/cuda_engine/cuda_engine.h"
#include "server/doorbell/self_test.h"
#endif

namespace arfuse {

absl::StatusOr<GpuProbe> SelectDevice(DaemonOptions* options) {
  GpuProbe gpu = ProbeGpu(options->gpu >= 0 ? options->gpu : 0);
  if (options->device.empty()) options->device = gpu.device_count > 0 ? "cuda" : "host";
  if (options->device == "cuda" && gpu.device_count == 0) {
    return absl::FailedPreconditionError(
        "--device=cuda but no GPU is visible (use --device=host on machines without a GPU)");
  }
  if (options->device == "cuda") {
    if (options->gpu < 0) options->gpu = options->rank % gpu.device_count;
    if (options->gpu >= gpu.device_count) {
      return absl::InvalidArgumentError(absl::StrCat("--gpu=", options->gpu, " but only ",
                                                     gpu.device_count, " GPU(s) are visible"));
    }
    gpu = ProbeGpu(options->gpu);
  }
  return gpu;
}

std::optional<DeviceReport> ProbeDevice(const DaemonOptions& options) {
  if (options.device != "cuda") return std::nullopt;
#if ARFUSE_HAVE_CUDA
  const MpsInfo mps = DetectMpsOnDevice(options.gpu);  // the driver's answer first (mps.h)
#else
  const MpsInfo mps = DetectMps();
#endif
  DeviceReport report;
  report.mps_detected = mps.active();
  DoorbellHopReport hop;
#if ARFUSE_HAVE_CUDA
  DoorbellSelfTestOptions self_test;
  self_test.device = options.gpu;
  self_test.ops = 200;
  self_test.repeats = 3;
  self_test.timeout = absl::Seconds(5);
  absl::StatusOr<DoorbellHopReport> measured = RunDoorbellSelfTest(self_test);
  if (measured.ok()) {
    hop = *measured;
  } else {
    hop.error = std::string(measured.status().message());
  }
#else
  hop.error = "this arfused was built without CUDA";
#endif
  if (hop.measured) report.doorbell_hop_us = hop.hop_us;
  spdlog::info("event=doorbell_self_test gpu={} result=\"{}\" {}", options.gpu,
               DescribeDoorbell(hop, report.mps_detected), mps.Describe());
  return report;
}

absl::StatusOr<std::unique_ptr<Engine>> MakeDeviceEngine(const DaemonOptions& options,
                                                         const config::Decision& decision) {
  EngineOptions eo;
  eo.rank = options.rank;
  eo.world_size = options.world_size;
  eo.nnodes = options.nnodes;
  eo.backend = decision.fusion_enabled ? decision.backend : "none";
  eo.max_tokens = options.max_tokens;
  eo.max_hidden = options.hidden;
  eo.dtype = options.dtype == "fp32"   ? DType::kFP32
             : options.dtype == "fp16" ? DType::kFP16
                                       : DType::kBF16;
  eo.spin_timeout = absl::Seconds(options.spin_timeout_s);
  if (!decision.fusion_enabled) eo.unfused_reason = absl::StrJoin(decision.reasons, "; ");
  if (options.device == "host") return MakeHostEngine(eo);
#if ARFUSE_HAVE_CUDA
  // The engine's stream, workspace and events live on this rank's GPU (the calling thread's
  // current device is not it in general).
  CudaEngineOptions cuda_options;
  cuda_options.device = options.gpu;
  cuda_options.doorbell_serve_blocks = static_cast<uint32_t>(options.doorbell_serve_blocks);
  cuda_options.sm_budget = static_cast<uint32_t>(options.sm_budget);
  ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<CudaEngine> cuda, MakeCudaEngine(eo, cuda_options));
  return std::unique_ptr<Engine>(std::move(cuda));
#else
  return absl::FailedPreconditionError("this arfused was built without CUDA");
#endif
}

void UseDeviceOnThisThread(const DaemonOptions& options) {
#if ARFUSE_HAVE_CUDA
  if (options.device == "cuda") cudaSetDevice(options.gpu);
#else
  static_cast<void>(options);
#endif
}

absl::Status DeviceLost(const DaemonOptions& options) {
#if ARFUSE_HAVE_CUDA
  if (options.device != "cuda") return absl::OkStatus();
  // A sticky error (illegal address, ...) has broken this process's CUDA context, the device
  // holds a kernel that can never finish, or this process cannot get a client of the GPU (held
  // elsewhere, or MPS refusing it: IsRestartOnlyCudaError): nothing on it can be trusted again.
  absl::Status health = DeviceHealth();
  if (!IsStickyDeviceError(health)) return absl::OkStatus();
  return health;
#else
  static_cast<void>(options);
  return absl::OkStatus();
#endif
}

}  // namespace arfuse
