// arfuse-bench sidecar, a client process's rows over the sidecar's RPCs and the host engine: the
// echo beside the eager op (so the gRPC round trip is told apart from the op), the refused call,
// and in host mode the same op run in-process. Shape runs every row of one shape, the GPU rows
// (sidecar_gpu_rows.cc) included.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/sidecar_client_run.h"
#include "common/status_macros.h"
#include "kernels/common/op_types.h"

#if defined(ARFUSE_BENCH_CUDA)
#include <cuda_runtime_api.h>

#include "server/cuda_device/cuda_status.h"
#include "server/cuda_device/fusion_workspace.h"
#endif

namespace arfuse::bench::sidecar {

using client::OpDesc;
using client::TensorLoc;

absl::Status ClientRun::Shape(uint32_t tokens, uint32_t hidden) {
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

void ClientRun::Record(const RowResult& r) {
  out.push_back(r);
  if (rank != 0) return;
  if (std::isnan(r.p50)) {
    std::fprintf(stderr, "arfuse-bench sidecar: %u x %u %-18s -  (%s)\n", r.tokens, r.hidden,
                 r.row.c_str(), r.note.c_str());
  } else {
    std::fprintf(stderr, "arfuse-bench sidecar: %u x %u %-18s p50 %.1f us  p99 %.1f us\n", r.tokens,
                 r.hidden, r.row.c_str(), r.p50, r.p99);
  }
}

absl::Status ClientRun::Echo() {
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

absl::Status ClientRun::Refused(const client::Plan& plan, uint32_t max_tokens) {
  client::ExecOptions eo;
  auto r = c.Execute(plan, max_tokens + 1, eo);
  if (r.ok() || !absl::IsInvalidArgument(r.status())) {
    return absl::InternalError(
        absl::StrCat("an op above the plan's maximum was not refused: ", r.status().ToString()));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ExecPath> ClientRun::Eager(const client::Plan& plan, uint32_t tokens, bool sync,
                                              double* rpc_us, double* cuda_us, bool events) {
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

absl::Status ClientRun::EagerRows(const client::Plan& plan, uint32_t tokens, uint32_t hidden,
                                  bool sync, const std::string& tag) {
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
    add("eager_rpc", rpc_us, client::ExecPathName(path), "the Execute RPC alone, of the eager row");
    add("eager_client_cuda", cuda_us, "-",
        "the client's cudaEventRecord + cudaStreamWaitEvent on interprocess events");
    add("eager_nowait", nowait_us, client::ExecPathName(path),
        "Execute without wait_event; the client does not wait on done_event");
  }
  return absl::OkStatus();
}

absl::Status ClientRun::HostInprocRow(const client::OpDesc& desc, uint32_t tokens, uint32_t hidden,
                                      const Layout& L, const std::string& tag) {
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

}  // namespace arfuse::bench::sidecar
