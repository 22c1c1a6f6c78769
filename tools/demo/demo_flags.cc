#include "tools/demo/demo_flags.h"

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
ABSL_FLAG(std::string, planes, "",
          "The data planes to run every shape on, comma-separated (the rows always come in this "
          "order): instream "
          "(libarfuse_client in the client process: host mode's CPU op, or the sidecar's kernel "
          "in a CUDA graph), eager (one Fusion.Execute per op), doorbell (--device=cuda: a ring "
          "kernel in a CUDA graph). Unset: instream, eager and, with --device=cuda, doorbell "
          "(see --doorbell); a sidecar's refusal of the in-stream attach shows its row as skipped. "
          "A plane named here that a sidecar refuses fails the demo.");
ABSL_FLAG(std::string, doorbell, "auto",
          "--device=cuda with --planes unset: the doorbell rows. auto: a sidecar that refuses the "
          "doorbell (FAILED_PRECONDITION, e.g. fusion off) shows the row as skipped; on: a "
          "refusal fails the demo; off: no doorbell rows.");
ABSL_FLAG(int, client_rank, -1, "Internal: run as the client process of this rank.");
ABSL_FLAG(std::string, work_dir, "", "Internal: the run's directory (sockets, peers, results).");

namespace arfuse::demo {

const flags::FlagSet& DemoFlags() {
  static const flags::FlagSet set(
      "arfuse-demo", {"ranks", "tokens", "hidden", "dtype", "device", "json", "arfused", "backend",
                      "iters", "timeout", "planes", "doorbell", "client_rank", "work_dir"});
  return set;
}

std::string Usage() {
  std::string out = absl::StrCat(
      "arfuse-demo: ", absl::ProgramUsageMessage(),
      "\nusage: arfuse-demo [--flag=value ...]\n\n"
      "Starts --ranks arfused sidecars and one client process per rank, runs every --tokens x\n"
      "--hidden shape on the in-stream plane, then the eager plane (and, with --device=cuda,\n"
      "the doorbell plane), checks every output against the CPU reference and prints a table:\n"
      "each row's plane, path, us per op and its cost against the in-stream row of the same\n"
      "shape. Exits non-zero on any wrong result or failed call.\n\nflags:\n");
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
