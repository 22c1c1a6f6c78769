// arfuse-demo: starts N arfused sidecars and N client processes (one per rank), registers
// regions, runs the fused op for several shapes on the eager plane and, with --device=cuda, on
// the doorbell plane (a ring kernel captured in a CUDA graph, replayed with new inputs), checks
// every output against the CPU reference, and prints a table (shape, plane, path, us per op, max
// error). Exits non-zero on any wrong result or failed call.
//
//   arfuse-demo --ranks=2 --tokens=1,16,128 --hidden=1024,4096 [--device=host|cuda] [--json]
//               [--doorbell=auto|on|off]
//
// Client processes are this binary again, started with --client_rank (internal).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/cpp/client.h"
#include "kernels/cpu/reference_op.h"
#include "server/core/flags.h"
#include "server/core/json.h"
#include "server/core/version.h"
#if defined(ARFUSE_DEMO_CUDA)
#include <cuda_runtime_api.h>

#include "kernels/doorbell/doorbell.h"
#endif

ABSL_FLAG(int, ranks, 2, "Ranks (sidecars and client processes) to start.");
ABSL_FLAG(std::string, tokens, "1,16,128", "Token counts to run, comma-separated.");
ABSL_FLAG(std::string, hidden, "1024,4096",
          "Hidden sizes to run (multiples of 8), comma-separated.");
ABSL_FLAG(std::string, dtype, "bf16", "bf16, fp16 or fp32.");
ABSL_FLAG(std::string, device, "", "host or cuda; default cuda when a GPU is present, else host.");
ABSL_FLAG(bool, json, false, "Print JSON instead of the table.");
ABSL_FLAG(std::string, arfused, "", "Path of the arfused binary (default: next to this build).");
ABSL_FLAG(std::string, backend, "auto",
          "Passed to the sidecars as --flashinfer-allreduce-fusion-backend (auto, trtllm, mnnvl; "
          "empty: unset, fusion off unless auto-enabled).");
ABSL_FLAG(int, iters, 20, "Timed ops per shape (after 3 warm-up ops).");
ABSL_FLAG(double, timeout, 120, "Seconds the whole demo may take before it gives up.");
ABSL_FLAG(std::string, doorbell, "auto",
          "--device=cuda: also run every shape on the doorbell plane. auto: a sidecar that refuses "
          "the doorbell (FAILED_PRECONDITION, e.g. fusion off) shows the row as skipped; on: a "
          "refusal fails the demo; off: eager plane only.");
ABSL_FLAG(int, client_rank, -1, "Internal: run as the client process of this rank.");
ABSL_FLAG(std::string, work_dir, "", "Internal: the run's directory (sockets, peers, results).");

namespace arfuse::demo {
namespace {

using client::Client;
using client::ClientOptions;
using client::OpDesc;
using client::TensorLoc;

struct Shape {
  uint32_t tokens;
  uint32_t hidden;
};

absl::StatusOr<std::vector<uint32_t>> ParseList(const std::string& s, const char* what) {
  std::vector<uint32_t> out;
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    uint32_t v = 0;
    if (!absl::SimpleAtoi(part, &v) || v == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", what, ": \"", std::string(part), "\" is not a positive integer"));
    }
    out.push_back(v);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("--", what, " is empty"));
  return out;
}

absl::StatusOr<DType> ParseDType(const std::string& s) {
  if (s == "bf16") return DType::kBF16;
  if (s == "fp16") return DType::kFP16;
  if (s == "fp32") return DType::kFP32;
  return absl::InvalidArgumentError("--dtype must be bf16, fp16 or fp32");
}

// Inputs every process can regenerate for every rank: small multiples of 1/8, exact in bf16.
float InputValue(int rank, uint64_t i) { return float(int((i * 7 + rank * 13) % 17) - 8) / 8.0f; }
float ResidualValue(uint64_t i) { return float(int((i * 5) % 11) - 5) / 4.0f; }
float GammaValue(uint64_t h) { return 0.5f + float(h % 9) / 8.0f; }

std::string SocketOf(const std::string& dir, int rank) {
  return absl::StrCat(dir, "/rank", rank, ".sock");
}

// ---------------------------------------------------------------- client process

// Memory for one shape: input | residual_in | residual_out | norm_out | gamma, each 256-aligned.
struct Layout {
  uint64_t tensor = 0, gamma = 0;
  uint64_t input = 0, residual_in = 0, residual_out = 0, norm_out = 0, gamma_off = 0, total = 0;
  Layout(const Shape& s, DType dt) {
    auto up = [](uint64_t v) { return (v + 255) / 256 * 256; };
    tensor = up(uint64_t{s.tokens} * s.hidden * DTypeSize(dt));
    gamma = up(uint64_t{s.hidden} * DTypeSize(dt));
    residual_in = tensor;
    residual_out = 2 * tensor;
    norm_out = 3 * tensor;
    gamma_off = 4 * tensor;
    total = 4 * tensor + gamma;
  }
};

// Device memory for --device=cuda (a plain cudaMalloc, exported by IPC), host memory otherwise.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual absl::StatusOr<client::Region> Register(Client& c, const std::string& name) = 0;
  virtual absl::Status Upload(const std::vector<char>& host) = 0;
  virtual absl::Status Download(std::vector<char>& host) = 0;
};

class HostBuffer final : public Buffer {
 public:
  explicit HostBuffer(client::HostShmBuffer b) : b_(std::move(b)) {}
  absl::StatusOr<client::Region> Register(Client& c, const std::string& name) override {
    return c.RegisterHostBuffer(name, b_);
  }
  absl::Status Upload(const std::vector<char>& host) override {
    std::memcpy(b_.data(), host.data(), host.size());
    return absl::OkStatus();
  }
  absl::Status Download(std::vector<char>& host) override {
    std::memcpy(host.data(), b_.data(), host.size());
    return absl::OkStatus();
  }

 private:
  client::HostShmBuffer b_;
};

#if defined(ARFUSE_DEMO_CUDA)
class CudaBuffer final : public Buffer {
 public:
  static absl::StatusOr<std::unique_ptr<Buffer>> Create(uint64_t bytes, int device) {
    auto b = std::unique_ptr<CudaBuffer>(new CudaBuffer());
    b->device_ = device;
    b->bytes_ = bytes;
    if (cudaSetDevice(device) != cudaSuccess || cudaMalloc(&b->ptr_, bytes) != cudaSuccess) {
      return absl::ResourceExhaustedError("cudaMalloc failed");
    }
    cudaIpcMemHandle_t h;
    if (cudaIpcGetMemHandle(&h, b->ptr_) != cudaSuccess) {
      return absl::InternalError("cudaIpcGetMemHandle failed");
    }
    b->handle_.assign(reinterpret_cast<const char*>(&h), sizeof(h));
    return std::unique_ptr<Buffer>(std::move(b));
  }
  ~CudaBuffer() override {
    if (ptr_) cudaFree(ptr_);
  }
  void* ptr() const { return ptr_; }
  absl::StatusOr<client::Region> Register(Client& c, const std::string& name) override {
    return c.RegisterCudaIpc(name, handle_, device_, bytes_);
  }
  absl::Status Upload(const std::vector<char>& host) override {
    return cudaMemcpy(ptr_, host.data(), host.size(), cudaMemcpyHostToDevice) == cudaSuccess
               ? absl::OkStatus()
               : absl::InternalError("cudaMemcpy H2D failed");
  }
  absl::Status Download(std::vector<char>& host) override {
    return cudaMemcpy(host.data(), ptr_, host.size(), cudaMemcpyDeviceToHost) == cudaSuccess
               ? absl::OkStatus()
               : absl::InternalError("cudaMemcpy D2H failed");
  }

 private:
  CudaBuffer() = default;
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;
  int device_ = 0;
  std::string handle_;
};
#endif

struct ShapeResult {
  Shape shape;
  std::string path = "-";
  double us_per_op = 0;
  double max_error = 0;
  bool ok = false;
  std::string error;
};

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
  std::vector<char> host(L.total, 0);
  std::vector<std::vector<char>> inputs(world, std::vector<char>(n * DTypeSize(dt)));
  for (int q = 0; q < world; ++q) {
    for (uint64_t i = 0; i < n; ++i) StoreFromFloat(dt, inputs[q].data(), i, InputValue(q, i));
  }
  std::memcpy(host.data() + L.input, inputs[rank].data(), inputs[rank].size());
  for (uint64_t i = 0; i < n; ++i)
    StoreFromFloat(dt, host.data() + L.residual_in, i, ResidualValue(i));
  for (uint64_t h = 0; h < s.hidden; ++h)
    StoreFromFloat(dt, host.data() + L.gamma_off, h, GammaValue(h));
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
  std::vector<char> want_res(n * DTypeSize(dt)), want_norm(n * DTypeSize(dt));
  CpuOpArgs ref;
  ref.pattern = Pattern::kAllReduceResidualRmsNorm;
  ref.dtype = dt;
  ref.world_size = world;
  ref.hidden = s.hidden;
  ref.num_tokens = s.tokens;
  ref.eps = 1e-6f;
  ref.rank_inputs = rank_inputs.data();
  ref.residual_in = host.data() + L.residual_in;
  ref.residual_out = want_res.data();
  ref.norm_out = want_norm.data();
  ref.gamma = host.data() + L.gamma_off;
  if (auto st = ReferenceFusedOp(ref); !st.ok()) return st;
  // residual_out is bit-exact on every path; norm_out within two units of the dtype's last place.
  const double tol = dt == DType::kFP32 ? 1e-5 : (dt == DType::kFP16 ? 2e-3 : 1.6e-2);
  bool ok = true;
  for (uint64_t i = 0; i < n; ++i) {
    float got_r = LoadAsFloat(dt, host.data() + L.residual_out, i);
    float exp_r = LoadAsFloat(dt, want_res.data(), i);
    float got_n = LoadAsFloat(dt, host.data() + L.norm_out, i);
    float exp_n = LoadAsFloat(dt, want_norm.data(), i);
    double er = std::fabs(double(got_r) - exp_r);
    double en = std::fabs(double(got_n) - exp_n);
    r.max_error = std::max({r.max_error, er, en});
    if (er != 0 || !(en <= tol * std::max(1.0, std::fabs(double(exp_n))))) ok = false;
  }
  r.ok = ok;
  if (!ok) r.error = "output differs from the CPU reference";
  c.DestroyPlan(*plan).IgnoreError();
  c.Unregister(*region).IgnoreError();
  return r;
}

#if defined(ARFUSE_DEMO_CUDA)
// ---------------------------------------------------------------- doorbell plane (CUDA)

absl::Status CudaCheck(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

// A failed doorbell CreatePlan that --doorbell=auto shows as skipped.
struct DoorbellRefused {
  std::string why;
};

// Inputs of replay variant k: other small multiples of 1/8 than the eager rows'.
float VariantInput(int rank, uint64_t i, int k) { return InputValue(rank + 3 * k, i); }

// The same shape on the doorbell plane: CreatePlan{doorbell}, the slot opened by CUDA IPC, one
// ring kernel captured in a CUDA graph on this client's stream and replayed 3 + iters times; the
// input tensor is overwritten with another variant before every replay (outside the graph),
// and the outputs of the last replay of each variant are kept and checked against the CPU
// reference. us per op: CUDA events around each timed replay (the ring's whole round trip: the
// sidecar's waiter, the fused op with its peers, the completion).
absl::StatusOr<ShapeResult> RunDoorbellShape(Client& c, int rank, int world, const Shape& s,
                                             DType dt, int iters, DoorbellRefused* refused) {
  constexpr int kVariants = 3;
  constexpr int kWarmup = 3;
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
      kVariants, std::vector<std::vector<char>>(world, std::vector<char>(tbytes)));
  for (int k = 0; k < kVariants; ++k)
    for (int q = 0; q < world; ++q)
      for (uint64_t i = 0; i < n; ++i)
        StoreFromFloat(dt, inputs[k][q].data(), i, VariantInput(q, i, k));
  std::vector<char> host(L.total, 0);
  std::memcpy(host.data() + L.input, inputs[0][rank].data(), tbytes);
  for (uint64_t i = 0; i < n; ++i)
    StoreFromFloat(dt, host.data() + L.residual_in, i, ResidualValue(i));
  for (uint64_t h = 0; h < s.hidden; ++h)
    StoreFromFloat(dt, host.data() + L.gamma_off, h, GammaValue(h));
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
  std::vector<cudaEvent_t> events;
  client::Plan plan;
  bool have_plan = false;
  auto cleanup = [&] {
    if (stream != nullptr) cudaStreamSynchronize(stream);
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
    for (cudaEvent_t e : events) cudaEventDestroy(e);
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

  absl::Status st = CudaCheck(cudaMalloc(reinterpret_cast<void**>(&variants), kVariants * tbytes),
                              "cudaMalloc (variants)");
  if (st.ok()) {
    st = CudaCheck(cudaMalloc(reinterpret_cast<void**>(&history), kVariants * 2 * tbytes),
                   "cudaMalloc (history)");
  }
  for (int k = 0; st.ok() && k < kVariants; ++k) {
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
  events.resize(2 * static_cast<size_t>(iters), nullptr);
  for (size_t i = 0; st.ok() && i < events.size(); ++i) {
    st = CudaCheck(cudaEventCreate(&events[i]), "cudaEventCreate");
  }
  if (!st.ok()) return fail(st);

  // The registered tensors, as this process sees them (the region is this client's allocation).
  char* dev = static_cast<char*>(static_cast<CudaBuffer*>(buf.get())->ptr());
  for (int i = 0; st.ok() && i < kWarmup + iters; ++i) {
    const int k = i % kVariants;
    const int t = i - kWarmup;  // timed replay index, < 0 for warm-up
    st = CudaCheck(cudaMemcpyAsync(dev + L.input, variants + k * tbytes, tbytes,
                                   cudaMemcpyDeviceToDevice, stream),
                   "input update");
    if (st.ok() && t >= 0) st = CudaCheck(cudaEventRecord(events[2 * t], stream), "event");
    if (st.ok()) st = CudaCheck(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    if (st.ok() && t >= 0) st = CudaCheck(cudaEventRecord(events[2 * t + 1], stream), "event");
    if (st.ok()) {
      st = CudaCheck(cudaMemcpyAsync(history + (2 * k) * tbytes, dev + L.residual_out, tbytes,
                                     cudaMemcpyDeviceToDevice, stream),
                     "output copy");
    }
    if (st.ok()) {
      st = CudaCheck(cudaMemcpyAsync(history + (2 * k + 1) * tbytes, dev + L.norm_out, tbytes,
                                     cudaMemcpyDeviceToDevice, stream),
                     "output copy");
    }
  }
  if (st.ok()) st = CudaCheck(cudaStreamSynchronize(stream), "replays");
  if (!st.ok()) return fail(st);
  // The slot's sticky error says whether every ring was served (a 4-byte read, after replays).
  uint32_t slot_error = 0;
  st = CudaCheck(cudaMemcpy(&slot_error, &slot->error, sizeof(slot_error), cudaMemcpyDeviceToHost),
                 "reading the slot's error word");
  if (!st.ok()) return fail(st);
  if (slot_error != 0) {
    return fail(
        absl::InternalError(absl::StrCat("doorbell slot error ", DoorbellErrorName(slot_error))));
  }
  double total_ms = 0;
  for (int t = 0; t < iters; ++t) {
    float ms = 0;
    cudaEventElapsedTime(&ms, events[2 * t], events[2 * t + 1]);
    total_ms += ms;
  }
  r.us_per_op = iters > 0 ? total_ms * 1e3 / iters : 0;

  // Every variant's outputs against the CPU reference over every rank's inputs of that variant.
  std::vector<char> got(kVariants * 2 * tbytes);
  st = CudaCheck(cudaMemcpy(got.data(), history, got.size(), cudaMemcpyDeviceToHost), "download");
  if (!st.ok()) return fail(st);
  const double tol = dt == DType::kFP32 ? 1e-5 : (dt == DType::kFP16 ? 2e-3 : 1.6e-2);
  bool ok = true;
  for (int k = 0; k < kVariants; ++k) {
    std::vector<const void*> rank_inputs;
    for (auto& in : inputs[k]) rank_inputs.push_back(in.data());
    std::vector<char> want_res(tbytes), want_norm(tbytes);
    CpuOpArgs cref;
    cref.pattern = Pattern::kAllReduceResidualRmsNorm;
    cref.dtype = dt;
    cref.world_size = world;
    cref.hidden = s.hidden;
    cref.num_tokens = s.tokens;
    cref.eps = 1e-6f;
    cref.rank_inputs = rank_inputs.data();
    cref.residual_in = host.data() + L.residual_in;
    cref.residual_out = want_res.data();
    cref.norm_out = want_norm.data();
    cref.gamma = host.data() + L.gamma_off;
    if (auto rs = ReferenceFusedOp(cref); !rs.ok()) return fail(rs);
    const char* got_res = got.data() + (2 * k) * tbytes;
    const char* got_norm = got.data() + (2 * k + 1) * tbytes;
    for (uint64_t i = 0; i < n; ++i) {
      const double er =
          std::fabs(double(LoadAsFloat(dt, got_res, i)) - LoadAsFloat(dt, want_res.data(), i));
      const float exp_n = LoadAsFloat(dt, want_norm.data(), i);
      const double en = std::fabs(double(LoadAsFloat(dt, got_norm, i)) - exp_n);
      r.max_error = std::max({r.max_error, er, en});
      if (er != 0 || !(en <= tol * std::max(1.0, std::fabs(double(exp_n))))) ok = false;
    }
  }
  r.ok = ok;
  if (!ok) r.error = "output differs from the CPU reference";
  cleanup();
  return r;
}
#endif

int ClientMain(int rank) {
  const std::string dir = absl::GetFlag(FLAGS_work_dir);
  const int world = absl::GetFlag(FLAGS_ranks);
  const bool cuda = absl::GetFlag(FLAGS_device) == "cuda";
  auto dt = ParseDType(absl::GetFlag(FLAGS_dtype));
  auto tokens = ParseList(absl::GetFlag(FLAGS_tokens), "tokens");
  auto hidden = ParseList(absl::GetFlag(FLAGS_hidden), "hidden");
  std::ofstream out(absl::StrCat(dir, "/result.", rank));
  auto fail = [&](const absl::Status& s) {
    out << "error " << s.ToString() << "\n";
    std::cerr << "rank " << rank << ": " << s << "\n";
    return 1;
  };
  if (!dt.ok()) return fail(dt.status());
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
  int rc = 0;
  for (uint32_t t : *tokens) {
    for (uint32_t h : *hidden) {
      auto r = RunShape(**c, rank, world, Shape{t, h}, *dt, cuda, absl::GetFlag(FLAGS_iters));
      if (!r.ok()) {
        out << "shape " << t << " " << h << " - 0 0 0 " << r.status().ToString() << "\n";
        rc = 1;
        continue;
      }
      out << "shape " << t << " " << h << " " << r->path << " " << r->us_per_op << " "
          << r->max_error << " " << (r->ok ? 1 : 0) << " " << r->error << "\n";
      if (!r->ok) rc = 1;
#if defined(ARFUSE_DEMO_CUDA)
      const std::string doorbell = absl::GetFlag(FLAGS_doorbell);
      if (cuda && doorbell != "off") {
        DoorbellRefused refused;
        auto d = RunDoorbellShape(**c, rank, world, Shape{t, h}, *dt, absl::GetFlag(FLAGS_iters),
                                  &refused);
        if (!d.ok() && !refused.why.empty() && doorbell == "auto") {
          out << "doorbell " << t << " " << h << " skipped 0 0 1 refused: " << refused.why << "\n";
        } else if (!d.ok()) {
          out << "doorbell " << t << " " << h << " - 0 0 0 " << d.status().ToString() << "\n";
          rc = 1;
        } else {
          out << "doorbell " << t << " " << h << " " << d->path << " " << d->us_per_op << " "
              << d->max_error << " " << (d->ok ? 1 : 0) << " " << d->error << "\n";
          if (!d->ok) rc = 1;
        }
      }
#endif
    }
  }
  return rc;
}

// ---------------------------------------------------------------- parent

std::string FindArfused(const char* argv0) {
  std::string flag = absl::GetFlag(FLAGS_arfused);
  if (!flag.empty()) return flag;
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    // build/client/demo/arfuse-demo -> build/server/daemon/arfused
    auto p = self.parent_path().parent_path().parent_path() / "server" / "daemon" / "arfused";
    if (std::filesystem::exists(p)) return p.string();
    auto q = self.parent_path() / "arfused";
    if (std::filesystem::exists(q)) return q.string();
  }
  (void)argv0;
  return "arfused";  // from PATH
}

pid_t Spawn(const std::vector<std::string>& args, const std::string& log) {
  pid_t pid = fork();
  if (pid == 0) {
    if (!log.empty()) {
      FILE* f = std::freopen(log.c_str(), "w", stderr);
      (void)f;
      dup2(fileno(stderr), STDOUT_FILENO);
    }
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    std::perror("exec");
    _exit(127);
  }
  return pid;
}

// The exit code of `pid` if it has ended (reaping it), nullopt while it runs.
std::optional<int> Reap(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, WNOHANG) != pid) return std::nullopt;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Waits for `pid` until `until`; returns the exit code, or -1 on timeout.
int WaitUntil(pid_t pid, absl::Time until) {
  for (;;) {
    if (std::optional<int> code = Reap(pid)) return *code;
    if (absl::Now() > until) return -1;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

std::string DefaultDevice() {
#if defined(ARFUSE_DEMO_CUDA)
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) return "cuda";
#endif
  return "host";
}

int ParentMain(const char* argv0) {
  const int ranks = absl::GetFlag(FLAGS_ranks);
  std::string device = absl::GetFlag(FLAGS_device);
  if (device.empty()) device = DefaultDevice();
  if (device != "host" && device != "cuda") {
    std::cerr << "--device must be host or cuda\n";
    return 2;
  }
  auto tokens = ParseList(absl::GetFlag(FLAGS_tokens), "tokens");
  auto hidden = ParseList(absl::GetFlag(FLAGS_hidden), "hidden");
  auto dt = ParseDType(absl::GetFlag(FLAGS_dtype));
  for (const absl::Status& s : {tokens.status(), hidden.status(), dt.status()}) {
    if (!s.ok()) {
      std::cerr << s.message() << "\n";
      return 2;
    }
  }
  if (ranks < 1 || ranks > kMaxWorldSize) {
    std::cerr << "--ranks must be 1.." << kMaxWorldSize << "\n";
    return 2;
  }
  char tmpl[] = "/tmp/arfuse-demo-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::string dir = tmpl;
  std::filesystem::create_directories(dir + "/peers");
  const std::string arfused = FindArfused(argv0);
  const uint32_t max_t = *std::max_element(tokens->begin(), tokens->end());
  const uint32_t max_h = *std::max_element(hidden->begin(), hidden->end());
  const absl::Time until = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_timeout));

  std::vector<pid_t> sidecars, clients;
  for (int r = 0; r < ranks; ++r) {
    sidecars.push_back(Spawn(
        {arfused, "--device=" + device, absl::StrCat("--rank=", r),
         absl::StrCat("--world-size=", ranks), "--peer-dir=" + dir + "/peers",
         "--socket=" + SocketOf(dir, r), "--health-port=0", absl::StrCat("--max-tokens=", max_t),
         absl::StrCat("--hidden=", max_h), "--dtype=" + absl::GetFlag(FLAGS_dtype),
         "--log-level=info", absl::StrCat("--spin-timeout=", 5),
         absl::GetFlag(FLAGS_backend).empty()
             ? std::string("--enable-deterministic-inference=false")
             : "--flashinfer-allreduce-fusion-backend=" + absl::GetFlag(FLAGS_backend)},
        absl::StrCat(dir, "/arfused.", r, ".log")));
  }
  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  for (int r = 0; r < ranks; ++r) {
    clients.push_back(
        Spawn({self, absl::StrCat("--client_rank=", r), "--work_dir=" + dir,
               absl::StrCat("--ranks=", ranks), "--device=" + device,
               "--tokens=" + absl::GetFlag(FLAGS_tokens), "--hidden=" + absl::GetFlag(FLAGS_hidden),
               "--dtype=" + absl::GetFlag(FLAGS_dtype),
               absl::StrCat("--iters=", absl::GetFlag(FLAGS_iters)),
               "--doorbell=" + absl::GetFlag(FLAGS_doorbell),
               absl::StrCat("--timeout=", absl::GetFlag(FLAGS_timeout))},
              ""));
  }
  // Wait for the clients. A sidecar that exits first (it cannot serve: a GPU it cannot use, a bad
  // flag) ends the wait at once: its clients would otherwise wait for it until --timeout.
  int rc = 0;
  std::vector<std::optional<int>> client_codes(clients.size()), sidecar_codes(sidecars.size());
  std::string sidecar_gone;
  auto clients_left = [&] {
    return std::count(client_codes.begin(), client_codes.end(), std::nullopt) > 0;
  };
  while (clients_left() && sidecar_gone.empty() && absl::Now() <= until) {
    for (size_t i = 0; i < clients.size(); ++i) {
      if (!client_codes[i]) client_codes[i] = Reap(clients[i]);
    }
    for (size_t r = 0; r < sidecars.size() && sidecar_gone.empty(); ++r) {
      sidecar_codes[r] = Reap(sidecars[r]);
      if (sidecar_codes[r] && clients_left()) {
        sidecar_gone = absl::StrCat("sidecar ", r, " exited with code ", *sidecar_codes[r],
                                    " before its clients finished (its log is below)");
      }
    }
    if (clients_left()) absl::SleepFor(absl::Milliseconds(20));
  }
  for (size_t i = 0; i < clients.size(); ++i) {
    if (client_codes[i]) {
      if (*client_codes[i] != 0) rc = 1;
      continue;
    }
    rc = 1;
    std::cerr << (sidecar_gone.empty() ? "a client did not finish within --timeout"
                                       : "a client's sidecar exited")
              << "; stopping it\n";
    kill(clients[i], SIGKILL);
    WaitUntil(clients[i], absl::Now() + absl::Seconds(5));
  }
  if (!sidecar_gone.empty()) std::cerr << "arfuse-demo: " << sidecar_gone << "\n";
  for (size_t r = 0; r < sidecars.size(); ++r) {
    if (!sidecar_codes[r]) kill(sidecars[r], SIGTERM);
  }
  for (size_t r = 0; r < sidecars.size(); ++r) {
    if (sidecar_codes[r]) continue;
    if (WaitUntil(sidecars[r], absl::Now() + absl::Seconds(15)) == -1) {
      kill(sidecars[r], SIGKILL);
      WaitUntil(sidecars[r], absl::Now() + absl::Seconds(5));
    }
  }

  // Gather: one row per shape, worst case over ranks.
  struct Row {
    uint32_t t = 0, h = 0;
    std::string path;
    double us = 0, err = 0;
    bool ok = true;
    int seen = 0;
    std::string why;
  };
  std::vector<Row> rows;
  for (uint32_t t : *tokens)
    for (uint32_t h : *hidden) {
      Row row;
      row.t = t;
      row.h = h;
      row.path = "-";
      rows.push_back(row);
    }
  // The doorbell plane's rows (CUDA), one per shape as well.
  const std::string doorbell = absl::GetFlag(FLAGS_doorbell);
  const bool doorbell_rows = device == "cuda" && doorbell != "off";
  std::vector<Row> drows = doorbell_rows ? rows : std::vector<Row>();
  std::vector<std::string> errors;
  for (int r = 0; r < ranks; ++r) {
    std::ifstream in(absl::StrCat(dir, "/result.", r));
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      std::string kind;
      ls >> kind;
      if (kind == "error") {
        errors.push_back(absl::StrCat("rank ", r, ": ", line.substr(6)));
        continue;
      }
      if (kind == "doorbell") {
        Row got;
        int ok = 0;
        ls >> got.t >> got.h >> got.path >> got.us >> got.err >> ok;
        std::getline(ls, got.why);
        for (Row& row : drows) {
          if (row.t != got.t || row.h != got.h) continue;
          row.seen++;
          row.path = got.path;
          row.us = std::max(row.us, got.us);
          row.err = std::max(row.err, got.err);
          if (!ok || got.path == "skipped") row.why = absl::StrCat("rank ", r, ":", got.why);
          if (!ok) row.ok = false;
        }
        continue;
      }
      Row got;
      int ok = 0;
      ls >> got.t >> got.h >> got.path >> got.us >> got.err >> ok;
      std::getline(ls, got.why);
      for (Row& row : rows) {
        if (row.t != got.t || row.h != got.h) continue;
        row.seen++;
        row.path = got.path;
        row.us = std::max(row.us, got.us);
        row.err = std::max(row.err, got.err);
        if (!ok) {
          row.ok = false;
          row.why = absl::StrCat("rank ", r, ":", got.why);
        }
      }
    }
  }
  for (Row& row : drows) {
    if (row.seen != ranks) {
      row.ok = false;
      if (row.why.empty()) row.why = absl::StrCat(row.seen, " of ", ranks, " ranks reported");
    }
    if (!row.ok) rc = 1;
  }
  for (Row& row : rows) {
    if (row.seen != ranks) {
      row.ok = false;
      if (row.why.empty()) row.why = absl::StrCat(row.seen, " of ", ranks, " ranks reported");
    }
    if (!row.ok) rc = 1;
  }
  if (!errors.empty()) rc = 1;
  const char* dname = DTypeName(*dt);
  if (absl::GetFlag(FLAGS_json)) {
    std::vector<std::string> items;
    for (const Row& row : rows) {
      // JsonNumber: a NaN error (a rank's output not a number) is null, not printf's "nan".
      items.push_back(absl::StrFormat(
          "{\"tokens\":%u,\"hidden\":%u,\"dtype\":%s,\"plane\":\"eager\",\"path\":%s,"
          "\"us_per_op\":%s,\"max_error\":%s,\"ok\":%s}",
          row.t, row.h, JsonQuote(dname), JsonQuote(row.path), JsonNumber(row.us, 2),
          JsonNumber(row.err, 3, 'g'), JsonBool(row.ok)));
    }
    for (const Row& row : drows) {
      items.push_back(absl::StrFormat(
          "{\"tokens\":%u,\"hidden\":%u,\"dtype\":%s,\"plane\":\"doorbell\",\"path\":%s,"
          "\"us_per_op\":%s,\"max_error\":%s,\"ok\":%s,\"skipped\":%s}",
          row.t, row.h, JsonQuote(dname), JsonQuote(row.path), JsonNumber(row.us, 2),
          JsonNumber(row.err, 3, 'g'), JsonBool(row.ok), JsonBool(row.path == "skipped")));
    }
    std::cout << absl::StrFormat("{\"device\":%s,\"ranks\":%d,\"results\":[%s],\"ok\":%s}\n",
                                 JsonQuote(device), ranks, absl::StrJoin(items, ","),
                                 JsonBool(rc == 0));
  } else {
    std::cout << absl::StrFormat(
        "arfuse-demo: device=%s ranks=%d dtype=%s (%s)\n", device, ranks, dname,
        device != "cuda" ? "doorbell plane: needs --device=cuda"
        : doorbell_rows  ? "planes: eager, doorbell (ring kernel captured in a CUDA graph)"
                         : "doorbell plane: off");
    std::cout << absl::StrFormat("%-14s %-8s %-8s %10s %10s  %s\n", "shape", "plane", "path",
                                 "us/op", "max err", "result");
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& row = rows[i];
      std::cout << absl::StrFormat("%-14s %-8s %-8s %10.1f %10.3g  %s\n",
                                   absl::StrCat(row.t, "x", row.h), "eager", row.path, row.us,
                                   row.err, row.ok ? "ok" : "FAIL " + row.why);
      if (i < drows.size()) {
        const Row& d = drows[i];
        std::cout << absl::StrFormat(
            "%-14s %-8s %-8s %10.1f %10.3g  %s\n", absl::StrCat(d.t, "x", d.h), "doorbell", d.path,
            d.us, d.err,
            !d.ok ? "FAIL " + d.why
                  : (d.path == "skipped" ? absl::StrCat("skipped (", d.why, ")")
                                         : std::string("ok")));
      }
    }
  }
  for (const std::string& e : errors) std::cerr << e << "\n";
  if (rc != 0) {
    // The sidecars' last lines usually say why (peers, workspace, NCCL).
    for (int r = 0; r < ranks; ++r) {
      std::ifstream log(absl::StrCat(dir, "/arfused.", r, ".log"));
      std::vector<std::string> lines;
      for (std::string line; std::getline(log, line);) lines.push_back(line);
      size_t from = lines.size() > 8 ? lines.size() - 8 : 0;
      for (size_t i = from; i < lines.size(); ++i) {
        std::cerr << "arfused." << r << ": " << lines[i].substr(0, 300) << "\n";
      }
    }
    std::cerr << "arfuse-demo: FAILED; sidecar logs kept in " << dir << "\n";
  } else {
    std::filesystem::remove_all(dir);
  }
  return rc;
}

}  // namespace

const flags::FlagSet& DemoFlags() {
  static const flags::FlagSet set(
      "arfuse-demo", {"ranks", "tokens", "hidden", "dtype", "device", "json", "arfused", "backend",
                      "iters", "timeout", "doorbell", "client_rank", "work_dir"});
  return set;
}

std::string Usage() {
  std::string out = absl::StrCat(
      "arfuse-demo: ", absl::ProgramUsageMessage(),
      "\nusage: arfuse-demo [--flag=value ...]\n\n"
      "Starts --ranks arfused sidecars and one client process per rank, runs every --tokens x\n"
      "--hidden shape on the eager plane (and, with --device=cuda, the doorbell plane), checks\n"
      "every output against the CPU reference and prints a table. Exits non-zero on any wrong\n"
      "result or failed call.\n\nflags:\n");
  // The demo's flags, by name; the internal ones (a client process's) are left out.
  std::vector<absl::CommandLineFlag*> flags;
  for (const std::string& name : DemoFlags().names()) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag != nullptr && !absl::StartsWith(flag->Help(), "Internal:")) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(), [](auto* a, auto* b) { return a->Name() < b->Name(); });
  for (const absl::CommandLineFlag* f : flags) {
    const std::string def = f->DefaultValue();
    absl::StrAppend(&out, "  --", f->Name(), "  (default: ", def.empty() ? "unset" : def,
                    ")\n      ", f->Help(), "\n");
  }
  return out;
}

}  // namespace arfuse::demo

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Runs the fused allreduce + residual + RMSNorm through N arfused sidecars and checks it.");
  // --help and --version before the flags are parsed, so that they answer whatever else is given.
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h" || arg == "--helpfull") {
      std::fputs(arfuse::demo::Usage().c_str(), stdout);
      return 0;
    }
    if (arg == "--version") {
      std::printf("%s\n", arfuse::VersionLine("arfuse-demo").c_str());
      return 0;
    }
  }
  if (absl::StatusOr<std::vector<arfuse::flags::GivenFlag>> given =
          arfuse::demo::DemoFlags().Parse(argc, argv);
      !given.ok()) {
    std::fprintf(stderr, "arfuse-demo: %s\n", std::string(given.status().message()).c_str());
    return 1;
  }
  signal(SIGPIPE, SIG_IGN);
  int rank = absl::GetFlag(FLAGS_client_rank);
  if (rank >= 0) return arfuse::demo::ClientMain(rank);
  return arfuse::demo::ParentMain(argv[0]);
}
