// The flags of `arfuse-bench sidecar`, kept apart from the rows, the client processes and the
// report so that the subcommand's command line reads in one place.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/flag_args.h"

namespace arfuse::bench {

struct SidecarFlags {
  FlagOutcome outcome = FlagOutcome::kRun;
  int ranks = 2;
  std::string device;  // host | cuda; empty: cuda when built with CUDA and a GPU is visible
  std::vector<uint32_t> tokens = {1, 16, 128};
  std::vector<uint32_t> hidden = {4096};
  int iters = 2000;
  int warmup = 200;
  int block = 50;  // echo and Execute calls alternate in blocks of this many
  int graph_ops = 100;
  int repeats = 15;
  int compute_us = 20;
  std::string json = "arfuse-bench-sidecar.json";
  std::string arfused;
  std::string backend = "auto";
  std::string ring_lib;
  int timeout_s = 600;
  // Internal: a client process.
  int client_rank = -1;
  std::string dir;
  std::vector<std::string> raw;  // the user's flags, passed on to the clients and into the JSON
};

// The flags with their values checked; for --help or --version only `outcome` is set.
absl::StatusOr<SidecarFlags> ParseSidecarFlags(int argc, char** argv);

// Prints --help or --version for `outcome` (not kRun); returns the exit code.
int PrintSidecarHelpOrVersion(FlagOutcome outcome);

}  // namespace arfuse::bench
