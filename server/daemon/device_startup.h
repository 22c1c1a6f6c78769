// Device start-up: which device this rank runs on, what the GPU reports before any engine exists
// (MPS, the doorbell hop), the engine for a group decision (CUDA or host mode) and whether the
// device is lost for good. Every CUDA call of the daemon is here, so the group supervisor and the
// servers build alike with and without CUDA.
#pragma once

#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "config/fusion_config.h"
#include "server/daemon/device_probe.h"
#include "server/daemon/options.h"
#include "server/engine_api/engine.h"

namespace arfuse {

// What the GPU reported at start-up (CUDA mode only): negotiation (the Config snapshot),
// GetWorkspaceInfo, the metrics and one log line carry it.
struct DeviceReport {
  bool mps_detected = false;
  // The doorbell plane's measured hop; 0 when the self-test did not measure one.
  double doorbell_hop_us = 0;
};

// Probes the GPUs and settles options->device (cuda when a GPU is visible, else host) and, in
// CUDA mode, options->gpu (rank % visible GPUs when unset). FAILED_PRECONDITION for --device=cuda
// without a GPU, INVALID_ARGUMENT for a --gpu that is not visible.
absl::StatusOr<GpuProbe> SelectDevice(DaemonOptions* options);

// CUDA mode: MPS detection and the doorbell self-test (docs/doorbell.md), once before the engine
// starts, logged as one line. Host mode: nullopt (nothing is measured).
std::optional<DeviceReport> ProbeDevice(const DaemonOptions& options);

// The engine for `decision` on this rank's device, not yet initialized (Engine::Initialize is
// collective).
absl::StatusOr<std::unique_ptr<Engine>> MakeDeviceEngine(const DaemonOptions& options,
                                                         const config::Decision& decision);

// Makes this rank's GPU the calling thread's device in CUDA mode (DeviceLost inspects the
// current device's context); nothing in host mode.
void UseDeviceOnThisThread(const DaemonOptions& options);

// CUDA mode: the sticky error of a device only a new process recovers (a broken context, a
// kernel that can never finish, no client of the GPU to be had); OK otherwise and in host mode.
absl::Status DeviceLost(const DaemonOptions& options);

}  // namespace arfuse
