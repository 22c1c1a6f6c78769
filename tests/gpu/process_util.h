// Starting rank processes for multi-process tests and benchmarks: each rank a separately exec'd
// process, as the sidecars are (a forked NCCL rank hung in an earlier probe). No CUDA here.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace arfuse::testing {

// Starts `argv[0]` with `argv` as a new process (posix_spawn, not fork + run), inheriting the
// environment and stdout/stderr.
absl::StatusOr<pid_t> SpawnProcess(const std::vector<std::string>& argv);

// Waits for every pid until `deadline`; kills (SIGKILL, by pid) those still running then.
// Returns each exit code (128 + signal for a process that died of one, -1 when killed at the
// deadline).
std::vector<int> WaitProcesses(const std::vector<pid_t>& pids, absl::Time deadline);

}  // namespace arfuse::testing
