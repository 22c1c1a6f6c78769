// One framework's op with one algorithm, for one shape: both ranks' launches probed, their grids
// checked for co-residency, one checked launch (a Snapshot of its outputs) and the CUDA-graph
// timing.
#pragma once

#include "bench/flashinfer/arfuse_ops.h"
#include "bench/flashinfer/cases.h"
#include "bench/flashinfer/compare.h"
#include "bench/flashinfer/flashinfer_ops.h"
#include "bench/flashinfer/pair_runner.h"
#include "bench/flashinfer/report.h"

namespace arfuse::bench_fi {

enum Impl { kArfuse = 0, kFlashInfer = 1 };

// Both frameworks' ranks: shared inputs (input per rank, residual and gamma alike on both),
// separate outputs.
struct Tensors {
  RankTensors t[2][kWorld];       // [impl][rank]
  float* static_scale = nullptr;  // the kFp8Static case's scale, on the device
};

struct AlgoContext {
  PairRunner* runner;
  ArfuseGroup* arfuse;
  FlashInferGroup* flashinfer;
  Tensors* tensors;
  int iters, warmup, repeats;  // the graph timing (PairRunner::Time)
};

// Runs `base` (its tensors are filled in per rank) for `impl`. What did not run says why in
// res->note (res->error when it failed rather than being refused or not co-resident); a run
// that failed leaves the framework's workspaces re-initialized.
void RunAlgo(AlgoContext& ctx, Impl impl, const RankOp& base, AlgoResult* res, Snapshot* snap);

}  // namespace arfuse::bench_fi
