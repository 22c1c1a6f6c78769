#include "bench/flashinfer/report.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "bench/flashinfer/flashinfer_ops.h"
#include "common/json.h"

#ifndef ARFUSE_BENCH_VERSION
#define ARFUSE_BENCH_VERSION "unknown"
#endif

namespace arfuse::bench_fi {
namespace {

const char* kAlgoNames[2] = {"oneshot", "twoshot"};

std::string Us(double v) {
  if (std::isnan(v)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", v);
  return buf;
}

std::string AlgoCell(const AlgoResult& a) {
  if (a.ran) return Us(a.us);
  return a.note.empty() ? "-" : a.note;
}

std::string BestCell(const ImplResult& r) {
  const int b = r.best();
  if (b >= 0) return Us(r.algo[b].us) + " (" + kAlgoNames[b] + ")";
  // Neither ran: the reason both share, else the one-shot's.
  if (r.algo[0].note == kNotCoResident || r.algo[1].note == kNotCoResident) {
    return kNotCoResident;
  }
  return r.algo[0].note.empty() ? "-" : r.algo[0].note;
}

uint64_t RankDiff(const RowResult& r) {
  uint64_t d = 0;
  for (const ImplResult* i : {&r.arfuse, &r.flashinfer}) {
    for (const AlgoResult& a : i->algo) d += a.ran ? a.rank_diff : 0;
  }
  return d;
}

std::string CheckCell(const RowResult& r) {
  const CrossCheck& k = r.check;
  if (!k.compared) return RankDiff(r) == 0 ? "not compared" : "FAIL: ranks differ";
  std::ostringstream o;
  o << (r.ok() ? "ok" : "FAIL");
  if (RankDiff(r) != 0) o << "; ranks differ " << RankDiff(r);
  if (k.residual_diff != 0) o << "; residual_out differs " << k.residual_diff;
  if (InfoOf(r.c).quant == QuantKind::kNone) {
    o << "; norm_out differs " << k.norm_diff << " (max " << k.norm_max_ulp << " ulp)";
  } else {
    o << "; codes 1 step " << k.codes_one_step << "/" << k.codes;
    if (k.codes_beyond != 0) o << ", >1 step " << k.codes_beyond;
    if (k.dequantized != 0) o << ", " << k.dequantized << " under differing scales";
  }
  return o.str();
}

void AlgoJson(std::ostream& o, const AlgoResult& a) {
  o << "{\"ran\": " << JsonBool(a.ran) << ", \"us\": " << JsonNumber(a.us, 3)
    << ", \"us_min\": " << JsonNumber(a.us_min, 3) << ", \"us_max\": " << JsonNumber(a.us_max, 3)
    << ", \"note\": " << JsonQuote(a.note) << ", \"grids\": " << JsonQuote(a.detail)
    << ", \"grid\": " << a.grid.grid << ", \"block\": " << a.grid.block
    << ", \"cluster\": " << a.grid.cluster << ", \"rank_diff\": " << a.rank_diff << "}";
}

void ImplJson(std::ostream& o, const ImplResult& r) {
  const int b = r.best();
  o << "{\"us\": " << JsonNumber(r.best_us(), 3)
    << ", \"algo\": " << (b < 0 ? std::string("null") : JsonQuote(kAlgoNames[b]))
    << ", \"oneshot\": ";
  AlgoJson(o, r.algo[0]);
  o << ", \"twoshot\": ";
  AlgoJson(o, r.algo[1]);
  o << "}";
}

}  // namespace

bool RowResult::ok() const {
  for (const ImplResult* i : {&arfuse, &flashinfer}) {
    for (const AlgoResult& a : i->algo) {
      if (a.ran && a.rank_diff != 0) return false;
    }
  }
  return check.ok();
}

void PrintHeader(const RunInfo& info) {
  std::printf(
      "arfuse-bench-flashinfer: arfuse %s against FlashInfer %s, %d ranks on one %s (%d SMs), "
      "bf16\n",
      ARFUSE_BENCH_VERSION, FlashInferVersion(), kWorld, info.device.c_str(), info.sms);
  std::printf("FlashInfer patterns: %s\n", FlashInferPatterns());
  std::printf(
      "arfuse sm_budget %u per rank; FlashInfer's launcher sees %d SMs%s; CUDA graphs of %d "
      "pairs, %d warm-up + %d timed replays, median us per op\n",
      info.arfuse_sm_budget, info.flashinfer_sms > 0 ? info.flashinfer_sms : info.sms,
      info.flashinfer_sms > 0 ? " (--flashinfer_sms)" : " (the device's)", info.iters, info.warmup,
      info.repeats);
  std::printf("workspace bytes per rank: arfuse %llu, FlashInfer %llu; ARFUSE_FUSION_TUNING=%s\n",
              static_cast<unsigned long long>(info.arfuse_workspace_bytes),
              static_cast<unsigned long long>(info.flashinfer_workspace_bytes),
              info.fusion_tuning.c_str());
  std::fflush(stdout);
}

void PrintTable(const RunInfo& info, const std::vector<RowResult>& rows) {
  (void)info;
  std::printf(
      "\n| hidden | tokens | pattern | arfuse us | FlashInfer us | arfuse/FlashInfer | "
      "arfuse oneshot | arfuse twoshot | FlashInfer oneshot | FlashInfer twoshot | check |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const RowResult& r : rows) {
    const double a = r.arfuse.best_us(), f = r.flashinfer.best_us();
    std::string ratio = "-";
    if (!std::isnan(a) && !std::isnan(f)) {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.2f", a / f);
      ratio = buf;
    }
    std::printf("| %u | %u | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", r.hidden, r.tokens,
                InfoOf(r.c).name, BestCell(r.arfuse).c_str(), BestCell(r.flashinfer).c_str(),
                ratio.c_str(), AlgoCell(r.arfuse.algo[0]).c_str(),
                AlgoCell(r.arfuse.algo[1]).c_str(), AlgoCell(r.flashinfer.algo[0]).c_str(),
                AlgoCell(r.flashinfer.algo[1]).c_str(), CheckCell(r).c_str());
  }
  // The grids of every algorithm that did not run, and why.
  bool first = true;
  for (const RowResult& r : rows) {
    for (int impl = 0; impl < 2; ++impl) {
      const ImplResult& i = impl == 0 ? r.arfuse : r.flashinfer;
      for (int k = 0; k < 2; ++k) {
        if (i.algo[k].ran || i.algo[k].note.empty()) continue;
        if (first) std::printf("\nnot run:\n");
        first = false;
        std::printf("  hidden %u tokens %u %s %s %s: %s%s%s\n", r.hidden, r.tokens,
                    InfoOf(r.c).name, impl == 0 ? "arfuse" : "FlashInfer", kAlgoNames[k],
                    i.algo[k].note.c_str(), i.algo[k].detail.empty() ? "" : "; ",
                    i.algo[k].detail.c_str());
      }
    }
  }
  std::fflush(stdout);
}

bool WriteJson(const std::string& path, const RunInfo& info, const std::vector<RowResult>& rows) {
  std::ofstream o(path);
  o << "{\n  \"command\": " << JsonQuote(info.command)
    << ",\n  \"arfuse_version\": " << JsonQuote(ARFUSE_BENCH_VERSION)
    << ",\n  \"flashinfer_version\": " << JsonQuote(FlashInferVersion())
    << ",\n  \"flashinfer_patterns\": " << JsonQuote(FlashInferPatterns())
    << ",\n  \"device\": " << JsonQuote(info.device) << ",\n  \"sms\": " << info.sms
    << ",\n  \"world_size\": " << kWorld << ",\n  \"dtype\": \"bf16\""
    << ",\n  \"arfuse_sm_budget\": " << info.arfuse_sm_budget
    << ",\n  \"flashinfer_sms\": " << (info.flashinfer_sms > 0 ? info.flashinfer_sms : info.sms)
    << ",\n  \"iters\": " << info.iters << ",\n  \"warmup\": " << info.warmup
    << ",\n  \"repeats\": " << info.repeats
    << ",\n  \"watchdog_s\": " << JsonNumber(info.watchdog_s, 3)
    << ",\n  \"spin_ms\": " << info.spin_ms
    << ",\n  \"fusion_tuning\": " << JsonQuote(info.fusion_tuning)
    << ",\n  \"arfuse_workspace_bytes_per_rank\": " << info.arfuse_workspace_bytes
    << ",\n  \"flashinfer_workspace_bytes_per_rank\": " << info.flashinfer_workspace_bytes
    << ",\n  \"unit\": \"us_per_op\",\n  \"rows\": [\n";
  for (size_t n = 0; n < rows.size(); ++n) {
    const RowResult& r = rows[n];
    const CaseInfo ci = InfoOf(r.c);
    const CrossCheck& k = r.check;
    const double a = r.arfuse.best_us(), f = r.flashinfer.best_us();
    o << "    {\"hidden\": " << r.hidden << ", \"tokens\": " << r.tokens
      << ", \"pattern\": " << JsonQuote(ci.name)
      << ", \"arfuse_pattern\": " << static_cast<int>(ci.arfuse_pattern)
      << ", \"arfuse_scale_layout\": " << static_cast<int>(ci.scale_layout)
      << ", \"flashinfer_pattern\": " << ci.flashinfer_pattern
      << ", \"ratio\": " << JsonNumber(std::isnan(a) || std::isnan(f) ? NAN : a / f, 3)
      << ", \"ok\": " << JsonBool(r.ok()) << ",\n     \"arfuse\": ";
    ImplJson(o, r.arfuse);
    o << ",\n     \"flashinfer\": ";
    ImplJson(o, r.flashinfer);
    o << ",\n     \"check\": {\"compared\": " << JsonBool(k.compared)
      << ", \"residual_diff\": " << k.residual_diff << ", \"norm_diff\": " << k.norm_diff
      << ", \"norm_max_ulp\": " << k.norm_max_ulp << ", \"codes\": " << k.codes
      << ", \"codes_one_step\": " << k.codes_one_step << ", \"codes_beyond\": " << k.codes_beyond
      << ", \"codes_dequantized\": " << k.dequantized << ", \"scales_differ\": " << k.scales_differ
      << ", \"scale_max_rel\": " << k.scale_max_rel
      << ", \"arfuse_algos_differ\": " << r.arfuse_algos_differ
      << ", \"flashinfer_algos_differ\": " << r.flashinfer_algos_differ << "}}"
      << (n + 1 < rows.size() ? "," : "") << "\n";
  }
  o << "  ]\n}\n";
  return static_cast<bool>(o);
}

}  // namespace arfuse::bench_fi
