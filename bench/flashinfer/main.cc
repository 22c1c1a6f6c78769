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
#include <memory>
#include <string>
#include <vector>

#include "bench/flashinfer/arfuse_ops.h"
#include "bench/flashinfer/cases.h"
#include "bench/flashinfer/compare.h"
#include "bench/flashinfer/device_fill.h"
#include "bench/flashinfer/flashinfer_ops.h"
#include "bench/flashinfer/pair_runner.h"
#include "bench/flashinfer/report.h"
#include "bench/flashinfer/row_runner.h"

namespace arfuse::bench_fi {
namespace {

constexpr float kStaticScale = 1.0f / 128.0f;  // normalized values of about +-3 -> codes up to 384

struct Options {
  std::vector<uint32_t> hidden = {4096, 8192};
  std::vector<uint32_t> tokens = {1, 2, 8, 32, 128, 512, 2048};
  std::vector<Case> cases = {Case::kNorm, Case::kFp8Static, Case::kFp8PerToken,
                             Case::kFp8GroupUe8m0, Case::kFp8GroupFp32};
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

constexpr const char* kUsage =
    "usage: arfuse-bench-flashinfer [--hidden=4096,8192] [--tokens=1,2,8,32,128,512,2048]\n"
    "         [--patterns=norm,fp8_static,fp8_per_token,fp8_group_ue8m0,fp8_group_fp32]\n"
    "         [--iters=20] [--warmup=3] [--repeats=9] [--json=PATH] [--watchdog_s=5]\n"
    "         [--spin_ms=2000] [--flashinfer_sms=0|half|N] [--arfuse_sm_budget=SMs/2]\n"
    "  --flashinfer_sms=N  FlashInfer's launcher sizes its grids for N SMs (0: the device's,\n"
    "                      half: half of them, each rank's share as arfuse's default budget)\n"
    "  --arfuse_sm_budget=N  SMs each arfuse rank's grid may assume (default half the GPU)\n";

bool ParseList(const std::string& v, std::vector<uint32_t>* out) {
  out->clear();
  size_t at = 0;
  while (at <= v.size()) {
    const size_t comma = std::min(v.find(',', at), v.size());
    const std::string item = v.substr(at, comma - at);
    char* end = nullptr;
    const unsigned long n = std::strtoul(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || n == 0 || n > (1u << 20)) return false;
    out->push_back(static_cast<uint32_t>(n));
    at = comma + 1;
  }
  return !out->empty();
}

bool ParseInt(const std::string& v, int lo, int* out) {
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < lo || n > (1 << 30)) return false;
  *out = static_cast<int>(n);
  return true;
}

// 0: run; 1: a bad flag (message printed); 2: --help.
int ParseFlags(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return 2;
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) {
      std::fprintf(stderr, "arfuse-bench-flashinfer: expected --key=value, got %s\n%s", arg.c_str(),
                   kUsage);
      return 1;
    }
    std::string key = arg.substr(2, eq - 2);
    std::replace(key.begin(), key.end(), '-', '_');
    const std::string v = arg.substr(eq + 1);
    bool ok = true;
    if (key == "hidden") {
      ok = ParseList(v, &o->hidden);
    } else if (key == "tokens") {
      ok = ParseList(v, &o->tokens);
    } else if (key == "patterns") {
      o->cases.clear();
      size_t at = 0;
      while (ok && at <= v.size()) {
        const size_t comma = std::min(v.find(',', at), v.size());
        const std::string name = v.substr(at, comma - at);
        bool found = false;
        for (int c = 0; c < kNumCases; ++c) {
          if (name == InfoOf(static_cast<Case>(c)).name) {
            o->cases.push_back(static_cast<Case>(c));
            found = true;
          }
        }
        ok = found;
        at = comma + 1;
      }
    } else if (key == "iters") {
      ok = ParseInt(v, 1, &o->iters);
    } else if (key == "warmup") {
      ok = ParseInt(v, 0, &o->warmup);
    } else if (key == "repeats") {
      ok = ParseInt(v, 1, &o->repeats);
    } else if (key == "json") {
      o->json = v;
    } else if (key == "watchdog_s") {
      char* end = nullptr;
      o->watchdog_s = std::strtod(v.c_str(), &end);
      ok = !v.empty() && *end == '\0' && o->watchdog_s > 0;
    } else if (key == "spin_ms") {
      ok = ParseInt(v, 1, &o->spin_ms);
    } else if (key == "flashinfer_sms") {
      o->flashinfer_half = v == "half";
      ok = o->flashinfer_half || ParseInt(v, 0, &o->flashinfer_sms);
    } else if (key == "arfuse_sm_budget") {
      ok = ParseInt(v, 0, &o->arfuse_sm_budget);
    } else {
      std::fprintf(stderr, "arfuse-bench-flashinfer: unknown flag --%s\n%s", key.c_str(), kUsage);
      return 1;
    }
    if (!ok) {
      std::fprintf(stderr, "arfuse-bench-flashinfer: bad value in %s\n%s", arg.c_str(), kUsage);
      return 1;
    }
  }
  for (uint32_t h : o->hidden) {
    if (h % fp8::kGroupSize != 0) {
      std::fprintf(stderr, "arfuse-bench-flashinfer: hidden %u is not a multiple of %u\n", h,
                   fp8::kGroupSize);
      return 1;
    }
  }
  return 0;
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
  arfuse::bench_fi::Options o;
  if (int rc = arfuse::bench_fi::ParseFlags(argc, argv, &o); rc != 0) {
    if (rc == 2) std::printf("%s", arfuse::bench_fi::kUsage);
    return rc == 2 ? 0 : 2;
  }
  // Before the first CUDA call: rank 0's and rank 1's streams (and a graph's branches) must not
  // share a hardware queue, where a kernel spinning on its peer would hold back the peer's
  // kernel queued behind it. 32 queues, as gpu-run gives its one-process multi-rank tests.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  std::string command = "arfuse-bench-flashinfer";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  return arfuse::bench_fi::Run(o, command);
}
