// arfuse-bench-flashinfer: arfuse's fused allreduce + residual + RMSNorm (+ FP8 E4M3) kernels
// against FlashInfer's trtllm_allreduce_fusion kernels for the same patterns, in one process on
// one GPU with two ranks (docs/gpu-tests.md, "bench-flashinfer"). Per shape and pattern, each
// framework's one-shot and two-shot op is checked (after one launch: both ranks agree, arfuse's
// outputs match FlashInfer's, see compare.h) and timed as a CUDA graph of --iters pairs
// (rank 0 on stream A, rank 1 on stream B, concurrently), median us per op of --repeats replays.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/flashinfer/arfuse_ops.h"
#include "bench/flashinfer/cases.h"
#include "bench/flashinfer/compare.h"
#include "bench/flashinfer/device_fill.h"
#include "bench/flashinfer/flashinfer_ops.h"
#include "bench/flashinfer/pair_runner.h"
#include "bench/flashinfer/report.h"
#include "bench/flashinfer/row_runner.h"
#include "common/flags.h"

namespace arfuse::bench_fi {
namespace {

constexpr float kStaticScale = 1.0f / 128.0f;  // normalized values of about +-3 -> codes up to 384

struct Options {
  std::vector<uint32_t> hidden;
  std::vector<uint32_t> tokens;
  std::vector<Case> cases;
  int iters = 20;
  int warmup = 3;
  int repeats = 9;
  std::string json;
  double watchdog_s = 5.0;
  int spin_ms = 2000;
  int flashinfer_sms = 0;        // 0: the device's SM count
  bool flashinfer_half = false;  // --flashinfer_sms=half: half the device's SMs, as arfuse's
  int arfuse_sm_budget = -1;     // -1: half the device's SMs
};

}  // namespace
}  // namespace arfuse::bench_fi

ABSL_FLAG(arfuse::flags::PositiveList, hidden, (arfuse::flags::PositiveList{{4096, 8192}}),
          "hidden sizes (multiples of 128)");
ABSL_FLAG(arfuse::flags::PositiveList, tokens,
          (arfuse::flags::PositiveList{{1, 2, 8, 32, 128, 512, 2048}}), "token counts");
ABSL_FLAG(std::string, patterns, "norm,fp8_static,fp8_per_token,fp8_group_ue8m0,fp8_group_fp32",
          "the cases to run (bench/flashinfer/cases.h)");
ABSL_FLAG(int, iters, 20, "op pairs captured per graph");
ABSL_FLAG(int, warmup, 3, "untimed graph replays first");
ABSL_FLAG(int, repeats, 9, "timed graph replays (the median is reported)");
ABSL_FLAG(std::string, json, "", "write every row to this JSON file");
ABSL_FLAG(double, watchdog_s, 5.0, "abort when one replay takes longer (seconds)");
ABSL_FLAG(int, spin_ms, 2000, "arfuse's spin deadline (ms)");
ABSL_FLAG(std::string, flashinfer_sms, "0",
          "SMs FlashInfer's launcher sizes its grids for: 0 (the device's), half (each rank's "
          "share, as arfuse's default budget) or a number");
ABSL_FLAG(int, arfuse_sm_budget, -1, "SMs each arfuse rank's grid may assume (-1: half the GPU)");

namespace arfuse::bench_fi {
namespace {

constexpr const char* kFlagNames[] = {
    "hidden", "tokens",     "patterns", "iters",          "warmup",          "repeats",
    "json",   "watchdog_s", "spin_ms",  "flashinfer_sms", "arfuse_sm_budget"};

std::string Usage(const flags::FlagSet& set) {
  std::string out = "usage: arfuse-bench-flashinfer [--key=value ...]\n";
  for (const std::string& name : set.names()) {
    const absl::CommandLineFlag* f = set.Find(name);
    out +=
        "  --" + flags::Hyphenated(name) + "=" + f->DefaultValue() + "\n      " + f->Help() + "\n";
  }
  return out;
}

// A value out of range, or a pattern name not in cases.h: INVALID_ARGUMENT naming the flag.
absl::StatusOr<Options> ReadOptions() {
  Options o;
  o.hidden = absl::GetFlag(FLAGS_hidden).values;
  o.tokens = absl::GetFlag(FLAGS_tokens).values;
  for (const uint32_t h : o.hidden) {
    if (h % fp8::kGroupSize != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--hidden=", h, ": not a multiple of ", fp8::kGroupSize));
    }
  }
  for (const absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_patterns), ',')) {
    bool found = false;
    for (int c = 0; c < kNumCases; ++c) {
      if (name == InfoOf(static_cast<Case>(c)).name) {
        o.cases.push_back(static_cast<Case>(c));
        found = true;
      }
    }
    if (!found) return absl::InvalidArgumentError(absl::StrCat("--patterns: unknown ", name));
  }
  o.iters = absl::GetFlag(FLAGS_iters);
  o.warmup = absl::GetFlag(FLAGS_warmup);
  o.repeats = absl::GetFlag(FLAGS_repeats);
  o.json = absl::GetFlag(FLAGS_json);
  o.watchdog_s = absl::GetFlag(FLAGS_watchdog_s);
  o.spin_ms = absl::GetFlag(FLAGS_spin_ms);
  o.arfuse_sm_budget = absl::GetFlag(FLAGS_arfuse_sm_budget);
  if (o.iters < 1 || o.warmup < 0 || o.repeats < 1 || o.spin_ms < 1 || !(o.watchdog_s > 0) ||
      o.arfuse_sm_budget < -1) {
    return absl::InvalidArgumentError(
        "--iters, --repeats and --spin-ms must be at least 1, --warmup at least 0, "
        "--watchdog-s positive and --arfuse-sm-budget at least -1");
  }
  const std::string sms = absl::GetFlag(FLAGS_flashinfer_sms);
  o.flashinfer_half = sms == "half";
  if (!o.flashinfer_half && (!absl::SimpleAtoi(sms, &o.flashinfer_sms) || o.flashinfer_sms < 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--flashinfer-sms=", sms, ": expected 0, half or a number of SMs"));
  }
  return o;
}

#define CHECK_CUDA(expr)                                                                          \
  do {                                                                                            \
    const cudaError_t err_ = (expr);                                                              \
    if (err_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "arfuse-bench-flashinfer: %s: %s\n", #expr, cudaGetErrorString(err_)); \
      return 1;                                                                                   \
    }                                                                                             \
  } while (false)

// Device memory freed at exit.
class Buffers {
 public:
  ~Buffers() {
    for (void* p : owned_) cudaFree(p);
  }
  void* Get(size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
    owned_.push_back(p);
    return p;
  }

 private:
  std::vector<void*> owned_;
};

int Run(const Options& o, const std::string& command) {
  int device = 0, sms = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  cudaDeviceProp prop = {};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  const int flashinfer_sms = o.flashinfer_half ? std::max(1, sms / kWorld) : o.flashinfer_sms;
  if (flashinfer_sms > 0) SetFlashInferSmCount(flashinfer_sms);
  const uint32_t budget = o.arfuse_sm_budget >= 0
                              ? static_cast<uint32_t>(o.arfuse_sm_budget)
                              : static_cast<uint32_t>(std::max(1, sms / kWorld));
  const uint32_t max_tokens = *std::max_element(o.tokens.begin(), o.tokens.end());
  const uint32_t max_hidden = *std::max_element(o.hidden.begin(), o.hidden.end());
  const size_t max_elems = static_cast<size_t>(max_tokens) * max_hidden;

  PairRunner runner(o.watchdog_s);
  CHECK_CUDA(runner.status());
  cudaStream_t s = runner.stream_a();
  std::unique_ptr<ArfuseGroup> arfuse;
  std::string why;
  if (cudaError_t e =
          ArfuseGroup::Create(max_tokens, max_hidden, budget,
                              static_cast<uint64_t>(o.spin_ms) * 1000000ull, s, &arfuse, &why);
      e != cudaSuccess) {
    std::fprintf(stderr, "arfuse-bench-flashinfer: arfuse workspaces: %s %s\n",
                 cudaGetErrorString(e), why.c_str());
    return 1;
  }
  std::unique_ptr<FlashInferGroup> flashinfer;
  CHECK_CUDA(FlashInferGroup::Create(max_tokens, max_hidden, s, &flashinfer));

  // Inputs: each rank its own contribution; the residual and gamma the same on both ranks (as
  // in tensor parallelism), so both ranks compute the same outputs.
  Buffers mem;
  Tensors tensors;
  void* gamma = mem.Get(max_hidden * 2);
  void* scale = mem.Get(sizeof(float));
  if (gamma == nullptr || scale == nullptr) return 1;
  CHECK_CUDA(FillRandomBf16(gamma, max_hidden, 200, 0.5f, 1.5f, s));
  CHECK_CUDA(cudaMemcpyAsync(scale, &kStaticScale, sizeof(float), cudaMemcpyHostToDevice, s));
  tensors.static_scale = static_cast<float*>(scale);
  const size_t scale_bytes =
      static_cast<size_t>(max_tokens) * (max_hidden / fp8::kGroupSize) * 4 + 64;
  for (int r = 0; r < kWorld; ++r) {
    void* input = mem.Get(max_elems * 2);
    void* residual = mem.Get(max_elems * 2);
    if (input == nullptr || residual == nullptr) return 1;
    CHECK_CUDA(FillRandomBf16(input, max_elems, 1 + r, -1.0f, 1.0f, s));
    CHECK_CUDA(FillRandomBf16(residual, max_elems, 100, -1.0f, 1.0f, s));
    for (int impl = 0; impl < 2; ++impl) {
      RankTensors& t = tensors.t[impl][r];
      t.input = input;
      t.residual_in = residual;
      t.gamma = gamma;
      t.residual_out = mem.Get(max_elems * 2);
      t.norm_out = mem.Get(max_elems * 2);
      t.quant_out = mem.Get(max_elems);
      t.scale = mem.Get(scale_bytes);
      if (t.residual_out == nullptr || t.norm_out == nullptr || t.quant_out == nullptr ||
          t.scale == nullptr) {
        std::fprintf(stderr, "arfuse-bench-flashinfer: out of device memory\n");
        return 1;
      }
    }
  }
  CHECK_CUDA(cudaStreamSynchronize(s));

  RunInfo info;
  info.command = command;
  info.device = prop.name;
  info.sms = sms;
  info.arfuse_sm_budget = budget;
  info.flashinfer_sms = flashinfer_sms;
  info.iters = o.iters;
  info.warmup = o.warmup;
  info.repeats = o.repeats;
  info.watchdog_s = o.watchdog_s;
  info.spin_ms = o.spin_ms;
  const char* tuning = std::getenv("ARFUSE_FUSION_TUNING");
  info.fusion_tuning = tuning != nullptr ? tuning : "";
  info.arfuse_workspace_bytes = arfuse->bytes_per_rank();
  info.flashinfer_workspace_bytes = flashinfer->bytes_per_rank();
  PrintHeader(info);

  AlgoContext ctx{&runner, arfuse.get(), flashinfer.get(), &tensors, o.iters, o.warmup, o.repeats};
  std::vector<RowResult> rows;
  const size_t total = o.hidden.size() * o.tokens.size() * o.cases.size();
  for (uint32_t h : o.hidden) {
    for (uint32_t tok : o.tokens) {
      for (Case c : o.cases) {
        RowResult row;
        row.hidden = h;
        row.tokens = tok;
        row.c = c;
        Snapshot snaps[2][2];  // [impl][algo]
        for (int impl = 0; impl < 2; ++impl) {
          for (int algo = 0; algo < 2; ++algo) {
            RankOp op;
            op.c = c;
            op.oneshot = algo == 0;
            op.tokens = tok;
            op.hidden = h;
            ImplResult& ir = impl == kArfuse ? row.arfuse : row.flashinfer;
            RunAlgo(ctx, static_cast<Impl>(impl), op, &ir.algo[algo], &snaps[impl][algo]);
          }
        }
        for (const Snapshot& a : snaps[kArfuse]) {
          for (const Snapshot& f : snaps[kFlashInfer]) {
            if (a.valid && f.valid) Merge(&row.check, Compare(c, tok, h, a, f));
          }
        }
        for (int impl = 0; impl < 2; ++impl) {
          if (snaps[impl][0].valid && snaps[impl][1].valid) {
            const int64_t d = static_cast<int64_t>(SnapshotDiff(snaps[impl][0], snaps[impl][1]));
            (impl == kArfuse ? row.arfuse_algos_differ : row.flashinfer_algos_differ) = d;
          }
        }
        rows.push_back(row);
        std::fprintf(stderr,
                     "arfuse-bench-flashinfer: [%zu/%zu] hidden %u tokens %u %s: arfuse %.1f us, "
                     "FlashInfer %.1f us%s\n",
                     rows.size(), total, h, tok, InfoOf(c).name, row.arfuse.best_us(),
                     row.flashinfer.best_us(),
                     !row.check.compared ? " (not compared)" : (row.ok() ? "" : " (check FAILED)"));
      }
    }
  }
  PrintTable(info, rows);
  if (!o.json.empty()) {
    if (!WriteJson(o.json, info, rows)) {
      std::fprintf(stderr, "arfuse-bench-flashinfer: cannot write %s\n", o.json.c_str());
      return 1;
    }
    std::printf("wrote %s\n", o.json.c_str());
  }
  // A failed check or a failed launch fails the run; what did not run (grids that cannot
  // co-reside, shapes FlashInfer refuses) does not.
  bool all_ok = true;
  for (const RowResult& r : rows) {
    if (r.check.compared && !r.ok()) all_ok = false;
    for (const ImplResult* i : {&r.arfuse, &r.flashinfer}) {
      for (const AlgoResult& a : i->algo) {
        if (a.error || (a.ran && a.rank_diff != 0)) all_ok = false;
      }
    }
  }
  return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace arfuse::bench_fi

int main(int argc, char** argv) {
  const arfuse::flags::FlagSet set(
      "arfuse-bench-flashinfer", std::vector<std::string>(std::begin(arfuse::bench_fi::kFlagNames),
                                                          std::end(arfuse::bench_fi::kFlagNames)));
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf("%s", arfuse::bench_fi::Usage(set).c_str());
      return 0;
    }
  }
  absl::StatusOr<arfuse::bench_fi::Options> o = absl::InvalidArgumentError("not parsed");
  if (absl::StatusOr<std::vector<arfuse::flags::GivenFlag>> given = set.Parse(argc, argv);
      !given.ok()) {
    o = given.status();
  } else {
    o = arfuse::bench_fi::ReadOptions();
  }
  if (!o.ok()) {
    std::fprintf(stderr, "arfuse-bench-flashinfer: %s\n%s",
                 std::string(o.status().message()).c_str(), arfuse::bench_fi::Usage(set).c_str());
    return 2;
  }
  // Before the first CUDA call: rank 0's and rank 1's streams (and a graph's branches) must not
  // share a hardware queue, where a kernel spinning on its peer would hold back the peer's
  // kernel queued behind it. 32 queues, as gpu-run gives its one-process multi-rank tests.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  std::string command = "arfuse-bench-flashinfer";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  return arfuse::bench_fi::Run(*o, command);
}
