// `arfuse-bench epilogue`: the cycles of a row's last step for each FP8 pattern against the
// unquantized norm store, on one block of the current GPU (bench/fp8_epilogue.cu runs it). What
// docs/performance.md's "Where the FP8 epilogue's time goes" reads.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "bench/flag_args.h"
#include "bench/fp8_epilogue.h"
#include "bench/subcommands.h"
#include "common/status_macros.h"

namespace {
const arfuse::bench::EpilogueRun kDefaultRun;
}  // namespace

ABSL_FLAG(arfuse::flags::PositiveList, epilogue_hidden, (arfuse::flags::PositiveList{{4096, 8192}}),
          "hidden sizes (bf16; multiples of 128 up to 8192), comma-separated");
ABSL_FLAG(int, epilogue_rows, static_cast<int>(kDefaultRun.rows),
          "rows one block runs in series per launch (1 to 4096)");
ABSL_FLAG(int, epilogue_repeats, kDefaultRun.repeats,
          "launches per variant and hidden (1 to 1000; the fewest cycles count)");

namespace arfuse::bench {
namespace {

const char kEpilogueDescription[] =
    "Cycles per row of a row's last step on one block of the current GPU, bf16, the fused\n"
    "kernels' row layout: the block's sum of squares, then the unquantized norm store or an FP8\n"
    "pattern's quantization (the kernels' own device functions), and three variants that leave a\n"
    "step out to show what it costs (their outputs are not the op's). Prints one line per hidden\n"
    "size and variant.";

const SubcommandFlags& EpilogueFlagSet() {
  static const SubcommandFlags set("epilogue", {"hidden", "rows", "repeats"}, "rank");
  return set;
}

struct EpilogueFlags {
  FlagOutcome outcome = FlagOutcome::kRun;
  std::vector<uint32_t> hidden;
  int rows = 0;
  int repeats = 0;
};

absl::StatusOr<EpilogueFlags> ParseEpilogueFlags(int argc, char** argv) {
  EpilogueFlags f;
  std::vector<std::string> given;
  ARFUSE_ASSIGN_OR_RETURN(f.outcome, EpilogueFlagSet().Parse(argc, argv, &given));
  if (f.outcome != FlagOutcome::kRun) return f;
  ARFUSE_RETURN_IF_ERROR(
      EpilogueFlagSet().Read({{"hidden", &f.hidden}, {"rows", &f.rows}, {"repeats", &f.repeats}}));
  for (uint32_t h : f.hidden) {
    if (h % 128 != 0 || h > kMaxEpilogueHidden) {
      return absl::InvalidArgumentError(
          absl::StrCat("--hidden=", h, " is not a multiple of 128 up to ", kMaxEpilogueHidden));
    }
  }
  if (f.rows < 1 || f.rows > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("--rows=", f.rows, " is not in 1..4096"));
  }
  if (f.repeats < 1 || f.repeats > 1000) {
    return absl::InvalidArgumentError(absl::StrCat("--repeats=", f.repeats, " is not in 1..1000"));
  }
  return f;
}

}  // namespace

int EpilogueMain(int argc, char** argv) {
  absl::StatusOr<EpilogueFlags> f = ParseEpilogueFlags(argc, argv);
  if (!f.ok()) {
    std::fprintf(stderr, "arfuse-bench epilogue: %s\n", f.status().ToString().c_str());
    return 2;
  }
  if (f->outcome != FlagOutcome::kRun) {
    return PrintHelpOrVersion(f->outcome, "epilogue", kEpilogueDescription, EpilogueFlagSet());
  }
  std::printf("%-7s %-30s %10s %8s\n", "hidden", "variant", "cycles/row", "x unq");
  for (uint32_t hidden : f->hidden) {
    double unquantized = 0.0;
    for (int v = 0; v < kEpilogueVariants; ++v) {
      EpilogueRun run;
      run.variant = static_cast<EpilogueVariant>(v);
      run.hidden = hidden;
      run.rows = static_cast<uint32_t>(f->rows);
      run.repeats = f->repeats;
      double cycles = 0.0;
      if (cudaError_t e = TimeEpilogue(run, &cycles); e != cudaSuccess) {
        std::fprintf(stderr, "arfuse-bench epilogue: hidden %u, %s: %s\n", hidden,
                     EpilogueVariantName(run.variant), cudaGetErrorString(e));
        return 1;
      }
      if (run.variant == EpilogueVariant::kUnquantized) unquantized = cycles;
      std::printf("%-7u %-30s %10.0f %8.2f\n", hidden, EpilogueVariantName(run.variant), cycles,
                  unquantized > 0.0 ? cycles / unquantized : 0.0);
    }
  }
  return 0;
}

}  // namespace arfuse::bench
