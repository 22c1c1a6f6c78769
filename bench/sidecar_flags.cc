#include "bench/sidecar_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/common/op_types.h"

// `arfuse-bench sidecar --key`, with SidecarFlags' defaults (a run reads the flags into it).
namespace {
const arfuse::bench::SidecarFlags kDefaults;
}  // namespace

ABSL_FLAG(int, sidecar_ranks, kDefaults.ranks,
          "ranks: sidecars and client processes (rank r on GPU r % GPUs)");
ABSL_FLAG(std::string, sidecar_device, kDefaults.device,
          "host or cuda (default: cuda when built with it and a GPU is visible, else host)");
ABSL_FLAG(arfuse::flags::PositiveList, sidecar_tokens,
          arfuse::flags::PositiveList{kDefaults.tokens}, "token counts, comma-separated");
ABSL_FLAG(arfuse::flags::PositiveList, sidecar_hidden,
          arfuse::flags::PositiveList{kDefaults.hidden},
          "hidden sizes (multiples of 8), comma-separated");
ABSL_FLAG(int, sidecar_iters, kDefaults.iters, "timed calls per per-call row");
ABSL_FLAG(int, sidecar_warmup, kDefaults.warmup, "untimed calls first");
ABSL_FLAG(int, sidecar_block, kDefaults.block,
          "echo and Execute calls alternate in blocks of this many");
ABSL_FLAG(int, sidecar_graph_ops, kDefaults.graph_ops, "ops per CUDA graph (graph rows)");
ABSL_FLAG(int, sidecar_repeats, kDefaults.repeats, "timed replays per graph row");
ABSL_FLAG(int, sidecar_compute_us, kDefaults.compute_us,
          "GPU time of the layer stand-in kernel, us");
ABSL_FLAG(std::string, sidecar_json, kDefaults.json, "where the results go");
ABSL_FLAG(std::string, sidecar_arfused, kDefaults.arfused,
          "the arfused binary (default: the build tree's, next to this binary, or PATH's)");
ABSL_FLAG(std::string, sidecar_backend, kDefaults.backend,
          "the sidecars' --flashinfer-allreduce-fusion-backend");
ABSL_FLAG(std::string, sidecar_ring_lib, kDefaults.ring_lib,
          "libarfuse_ring.so for the doorbell rows (default: found)");
ABSL_FLAG(int, sidecar_timeout, kDefaults.timeout_s, "seconds the whole run may take");
ABSL_FLAG(int, sidecar_client_rank, kDefaults.client_rank,
          "internal: run as the client process of this rank");
ABSL_FLAG(std::string, sidecar_dir, kDefaults.dir, "internal: the run's directory");

namespace arfuse::bench {
namespace {

constexpr char kDescription[] =
    "The sidecar's data planes per op, each against its yardstick in the same run: eager\n"
    "(Fusion.Execute) against a gRPC echo, the doorbell plane against the same kernel launched\n"
    "in-process, and a layer loop (stand-in kernel + fused op) in-process, through the doorbell\n"
    "and over NCCL. Starts --ranks arfused sidecars and one client process per rank; prints one\n"
    "progress line per row to stderr, then the table (slowest rank, us), and writes --json.\n"
    "Host mode (--device=host) needs no GPU.";

const SubcommandFlags& SidecarFlagSet() {
  static const SubcommandFlags set(
      "sidecar",
      {"ranks", "device", "tokens", "hidden", "iters", "warmup", "block", "graph_ops", "repeats",
       "compute_us", "json", "arfused", "backend", "ring_lib", "timeout"},
      "client_rank");
  return set;
}

}  // namespace

absl::StatusOr<SidecarFlags> ParseSidecarFlags(int argc, char** argv) {
  SidecarFlags f;
  ARFUSE_ASSIGN_OR_RETURN(f.outcome, SidecarFlagSet().Parse(argc, argv, &f.raw));
  if (f.outcome != FlagOutcome::kRun) return f;
  ARFUSE_RETURN_IF_ERROR(SidecarFlagSet().Read({{"ranks", &f.ranks},
                                                {"device", &f.device},
                                                {"tokens", &f.tokens},
                                                {"hidden", &f.hidden},
                                                {"iters", &f.iters},
                                                {"warmup", &f.warmup},
                                                {"block", &f.block},
                                                {"graph_ops", &f.graph_ops},
                                                {"repeats", &f.repeats},
                                                {"compute_us", &f.compute_us},
                                                {"json", &f.json},
                                                {"arfused", &f.arfused},
                                                {"backend", &f.backend},
                                                {"ring_lib", &f.ring_lib},
                                                {"timeout", &f.timeout_s},
                                                {"client_rank", &f.client_rank},
                                                {"dir", &f.dir}}));
  if (f.ranks < 1 || f.ranks > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat("--ranks must be 1..", kMaxWorldSize));
  }
  if (!f.device.empty() && f.device != "host" && f.device != "cuda") {
    return absl::InvalidArgumentError("--device is host or cuda");
  }
  for (uint32_t h : f.hidden) {
    if (h % 8 != 0) return absl::InvalidArgumentError("--hidden values must be multiples of 8");
  }
  if (f.iters < 1 || f.warmup < 0 || f.block < 1 || f.graph_ops < 1 || f.repeats < 1 ||
      f.compute_us < 0 || f.timeout_s < 1) {
    return absl::InvalidArgumentError(
        "--iters, --block, --graph_ops, --repeats, --timeout >= 1; --warmup, --compute_us >= 0");
  }
  return f;
}

int PrintSidecarHelpOrVersion(FlagOutcome outcome) {
  return PrintHelpOrVersion(outcome, "sidecar", kDescription, SidecarFlagSet());
}

}  // namespace arfuse::bench
