// The flags of `arfuse-bench kernels`, apart from its CUDA code so that every build answers
// `arfuse-bench kernels --help` (a build without CUDA cannot run the subcommand).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/flag_args.h"

namespace arfuse::bench {

// What --help says the subcommand does.
extern const char kKernelsDescription[];

struct KernelsFlags {
  FlagOutcome outcome = FlagOutcome::kRun;
  int world = 2;
  int rank = -1;  // -1: launcher
  std::string dir;
  std::string backend = "trtllm";
  std::string vmm = "posix_fd";
  std::vector<uint32_t> tokens = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048};
  std::vector<uint32_t> hidden = {4096, 7168, 8192};
  int repeats = 7;
  int iters = 20;
  int warmup = 3;
  int spin_ms = 5000;
  int fp8 = 0;  // 1: also the FP8 patterns against the unquantized op + a separate quantization
  std::string json = "arfuse-bench-kernels.json";
  std::vector<std::string> raw;  // flags to pass on to the ranks
};

// The flags with their values checked; for --help or --version only `outcome` is set.
absl::StatusOr<KernelsFlags> ParseKernelsFlags(int argc, char** argv);

// Prints --help or --version for `outcome` (not kRun); returns the exit code.
int PrintKernelsHelpOrVersion(FlagOutcome outcome);

}  // namespace arfuse::bench
