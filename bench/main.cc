// arfuse-bench: benchmarks of arfuse, one subcommand per thing measured.
#include <cstdio>
#include <cstring>

#include "bench/kernels_flags.h"
#include "bench/subcommands.h"
#include "common/version.h"

namespace arfuse::bench {
namespace {

#if !defined(ARFUSE_BENCH_CUDA)
// Without CUDA the subcommand still answers --help and --version; a run says why it cannot.
int KernelsMain(int argc, char** argv) {
  absl::StatusOr<KernelsFlags> f = ParseKernelsFlags(argc, argv);
  if (f.ok() && f->outcome != FlagOutcome::kRun) return PrintKernelsHelpOrVersion(f->outcome);
  std::fprintf(stderr,
               "arfuse-bench kernels: this build has no CUDA (configure with a CUDA "
               "toolkit and NCCL to build it)\n");
  return 2;
}

int EpilogueMain(int /*argc*/, char** /*argv*/) {
  std::fprintf(stderr, "arfuse-bench epilogue: this build has no CUDA\n");
  return 2;
}
#endif

constexpr Subcommand kSubcommands[] = {
    {"kernels", "fused one-shot/two-shot vs NCCL (+ add-RMSNorm) vs a peer copy, per shape",
     KernelsMain},
    {"epilogue", "cycles per row of the FP8 patterns' last step vs the norm store, one block",
     EpilogueMain},
    {"sidecar", "eager and doorbell planes per op vs gRPC echo / in-process launch; layer loop",
     SidecarMain},
};

void PrintUsage(std::FILE* out) {
  std::fprintf(out, "usage: arfuse-bench <subcommand> [--key=value ...]\n\nsubcommands:\n");
  for (const Subcommand& s : kSubcommands) std::fprintf(out, "  %-10s %s\n", s.name, s.summary);
  std::fprintf(out,
               "\n'arfuse-bench <subcommand> --help' lists its flags; 'arfuse-bench --version' "
               "prints the version.\n");
}

}  // namespace
}  // namespace arfuse::bench

int main(int argc, char** argv) {
  using arfuse::bench::kSubcommands;
  if (argc < 2) {
    arfuse::bench::PrintUsage(stderr);
    return 2;
  }
  if (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0 ||
      std::strcmp(argv[1], "help") == 0) {
    arfuse::bench::PrintUsage(stdout);
    return 0;
  }
  if (std::strcmp(argv[1], "--version") == 0) {
    std::printf("%s\n", arfuse::VersionLine("arfuse-bench").c_str());
    return 0;
  }
  for (const auto& s : kSubcommands) {
    if (std::strcmp(argv[1], s.name) == 0) return s.run(argc - 1, argv + 1);
  }
  std::fprintf(stderr, "arfuse-bench: unknown subcommand %s\n", argv[1]);
  arfuse::bench::PrintUsage(stderr);
  return 2;
}
