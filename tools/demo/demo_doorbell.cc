#include "tools/demo/demo_doorbell.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/doorbell/doorbell.h"
#include "kernels/host/reference_op.h"
#include "tools/demo/demo_cuda.h"

namespace arfuse::demo {

using client::Client;
using client::OpDesc;
using client::TensorLoc;

absl::StatusOr<ShapeResult> RunDoorbellShape(Client& c, int rank, int world, const Shape& s,
                                             DType dt, int iters, DoorbellRefused* refused) {
  constexpr uint64_t kRingTimeoutNs = 20'000'000'000ull;  // a peer rank's client may be late
  ShapeResult r;
  r.shape = s;
  Layout L(s, dt);
  int count = 0;
  cudaGetDeviceCount(&count);
  const int device = count > 0 ? rank % count : 0;
  if (auto st = CudaCheck(cudaSetDevice(device), "cudaSetDevice"); !st.ok()) return st;
  auto cb = CudaBuffer::Create(L.total, device);
  if (!cb.ok()) return cb.status();
  std::unique_ptr<Buffer> buf = std::move(*cb);
  const uint64_t n = uint64_t{s.tokens} * s.hidden;
  const size_t tbytes = n * DTypeSize(dt);
  // inputs[k][q]: rank q's input of variant k.
  std::vector<std::vector<std::vector<char>>> inputs(
      kDemoVariants, std::vector<std::vector<char>>(world, std::vector<char>(tbytes)));
  for (int k = 0; k < kDemoVariants; ++k)
    for (int q = 0; q < world; ++q)
      for (uint64_t i = 0; i < n; ++i)
        StoreFromFloat(dt, inputs[k][q].data(), i, VariantInput(q, i, k));
  std::vector<char> host = RegionImage(L, s, dt, inputs[0][rank]);
  if (auto st = buf->Upload(host); !st.ok()) return st;
  auto region = buf->Register(c, absl::StrCat("doorbell-", s.tokens, "x", s.hidden));
  if (!region.ok()) return region.status();

  // Device memory the demo owns besides the registered region: this rank's input variants, and
  // the outputs of the last replay of each variant.
  char* variants = nullptr;
  char* history = nullptr;  // [variant][residual_out | norm_out]
  void* base = nullptr;
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  client::Plan plan;
  bool have_plan = false;
  auto cleanup = [&] {
    if (stream != nullptr) cudaStreamSynchronize(stream);
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (stream != nullptr) cudaStreamDestroy(stream);
    if (have_plan) c.DestroyPlan(plan).IgnoreError();
    if (base != nullptr) cudaIpcCloseMemHandle(base);
    if (variants != nullptr) cudaFree(variants);
    if (history != nullptr) cudaFree(history);
    c.Unregister(*region).IgnoreError();
  };
  auto fail = [&](absl::Status st) {
    cleanup();
    return st;
  };

  v1::CreatePlanRequest req;
  req.set_doorbell(true);
  v1::OpSpec* op = req.mutable_op();
  op->set_pattern(v1::PATTERN_ALLREDUCE_RESIDUAL_RMSNORM);
  op->set_dtype(static_cast<v1::DType>(dt));
  op->set_hidden(s.hidden);
  op->set_max_tokens(s.tokens);
  op->set_eps(1e-6f);
  auto ref = [&](v1::RegionRef* rr, uint64_t offset) {
    rr->set_region_id(region->id);
    rr->set_generation(region->generation);
    rr->set_offset(offset);
  };
  ref(op->mutable_input(), L.input);
  ref(op->mutable_residual_in(), L.residual_in);
  ref(op->mutable_residual_out(), L.residual_out);
  ref(op->mutable_norm_out(), L.norm_out);
  ref(op->mutable_gamma(), L.gamma_off);
  v1::CreatePlanResponse resp;
  {
    grpc::ClientContext ctx;
    c.PrepareContext(&ctx, absl::Seconds(30));
    grpc::Status gs = c.stub().CreatePlan(&ctx, req, &resp);
    if (!gs.ok()) {
      absl::Status st(static_cast<absl::StatusCode>(gs.error_code()), gs.error_message());
      if (absl::IsFailedPrecondition(st) && refused != nullptr) refused->why = gs.error_message();
      return fail(st);
    }
  }
  plan.id = resp.plan_id();
  plan.generation = resp.generation();
  have_plan = true;
  r.path = client::ExecPathName(resp.path());
  const v1::Doorbell& bell = resp.doorbell();
  if (bell.ipc_handle().size() != sizeof(cudaIpcMemHandle_t) ||
      bell.request_value() != kDoorbellRequest || bell.complete_value() != kDoorbellComplete ||
      bell.reset_value() != kDoorbellReset || bell.offset() % sizeof(DoorbellSlot) != 0) {
    return fail(absl::InternalError(
        absl::StrCat("the sidecar's Doorbell message does not match this client (handle of ",
                     bell.ipc_handle().size(), " bytes, offset ", bell.offset(), ", values ",
                     absl::Hex(bell.request_value()), "/", absl::Hex(bell.complete_value()), "/",
                     bell.reset_value(), ")")));
  }
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, bell.ipc_handle().data(), sizeof(handle));
  if (auto st = CudaCheck(PrepareDoorbellRing(), "loading the ring kernel"); !st.ok())
    return fail(st);
  if (auto st = CudaCheck(cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess),
                          "cudaIpcOpenMemHandle (doorbell block)");
      !st.ok()) {
    return fail(st);
  }
  DoorbellSlot* slot = reinterpret_cast<DoorbellSlot*>(static_cast<char*>(base) + bell.offset());

  absl::Status st =
      CudaCheck(cudaMalloc(reinterpret_cast<void**>(&variants), kDemoVariants * tbytes),
                "cudaMalloc (variants)");
  if (st.ok()) {
    st = CudaCheck(cudaMalloc(reinterpret_cast<void**>(&history), kDemoVariants * 2 * tbytes),
                   "cudaMalloc (history)");
  }
  for (int k = 0; st.ok() && k < kDemoVariants; ++k) {
    st = CudaCheck(
        cudaMemcpy(variants + k * tbytes, inputs[k][rank].data(), tbytes, cudaMemcpyHostToDevice),
        "cudaMemcpy (variants)");
  }
  if (st.ok()) st = CudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  // As libarfuse_ring does: GPU scope when this stream's device holds the slot.
  DoorbellScope scope = DoorbellScope::kSystem;
  if (st.ok()) st = CudaCheck(DoorbellRingScopeForSlot(slot, &scope), "doorbell ring scope");
  // The captured graph: one ring of s.tokens tokens on the client's stream.
  if (st.ok()) {
    st = CudaCheck(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
  }
  if (st.ok()) {
    const cudaError_t launched = LaunchDoorbellRing(slot, s.tokens, kRingTimeoutNs, stream, scope);
    st = CudaCheck(cudaStreamEndCapture(stream, &graph), "end capture");
    if (st.ok()) st = CudaCheck(launched, "LaunchDoorbellRing (captured)");
  }
  if (st.ok()) st = CudaCheck(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  if (!st.ok()) return fail(st);

  // The registered tensors, as this process sees them (the region is this client's allocation).
  char* dev = static_cast<char*>(static_cast<CudaBuffer*>(buf.get())->ptr());
  absl::StatusOr<std::vector<double>> us =
      ReplayVariants(exec, stream, dev, L, variants, history, tbytes, iters);
  if (!us.ok()) return fail(us.status());
  // The slot's sticky error says whether every ring was served (a 4-byte read, after replays).
  uint32_t slot_error = 0;
  st = CudaCheck(cudaMemcpy(&slot_error, &slot->error, sizeof(slot_error), cudaMemcpyDeviceToHost),
                 "reading the slot's error word");
  if (!st.ok()) return fail(st);
  if (slot_error != 0) {
    return fail(
        absl::InternalError(absl::StrCat("doorbell slot error ", DoorbellErrorName(slot_error))));
  }
  double total_us = 0;
  for (double t : *us) total_us += t;
  r.us_per_op = iters > 0 ? total_us / iters : 0;

  // Every variant's outputs against the CPU reference over every rank's inputs of that variant.
  std::vector<char> got(kDemoVariants * 2 * tbytes);
  st = CudaCheck(cudaMemcpy(got.data(), history, got.size(), cudaMemcpyDeviceToHost), "download");
  if (!st.ok()) return fail(st);
  bool ok = true;
  for (int k = 0; k < kDemoVariants; ++k) {
    std::vector<const void*> rank_inputs;
    for (auto& in : inputs[k]) rank_inputs.push_back(in.data());
    absl::StatusOr<bool> matched = MatchesReference(
        dt, world, s, rank_inputs, host.data() + L.residual_in, host.data() + L.gamma_off,
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
