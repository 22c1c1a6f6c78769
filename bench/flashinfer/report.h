// What arfuse-bench-flashinfer measured, as a Markdown table on stdout and a JSON file.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "bench/flashinfer/cases.h"
#include "bench/flashinfer/compare.h"
#include "bench/flashinfer/pair_runner.h"

namespace arfuse::bench_fi {

inline constexpr const char* kNotCoResident = "not run (grids do not co-reside)";

// One framework's op with one algorithm.
struct AlgoResult {
  bool ran = false;    // checked and timed
  bool error = false;  // it launched but failed (an error, not a shape FlashInfer refuses)
  std::string note;    // why it did not run (kNotCoResident, an error), or empty
  std::string detail;  // the grids and the device's capacity for them
  double us = NAN;     // median us per op
  double us_min = NAN;
  double us_max = NAN;
  GridShape grid;          // rank 0's launch
  uint64_t rank_diff = 0;  // outputs where rank 1 differs from rank 0
};

struct ImplResult {
  AlgoResult algo[2];  // [0] one-shot, [1] two-shot
  // The faster algorithm that ran (-1: none).
  int best() const {
    int b = -1;
    for (int i = 0; i < 2; ++i) {
      if (algo[i].ran && (b < 0 || algo[i].us < algo[b].us)) b = i;
    }
    return b;
  }
  double best_us() const { return best() < 0 ? NAN : algo[best()].us; }
};

struct RowResult {
  uint32_t hidden = 0;
  uint32_t tokens = 0;
  Case c = Case::kNorm;
  ImplResult arfuse, flashinfer;
  CrossCheck check;                  // worst over every (arfuse, FlashInfer) algorithm pair
  int64_t arfuse_algos_differ = -1;  // outputs where one-shot and two-shot differ (-1: n/a)
  int64_t flashinfer_algos_differ = -1;
  bool ok() const;  // every run algorithm's ranks agree and the cross check passed
};

struct RunInfo {
  std::string command;
  std::string device;
  int sms = 0;
  uint32_t arfuse_sm_budget = 0;
  int flashinfer_sms = 0;  // what FlashInfer's launcher was told (0: the device's)
  int iters = 0, warmup = 0, repeats = 0;
  double watchdog_s = 0;
  int spin_ms = 0;
  std::string fusion_tuning;  // ARFUSE_FUSION_TUNING, the arfuse kernels' knobs (empty: defaults)
  uint64_t arfuse_workspace_bytes = 0;      // per rank
  uint64_t flashinfer_workspace_bytes = 0;  // per rank
};

void PrintHeader(const RunInfo& info);
void PrintTable(const RunInfo& info, const std::vector<RowResult>& rows);
// false when the file cannot be written.
bool WriteJson(const std::string& path, const RunInfo& info, const std::vector<RowResult>& rows);

}  // namespace arfuse::bench_fi
