#include "tools/demo/demo_client.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cpp/client.h"
#include "kernels/host/reference_op.h"
#include "tools/demo/demo_flags.h"
#include "tools/demo/demo_instream.h"
#include "tools/demo/demo_shape.h"
#if defined(ARFUSE_DEMO_CUDA)
#include "tools/demo/demo_doorbell.h"
#endif

namespace arfuse::demo {
namespace {

using client::Client;
using client::ClientOptions;
using client::OpDesc;
using client::TensorLoc;

absl::StatusOr<ShapeResult> RunShape(Client& c, int rank, int world, const Shape& s, DType dt,
                                     bool cuda, int iters) {
  ShapeResult r;
  r.shape = s;
  Layout L(s, dt);
  std::unique_ptr<Buffer> buf;
  if (cuda) {
#if defined(ARFUSE_DEMO_CUDA)
    int count = 0;
    cudaGetDeviceCount(&count);
    auto cb = CudaBuffer::Create(L.total, count > 0 ? rank % count : 0);
    if (!cb.ok()) return cb.status();
    buf = std::move(*cb);
#else
    return absl::UnimplementedError("this arfuse-demo was built without CUDA");
#endif
  } else {
    auto hb = client::HostShmBuffer::Create(L.total, absl::StrCat("demo", rank));
    if (!hb.ok()) return hb.status();
    buf = std::make_unique<HostBuffer>(std::move(*hb));
  }
  const uint64_t n = uint64_t{s.tokens} * s.hidden;
  std::vector<std::vector<char>> inputs(world, std::vector<char>(n * DTypeSize(dt)));
  for (int q = 0; q < world; ++q) {
    for (uint64_t i = 0; i < n; ++i) StoreFromFloat(dt, inputs[q].data(), i, InputValue(q, i));
  }
  std::vector<char> host = RegionImage(L, s, dt, inputs[rank]);
  if (auto st = buf->Upload(host); !st.ok()) return st;

  auto region = buf->Register(c, absl::StrCat("shape-", s.tokens, "x", s.hidden));
  if (!region.ok()) return region.status();
  OpDesc op;
  op.pattern = Pattern::kAllReduceResidualRmsNorm;
  op.dtype = dt;
  op.hidden = s.hidden;
  op.max_tokens = s.tokens;
  op.eps = 1e-6f;
  op.input = TensorLoc{*region, L.input};
  op.residual_in = TensorLoc{*region, L.residual_in};
  op.residual_out = TensorLoc{*region, L.residual_out};
  op.norm_out = TensorLoc{*region, L.norm_out};
  op.gamma = TensorLoc{*region, L.gamma_off};
  auto plan = c.CreatePlan(op);
  if (!plan.ok()) return plan.status();

  // Timed ops run as a client runs the eager plane: the reply comes after the enqueue (CUDA; in
  // host mode every op completes before its reply). us/op is the median client-side time of one
  // Execute, so one slow call (a peer descheduled, a page fault) does not stand for all of them.
  client::ExecOptions eo;
  eo.synchronous = false;
  for (int i = 0; i < 3; ++i) {
    auto e = c.Execute(*plan, s.tokens, eo);
    if (!e.ok()) return e.status();
    r.path = client::ExecPathName(e->path);
  }
  std::vector<double> us;
  us.reserve(std::max(iters, 1));
  for (int i = 0; i < iters; ++i) {
    auto start = std::chrono::steady_clock::now();
    auto e = c.Execute(*plan, s.tokens, eo);
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
                     .count());
    if (!e.ok()) return e.status();
  }
  if (!us.empty()) {
    std::sort(us.begin(), us.end());
    r.us_per_op = us[(us.size() - 1) / 2];
  }
  // One more op, synchronous (untimed): it completes after every op before it on the sidecar's
  // stream, so the outputs read below are final.
  eo.synchronous = true;
  if (auto e = c.Execute(*plan, s.tokens, eo); !e.ok()) return e.status();

  if (auto st = buf->Download(host); !st.ok()) return st;
  // The oracle: the CPU reference over every rank's inputs.
  std::vector<const void*> rank_inputs;
  for (auto& in : inputs) rank_inputs.push_back(in.data());
  absl::StatusOr<bool> matched = MatchesReference(
      dt, world, s, rank_inputs, host.data() + L.residual_in, host.data() + L.gamma_off,
      host.data() + L.residual_out, host.data() + L.norm_out, &r.max_error);
  if (!matched.ok()) return matched.status();
  const bool ok = *matched;
  r.ok = ok;
  if (!ok) r.error = "output differs from the CPU reference";
  c.DestroyPlan(*plan).IgnoreError();
  c.Unregister(*region).IgnoreError();
  return r;
}

}  // namespace

int ClientMain(int rank) {
  const std::string dir = absl::GetFlag(FLAGS_work_dir);
  const int world = absl::GetFlag(FLAGS_ranks);
  const bool cuda = absl::GetFlag(FLAGS_device) == "cuda";
  auto dt = ParseDType(absl::GetFlag(FLAGS_dtype));
  auto tokens = ParseList(absl::GetFlag(FLAGS_tokens), "tokens");
  auto hidden = ParseList(absl::GetFlag(FLAGS_hidden), "hidden");
  auto planes = ParsePlanes(absl::GetFlag(FLAGS_planes), absl::GetFlag(FLAGS_device),
                            absl::GetFlag(FLAGS_doorbell));
  std::ofstream out(absl::StrCat(dir, "/result.", rank));
  auto fail = [&](const absl::Status& s) {
    out << "error " << s.ToString() << "\n";
    std::cerr << "rank " << rank << ": " << s << "\n";
    return 1;
  };
  if (!dt.ok()) return fail(dt.status());
  if (!planes.ok()) return fail(planes.status());
  ClientOptions co;
  co.target = SocketOf(dir, rank);
  co.client_name = absl::StrCat("arfuse-demo-rank", rank);
  co.default_timeout = absl::Seconds(30);
  co.connect_timeout = absl::Seconds(std::min(60.0, absl::GetFlag(FLAGS_timeout)));
  auto c = Client::Connect(co);
  if (!c.ok()) return fail(c.status());
  // The group forms in the background: wait (bounded) until the workspace is ready.
  absl::Time until = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_timeout));
  for (;;) {
    auto info = (*c)->GetWorkspaceInfo();
    if (!info.ok()) return fail(info.status());
    if (info->state() == v1::WORKSPACE_STATE_READY || info->state() == v1::WORKSPACE_STATE_UNFUSED)
      break;
    if (absl::Now() > until) {
      return fail(
          absl::DeadlineExceededError(absl::StrCat("workspace not ready: ", info->reason())));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  // One line per row: "row <plane> <tokens> <hidden> <path> <us/op> <max err> <ok> <why>".
  int rc = 0;
  auto put = [&](Plane p, const Shape& s, const std::string& path, double us, double err, bool ok,
                 const std::string& why) {
    out << "row " << PlaneName(p) << " " << s.tokens << " " << s.hidden << " " << path << " " << us
        << " " << err << " " << (ok ? 1 : 0) << " " << why << "\n";
    if (!ok) rc = 1;
  };
  auto put_result = [&](Plane p, const Shape& s, const absl::StatusOr<ShapeResult>& r) {
    if (!r.ok()) return put(p, s, "-", 0, 0, false, r.status().ToString());
    put(p, s, r->path, r->us_per_op, r->max_error, r->ok, r->error);
  };
  const int iters = absl::GetFlag(FLAGS_iters);
  for (uint32_t t : *tokens) {
    for (uint32_t h : *hidden) {
      const Shape shape{t, h};
      // In-stream first: its attachment ends before the eager and doorbell rows, which the
      // sidecar refuses while a client is attached (one plane per workspace).
      if (planes->runs(Plane::kInStream)) {
        InStreamSkipped skipped;
        auto r = RunInStreamShape(**c, dir, rank, world, shape, *dt, cuda, iters,
                                  absl::GetFlag(FLAGS_timeout), &skipped);
        if (r.ok() && !skipped.why.empty()) {
          // A declined shape is the client library's answer for the shape, never a failure; a
          // refused attach fails when --planes names the plane.
          const bool ok = skipped.declined || !planes->requires_plane(Plane::kInStream);
          put(Plane::kInStream, shape, r->path, 0, 0, ok,
              ok ? skipped.why : skipped.why + " (--planes names instream)");
        } else {
          put_result(Plane::kInStream, shape, r);
        }
      }
      if (planes->runs(Plane::kEager)) {
        put_result(Plane::kEager, shape, RunShape(**c, rank, world, shape, *dt, cuda, iters));
      }
      if (planes->runs(Plane::kDoorbell)) {
#if defined(ARFUSE_DEMO_CUDA)
        DoorbellRefused refused;
        auto d = RunDoorbellShape(**c, rank, world, shape, *dt, iters, &refused);
        if (!d.ok() && !refused.why.empty() && !planes->requires_plane(Plane::kDoorbell)) {
          put(Plane::kDoorbell, shape, "skipped", 0, 0, true, "refused: " + refused.why);
        } else {
          put_result(Plane::kDoorbell, shape, d);
        }
#else
        put(Plane::kDoorbell, shape, "-", 0, 0, false,
            "this arfuse-demo was built without CUDA: no doorbell plane");
#endif
      }
    }
  }
  return rc;
}

}  // namespace arfuse::demo
