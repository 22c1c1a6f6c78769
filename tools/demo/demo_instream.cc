#include "tools/demo/demo_instream.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cpp/instream_attach.h"
#include "kernels/host/reference_op.h"
#if defined(ARFUSE_DEMO_CUDA)
#include "tools/demo/demo_cuda.h"
#endif

namespace arfuse::demo {
namespace {

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[(v.size() - 1) / 2];
}

// The path the client library's dispatch takes for this op: one algorithm in host mode; on a GPU
// one-shot up to oneshot_max_bytes, two-shot above (client/instream/op_rules.cc).
std::string PathOf(const arfuse_ctx_info& info, const Shape& s, DType dt) {
  if (info.device_kind == 2) return "host";
  const uint64_t payload = uint64_t{s.tokens} * s.hidden * DTypeSize(dt);
  return payload <= info.oneshot_max_bytes ? "oneshot" : "twoshot";
}

}  // namespace

absl::StatusOr<ShapeResult> RunInStreamShape(client::Client& c, const std::string& dir, int rank,
                                             int world, const Shape& s, DType dt, bool cuda,
                                             int iters, double timeout_s,
                                             InStreamSkipped* skipped) {
  ShapeResult r;
  r.shape = s;
  const Layout L(s, dt);
  const uint64_t n = uint64_t{s.tokens} * s.hidden;
  const size_t tbytes = n * DTypeSize(dt);
  // inputs[k][q]: rank q's input of variant k.
  std::vector<std::vector<std::vector<char>>> inputs(
      kDemoVariants, std::vector<std::vector<char>>(world, std::vector<char>(tbytes)));
  for (int k = 0; k < kDemoVariants; ++k)
    for (int q = 0; q < world; ++q)
      for (uint64_t i = 0; i < n; ++i)
        StoreFromFloat(dt, inputs[k][q].data(), i, VariantInput(q, i, k));
  const std::vector<char> image = RegionImage(L, s, dt, inputs[0][rank]);
  // The outputs of the last op of each variant: [variant][residual_out | norm_out].
  std::vector<char> got(kDemoVariants * 2 * tbytes);

  // The op's tensors are this process's own memory, registered nowhere: the in-stream plane
  // launches on the caller's tensors. The region layout is the eager rows' (demo_shape.h).
  std::unique_ptr<char, decltype(&std::free)> host_mem(nullptr, &std::free);
  char* base = nullptr;
#if defined(ARFUSE_DEMO_CUDA)
  char* variants = nullptr;
  char* history = nullptr;
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
#endif
  std::optional<instream::InStreamContext> ctx;
  uint64_t attach_id = 0;
  // Ends the attachment after its launches, and the graph that captured them before it
  // (arfuse_detach's contract), then frees the tensors.
  auto cleanup = [&] {
#if defined(ARFUSE_DEMO_CUDA)
    if (stream != nullptr) cudaStreamSynchronize(stream);
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (stream != nullptr) cudaStreamDestroy(stream);
#endif
    ctx.reset();
    if (attach_id != 0) c.Detach(attach_id).IgnoreError();
#if defined(ARFUSE_DEMO_CUDA)
    if (cuda && base != nullptr) cudaFree(base);
    if (variants != nullptr) cudaFree(variants);
    if (history != nullptr) cudaFree(history);
#endif
  };
  auto fail = [&](absl::Status st) {
    cleanup();
    return st;
  };

  absl::Status st;
  if (cuda) {
#if defined(ARFUSE_DEMO_CUDA)
    int count = 0;
    cudaGetDeviceCount(&count);
    // The sidecar of this rank serves this GPU, and arfuse_attach checks that the current
    // context's device is the sidecar's: the allocations below make it current.
    st = CudaCheck(cudaSetDevice(count > 0 ? rank % count : 0), "cudaSetDevice");
    if (st.ok()) {
      st = CudaCheck(cudaMalloc(reinterpret_cast<void**>(&base), L.total), "cudaMalloc (tensors)");
    }
    if (st.ok()) {
      st = CudaCheck(cudaMalloc(reinterpret_cast<void**>(&variants), kDemoVariants * tbytes),
                     "cudaMalloc (variants)");
    }
    if (st.ok()) {
      st = CudaCheck(cudaMalloc(reinterpret_cast<void**>(&history), got.size()),
                     "cudaMalloc (history)");
    }
    if (st.ok()) {
      st = CudaCheck(cudaMemcpy(base, image.data(), image.size(), cudaMemcpyHostToDevice),
                     "cudaMemcpy (tensors)");
    }
    for (int k = 0; st.ok() && k < kDemoVariants; ++k) {
      st = CudaCheck(
          cudaMemcpy(variants + k * tbytes, inputs[k][rank].data(), tbytes, cudaMemcpyHostToDevice),
          "cudaMemcpy (variants)");
    }
    if (st.ok()) {
      st = CudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    }
#else
    st = absl::UnimplementedError("this arfuse-demo was built without CUDA");
#endif
  } else {
    host_mem.reset(static_cast<char*>(std::aligned_alloc(256, L.total)));
    base = host_mem.get();
    if (base == nullptr) {
      st = absl::ResourceExhaustedError("cannot allocate the tensors");
    } else {
      std::memcpy(base, image.data(), image.size());
    }
  }

  // Attach, and whether this rank can run the shape; then every rank's answer. A rank votes
  // even when it failed, so that its peers learn it at once instead of at --timeout.
  std::string why_not;
  bool declined = false;
  absl::Status hard;  // this rank's own failure (not a refusal): the row fails
  std::string path = "-";
  if (!st.ok()) {
    hard = st;
    why_not = st.ToString();
  } else {
    absl::StatusOr<instream::InStreamContext> a = client::AttachInStream(c, {s.hidden});
    if (!a.ok()) {
      why_not = absl::StrCat("attach refused: ", a.status().ToString());
      if (!absl::IsFailedPrecondition(a.status()) && !absl::IsUnavailable(a.status())) {
        hard = a.status();
      }
    } else {
      ctx.emplace(*std::move(a));
      absl::StatusOr<arfuse_ctx_info> info = ctx->Info();
      if (!info.ok()) {
        hard = info.status();
        why_not = info.status().ToString();
      } else {
        attach_id = info->attach_id;
        path = PathOf(*info, s, dt);
        absl::Status sup =
            ctx->Supports(Pattern::kAllReduceResidualRmsNorm, s.tokens, s.hidden, dt);
        if (instream::IsFusionUnavailable(sup)) {
          why_not = absl::StrCat("declined: ", sup.message());
          declined = absl::IsOutOfRange(sup);
        } else if (!sup.ok()) {
          hard = sup;
          why_not = sup.ToString();
        }
      }
    }
  }
  absl::StatusOr<std::string> agreed = Agree(
      dir, rank, world, absl::StrCat("instream-", s.tokens, "x", s.hidden), why_not, timeout_s);
  if (!hard.ok()) return fail(hard);
  if (!agreed.ok()) return fail(agreed.status());
  if (!agreed->empty()) {
    skipped->why = why_not.empty() ? *agreed : why_not;
    skipped->declined = declined;
    r.path = declined ? "declined" : "skipped";
    r.ok = true;
    cleanup();
    return r;
  }
  r.path = path;

  auto launch = [&](void* strm) {
    return ctx->FusedAllReduceResidualRmsNorm(strm, base + L.input, base + L.residual_in,
                                              base + L.residual_out, base + L.norm_out,
                                              base + L.gamma_off, s.tokens, s.hidden, dt, 1e-6f);
  };
  std::vector<double> us;
  us.reserve(std::max(iters, 1));
  if (!cuda) {
    // Host mode: each call runs the op in this thread with the peers' clients and returns when
    // its outputs are written (the stream is ignored).
    for (int i = 0; i < kDemoWarmup + iters; ++i) {
      const int k = i % kDemoVariants;
      std::memcpy(base + L.input, inputs[k][rank].data(), tbytes);
      const auto start = std::chrono::steady_clock::now();
      if (absl::Status op = launch(nullptr); !op.ok()) return fail(op);
      const auto end = std::chrono::steady_clock::now();
      if (i >= kDemoWarmup)
        us.push_back(std::chrono::duration<double, std::micro>(end - start).count());
      std::memcpy(got.data() + (2 * k) * tbytes, base + L.residual_out, tbytes);
      std::memcpy(got.data() + (2 * k + 1) * tbytes, base + L.norm_out, tbytes);
    }
  } else {
#if defined(ARFUSE_DEMO_CUDA)
    // One op outside capture (every rank makes the same launches in the same order), then the op
    // captured once and replayed: the input tensor is overwritten with another variant before
    // every replay and the outputs copied aside after it, outside the graph.
    st = launch(stream);
    if (st.ok()) st = CudaCheck(cudaStreamSynchronize(stream), "the first op");
    if (st.ok()) {
      st = CudaCheck(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
    }
    if (st.ok()) {
      const absl::Status captured = launch(stream);
      st = CudaCheck(cudaStreamEndCapture(stream, &graph), "end capture");
      if (st.ok()) st = captured;
    }
    if (st.ok()) st = CudaCheck(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    if (st.ok()) {
      absl::StatusOr<std::vector<double>> timed =
          ReplayVariants(exec, stream, base, L, variants, history, tbytes, iters);
      if (timed.ok()) {
        us = *std::move(timed);
      } else {
        st = timed.status();
      }
    }
    if (st.ok()) {
      st = CudaCheck(cudaMemcpy(got.data(), history, got.size(), cudaMemcpyDeviceToHost),
                     "download");
    }
    if (!st.ok()) return fail(st);
#endif
  }
  // The attachment's error word: a launch that failed on the device (a peer that did not arrive,
  // a stale generation, a poisoned workspace) wrote no outputs.
  uint32_t code = 0;
  if (absl::Status checked = ctx->Check(&code); !checked.ok()) {
    return fail(absl::Status(
        checked.code(), absl::StrCat("arfuse_check after the ops: ", arfuse_error_name(code), ": ",
                                     checked.message())));
  }
  r.us_per_op = Median(us);

  // Every variant's outputs against the CPU reference over every rank's inputs of that variant.
  bool ok = true;
  for (int k = 0; k < kDemoVariants; ++k) {
    std::vector<const void*> rank_inputs;
    for (auto& in : inputs[k]) rank_inputs.push_back(in.data());
    absl::StatusOr<bool> matched = MatchesReference(
        dt, world, s, rank_inputs, image.data() + L.residual_in, image.data() + L.gamma_off,
        got.data() + (2 * k) * tbytes, got.data() + (2 * k + 1) * tbytes, &r.max_error);
    if (!matched.ok()) return fail(matched.status());
    ok = ok && *matched;
  }
  r.ok = ok;
  if (!ok) r.error = "output differs from the CPU reference";
  cleanup();
  return r;
}

}  // namespace arfuse::demo
