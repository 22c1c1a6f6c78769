#include "client/demo/demo_flags.h"

#include <algorithm>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(int, ranks, 2, "Ranks (sidecars and client processes) to start.");
ABSL_FLAG(std::string, tokens, "1,16,128", "Token counts to run, comma-separated.");
ABSL_FLAG(std::string, hidden, "1024,4096",
          "Hidden sizes to run (multiples of 8), comma-separated.");
ABSL_FLAG(std::string, dtype, "bf16", "bf16, fp16 or fp32.");
ABSL_FLAG(std::string, device, "", "host or cuda; default cuda when a GPU is present, else host.");
ABSL_FLAG(bool, json, false, "Print JSON instead of the table.");
ABSL_FLAG(std::string, arfused, "", "Path of the arfused binary (default: next to this build).");
ABSL_FLAG(std::string, backend, "auto",
          "Passed to the sidecars as --flashinfer-allreduce-fusion-backend (auto, trtllm, mnnvl; "
          "empty: unset, fusion off unless auto-enabled).");
ABSL_FLAG(int, iters, 20, "Timed ops per shape (after 3 warm-up ops).");
ABSL_FLAG(double, timeout, 120, "Seconds the whole demo may take before it gives up.");
ABSL_FLAG(std::string, doorbell, "auto",
          "--device=cuda: also run every shape on the doorbell plane. auto: a sidecar that refuses "
          "the doorbell (FAILED_PRECONDITION, e.g. fusion off) shows the row as skipped; on: a "
          "refusal fails the demo; off: eager plane only.");
ABSL_FLAG(int, client_rank, -1, "Internal: run as the client process of this rank.");
ABSL_FLAG(std::string, work_dir, "", "Internal: the run's directory (sockets, peers, results).");

namespace arfuse::demo {

const flags::FlagSet& DemoFlags() {
  static const flags::FlagSet set(
      "arfuse-demo", {"ranks", "tokens", "hidden", "dtype", "device", "json", "arfused", "backend",
                      "iters", "timeout", "doorbell", "client_rank", "work_dir"});
  return set;
}

std::string Usage() {
  std::string out = absl::StrCat(
      "arfuse-demo: ", absl::ProgramUsageMessage(),
      "\nusage: arfuse-demo [--flag=value ...]\n\n"
      "Starts --ranks arfused sidecars and one client process per rank, runs every --tokens x\n"
      "--hidden shape on the eager plane (and, with --device=cuda, the doorbell plane), checks\n"
      "every output against the CPU reference and prints a table. Exits non-zero on any wrong\n"
      "result or failed call.\n\nflags:\n");
  // The demo's flags, by name; the internal ones (a client process's) are left out.
  std::vector<absl::CommandLineFlag*> flags;
  for (const std::string& name : DemoFlags().names()) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag != nullptr && !absl::StartsWith(flag->Help(), "Internal:")) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(), [](auto* a, auto* b) { return a->Name() < b->Name(); });
  for (const absl::CommandLineFlag* f : flags) {
    const std::string def = f->DefaultValue();
    absl::StrAppend(&out, "  --", f->Name(), "  (default: ", def.empty() ? "unset" : def,
                    ")\n      ", f->Help(), "\n");
  }
  return out;
}

}  // namespace arfuse::demo
