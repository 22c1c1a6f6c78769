// arfuse-bench sidecar, a client process's CUDA rows: the op with no RPC per op, each way a
// client can have it (the fused kernel in-process, the doorbell rung from its graph, the sidecar's
// kernel launched in its own stream), alone and in a layer loop beside stand-in compute, the cost
// of the sidecar's idle planes to a client kernel that wants the whole GPU, and NCCL's unfused
// layer for comparison. Built into every arfuse-bench; empty without CUDA.
#if defined(ARFUSE_BENCH_CUDA)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/layer_standin.h"
#include "bench/sidecar_client_run.h"
#include "client/cpp/instream_attach.h"
#include "common/status_macros.h"
#include "kernels/add_rmsnorm/add_rmsnorm.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "server/cuda_device/cuda_status.h"
#include "server/cuda_device/fusion_workspace.h"

namespace arfuse::bench::sidecar {

void ClientRun::AddGraphRow(const std::string& row, uint32_t tokens, uint32_t hidden,
                            const absl::StatusOr<std::vector<double>>& per_op,
                            const std::string& path, const std::string& note) {
  RowResult r = ShapeRow(row, tokens, hidden);
  r.path = path;
  if (per_op.ok()) {
    Summary s = Summarize(*per_op);
    SetFigures(s, &r);
    // A graph row's p99 is its slowest replay.
    r.p99 = std::isnan(s.p50) ? NAN : *std::max_element(per_op->begin(), per_op->end());
    r.note = note;
  } else {
    r.failed = true;
    r.note = std::string(per_op.status().message()).substr(0, 200);
  }
  Record(r);
}

void ClientRun::AddSkippedRow(const std::string& row, uint32_t tokens, uint32_t hidden,
                              const std::string& why) {
  RowResult r = ShapeRow(row, tokens, hidden);
  r.note = why;
  Record(r);
}

absl::Status ClientRun::GpuRows(const client::OpDesc& desc, uint32_t tokens, uint32_t hidden,
                                char* base, const std::string& eager_path, const std::string& tag) {
  const cudaStream_t s = gpu->stream;
  const OpArgs op = InProcessOp(desc, base);
  const FusionAlgo algo = eager_path == "twoshot" ? FusionAlgo::kTwoShot : FusionAlgo::kOneShot;
  const std::string algo_name = algo == FusionAlgo::kTwoShot ? "twoshot" : "oneshot";
  const size_t count = size_t{tokens} * hidden;
  const uint32_t busy_ns = static_cast<uint32_t>(f.compute_us) * 1000u;
  auto standin = [&]() -> absl::Status {
    return ARFUSE_CUDA_STATUS(
        LaunchLayerStandIn(op.norm_out, const_cast<void*>(op.input), count, busy_ns, s));
  };
  // Every rank decides alike whether a row runs, so no rank waits in a barrier for a peer
  // that skipped it.
  auto all = [&](const std::string& what, bool yes, const std::string& why) -> bool {
    auto v = ex.Vote(tag + "/" + what, yes, why, absl::Now() + absl::Seconds(120));
    return v.ok() && v->all_yes;
  };

  // In-process: the same fused kernel, launched by this process on its own workspace.
  const bool ws_ok = all("ws", gpu->ws != nullptr, gpu->ws_note);
  if (ws_ok) {
    auto launch = [&]() { return gpu->ws->Launch(op, algo, s); };
    AddGraphRow("inproc", tokens, hidden, TimeGraph(ex, s, f, launch, tag + "/inproc"), algo_name,
                "fused kernel launched in the client process");
  } else {
    AddSkippedRow("inproc", tokens, hidden,
                  gpu->ws_note.empty() ? "a rank has no in-process workspace" : gpu->ws_note);
  }

  // What the sidecar's idle doorbell plane costs a client kernel that wants the whole GPU:
  // the same graph of full-GPU kernels before any doorbell plan exists (nothing of the
  // sidecar resident) and after (its serving launch resident and idle, between rings).
  // Two shapes of the same FMA work: light 256-thread blocks that share SMs with anything, and
  // one 1024-thread block per SM needing more than half of its registers (a large GEMM tile's
  // shape), which cannot sit on an SM where a serving block keeps its registers.
  struct BusyKernel {
    std::string row;
    std::string what;
    int blocks;
    std::function<cudaError_t(float*)> launch;
    float* scratch = nullptr;
    bool ok = false;
  };
  constexpr int kBusyWaves = 4, kFullSmWaves = 8;
  constexpr uint32_t kBusyIters = 4096, kFullSmIters = 2048;
  BusyKernel busy_kernels[] = {
      {"busy", "full-GPU client kernel", FullGpuBusyBlocks(kBusyWaves),
       [&](float* scratch) { return LaunchFullGpuBusy(scratch, kBusyWaves, kBusyIters, s); }},
      {"busy_sm",
       absl::StrCat("register-heavy client kernel (", FullSmBusyRegisters(),
                    " registers x 1024 threads per block, one block per SM)"),
       FullSmBusyBlocks(kFullSmWaves),
       [&](float* scratch) { return LaunchFullSmBusy(scratch, kFullSmWaves, kFullSmIters, s); }},
  };
  auto enqueue_busy = [](BusyKernel& k) {
    return [&k]() -> absl::Status { return ARFUSE_CUDA_STATUS(k.launch(k.scratch)); };
  };
  // The busy kernels again while a plane is in place (`suffix` names their rows).
  auto add_busy_rows = [&](bool plane_ok, const std::string& suffix, const std::string& note) {
    for (BusyKernel& k : busy_kernels) {
      if (!k.ok || !plane_ok) continue;
      const std::string row = k.row + suffix;
      AddGraphRow(row, tokens, hidden, TimeGraph(ex, s, f, enqueue_busy(k), tag + "/" + row), "-",
                  note);
    }
  };
  for (BusyKernel& k : busy_kernels) {
    k.ok = all(k.row, cudaMalloc(&k.scratch, sizeof(float) * std::max(k.blocks, 1)) == cudaSuccess,
               "scratch allocation");
    if (k.ok) {
      AddGraphRow(k.row, tokens, hidden, TimeGraph(ex, s, f, enqueue_busy(k), tag + "/" + k.row),
                  "-",
                  absl::StrCat(k.what, ", no doorbell plan yet (nothing of the sidecar resident)"));
    }
  }

  // Doorbell: a plan with a doorbell, rung from this process's stream.
  std::optional<client::Plan> dplan;
  std::string dnote;
  void* slot = nullptr;
  if (!gpu->ring.loaded()) {
    dnote = gpu->ring.note;
  } else {
    auto p = c.CreatePlan(desc, /*doorbell=*/true);
    if (!p.ok()) {
      dnote = absl::StrCat("CreatePlan(doorbell): ", p.status().ToString()).substr(0, 200);
    } else if (!p->doorbell.has_value()) {
      dnote = "the sidecar's CreatePlan reply has no doorbell";
      c.DestroyPlan(*p).IgnoreError();
    } else {
      dplan = *p;
#if defined(ARFUSE_BENCH_HAVE_RING_HEADER)
      const client::DoorbellInfo& d = *dplan->doorbell;
      int rc = gpu->ring.check_values(d.request_value, d.complete_value, d.reset_value);
      if (rc == 0) rc = gpu->ring.open(d.ipc_handle.data(), d.offset, &slot);
      if (rc != 0) {
        dnote = absl::StrCat("ring library: ", gpu->ring.strerror(rc));
        slot = nullptr;
      }
#endif
    }
  }
  const bool db_ok = all("doorbell", slot != nullptr, dnote);
  if (!db_ok && dnote.empty()) dnote = "another rank could not set up its doorbell";
#if defined(ARFUSE_BENCH_HAVE_RING_HEADER)
  const uint64_t ring_timeout_ns = 5'000'000'000ull;
  auto ring = [&]() -> absl::Status {
    int rc = gpu->ring.ring(s, slot, tokens, ring_timeout_ns);
    if (rc != 0) return absl::InternalError(absl::StrCat("arfuse_ring: ", gpu->ring.strerror(rc)));
    return absl::OkStatus();
  };
  // A row whose graph rings the doorbell: failed when the slot reports an error after it.
  auto add_ring_row = [&](const std::string& row, const std::function<absl::Status()>& enqueue,
                          const std::string& note) {
    auto t = TimeGraph(ex, s, f, enqueue, tag + "/" + row);
    uint32_t code = 0;
    if (t.ok() && gpu->ring.error(slot, &code) == 0 && code != 0) {
      t = absl::InternalError(absl::StrCat("doorbell slot error: ", gpu->ring.error_name(code)));
    }
    AddGraphRow(row, tokens, hidden, t, client::ExecPathName(dplan->path), note);
  };
#endif
  if (db_ok) {
#if defined(ARFUSE_BENCH_HAVE_RING_HEADER)
    add_ring_row("doorbell", ring, "ring kernel in the client's graph; the sidecar serves it");
#endif
  } else {
    AddSkippedRow("doorbell", tokens, hidden, dnote);
  }
  add_busy_rows(db_ok, "_idle", "the same kernel while the doorbell plane waits for the next ring");
  // The layer loop: stand-in compute, then the fused op.
  AddGraphRow("compute", tokens, hidden, TimeGraph(ex, s, f, standin, tag + "/compute"), "-",
              absl::StrCat("stand-in kernel, ", f.compute_us, " us busy per layer"));
  if (ws_ok) {
    auto layer = [&]() -> absl::Status {
      ARFUSE_RETURN_IF_ERROR(standin());
      return gpu->ws->Launch(op, algo, s);
    };
    AddGraphRow("layer_inproc", tokens, hidden, TimeGraph(ex, s, f, layer, tag + "/layer_inproc"),
                algo_name, "stand-in + fused kernel in-process");
  } else {
    AddSkippedRow("layer_inproc", tokens, hidden, "no in-process workspace");
  }
  if (db_ok) {
#if defined(ARFUSE_BENCH_HAVE_RING_HEADER)
    auto layer = [&]() -> absl::Status {
      ARFUSE_RETURN_IF_ERROR(standin());
      return ring();
    };
    add_ring_row("layer_doorbell", layer, "stand-in + ring, one graph");
#endif
  } else {
    AddSkippedRow("layer_doorbell", tokens, hidden, dnote);
  }
#if defined(ARFUSE_BENCH_HAVE_RING_HEADER)
  // The in-stream plane needs the workspace to itself: the doorbell plan goes first.
  if (slot != nullptr) gpu->ring.close(slot);
  slot = nullptr;
#endif
  if (dplan.has_value()) c.DestroyPlan(*dplan).IgnoreError();
  dplan.reset();

  // In-stream: the sidecar's kernel, from the image it handed over at attach, launched by this
  // process in its own stream (nothing of the sidecar resident, no RPC per op).
  std::optional<instream::InStreamContext> is;
  uint64_t attach_id = 0;
  std::string inote;
  {
    absl::StatusOr<instream::InStreamContext> a = client::AttachInStream(c, {hidden});
    if (!a.ok()) {
      inote = absl::StrCat("attach: ", a.status().ToString()).substr(0, 200);
    } else {
      is.emplace(*std::move(a));
      absl::StatusOr<arfuse_ctx_info> info = is->Info();
      if (info.ok()) attach_id = info->attach_id;
      absl::Status sup =
          is->Supports(Pattern::kAllReduceResidualRmsNorm, tokens, hidden, DType::kBF16);
      if (!sup.ok()) inote = std::string(sup.message()).substr(0, 200);
    }
  }
  const bool is_ok = all("instream", is.has_value() && inote.empty(), inote);
  if (!is_ok && inote.empty()) inote = "another rank could not attach";
  auto instream_op = [&]() -> absl::Status {
    return is->FusedAllReduceResidualRmsNorm(s, op.input, op.residual_in, op.residual_out,
                                             op.norm_out, op.gamma, tokens, hidden, DType::kBF16,
                                             op.eps);
  };
  // A row whose graph launches in-stream: failed when the attachment's error word is set.
  auto add_instream_row = [&](const std::string& row, const std::function<absl::Status()>& enq,
                              const std::string& note) {
    auto t = TimeGraph(ex, s, f, enq, tag + "/" + row);
    uint32_t code = 0;
    if (t.ok()) {
      absl::Status checked = is->Check(&code);
      if (!checked.ok()) t = checked;
    }
    AddGraphRow(row, tokens, hidden, t, algo_name, note);
  };
  if (is_ok) {
    add_instream_row("instream", instream_op,
                     "the sidecar's kernel launched in the client's stream (attached)");
  } else {
    AddSkippedRow("instream", tokens, hidden, inote);
  }
  add_busy_rows(is_ok, "_instream",
                "the same kernel while attached in-stream (nothing of the sidecar resident)");
  for (BusyKernel& k : busy_kernels) {
    if (k.scratch != nullptr) cudaFree(k.scratch);
  }

  if (is_ok) {
    auto layer = [&]() -> absl::Status {
      ARFUSE_RETURN_IF_ERROR(standin());
      return instream_op();
    };
    add_instream_row("layer_instream", layer, "stand-in + in-stream fused op, one graph");
  } else {
    AddSkippedRow("layer_instream", tokens, hidden, inote);
  }
  const bool nccl_ok = all("nccl", gpu->nccl != nullptr, gpu->nccl_note);
  if (nccl_ok) {
    const absl::Time far = absl::Now() + absl::Minutes(10);
    AddRmsNormParams np = {};
    np.input = op.norm_out;  // NCCL sums into norm_out; the norm rewrites it in place
    np.residual_in = op.residual_in;
    np.residual_out = op.residual_out;
    np.norm_out = op.norm_out;
    np.gamma = op.gamma;
    np.num_tokens = tokens;
    np.hidden = hidden;
    np.eps = 1e-6f;
    np.dtype = DType::kBF16;
    auto layer = [&]() -> absl::Status {
      ARFUSE_RETURN_IF_ERROR(standin());
      ARFUSE_RETURN_IF_ERROR(
          gpu->nccl->AllReduce(op.input, op.norm_out, count, DType::kBF16, s, far));
      return ARFUSE_CUDA_STATUS(LaunchAddRmsNorm(np, s));
    };
    AddGraphRow("layer_nccl", tokens, hidden, TimeGraph(ex, s, f, layer, tag + "/layer_nccl"),
                "unfused", "stand-in + NCCL allreduce + add-RMSNorm in-process");
  } else {
    AddSkippedRow("layer_nccl", tokens, hidden,
                  gpu->nccl_note.empty() ? "a rank has no NCCL communicator" : gpu->nccl_note);
  }

  // The attachment ends after its launches (WaitStream) and before the next shape's eager rows.
  if (is.has_value()) {
    static_cast<void>(WaitStream(s, absl::Now() + absl::Seconds(60)));
    is.reset();
    if (attach_id != 0) c.Detach(attach_id).IgnoreError();
  }
  return absl::OkStatus();
}

}  // namespace arfuse::bench::sidecar
#endif  // ARFUSE_BENCH_CUDA
