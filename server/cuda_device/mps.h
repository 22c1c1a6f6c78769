// Detects whether the CUDA Multi-Process Service is running for this process. Without MPS every
// cross-process hop between ranks sharing a GPU costs a context switch (4.4 ms instead of 0.7 µs
// measured), so the daemon reports it in negotiation and metrics.
//
// The driver knows best: CU_DEVICE_ATTRIBUTE_MPS_ENABLED (cuda.h since CUDA 12.3) says whether
// this process's contexts on a device go through MPS, including when the control daemon runs in
// another container, where a scan of our /proc cannot see it. A driver older than the attribute
// answers CUDA_ERROR_INVALID_VALUE; then, and without a driver, the scan below decides. This
// header and mps.cc are CUDA-free (the choice unit-tests without a GPU); mps_driver.h asks the
// driver.
#pragma once

#include <string>

namespace arfuse {

// The driver's answer to CU_DEVICE_ATTRIBUTE_MPS_ENABLED.
enum class DriverMps {
  kUnknown,   // not asked, no driver, or a driver older than the attribute
  kEnabled,   // the device's contexts go through MPS
  kDisabled,  // they do not, whatever the scan finds
};

// cuDeviceGetAttribute's result code (a CUresult; 0 is CUDA_SUCCESS) and value, as a DriverMps:
// any error means the driver cannot say.
DriverMps DriverMpsFromAttribute(int cu_result, int value);

struct MpsInfo {
  // The control pipe exists in the pipe directory this process would use.
  bool control_pipe_present = false;
  // An nvidia-cuda-mps-server process is running (it starts with the first client).
  bool server_running = false;
  // An nvidia-cuda-mps-control daemon is running.
  bool control_daemon_running = false;
  std::string pipe_directory;
  DriverMps driver = DriverMps::kUnknown;
  // True when this process's CUDA contexts will go through MPS. The driver's answer when it has
  // one; else the scan's: the control daemon runs and either its control endpoint is in our pipe
  // directory or an MPS server already serves clients (some releases keep the endpoint
  // elsewhere).
  bool active() const {
    if (driver != DriverMps::kUnknown) return driver == DriverMps::kEnabled;
    return control_daemon_running && (control_pipe_present || server_running);
  }
  // One line for logs and reports: "mps=active pipe_dir=/tmp/mps-pipe server=running"; "driver="
  // is added when the driver answered.
  std::string Describe() const;
};

// `pipe_dir_env` is CUDA_MPS_PIPE_DIRECTORY (empty: unset, then /tmp/nvidia-mps as CUDA does);
// `proc_root` is normally "/proc"; `driver` what the driver said, if it was asked.
MpsInfo DetectMps(const std::string& pipe_dir_env, const std::string& proc_root,
                  DriverMps driver = DriverMps::kUnknown);

// The same with this process's environment and /proc, without asking the driver (CUDA-free
// callers; DetectMpsOnDevice in mps_driver.h asks it).
MpsInfo DetectMps();

}  // namespace arfuse
