// arfuse-bench kernels: the fused kernels against the unfused path, per shape, bf16.
//
// One process per rank: without --rank the command starts --world copies of itself (exec'd, as
// the sidecars are) and waits; each rank joins through ConnectPeers, builds a fused workspace
// (and NCCL when every rank has its own GPU) and times every row as a CUDA graph of --iters ops,
// warmed up, replayed --repeats times after a host barrier; a row's figure is the median per-op
// time, the slowest rank's (the fused rows' slowest replay is kept too: "outlier" lines and the
// JSON's *_max fields show stalls a median hides). ARFUSE_FUSION_TUNING (kernel knobs, see
// kernels/allreduce_fusion/allreduce_fusion.cu) is passed to the ranks and recorded. Rows:
//   oneshot, twoshot     fused allreduce + residual + RMSNorm (forced algorithm)
//   choice               what the dispatcher picks for the shape (its row's time)
//   nccl, nccl_sym       NCCL allreduce alone: regular buffers / symmetric windows
//   unfused              the faster of {nccl, nccl_sym} + our add-RMSNorm kernel (the baseline)
//   pull                 one peer-to-peer copy of the same bytes (the bandwidth ceiling)
// With ranks sharing a GPU (MPS) NCCL cannot run: its rows are "not run", and the figures
// measure kernel overhead, not NVLink. Rank 0 prints the table and writes --json.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/flag_args.h"
#include "bench/fp8_standalone.h"
#include "bench/graph_timing.h"
#include "bench/kernels_flags.h"
#include "bench/rank_launch.h"
#include "common/json.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "kernels/add_rmsnorm/add_rmsnorm.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "server/collective/dispatch_table.h"
#include "server/cuda_device/cuda_status.h"
#include "server/cuda_device/fusion_workspace.h"
#include "server/cuda_device/mps_driver.h"
#include "server/cuda_device/nccl_comm.h"
#include "server/peers/peer_exchange.h"
#include "tests/gpu/process_util.h"

namespace arfuse::bench {
namespace {

using Flags = KernelsFlags;

constexpr const char* kRows[] = {"oneshot",   "twoshot",       "choice",  "nccl", "nccl_sym",
                                 "nccl_norm", "nccl_sym_norm", "unfused", "pull"};
constexpr int kNumRows = sizeof(kRows) / sizeof(kRows[0]);
enum Row { kOneShot, kTwoShot, kChoice, kNccl, kNcclSym, kNcclNorm, kNcclSymNorm, kUnfused, kPull };

// --fp8: per FP8 pattern (static, per-token, per-group), the fused op's time (the faster
// algorithm) and the unquantized fused op's (the faster algorithm) followed by the separate
// quantization kernel (bench/fp8_standalone.cu).
constexpr const char* kFp8Kinds[] = {"static", "per_token", "per_group"};
constexpr int kNumFp8 = 3;

struct ShapeResult {
  uint32_t tokens = 0;
  uint32_t hidden = 0;
  double us[kNumRows];
  double fused_max[2] = {NAN, NAN};  // slowest replay of oneshot, twoshot (outlier check)
  double fp8[kNumFp8] = {NAN, NAN, NAN};
  double fp8_separate[kNumFp8] = {NAN, NAN, NAN};
  std::string choice;
};

// Times `enqueue` (which enqueues one op on `s`) captured `iters` times in one CUDA graph: the
// median replay's us per op (`slowest`: the slowest replay's).
absl::StatusOr<double> TimeGraph(Exchange& ex, cudaStream_t s, const Flags& f,
                                 const std::function<absl::Status()>& enqueue,
                                 const std::string& tag, double* slowest = nullptr) {
  ARFUSE_ASSIGN_OR_RETURN(
      std::vector<double> samples,
      TimeGraphReplays(ex, s, GraphTiming{f.iters, f.warmup, f.repeats, absl::Seconds(60)}, enqueue,
                       tag));
  std::sort(samples.begin(), samples.end());
  if (slowest != nullptr) *slowest = samples.back();
  return samples[samples.size() / 2];
}

class DeviceMem {
 public:
  ~DeviceMem() {
    if (p_ != nullptr) ARFUSE_CUDA_LOG_IF_ERROR(cudaFree(p_));
  }
  absl::Status Allocate(size_t bytes) {
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaMalloc(&p_, bytes));
    // Small values: sums stay finite whatever the world size.
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemset(p_, 0x3c, bytes));
    return absl::OkStatus();
  }
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
};

absl::Status RunRank(const Flags& f) {
  int devices = 0;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&devices));
  const int device = f.rank % devices;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  const bool shared_gpu = f.world > devices;
  PeerOptions po;
  po.rank = f.rank;
  po.world_size = f.world;
  po.peer_dir = f.dir;
  po.group = "bench";
  po.timeout = absl::Seconds(60);
  ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<PeerExchange> ex, ConnectPeers(po));
  cudaStream_t s = nullptr;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int sms = 0, major = 0, minor = 0;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  const uint32_t max_tokens = *std::max_element(f.tokens.begin(), f.tokens.end());
  const uint32_t max_hidden = *std::max_element(f.hidden.begin(), f.hidden.end());
  const size_t max_bytes = static_cast<size_t>(max_tokens) * max_hidden * 2;

  WorkspaceOptions wo;
  wo.backend = f.backend;
  ARFUSE_ASSIGN_OR_RETURN(wo.vmm_handle, ParseVmmHandleType(f.vmm));
  wo.max_tokens = max_tokens;
  wo.hidden = max_hidden;
  wo.dtype = DType::kBF16;
  wo.spin_timeout = absl::Milliseconds(f.spin_ms);
  // Ranks sharing a GPU split its SMs, so every rank's spinning grid stays resident.
  const int per_gpu = (f.world + devices - 1) / devices;
  wo.sm_budget = shared_gpu ? static_cast<uint32_t>(sms / per_gpu) : 0;
  ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<FusionWorkspace> ws,
                          FusionWorkspace::Create(*ex, wo, s, absl::Now() + absl::Seconds(120)));
  std::unique_ptr<NcclComm> nccl;
  // Symmetric windows get their own blocking communicator: a failed registration leaves its
  // communicator unusable, and the regular rows must still run.
  std::unique_ptr<NcclComm> sym_nccl;
  void* sym = nullptr;
  if (!shared_gpu) {
    ARFUSE_ASSIGN_OR_RETURN(nccl, NcclComm::Create(*ex, absl::Now() + absl::Seconds(120)));
    auto sym_comm = NcclComm::Create(*ex, absl::Now() + absl::Seconds(120), /*blocking=*/true);
    absl::StatusOr<void*> window =
        sym_comm.ok() ? (*sym_comm)->AllocSymmetric(max_bytes, absl::Now() + absl::Seconds(60))
                      : absl::StatusOr<void*>(sym_comm.status());
    if (window.ok()) {
      sym = *window;
      sym_nccl = std::move(*sym_comm);
    } else {
      std::fprintf(stderr, "rank %d: symmetric-window rows not run: %s\n", f.rank,
                   std::string(window.status().message()).c_str());
    }
  }
  DeviceMem in, res_in, res_out, norm, gamma, out, pull_dst, quant, scales, static_scale;
  for (DeviceMem* m : {&in, &res_in, &res_out, &norm, &out, &pull_dst}) {
    ARFUSE_RETURN_IF_ERROR(m->Allocate(max_bytes));
  }
  ARFUSE_RETURN_IF_ERROR(gamma.Allocate(static_cast<size_t>(max_hidden) * 2));
  if (f.fp8 != 0) {
    ARFUSE_RETURN_IF_ERROR(quant.Allocate(max_bytes / 2));
    ARFUSE_RETURN_IF_ERROR(scales.Allocate(static_cast<size_t>(max_tokens) * max_hidden / 32));
    ARFUSE_RETURN_IF_ERROR(static_scale.Allocate(sizeof(float)));
  }
  // The memsets ran on the legacy stream, which `s` (non-blocking) does not wait for.
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  const DispatchTable table = DispatchTable::Published();
  const int peer = (f.rank + 1) % f.world;

  std::vector<ShapeResult> results;
  for (uint32_t h : f.hidden) {
    for (uint32_t t : f.tokens) {
      ShapeResult r;
      r.tokens = t;
      r.hidden = h;
      std::fill(std::begin(r.us), std::end(r.us), NAN);
      const size_t count = static_cast<size_t>(t) * h;
      const size_t bytes = count * 2;
      const std::string tag = absl::StrCat("h", h, "t", t);
      OpArgs op;
      op.pattern = Pattern::kAllReduceResidualRmsNorm;
      op.dtype = DType::kBF16;
      op.hidden = h;
      op.num_tokens = t;
      op.input = in.get();
      op.residual_in = res_in.get();
      op.residual_out = res_out.get();
      op.norm_out = norm.get();
      op.gamma = gamma.get();
      for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
        const int i = algo == FusionAlgo::kOneShot ? 0 : 1;
        ARFUSE_ASSIGN_OR_RETURN(
            r.us[i == 0 ? kOneShot : kTwoShot],
            TimeGraph(
                *ex, s, f, [&] { return ws->Launch(op, algo, s); },
                absl::StrCat(tag, "/fused", static_cast<int>(algo)), &r.fused_max[i]));
      }
      if (f.fp8 != 0) {
        const FusionAlgo best_unquantized =
            r.us[kOneShot] <= r.us[kTwoShot] ? FusionAlgo::kOneShot : FusionAlgo::kTwoShot;
        const Pattern patterns[kNumFp8] = {Pattern::kAllReduceResidualRmsNormFp8Static,
                                           Pattern::kAllReduceResidualRmsNormFp8PerToken,
                                           Pattern::kAllReduceResidualRmsNormFp8PerGroup};
        for (int k = 0; k < kNumFp8; ++k) {
          OpArgs q = op;
          q.pattern = patterns[k];
          q.norm_out = nullptr;
          q.quant_out = quant.get();
          q.scale = k == 0 ? static_scale.get() : scales.get();
          q.scale_layout = static_cast<uint8_t>(fp8::GroupScaleLayout::kFp32RowMajor);
          for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
            ARFUSE_ASSIGN_OR_RETURN(
                double us, TimeGraph(
                               *ex, s, f, [&] { return ws->Launch(q, algo, s); },
                               absl::StrCat(tag, "/fp8_", kFp8Kinds[k], static_cast<int>(algo))));
            r.fp8[k] = std::isnan(r.fp8[k]) ? us : std::min(r.fp8[k], us);
          }
          StandaloneFp8Params sp;
          sp.kind = TraitsOf(patterns[k]).quant;
          sp.norm = norm.get();
          sp.quant_out = quant.get();
          sp.scale = q.scale;
          sp.tokens = t;
          sp.hidden = h;
          ARFUSE_ASSIGN_OR_RETURN(r.fp8_separate[k],
                                  TimeGraph(
                                      *ex, s, f,
                                      [&] {
                                        ARFUSE_RETURN_IF_ERROR(ws->Launch(op, best_unquantized, s));
                                        return ARFUSE_CUDA_STATUS(LaunchStandaloneFp8Quant(sp, s));
                                      },
                                      absl::StrCat(tag, "/fp8_separate_", kFp8Kinds[k])));
        }
      }
      AddRmsNormParams np = {};
      np.residual_in = res_in.get();
      np.residual_out = res_out.get();
      np.norm_out = norm.get();
      np.gamma = gamma.get();
      np.num_tokens = t;
      np.hidden = h;
      np.eps = 1e-6f;
      np.dtype = DType::kBF16;
      if (nccl != nullptr) {
        const absl::Time far = absl::Now() + absl::Seconds(60);
        ARFUSE_ASSIGN_OR_RETURN(
            r.us[kNccl],
            TimeGraph(
                *ex, s, f,
                [&] { return nccl->AllReduce(in.get(), out.get(), count, DType::kBF16, s, far); },
                tag + "/nccl"));
        AddRmsNormParams reg = np;
        reg.input = out.get();
        ARFUSE_ASSIGN_OR_RETURN(r.us[kNcclNorm],
                                TimeGraph(
                                    *ex, s, f,
                                    [&] {
                                      ARFUSE_RETURN_IF_ERROR(nccl->AllReduce(
                                          in.get(), out.get(), count, DType::kBF16, s, far));
                                      return ARFUSE_CUDA_STATUS(LaunchAddRmsNorm(reg, s));
                                    },
                                    tag + "/nccl_norm"));
        if (sym != nullptr) {
          ARFUSE_ASSIGN_OR_RETURN(
              r.us[kNcclSym],
              TimeGraph(
                  *ex, s, f,
                  [&] { return sym_nccl->AllReduce(sym, sym, count, DType::kBF16, s, far); },
                  tag + "/nccl_sym"));
          AddRmsNormParams symp = np;
          symp.input = sym;
          ARFUSE_ASSIGN_OR_RETURN(r.us[kNcclSymNorm],
                                  TimeGraph(
                                      *ex, s, f,
                                      [&] {
                                        ARFUSE_RETURN_IF_ERROR(sym_nccl->AllReduce(
                                            sym, sym, count, DType::kBF16, s, far));
                                        return ARFUSE_CUDA_STATUS(LaunchAddRmsNorm(symp, s));
                                      },
                                      tag + "/nccl_sym_norm"));
        }
        r.us[kUnfused] = std::isnan(r.us[kNcclSymNorm])
                             ? r.us[kNcclNorm]
                             : std::min(r.us[kNcclNorm], r.us[kNcclSymNorm]);
      }
      // A peer's workspace is mapped here (at least 3 x world x the largest shape's bytes: its
      // Lamport buffers): read the same number of bytes from it.
      ARFUSE_ASSIGN_OR_RETURN(r.us[kPull], TimeGraph(
                                               *ex, s, f,
                                               [&] {
                                                 return ARFUSE_CUDA_STATUS(cudaMemcpyAsync(
                                                     pull_dst.get(), ws->peer_base(peer), bytes,
                                                     cudaMemcpyDeviceToDevice, s));
                                               },
                                               tag + "/pull"));
      DispatchRequest req;
      req.sm = major * 10 + minor;
      req.world_size = f.world;
      req.num_tokens = t;
      req.hidden = h;
      req.dtype = DType::kBF16;
      req.fused_available = true;
      req.twoshot_available = true;
      req.nccl_available = nccl != nullptr;
      req.nccl_symmetric_available = sym != nullptr;
      ARFUSE_ASSIGN_OR_RETURN(DispatchChoice choice, ChooseExecPath(table, req));
      r.choice = ExecPathName(choice.path);
      r.us[kChoice] = choice.path == ExecPath::kOneShot   ? r.us[kOneShot]
                      : choice.path == ExecPath::kTwoShot ? r.us[kTwoShot]
                                                          : r.us[kUnfused];
      results.push_back(r);
      if (f.rank == 0) {
        // Progress, one line per shape: this rank's figures (the table takes the slowest rank's).
        std::fprintf(stderr,
                     "arfuse-bench kernels: [%zu/%zu] hidden %u tokens %u: oneshot %.1f twoshot "
                     "%.1f unfused %.1f us (%s; rank 0)\n",
                     results.size(), f.hidden.size() * f.tokens.size(), h, t, r.us[kOneShot],
                     r.us[kTwoShot], r.us[kUnfused], r.choice.c_str());
      }
    }
  }
  const uint32_t err = ws->error_code();
  if (err != 0) {
    return absl::AbortedError(absl::StrCat("fused kernel error: ", FusionErrorName(err)));
  }

  // The slowest rank's figure per row.
  std::string mine;
  for (const ShapeResult& r : results) {
    for (double v : r.us) absl::StrAppend(&mine, v, ",");
    for (double v : r.fused_max) absl::StrAppend(&mine, v, ",");
    for (double v : r.fp8) absl::StrAppend(&mine, v, ",");
    for (double v : r.fp8_separate) absl::StrAppend(&mine, v, ",");
  }
  ARFUSE_ASSIGN_OR_RETURN(std::vector<std::string> all,
                          ex->Allgather("results", mine, absl::Now() + absl::Seconds(60)));
  for (const std::string& other : all) {
    std::vector<std::string> vals = absl::StrSplit(other, ',', absl::SkipEmpty());
    size_t k = 0;
    for (ShapeResult& r : results) {
      auto take_max = [&](double& v) {
        double x = NAN;
        if (k < vals.size() && absl::SimpleAtod(vals[k], &x) && !std::isnan(x) && !std::isnan(v)) {
          v = std::max(v, x);
        }
        ++k;
      };
      for (double& v : r.us) take_max(v);
      for (double& v : r.fused_max) take_max(v);
      for (double& v : r.fp8) take_max(v);
      for (double& v : r.fp8_separate) take_max(v);
    }
  }
  if (f.rank != 0) return absl::OkStatus();

  const MpsInfo mps = DetectMpsOnDevice(device);
  cudaDeviceProp prop;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  auto fmt = [](double v) { return std::isnan(v) ? std::string("-") : absl::StrFormat("%.1f", v); };
  auto ratio = [](double a, double b) {
    return std::isnan(a) || std::isnan(b) ? std::string("-") : absl::StrFormat("%.2f", a / b);
  };
  std::printf(
      "arfuse-bench kernels: %s, %d rank(s) on %d GPU(s) (%s), backend=%s workspace=%s, "
      "bf16, CUDA graphs of %d ops, median of %d, us per op\n",
      prop.name, f.world, std::min(devices, f.world), shared_gpu ? "shared, MPS" : "one each",
      f.backend.c_str(), ws->kind(), f.iters, f.repeats);
  std::printf("workspace bytes per rank: %llu; %s%s\n",
              static_cast<unsigned long long>(ws->bytes_per_rank()), mps.Describe().c_str(),
              shared_gpu ? "; NCCL rows not run (ranks share a GPU)" : "");
  std::printf(
      "| hidden | tokens | bytes | oneshot | twoshot | choice | nccl | nccl_sym | unfused | "
      "pull | oneshot/unfused | twoshot/unfused | choice/unfused | pull/oneshot |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const ShapeResult& r : results) {
    const uint64_t bytes = static_cast<uint64_t>(r.tokens) * r.hidden * 2;
    std::printf(
        "| %u | %u | %llu | %s | %s | %s %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", r.hidden,
        r.tokens, static_cast<unsigned long long>(bytes), fmt(r.us[kOneShot]).c_str(),
        fmt(r.us[kTwoShot]).c_str(), r.choice.c_str(), fmt(r.us[kChoice]).c_str(),
        fmt(r.us[kNccl]).c_str(), fmt(r.us[kNcclSym]).c_str(), fmt(r.us[kUnfused]).c_str(),
        fmt(r.us[kPull]).c_str(), ratio(r.us[kOneShot], r.us[kUnfused]).c_str(),
        ratio(r.us[kTwoShot], r.us[kUnfused]).c_str(), ratio(r.us[kChoice], r.us[kUnfused]).c_str(),
        ratio(r.us[kPull], r.us[kOneShot]).c_str());
  }
  // Replays far slower than the median: a stall (the figures above are medians).
  for (const ShapeResult& r : results) {
    for (int i = 0; i < 2; ++i) {
      const double median = r.us[i == 0 ? kOneShot : kTwoShot];
      if (!std::isnan(r.fused_max[i]) && r.fused_max[i] > 2.0 * median + 5.0) {
        std::printf("outlier: %s %u x %u: slowest replay %.1f us per op, median %.1f\n",
                    i == 0 ? "oneshot" : "twoshot", r.tokens, r.hidden, r.fused_max[i], median);
      }
    }
  }
  if (f.fp8 != 0) {
    // Quantized / unquantized: the faster algorithm of each; separate: unquantized + a kernel.
    std::printf(
        "\nFP8 E4M3 outputs (no norm_out; per-group: fp32 row-major scales), us per op:\n"
        "| hidden | tokens | unquantized | static | per_token | per_group | static sep | "
        "per_token sep | per_group sep | static/unq | per_token/unq | per_group/unq | "
        "static/sep | per_token/sep | per_group/sep |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const ShapeResult& r : results) {
      const double unq = std::min(r.us[kOneShot], r.us[kTwoShot]);
      std::printf("| %u | %u | %s", r.hidden, r.tokens, fmt(unq).c_str());
      for (double v : r.fp8) std::printf(" | %s", fmt(v).c_str());
      for (double v : r.fp8_separate) std::printf(" | %s", fmt(v).c_str());
      for (double v : r.fp8) std::printf(" | %s", ratio(v, unq).c_str());
      for (int k = 0; k < kNumFp8; ++k) {
        std::printf(" | %s", ratio(r.fp8[k], r.fp8_separate[k]).c_str());
      }
      std::printf(" |\n");
    }
  }
  const char* tuning = std::getenv("ARFUSE_FUSION_TUNING");
  std::ofstream json(f.json);
  // Every string through JsonQuote: an environment variable or a device name cannot break it.
  json << "{\n  \"command\": "
       << JsonQuote(absl::StrCat("arfuse-bench kernels ", absl::StrJoin(f.raw, " ")))
       << ",\n  \"version\": " << JsonQuote(absl::StrCat(kVersion, "+", kGitRevision))
       << ",\n  \"device\": " << JsonQuote(prop.name) << ",\n  \"world_size\": " << f.world
       << ",\n  \"gpus\": " << std::min(devices, f.world)
       << ",\n  \"shared_gpu\": " << JsonBool(shared_gpu)
       << ",\n  \"mps_active\": " << JsonBool(mps.active())
       << ",\n  \"backend\": " << JsonQuote(f.backend)
       << ",\n  \"workspace_kind\": " << JsonQuote(ws->kind())
       << ",\n  \"workspace_bytes_per_rank\": " << ws->bytes_per_rank()
       << ",\n  \"fusion_tuning\": " << JsonQuote(tuning != nullptr ? tuning : "")
       << ",\n  \"iters\": " << f.iters << ",\n  \"repeats\": " << f.repeats
       << ",\n  \"unit\": \"us_per_op\",\n  \"rows\": [\n";
  for (size_t i = 0; i < results.size(); ++i) {
    const ShapeResult& r = results[i];
    json << "    {\"hidden\": " << r.hidden << ", \"tokens\": " << r.tokens
         << ", \"bytes\": " << static_cast<uint64_t>(r.tokens) * r.hidden * 2
         << ", \"choice_path\": " << JsonQuote(r.choice);
    // A row that did not run is NaN: null in the JSON.
    for (int k = 0; k < kNumRows; ++k) {
      json << ", \"" << kRows[k] << "\": " << JsonNumber(r.us[k], 3);
    }
    for (int i = 0; i < 2; ++i) {
      json << ", \"" << (i == 0 ? "oneshot_max" : "twoshot_max")
           << "\": " << JsonNumber(r.fused_max[i], 3);
    }
    if (f.fp8 != 0) {
      for (int k = 0; k < kNumFp8; ++k) {
        json << ", \"fp8_" << kFp8Kinds[k] << "\": " << JsonNumber(r.fp8[k], 3) << ", \"fp8_"
             << kFp8Kinds[k] << "_separate\": " << JsonNumber(r.fp8_separate[k], 3);
      }
    }
    json << "}" << (i + 1 < results.size() ? "," : "") << "\n";
  }
  json << "  ]\n}\n";
  if (!json) return absl::FailedPreconditionError(absl::StrCat("cannot write ", f.json));
  std::printf("wrote %s\n", f.json.c_str());
  return absl::OkStatus();
}

int Launch(const Flags& f) {
  const std::string self = SelfExe();
  if (self.empty()) {
    std::fprintf(stderr, "arfuse-bench: cannot find its own executable\n");
    return 1;
  }
  char tmpl[] = "/tmp/arfbench-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    std::fprintf(stderr, "arfuse-bench: cannot make a peer directory\n");
    return 1;
  }
  std::vector<pid_t> pids;
  for (int r = 0; r < f.world; ++r) {
    absl::StatusOr<pid_t> pid =
        testing::SpawnProcess(RankCommand(self, "kernels", "rank", r, tmpl, f.raw));
    if (!pid.ok()) {
      std::fprintf(stderr, "arfuse-bench: %s\n", pid.status().ToString().c_str());
      break;
    }
    pids.push_back(*pid);
  }
  std::vector<int> codes = testing::WaitProcesses(pids, absl::Now() + absl::Minutes(15));
  std::filesystem::remove_all(tmpl);
  int worst = static_cast<int>(pids.size()) == f.world ? 0 : 1;
  for (size_t r = 0; r < codes.size(); ++r) {
    if (codes[r] != 0) {
      std::fprintf(stderr, "arfuse-bench: rank %zu exited with %d\n", r, codes[r]);
      worst = 1;
    }
  }
  return worst;
}

}  // namespace

int KernelsMain(int argc, char** argv) {
  absl::StatusOr<Flags> f = ParseKernelsFlags(argc, argv);
  if (!f.ok()) {
    std::fprintf(stderr, "arfuse-bench kernels: %s\n", f.status().ToString().c_str());
    return 2;
  }
  if (f->outcome != FlagOutcome::kRun) return PrintKernelsHelpOrVersion(f->outcome);
  if (f->rank < 0) return Launch(*f);
  static_cast<void>(InitLogging("warn"));
  absl::Status s = RunRank(*f);
  if (!s.ok()) {
    std::fprintf(stderr, "arfuse-bench kernels rank %d: %s\n", f->rank, s.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace arfuse::bench
