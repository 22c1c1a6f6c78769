#include "bench/kernels_flags.h"

#include "absl/strings/str_cat.h"
#include "kernels/common/op_types.h"
#include "server/core/status_macros.h"

namespace arfuse::bench {
namespace {

using Flag = FlagTable::Flag;

FlagTable KernelsFlagTable(KernelsFlags* f) {
  return FlagTable(
      {Flag("world", &f->world, "ranks, one process each (2, 4, 8 or 16; rank r on GPU r % GPUs)"),
       Flag("backend", &f->backend, "workspace backend: trtllm or mnnvl"),
       Flag("vmm", &f->vmm, "mnnvl: VMM handle type (auto, posix_fd or fabric)"),
       Flag("tokens", &f->tokens, "token counts, comma-separated"),
       Flag("hidden", &f->hidden, "hidden sizes (multiples of 8), comma-separated"),
       Flag("repeats", &f->repeats, "timed graph replays per row (at least 5; the median counts)"),
       Flag("iters", &f->iters, "ops per CUDA graph"),
       Flag("warmup", &f->warmup, "untimed graph replays per row"),
       Flag("spin_ms", &f->spin_ms, "the fused kernels' spin deadline in ms"),
       Flag("json", &f->json, "where rank 0 writes the results")},
      "rank", &f->rank, &f->dir);
}

}  // namespace

const char kKernelsDescription[] =
    "The fused allreduce + residual add + RMSNorm (one-shot, two-shot, the dispatcher's choice)\n"
    "against NCCL + add-RMSNorm and a peer copy of the same bytes, bf16, per shape, each row a\n"
    "CUDA graph. Starts --world rank processes; prints one progress line per shape to stderr,\n"
    "then the table (slowest rank's median, us per op), and writes --json. Needs a CUDA build and\n"
    "one GPU per rank for the NCCL rows (ranks sharing a GPU need MPS).";

absl::StatusOr<KernelsFlags> ParseKernelsFlags(int argc, char** argv) {
  KernelsFlags f;
  ARFUSE_ASSIGN_OR_RETURN(f.outcome, KernelsFlagTable(&f).Parse(argc, argv, &f.raw));
  if (f.outcome != FlagOutcome::kRun) return f;
  if (!IsSupportedWorldSize(f.world)) {
    return absl::InvalidArgumentError(absl::StrCat("--world=", f.world, " is not 2, 4, 8 or 16"));
  }
  if (f.repeats < 5) return absl::InvalidArgumentError("--repeats must be at least 5");
  if (f.iters < 1 || f.warmup < 0) return absl::InvalidArgumentError("--iters >= 1, --warmup >= 0");
  if (f.backend != "trtllm" && f.backend != "mnnvl") {
    return absl::InvalidArgumentError("--backend is trtllm or mnnvl");
  }
  return f;
}

int PrintKernelsHelpOrVersion(FlagOutcome outcome) {
  KernelsFlags defaults;
  return PrintHelpOrVersion(outcome, "kernels", kKernelsDescription, KernelsFlagTable(&defaults));
}

}  // namespace arfuse::bench
