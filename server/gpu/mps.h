// Detects whether the CUDA Multi-Process Service is running for this process. Without MPS every
// cross-process hop between ranks sharing a GPU costs a context switch (4.4 ms instead of 0.7 µs
// measured), so the daemon reports it in negotiation and metrics. CUDA-free: it reads the
// environment, the pipe directory and /proc, so it unit-tests without a GPU.
#pragma once

#include <string>

namespace arfuse {

struct MpsInfo {
  // The control pipe exists in the pipe directory this process would use.
  bool control_pipe_present = false;
  // An nvidia-cuda-mps-server process is running (it starts with the first client).
  bool server_running = false;
  // An nvidia-cuda-mps-control daemon is running.
  bool control_daemon_running = false;
  std::string pipe_directory;
  // True when this process's CUDA contexts will go through MPS: the control pipe is there and
  // the daemon runs.
  // The control daemon runs and either its control endpoint is in our pipe directory or an MPS
  // server already serves clients (some releases keep the endpoint elsewhere).
  bool active() const { return control_daemon_running && (control_pipe_present || server_running); }
  // One line for logs and reports: "mps=active pipe_dir=/tmp/mps-pipe server=running".
  std::string Describe() const;
};

// `pipe_dir_env` is CUDA_MPS_PIPE_DIRECTORY (empty: unset, then /tmp/nvidia-mps as CUDA does);
// `proc_root` is normally "/proc".
MpsInfo DetectMps(const std::string& pipe_dir_env, const std::string& proc_root);

// The same with this process's environment and /proc.
MpsInfo DetectMps();

}  // namespace arfuse
