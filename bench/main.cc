// arfuse-bench: benchmarks of arfuse, one subcommand per thing measured.
#include <cstdio>
#include <cstring>

#include "bench/subcommands.h"

namespace arfuse::bench {
namespace {

#if !defined(ARFUSE_BENCH_CUDA)
int KernelsMain(int, char**) {
  std::fprintf(stderr, "arfuse-bench kernels: this build has no CUDA\n");
  return 2;
}
#endif

constexpr Subcommand kSubcommands[] = {
    {"kernels", "fused one-shot/two-shot vs NCCL (+ add-RMSNorm) vs a peer copy, per shape",
     KernelsMain},
    {"sidecar", "eager and doorbell planes per op vs gRPC echo / in-process launch; layer loop",
     SidecarMain},
};

int Usage() {
  std::fprintf(stderr, "usage: arfuse-bench <subcommand> [--key=value ...]\nsubcommands:\n");
  for (const Subcommand& s : kSubcommands) std::fprintf(stderr, "  %-10s %s\n", s.name, s.summary);
  return 2;
}

}  // namespace
}  // namespace arfuse::bench

int main(int argc, char** argv) {
  using arfuse::bench::kSubcommands;
  if (argc < 2) return arfuse::bench::Usage();
  for (const auto& s : kSubcommands) {
    if (std::strcmp(argv[1], s.name) == 0) return s.run(argc - 1, argv + 1);
  }
  std::fprintf(stderr, "unknown subcommand %s\n", argv[1]);
  return arfuse::bench::Usage();
}
