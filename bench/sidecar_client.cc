#include "bench/sidecar_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/sidecar_memory.h"
#include "bench/sidecar_rows.h"
#include "client/cpp/client.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kernels/common/op_types.h"
#include "server/core/log.h"
#include "server/core/status_macros.h"
#include "server/host/host_engine.h"
#include "server/peers/peer_exchange.h"

#if defined(ARFUSE_BENCH_CUDA)
#include <cuda_runtime_api.h>

#include "bench/layer_standin.h"
#include "bench/sidecar_gpu.h"
#include "client/cpp/instream_attach.h"
#include "kernels/add_rmsnorm/add_rmsnorm.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "server/gpu/cuda_status.h"
#include "server/doorbell/doorbell_dispatch.h"
#include "server/gpu/fusion_workspace.h"
#include "server/gpu/mps_driver.h"
#include "server/gpu/nccl_comm.h"
#endif

namespace arfuse::bench::sidecar {
namespace {

using client::Client;
using client::ClientOptions;
using client::OpDesc;
using client::TensorLoc;

using Flags = SidecarFlags;

struct ClientRun {
  ClientRun(const Flags& f, int rank, bool cuda, Client& c, PeerExchange& ex,
            grpc::health::v1::Health::Stub& health, std::vector<RowResult>& out)
      : f(f), rank(rank), cuda(cuda), c(c), ex(ex), health(health), out(out) {}

  const Flags& f;
  int rank;
  bool cuda;
  Client& c;
  PeerExchange& ex;
  grpc::health::v1::Health::Stub& health;
  std::vector<RowResult>& out;
  // Host mode: the host engine run by the client processes themselves (the in-process op).
  Engine* host_engine = nullptr;
  std::string host_engine_note;
#if defined(ARFUSE_BENCH_CUDA)
  Gpu* gpu = nullptr;
#endif

  // Keeps a finished row; rank 0 also prints it to stderr, one progress line per row (its own
  // figures: the table takes the slowest rank's).
  void Record(const RowResult& r) {
    out.push_back(r);
    if (rank != 0) return;
    if (std::isnan(r.p50)) {
      std::fprintf(stderr, "arfuse-bench sidecar: %u x %u %-18s -  (%s)\n", r.tokens, r.hidden,
                   r.row.c_str(), r.note.c_str());
    } else {
      std::fprintf(stderr, "arfuse-bench sidecar: %u x %u %-18s p50 %.1f us  p99 %.1f us\n",
                   r.tokens, r.hidden, r.row.c_str(), r.p50, r.p99);
    }
  }

  absl::Status Echo() {
    grpc::ClientContext ctx;
    c.PrepareContext(&ctx, absl::ZeroDuration());
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status s = health.Check(&ctx, req, &resp);
    if (!s.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                          absl::StrCat("Health.Check: ", s.error_message()));
    }
    return absl::OkStatus();
  }

  // An Execute the sidecar refuses after the session and plan lookup (one token more than the
  // plan's maximum): the gRPC round trip plus the service's front, no engine. Same request shape
  // as an eager op's.
  absl::Status Refused(const client::Plan& plan, uint32_t max_tokens) {
    client::ExecOptions eo;
    auto r = c.Execute(plan, max_tokens + 1, eo);
    if (r.ok() || !absl::IsInvalidArgument(r.status())) {
      return absl::InternalError(
          absl::StrCat("an op above the plan's maximum was not refused: ", r.status().ToString()));
    }
    return absl::OkStatus();
  }

  // One eager op as a client would issue it. Returns the reply's path. `rpc_us` (optional) gets
  // the time of the Execute call alone, `cuda_us` that of the client's event record and wait.
  // `events` false: no wait_event, and the client's stream does not wait on done_event (the
  // inputs do not change between calls, so only the timing differs).
  absl::StatusOr<v1::ExecPath> Eager(const client::Plan& plan, uint32_t tokens, bool sync,
                                     double* rpc_us = nullptr, double* cuda_us = nullptr,
                                     bool events = true) {
    client::ExecOptions eo;
    eo.synchronous = sync;
    double cuda_time = 0;
#if defined(ARFUSE_BENCH_CUDA)
    if (cuda && !sync && events) {
      auto t0 = std::chrono::steady_clock::now();
      ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventRecord(gpu->wait_event, gpu->stream));
      cuda_time += MicrosSince(t0);
      eo.wait_event = gpu->wait_handle;
    }
#endif
    auto t_rpc = std::chrono::steady_clock::now();
    ARFUSE_ASSIGN_OR_RETURN(client::ExecResult r, c.Execute(plan, tokens, eo));
    if (rpc_us != nullptr) *rpc_us = MicrosSince(t_rpc);
#if defined(ARFUSE_BENCH_CUDA)
    if (cuda && events && !r.done_event.empty()) {
      auto t0 = std::chrono::steady_clock::now();
      ARFUSE_ASSIGN_OR_RETURN(cudaEvent_t done, gpu->DoneEvent(r.done_event));
      ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(gpu->stream, done, 0));
      cuda_time += MicrosSince(t0);
    }
#endif
    if (cuda_us != nullptr) *cuda_us = cuda_time;
    return r.path;
  }

  // Echo and Execute in alternating blocks; adds the echo (asynchronous pass only) and eager rows.
  absl::Status EagerRows(const client::Plan& plan, uint32_t tokens, uint32_t hidden, bool sync,
                         const std::string& tag) {
    ARFUSE_RETURN_IF_ERROR(ex.Barrier(tag, absl::Now() + absl::Seconds(120)));
    std::vector<double> echo_us, exec_us, rpc_us, cuda_us, refused_us, nowait_us;
    // The eager call split: a refused call (the service's front alone, on every device) and,
    // on CUDA, a call without the interprocess events.
    const bool refused = !sync;
    const bool split = cuda && !sync;
    echo_us.reserve(f.iters);
    exec_us.reserve(f.iters);
    v1::ExecPath path = v1::EXEC_PATH_UNSPECIFIED;
    // Blocks of --block echo calls, then --block Execute calls, alternating: drift in the load
    // of the machine hits both alike, and within an Execute block the ranks stay in step (the
    // collective paces them), as a serving loop keeps them.
    const int block = std::max(1, f.block);
    for (int done = 0; done < f.warmup + f.iters; done += block) {
      const int n = std::min(block, f.warmup + f.iters - done);
      for (int i = 0; i < n; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        ARFUSE_RETURN_IF_ERROR(Echo());
        if (done + i >= f.warmup) echo_us.push_back(MicrosSince(t0));
      }
      for (int i = 0; i < n; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        double rpc = 0, cuda_calls = 0;
        ARFUSE_ASSIGN_OR_RETURN(path, Eager(plan, tokens, sync, &rpc, &cuda_calls));
        if (done + i >= f.warmup) {
          exec_us.push_back(MicrosSince(t0));
          rpc_us.push_back(rpc);
          cuda_us.push_back(cuda_calls);
        }
      }
      for (int i = 0; refused && i < n; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        ARFUSE_RETURN_IF_ERROR(Refused(plan, tokens));  // the plan's maximum is `tokens`
        if (done + i >= f.warmup) refused_us.push_back(MicrosSince(t0));
      }
      for (int i = 0; split && i < n; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        ARFUSE_RETURN_IF_ERROR(Eager(plan, tokens, false, nullptr, nullptr, false).status());
        if (done + i >= f.warmup) nowait_us.push_back(MicrosSince(t0));
      }
    }
#if defined(ARFUSE_BENCH_CUDA)
    if (cuda) ARFUSE_RETURN_IF_ERROR(WaitStream(gpu->stream, absl::Now() + absl::Seconds(60)));
#endif
    auto add = [&](const std::string& row, const std::vector<double>& v, const std::string& p,
                   const std::string& note) {
      RowResult r = ShapeRow(row, tokens, hidden);
      SetFigures(Summarize(v), &r);
      r.path = p;
      r.note = note;
      Record(r);
    };
    if (!sync) add("echo", echo_us, "-", "Health.Check, same channel and metadata");
    if (refused) {
      add("eager_refused", refused_us, "-",
          "Execute refused after the session and plan lookup: gRPC + the service's front");
    }
    add(sync ? "eager_sync" : "eager", exec_us, client::ExecPathName(path),
        sync ? "synchronous=true: reply after completion"
             : (cuda ? "reply after enqueue; IPC events both ways" : "op completes before reply"));
    if (cuda && !sync) {
      // Where the eager call's time goes on the client: the RPC itself (the sidecar's work
      // included) and the client's CUDA calls around it.
      add("eager_rpc", rpc_us, client::ExecPathName(path),
          "the Execute RPC alone, of the eager row");
      add("eager_client_cuda", cuda_us, "-",
          "the client's cudaEventRecord + cudaStreamWaitEvent on interprocess events");
      add("eager_nowait", nowait_us, client::ExecPathName(path),
          "Execute without wait_event; the client does not wait on done_event");
    }
    return absl::OkStatus();
  }

  absl::Status Shape(uint32_t tokens, uint32_t hidden) {
    const Layout L(tokens, hidden);
    std::unique_ptr<Memory> mem;
    if (cuda) {
#if defined(ARFUSE_BENCH_CUDA)
      ARFUSE_ASSIGN_OR_RETURN(mem, CudaMemory::Create(L.total, gpu->device));
#endif
    } else {
      ARFUSE_ASSIGN_OR_RETURN(client::HostShmBuffer b,
                              client::HostShmBuffer::Create(L.total, absl::StrCat("bench", rank)));
      mem = std::make_unique<HostMemory>(std::move(b));
    }
    ARFUSE_RETURN_IF_ERROR(mem->Upload(HostImage(L, tokens, hidden, rank)));
    ARFUSE_ASSIGN_OR_RETURN(client::Region region,
                            mem->Register(c, absl::StrCat("bench-", tokens, "x", hidden)));
    OpDesc op;
    op.pattern = Pattern::kAllReduceResidualRmsNorm;
    op.dtype = DType::kBF16;
    op.hidden = hidden;
    op.max_tokens = tokens;
    op.eps = 1e-6f;
    op.input = TensorLoc{region, L.input};
    op.residual_in = TensorLoc{region, L.residual_in};
    op.residual_out = TensorLoc{region, L.residual_out};
    op.norm_out = TensorLoc{region, L.norm_out};
    op.gamma = TensorLoc{region, L.gamma};
    ARFUSE_ASSIGN_OR_RETURN(client::Plan plan, c.CreatePlan(op));
    const std::string tag = absl::StrCat("t", tokens, "h", hidden);

    absl::Status st = EagerRows(plan, tokens, hidden, /*sync=*/false, tag + "/eager");
    if (st.ok() && cuda) st = EagerRows(plan, tokens, hidden, /*sync=*/true, tag + "/sync");
    if (st.ok() && !cuda) st = HostInprocRow(op, tokens, hidden, L, tag + "/inproc");
#if defined(ARFUSE_BENCH_CUDA)
    if (st.ok() && cuda) {
      std::string eager_path = "oneshot";
      for (const RowResult& r : out) {
        if (r.row == "eager" && r.tokens == tokens && r.hidden == hidden) eager_path = r.path;
      }
      st = GpuRows(op, tokens, hidden, mem->device_ptr(), eager_path, tag);
    }
#endif
    c.DestroyPlan(plan).IgnoreError();
    c.Unregister(region).IgnoreError();
    return st;
  }

  // Host mode: the same op on the host engine, run by this process (no RPC, no sidecar).
  absl::Status HostInprocRow(const OpDesc& desc, uint32_t tokens, uint32_t hidden, const Layout& L,
                             const std::string& tag) {
    RowResult r = ShapeRow("inproc", tokens, hidden);
    r.path = "host";
    if (host_engine == nullptr) {
      r.note = host_engine_note;
      Record(r);
      return absl::OkStatus();
    }
    std::vector<char> img = HostImage(L, tokens, hidden, rank);
    const OpArgs op = InProcessOp(desc, img.data());
    ARFUSE_RETURN_IF_ERROR(ex.Barrier(tag, absl::Now() + absl::Seconds(120)));
    std::vector<double> us;
    us.reserve(f.iters);
    for (int i = 0; i < f.warmup + f.iters; ++i) {
      ExecContext ctx;
      ctx.deadline = absl::Now() + absl::Seconds(30);
      ctx.synchronous = true;
      auto t0 = std::chrono::steady_clock::now();
      ARFUSE_RETURN_IF_ERROR(host_engine->Execute(op, ctx).status());
      if (i >= f.warmup) us.push_back(MicrosSince(t0));
    }
    SetFigures(Summarize(us), &r);
    r.note = "host engine's op run by the client processes: the op's own cost";
    Record(r);
    return absl::OkStatus();
  }

#if defined(ARFUSE_BENCH_CUDA)
  void AddGraphRow(const std::string& row, uint32_t tokens, uint32_t hidden,
                   const absl::StatusOr<std::vector<double>>& per_op, const std::string& path,
                   const std::string& note) {
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

  void AddSkippedRow(const std::string& row, uint32_t tokens, uint32_t hidden,
                     const std::string& why) {
    RowResult r = ShapeRow(row, tokens, hidden);
    r.note = why;
    Record(r);
  }

  absl::Status GpuRows(const OpDesc& desc, uint32_t tokens, uint32_t hidden, char* base,
                       const std::string& eager_path, const std::string& tag) {
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
      k.ok =
          all(k.row, cudaMalloc(&k.scratch, sizeof(float) * std::max(k.blocks, 1)) == cudaSuccess,
              "scratch allocation");
      if (k.ok) {
        AddGraphRow(
            k.row, tokens, hidden, TimeGraph(ex, s, f, enqueue_busy(k), tag + "/" + k.row), "-",
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
      if (rc != 0)
        return absl::InternalError(absl::StrCat("arfuse_ring: ", gpu->ring.strerror(rc)));
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
    add_busy_rows(db_ok, "_idle",
                  "the same kernel while the doorbell plane waits for the next ring");
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
#endif  // ARFUSE_BENCH_CUDA
};

}  // namespace

int ClientMain(const Flags& f) {
  static_cast<void>(InitLogging("error"));
  const int rank = f.client_rank;
  std::ofstream result(absl::StrCat(f.dir, "/result.", rank));
  auto fail = [&](const absl::Status& s) {
    result << "error\t" << Clean(s.ToString()) << "\n";
    std::fprintf(stderr, "arfuse-bench sidecar client %d: %s\n", rank, s.ToString().c_str());
    return 1;
  };
  const bool cuda = f.device == "cuda";
  const absl::Time until = absl::Now() + absl::Seconds(f.timeout_s);

#if defined(ARFUSE_BENCH_CUDA)
  std::unique_ptr<Gpu> gpu;
  if (cuda) {
    gpu = std::make_unique<Gpu>();
    if (absl::Status s = gpu->Init(rank, f.ranks); !s.ok()) return fail(s);
  }
#else
  if (cuda) return fail(absl::UnimplementedError("this arfuse-bench was built without CUDA"));
#endif

  ClientOptions co;
  co.target = SocketOf(f.dir, rank);
  co.client_name = absl::StrCat("arfuse-bench-rank", rank);
  co.default_timeout = absl::Seconds(30);
  co.connect_timeout = absl::Seconds(std::min(120, f.timeout_s));
  auto c = Client::Connect(co);
  if (!c.ok()) return fail(c.status());
  // The sidecars' group forms in the background.
  v1::GetWorkspaceInfoResponse info;
  for (;;) {
    auto i = (*c)->GetWorkspaceInfo();
    if (!i.ok()) return fail(i.status());
    info = *i;
    if (info.state() == v1::WORKSPACE_STATE_READY || info.state() == v1::WORKSPACE_STATE_UNFUSED) {
      break;
    }
    if (absl::Now() > until) {
      return fail(absl::DeadlineExceededError(
          absl::StrCat("the sidecar's workspace is not ready: ", info.reason())));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }

  // The client processes' own group: barriers around timed loops, and the in-process rows'
  // workspace and NCCL communicator.
  PeerOptions po;
  po.rank = rank;
  po.world_size = f.ranks;
  po.peer_dir = f.dir + "/clients";
  po.group = "bench";
  po.timeout = absl::Seconds(std::min(120, f.timeout_s));
  auto ex = ConnectPeers(po);
  if (!ex.ok()) return fail(ex.status());

  std::vector<RowResult> rows;
  auto health = grpc::health::v1::Health::NewStub((*c)->channel());
  ClientRun run(f, rank, cuda, **c, **ex, *health, rows);

#if defined(ARFUSE_BENCH_CUDA)
  if (cuda) {
    run.gpu = gpu.get();
    gpu->ring = RingLib::Load(f.ring_lib);
    const uint32_t max_t = *std::max_element(f.tokens.begin(), f.tokens.end());
    const uint32_t max_h = *std::max_element(f.hidden.begin(), f.hidden.end());
    const std::string& backend = info.backend();
    if (f.ranks < 2) {
      gpu->ws_note = "in-process rows need 2 or more ranks";
    } else if (backend != "trtllm" && backend != "mnnvl") {
      gpu->ws_note = absl::StrCat("the sidecars run backend \"", backend, "\" (", info.reason(),
                                  "): no fused kernel to compare with");
    } else {
      WorkspaceOptions wo;
      wo.backend = backend;
      wo.max_tokens = max_t;
      wo.hidden = max_h;
      wo.dtype = DType::kBF16;
      // Ranks sharing a GPU split its SMs, leaving room for every rank's ring and waiter blocks
      // (docs/doorbell.md), so every rank's grid stays co-resident.
      // The same budget as the sidecars' own workspaces with arfused's default serving blocks
      // (SharedGpuSmBudget), so in-process and in-stream launches have the same grids.
      if (gpu->shared) {
        wo.sm_budget = SharedGpuSmBudget(gpu->sms, gpu->per_gpu, true,
                                         DoorbellServeBlocksFor(kDefaultDoorbellServeBlocks, true));
      }
      auto ws = FusionWorkspace::Create(**ex, wo, gpu->stream, absl::Now() + absl::Seconds(120));
      if (ws.ok()) {
        gpu->ws = std::move(*ws);
      } else {
        gpu->ws_note = absl::StrCat("in-process workspace: ", ws.status().ToString());
      }
    }
    if (f.ranks < 2) {
      gpu->nccl_note = "NCCL rows need 2 or more ranks";
    } else if (gpu->shared) {
      gpu->nccl_note = "NCCL rows need one GPU per rank (ranks share a GPU)";
    } else {
      auto nccl = NcclComm::Create(**ex, absl::Now() + absl::Seconds(120));
      if (nccl.ok()) {
        gpu->nccl = std::move(*nccl);
      } else {
        gpu->nccl_note = absl::StrCat("NCCL: ", nccl.status().ToString());
      }
    }
    if (rank == 0) {
      cudaDeviceProp prop;
      if (cudaGetDeviceProperties(&prop, gpu->device) == cudaSuccess) {
        result << "info\tgpu\t" << Clean(prop.name) << "\n";
      }
      result << "info\tgpus\t" << std::min(gpu->devices, f.ranks) << "\n";
      result << "info\tshared_gpu\t" << (gpu->shared ? 1 : 0) << "\n";
      const MpsInfo mps = DetectMpsOnDevice(gpu->device);
      result << "info\tmps_active\t" << (mps.active() ? 1 : 0) << "\n";
      result << "info\tmps\t" << Clean(mps.Describe()) << "\n";
    }
  }
#endif
  std::unique_ptr<Engine> host_engine;
  if (!cuda) {
    EngineOptions eo;
    eo.rank = rank;
    eo.world_size = f.ranks;
    eo.max_tokens = *std::max_element(f.tokens.begin(), f.tokens.end());
    eo.max_hidden = *std::max_element(f.hidden.begin(), f.hidden.end());
    eo.dtype = DType::kBF16;
    auto e = MakeHostEngine(eo);
    absl::Status st = e.status();
    if (st.ok()) st = (*e)->Initialize(**ex, absl::Now() + absl::Seconds(120));
    if (st.ok()) {
      host_engine = std::move(*e);
      run.host_engine = host_engine.get();
    } else {
      run.host_engine_note = absl::StrCat("in-process host engine: ", st.ToString());
    }
  }
  if (rank == 0) {
    result << "info\tbackend\t" << Clean(info.backend()) << "\n";
    result << "info\tbackend_reason\t" << Clean(info.reason()) << "\n";
  }

  int rc = 0;
  for (uint32_t h : f.hidden) {
    for (uint32_t t : f.tokens) {
      absl::Status s = run.Shape(t, h);
      if (!s.ok()) {
        rc = fail(absl::Status(s.code(), absl::StrCat(t, "x", h, ": ", s.message())));
        break;
      }
    }
    if (rc != 0) break;
  }
  for (const RowResult& r : rows) result << Serialize(r);
  result.flush();
  // The group leaves together: rank 0's coordinator serves the others until they are done.
  static_cast<void>((*ex)->Barrier("done", absl::Now() + absl::Seconds(60)));
  return rc;
}

}  // namespace arfuse::bench::sidecar
