#include "bench/kernels_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/common/op_types.h"

// `arfuse-bench kernels --key`, with KernelsFlags' defaults (a run reads the flags into it).
namespace {
const arfuse::bench::KernelsFlags kDefaults;
}  // namespace

ABSL_FLAG(int, kernels_world, kDefaults.world,
          "ranks, one process each (2, 4, 8 or 16; rank r on GPU r % GPUs)");
ABSL_FLAG(std::string, kernels_backend, kDefaults.backend, "workspace backend: trtllm or mnnvl");
ABSL_FLAG(std::string, kernels_vmm, kDefaults.vmm,
          "mnnvl: VMM handle type (auto, posix_fd or fabric)");
ABSL_FLAG(arfuse::flags::PositiveList, kernels_tokens,
          arfuse::flags::PositiveList{kDefaults.tokens}, "token counts, comma-separated");
ABSL_FLAG(arfuse::flags::PositiveList, kernels_hidden,
          arfuse::flags::PositiveList{kDefaults.hidden},
          "hidden sizes (multiples of 8), comma-separated");
ABSL_FLAG(int, kernels_repeats, kDefaults.repeats,
          "timed graph replays per row (at least 5; the median counts)");
ABSL_FLAG(int, kernels_iters, kDefaults.iters, "ops per CUDA graph");
ABSL_FLAG(int, kernels_warmup, kDefaults.warmup, "untimed graph replays per row");
ABSL_FLAG(int, kernels_spin_ms, kDefaults.spin_ms, "the fused kernels' spin deadline in ms");
ABSL_FLAG(int, kernels_fp8, kDefaults.fp8,
          "1: also time the FP8 patterns (static, per-token, per-group fp32 scales) against the "
          "unquantized fused op followed by a separate quantization kernel");
ABSL_FLAG(std::string, kernels_json, kDefaults.json, "where rank 0 writes the results");
ABSL_FLAG(int, kernels_rank, kDefaults.rank,
          "internal: this rank process's rank (-1: the launcher)");
ABSL_FLAG(std::string, kernels_dir, "", "internal: the run's directory");

namespace arfuse::bench {
namespace {

const SubcommandFlags& KernelsFlagSet() {
  static const SubcommandFlags set("kernels",
                                   {"world", "backend", "vmm", "tokens", "hidden", "repeats",
                                    "iters", "warmup", "spin_ms", "fp8", "json"},
                                   "rank");
  return set;
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
  ARFUSE_ASSIGN_OR_RETURN(f.outcome, KernelsFlagSet().Parse(argc, argv, &f.raw));
  if (f.outcome != FlagOutcome::kRun) return f;
  ARFUSE_RETURN_IF_ERROR(KernelsFlagSet().Read({{"world", &f.world},
                                                {"rank", &f.rank},
                                                {"dir", &f.dir},
                                                {"backend", &f.backend},
                                                {"vmm", &f.vmm},
                                                {"tokens", &f.tokens},
                                                {"hidden", &f.hidden},
                                                {"repeats", &f.repeats},
                                                {"iters", &f.iters},
                                                {"warmup", &f.warmup},
                                                {"spin_ms", &f.spin_ms},
                                                {"fp8", &f.fp8},
                                                {"json", &f.json}}));
  if (!IsSupportedWorldSize(f.world)) {
    return absl::InvalidArgumentError(absl::StrCat("--world=", f.world, " is not 2, 4, 8 or 16"));
  }
  if (f.repeats < 5) return absl::InvalidArgumentError("--repeats must be at least 5");
  if (f.iters < 1 || f.warmup < 0) return absl::InvalidArgumentError("--iters >= 1, --warmup >= 0");
  if (f.fp8 != 0 && f.fp8 != 1) return absl::InvalidArgumentError("--fp8 is 0 or 1");
  if (f.backend != "trtllm" && f.backend != "mnnvl") {
    return absl::InvalidArgumentError("--backend is trtllm or mnnvl");
  }
  return f;
}

int PrintKernelsHelpOrVersion(FlagOutcome outcome) {
  return PrintHelpOrVersion(outcome, "kernels", kKernelsDescription, KernelsFlagSet());
}

}  // namespace arfuse::bench
