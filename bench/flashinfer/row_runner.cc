#include "bench/flashinfer/row_runner.h"

#include <algorithm>
#include <string>
#include <vector>

namespace arfuse::bench_fi {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Fills the outputs the op writes with a different byte per rank: whatever a kernel leaves
// unwritten then shows up as a rank difference.
cudaError_t PoisonOutputs(const RankTensors (&t)[kWorld], const RankOp& op, bool flashinfer,
                          cudaStream_t s) {
  const size_t elems = static_cast<size_t>(op.tokens) * op.hidden;
  const bool quant = InfoOf(op.c).quant != QuantKind::kNone;
  for (int r = 0; r < kWorld; ++r) {
    const int byte = r == 0 ? 0xa5 : 0x5a;
    cudaError_t e = cudaMemsetAsync(t[r].residual_out, byte, elems * 2, s);
    if (e == cudaSuccess && !quant) e = cudaMemsetAsync(t[r].norm_out, byte, elems * 2, s);
    if (e == cudaSuccess && quant) e = cudaMemsetAsync(t[r].quant_out, byte, elems, s);
    const uint64_t scale_bytes = WrittenScaleBytes(op.c, op.tokens, op.hidden, flashinfer);
    if (e == cudaSuccess && scale_bytes != 0) e = cudaMemsetAsync(t[r].scale, byte, scale_bytes, s);
    if (e != cudaSuccess) return e;
  }
  return cudaStreamSynchronize(s);
}

}  // namespace

void RunAlgo(AlgoContext& ctx, Impl impl, const RankOp& base, AlgoResult* res, Snapshot* snap) {
  const bool fi = impl == kFlashInfer;
  std::string fi_why;
  if (fi && !FlashInferGroup::Supports(base, &fi_why)) {
    res->note = fi_why;
    return;
  }
  const RankTensors(&t)[kWorld] = ctx.tensors->t[impl];
  RankEnqueue enqueue = [&](int rank, cudaStream_t s) {
    RankOp op = base;
    op.t = t[rank];
    return fi ? ctx.flashinfer->Launch(rank, op, ctx.tensors->static_scale, s, &fi_why)
              : ctx.arfuse->Launch(rank, op, ctx.tensors->static_scale, s);
  };
  GridShape g[kWorld];
  for (int r = 0; r < kWorld; ++r) {
    std::string why;
    if (ctx.runner->Probe(enqueue, r, &g[r], &why) != cudaSuccess) {
      res->note = "launch refused: " + (fi_why.empty() ? why : fi_why);
      return;
    }
  }
  res->grid = g[0];
  if (!PairRunner::CoResident(g[0], g[1], &res->detail)) {
    res->note = kNotCoResident;
    return;
  }
  const std::string what = std::string(fi ? "FlashInfer " : "arfuse ") + InfoOf(base.c).name +
                           (base.oneshot ? " oneshot" : " twoshot") + " hidden " +
                           std::to_string(base.hidden) + " tokens " + std::to_string(base.tokens);
  cudaStream_t s = ctx.runner->stream_a();
  auto failed = [&](const std::string& note) {
    res->note = note;
    res->error = true;
    // The ranks may be out of step (one launched, one refused): back to a clean state.
    if (fi) {
      (void)ctx.flashinfer->Reset(s);
    } else {
      (void)ctx.arfuse->Reinit(s);
    }
  };
  auto arfuse_error = [&]() -> std::string {
    if (fi) return "";
    uint32_t codes[kWorld] = {};
    if (ctx.arfuse->ErrorWords(s, codes) != cudaSuccess) return "cannot read the error words";
    for (uint32_t c : codes) {
      if (c != 0) return std::string("arfuse kernel error: ") + FusionErrorName(c);
    }
    return "";
  };
  if (cudaError_t e = PoisonOutputs(t, base, fi, s); e != cudaSuccess) {
    failed(std::string("memset: ") + cudaGetErrorString(e));
    return;
  }
  if (cudaError_t e = ctx.runner->RunOnce(enqueue, what); e != cudaSuccess) {
    failed(std::string("launch: ") + cudaGetErrorString(e) + (fi_why.empty() ? "" : ": " + fi_why));
    return;
  }
  if (std::string err = arfuse_error(); !err.empty()) {
    failed(err);
    return;
  }
  if (cudaError_t e = TakeSnapshot(base.c, base.tokens, base.hidden, fi, t, snap);
      e != cudaSuccess) {
    failed(std::string("copy: ") + cudaGetErrorString(e));
    return;
  }
  res->rank_diff = snap->rank_diff;
  std::vector<double> us;
  if (cudaError_t e = ctx.runner->Time(enqueue, ctx.iters, ctx.warmup, ctx.repeats, what, &us);
      e != cudaSuccess || us.empty()) {
    failed(std::string("timing: ") + cudaGetErrorString(e));
    return;
  }
  if (std::string err = arfuse_error(); !err.empty()) {
    failed(err);
    return;
  }
  res->ran = true;
  res->us = Median(us);
  res->us_min = *std::min_element(us.begin(), us.end());
  res->us_max = *std::max_element(us.begin(), us.end());
}

}  // namespace arfuse::bench_fi
