// arfuse-bench sidecar: the sidecar's data planes per op, each against its yardstick measured in
// the same run (design.md §7, issue 5 item 8).
//
//   arfuse-bench sidecar [--ranks=2] [--device=host|cuda] [--tokens=1,16,128] [--hidden=4096]
//                        [--iters=2000] [--warmup=200] [--block=50] [--graph_ops=100]
//                        [--repeats=15]
//                        [--compute_us=20] [--json=arfuse-bench-sidecar.json] [--arfused=PATH]
//                        [--backend=auto] [--ring_lib=PATH] [--timeout=600]
//
// Starts --ranks arfused sidecars (as arfuse-demo does: one per rank, rank r on GPU r % GPUs, so
// ranks share a GPU when there are fewer GPUs than ranks; run MPS then) and one client process
// per rank (this binary again, with --client_rank). Every client, per shape:
//
//   echo         grpc.health.v1 Health.Check on the sidecar's socket, over the same channel and
//                with the same metadata and deadline as Execute: the bare gRPC round trip.
//   eager        Fusion.Execute of a plan, client-side time per call. CUDA: the client records an
//                interprocess event on its stream and sends it as wait_event, the sidecar replies
//                after the enqueue, the client's stream waits on done_event (design §3). Host
//                mode: the op completes before the reply. Echo and eager calls alternate in blocks
//                of --block (50), so load on the machine hits both alike. Target: eager p50 <=
//                1.25x echo.
//   eager_refused an Execute refused after the session and plan lookup (one token above the
//                plan's maximum): gRPC and the service's front, no engine.
//   eager_nowait (CUDA) an Execute without the interprocess events.
//   eager_sync   (CUDA) the same with synchronous = true: the reply waits for completion.
//   inproc       the same op run by the client processes themselves, without a sidecar. CUDA:
//                the fused kernel on a workspace of their own (same backend, same algorithm as
//                the sidecar's reply), per op in a CUDA graph. Host mode: the host engine's CPU
//                op, per call; eager minus inproc is then what the plane adds over the op.
//   doorbell     (CUDA) the plan's doorbell rung from the client's stream (client/ring), served
//                by the sidecar. Target: at most 3 us per op over inproc.
//   compute      (CUDA) the layer stand-in kernel alone (--compute_us of GPU time per layer).
//   layer_inproc, layer_doorbell, layer_nccl
//                (CUDA) a layer loop captured in one graph: the stand-in kernel, then the fused op
//                in-process / through the doorbell / as in-process NCCL + add-RMSNorm (NCCL only
//                with one GPU per rank). Target: layer_doorbell <= 0.7x layer_nccl (<= 128 tokens).
//
// echo, eager, eager_sync and host-mode inproc rows are per call: p50 and p99 of --iters calls.
// Graph rows replay a graph of --graph_ops ops --repeats times (ranks start each replay together):
// p50 is the median of the replays' us per op and p99 the slowest replay. Every figure is the
// slowest rank's. The table goes to stdout, the same figures as JSON to --json. Exit code 0 when
// every row that could run ran.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/flag_args.h"
#include "bench/rank_launch.h"
#include "bench/subcommands.h"
#include "client/cpp/client.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kernels/common/op_types.h"
#include "server/core/log.h"
#include "server/core/status_macros.h"
#include "server/core/version.h"
#include "server/host/host_engine.h"
#include "server/peers/peer_exchange.h"

#if defined(ARFUSE_BENCH_CUDA)
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include "bench/layer_standin.h"
#include "client/cpp/instream_attach.h"
#include "kernels/add_rmsnorm/add_rmsnorm.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "server/doorbell/doorbell_dispatch.h"
#include "server/gpu/cuda_status.h"
#include "server/gpu/fusion_workspace.h"
#include "server/gpu/mps.h"
#include "server/gpu/nccl_comm.h"
#if __has_include("client/ring/arfuse_ring.h")
#include "client/ring/arfuse_ring.h"
#define ARFUSE_BENCH_HAVE_RING_HEADER 1
#endif
#endif

extern char** environ;

namespace arfuse::bench {
namespace {

using client::Client;
using client::ClientOptions;
using client::OpDesc;
using client::TensorLoc;

// ------------------------------------------------------------------------------------ flags

struct Flags {
  FlagOutcome outcome = FlagOutcome::kRun;
  int ranks = 2;
  std::string device;  // host | cuda; empty: cuda when built with CUDA and a GPU is visible
  std::vector<uint32_t> tokens = {1, 16, 128};
  std::vector<uint32_t> hidden = {4096};
  int iters = 2000;
  int warmup = 200;
  int block = 50;  // echo and Execute calls alternate in blocks of this many
  int graph_ops = 100;
  int repeats = 15;
  int compute_us = 20;
  std::string json = "arfuse-bench-sidecar.json";
  std::string arfused;
  std::string backend = "auto";
  std::string ring_lib;
  int timeout_s = 600;
  // Internal: a client process.
  int client_rank = -1;
  std::string dir;
  std::vector<std::string> raw;  // the user's flags, passed on to the clients and into the JSON
};

using Flag = FlagTable::Flag;

constexpr char kDescription[] =
    "The sidecar's data planes per op, each against its yardstick in the same run: eager\n"
    "(Fusion.Execute) against a gRPC echo, the doorbell plane against the same kernel launched\n"
    "in-process, and a layer loop (stand-in kernel + fused op) in-process, through the doorbell\n"
    "and over NCCL. Starts --ranks arfused sidecars and one client process per rank; prints one\n"
    "progress line per row to stderr, then the table (slowest rank, us), and writes --json.\n"
    "Host mode (--device=host) needs no GPU.";

FlagTable SidecarFlagTable(Flags* f) {
  return FlagTable(
      {Flag("ranks", &f->ranks, "ranks: sidecars and client processes (rank r on GPU r % GPUs)"),
       Flag("device", &f->device,
            "host or cuda (default: cuda when built with it and a GPU is "
            "visible, else host)"),
       Flag("tokens", &f->tokens, "token counts, comma-separated"),
       Flag("hidden", &f->hidden, "hidden sizes (multiples of 8), comma-separated"),
       Flag("iters", &f->iters, "timed calls per per-call row"),
       Flag("warmup", &f->warmup, "untimed calls first"),
       Flag("block", &f->block, "echo and Execute calls alternate in blocks of this many"),
       Flag("graph_ops", &f->graph_ops, "ops per CUDA graph (graph rows)"),
       Flag("repeats", &f->repeats, "timed replays per graph row"),
       Flag("compute_us", &f->compute_us, "GPU time of the layer stand-in kernel, us"),
       Flag("json", &f->json, "where the results go"),
       Flag("arfused", &f->arfused,
            "the arfused binary (default: the build tree's, next to this binary, or PATH's)"),
       Flag("backend", &f->backend, "the sidecars' --flashinfer-allreduce-fusion-backend"),
       Flag("ring_lib", &f->ring_lib, "libarfuse_ring.so for the doorbell rows (default: found)"),
       Flag("timeout", &f->timeout_s, "seconds the whole run may take")},
      "client_rank", &f->client_rank, &f->dir);
}

absl::StatusOr<Flags> ParseFlags(int argc, char** argv) {
  Flags f;
  ARFUSE_ASSIGN_OR_RETURN(f.outcome, SidecarFlagTable(&f).Parse(argc, argv, &f.raw));
  if (f.outcome != FlagOutcome::kRun) return f;
  if (f.ranks < 1 || f.ranks > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat("--ranks must be 1..", kMaxWorldSize));
  }
  if (!f.device.empty() && f.device != "host" && f.device != "cuda") {
    return absl::InvalidArgumentError("--device is host or cuda");
  }
  for (uint32_t h : f.hidden) {
    if (h % 8 != 0) return absl::InvalidArgumentError("--hidden values must be multiples of 8");
  }
  if (f.iters < 1 || f.warmup < 0 || f.block < 1 || f.graph_ops < 1 || f.repeats < 1 ||
      f.compute_us < 0 || f.timeout_s < 1) {
    return absl::InvalidArgumentError(
        "--iters, --block, --graph_ops, --repeats, --timeout >= 1; --warmup, --compute_us >= 0");
  }
  return f;
}

// ------------------------------------------------------------------------------------ results

// Rows in table order.
constexpr const char* kRows[] = {
    "echo",           "eager_refused", "eager",        "eager_rpc", "eager_client_cuda",
    "eager_nowait",   "eager_sync",    "inproc",       "busy",      "busy_sm",
    "doorbell",       "busy_idle",     "busy_sm_idle", "instream",  "busy_instream",
    "busy_sm_instream", "compute",     "layer_inproc", "layer_doorbell", "layer_instream",
    "layer_nccl"};

struct RowResult {
  std::string row;
  uint32_t tokens = 0;
  uint32_t hidden = 0;
  double p50 = NAN, p99 = NAN, mean = NAN;
  size_t samples = 0;
  std::string path = "-";
  std::string note;  // why a row did not run, or what it ran
  bool failed = false;
};

struct Summary {
  double p50 = NAN, p99 = NAN, mean = NAN;
  size_t n = 0;
};

Summary Summarize(std::vector<double> v) {
  Summary s;
  s.n = v.size();
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  auto pct = [&](double q) {
    size_t k = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
    return v[std::min(v.size() - 1, k == 0 ? 0 : k - 1)];
  };
  s.p50 = pct(0.50);
  s.p99 = pct(0.99);
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / static_cast<double>(v.size());
  return s;
}

// A row of one shape, nothing measured yet.
RowResult ShapeRow(const std::string& row, uint32_t tokens, uint32_t hidden) {
  RowResult r;
  r.row = row;
  r.tokens = tokens;
  r.hidden = hidden;
  return r;
}

// The row's figures: those of its samples.
void SetFigures(const Summary& s, RowResult* r) {
  r->p50 = s.p50;
  r->p99 = s.p99;
  r->mean = s.mean;
  r->samples = s.n;
}

std::string Clean(std::string s) {
  for (char& c : s) {
    if (c == '\t' || c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

// One line per row in the rank's result file: tab-separated, the note last.
std::string Serialize(const RowResult& r) {
  return absl::StrFormat("row\t%s\t%u\t%u\t%.17g\t%.17g\t%.17g\t%u\t%s\t%d\t%s\n", r.row, r.tokens,
                         r.hidden, r.p50, r.p99, r.mean, static_cast<unsigned>(r.samples),
                         Clean(r.path), r.failed ? 1 : 0, Clean(r.note));
}

bool Deserialize(const std::string& line, RowResult* r) {
  std::vector<std::string> p = absl::StrSplit(line, '\t');
  if (p.size() < 11 || p[0] != "row") return false;
  r->row = p[1];
  unsigned n = 0;
  int failed = 0;
  auto dbl = [](const std::string& s) {
    double x = NAN;
    return absl::SimpleAtod(s, &x) ? x : NAN;
  };
  if (!absl::SimpleAtoi(p[2], &r->tokens) || !absl::SimpleAtoi(p[3], &r->hidden) ||
      !absl::SimpleAtoi(p[7], &n) || !absl::SimpleAtoi(p[9], &failed)) {
    return false;
  }
  r->p50 = dbl(p[4]);
  r->p99 = dbl(p[5]);
  r->mean = dbl(p[6]);
  r->samples = n;
  r->path = p[8];
  r->failed = failed != 0;
  r->note = p[10];
  return true;
}

std::string SocketOf(const std::string& dir, int rank) {
  return absl::StrCat(dir, "/rank", rank, ".sock");
}

double MicrosSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

// ------------------------------------------------------------------------------------ memory

// One shape's tensors, bf16, each 256-byte aligned: input | residual_in | residual_out |
// norm_out | gamma. residual_out is not residual_in, so repeated ops see the same inputs.
struct Layout {
  uint64_t tensor = 0, input = 0, residual_in = 0, residual_out = 0, norm_out = 0, gamma = 0;
  uint64_t total = 0;
  Layout(uint32_t tokens, uint32_t hidden) {
    auto up = [](uint64_t v) { return (v + 255) / 256 * 256; };
    tensor = up(uint64_t{tokens} * hidden * 2);
    residual_in = tensor;
    residual_out = 2 * tensor;
    norm_out = 3 * tensor;
    gamma = 4 * tensor;
    total = gamma + up(uint64_t{hidden} * 2);
  }
};

// The op of `desc` (a plan's, at its max_tokens) as this process runs it itself, on tensors at
// `base` laid out as the plan's region is: the in-process rows run the sidecar's op.
OpArgs InProcessOp(const OpDesc& desc, char* base) {
  auto at = [base](const std::optional<TensorLoc>& t) { return base + t->offset; };
  OpArgs op;
  op.pattern = desc.pattern;
  op.dtype = desc.dtype;
  op.hidden = desc.hidden;
  op.num_tokens = desc.max_tokens;
  op.eps = *desc.eps;
  op.input = at(desc.input);
  op.residual_in = at(desc.residual_in);
  op.residual_out = at(desc.residual_out);
  op.norm_out = at(desc.norm_out);
  op.gamma = at(desc.gamma);
  return op;
}

uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);  // values below are exact in bf16
}

std::vector<char> HostImage(const Layout& L, uint32_t tokens, uint32_t hidden, int rank) {
  std::vector<char> img(L.total, 0);
  const uint64_t n = uint64_t{tokens} * hidden;
  auto put = [&](uint64_t off, uint64_t i, float v) {
    uint16_t b = Bf16(v);
    std::memcpy(img.data() + off + 2 * i, &b, 2);
  };
  for (uint64_t i = 0; i < n; ++i) {
    put(L.input, i, float(int((i * 7 + rank * 13) % 17) - 8) / 8.0f);
    put(L.residual_in, i, float(int((i * 5) % 11) - 5) / 4.0f);
  }
  for (uint64_t h = 0; h < hidden; ++h) put(L.gamma, h, 0.5f + float(h % 9) / 8.0f);
  return img;
}

class Memory {
 public:
  virtual ~Memory() = default;
  virtual absl::StatusOr<client::Region> Register(Client& c, const std::string& name) = 0;
  virtual absl::Status Upload(const std::vector<char>& img) = 0;
  virtual char* device_ptr() { return nullptr; }
};

class HostMemory final : public Memory {
 public:
  explicit HostMemory(client::HostShmBuffer b) : b_(std::move(b)) {}
  absl::StatusOr<client::Region> Register(Client& c, const std::string& name) override {
    return c.RegisterHostBuffer(name, b_);
  }
  absl::Status Upload(const std::vector<char>& img) override {
    std::memcpy(b_.data(), img.data(), img.size());
    return absl::OkStatus();
  }

 private:
  client::HostShmBuffer b_;
};

#if defined(ARFUSE_BENCH_CUDA)
class CudaMemory final : public Memory {
 public:
  static absl::StatusOr<std::unique_ptr<Memory>> Create(uint64_t bytes, int device) {
    std::unique_ptr<CudaMemory> m(new CudaMemory());
    m->device_ = device;
    m->bytes_ = bytes;
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaMalloc(&m->ptr_, bytes));
    cudaIpcMemHandle_t h;
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&h, m->ptr_));
    m->handle_.assign(reinterpret_cast<const char*>(&h), sizeof(h));
    return std::unique_ptr<Memory>(std::move(m));
  }
  ~CudaMemory() override {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  absl::StatusOr<client::Region> Register(Client& c, const std::string& name) override {
    return c.RegisterCudaIpc(name, handle_, device_, bytes_);
  }
  absl::Status Upload(const std::vector<char>& img) override {
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemcpy(ptr_, img.data(), img.size(), cudaMemcpyHostToDevice));
    return absl::OkStatus();
  }
  char* device_ptr() override { return static_cast<char*>(ptr_); }

 private:
  CudaMemory() = default;
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;
  int device_ = 0;
  std::string handle_;
};
#endif

// ------------------------------------------------------------------------------------ GPU side

#if defined(ARFUSE_BENCH_CUDA)

// libarfuse_ring.so, loaded at run time (as Python's ctypes binding does), so this binary builds
// and runs whether or not the ring library is there.
struct RingLib {
#if defined(ARFUSE_BENCH_HAVE_RING_HEADER)
  decltype(&arfuse_open_doorbell) open = nullptr;
  decltype(&arfuse_close_doorbell) close = nullptr;
  decltype(&arfuse_ring) ring = nullptr;
  decltype(&arfuse_doorbell_error) error = nullptr;
  decltype(&arfuse_doorbell_error_name) error_name = nullptr;
  decltype(&arfuse_doorbell_check_values) check_values = nullptr;
  decltype(&arfuse_ring_strerror) strerror = nullptr;
#endif
  void* handle = nullptr;
  std::string note;  // why it is not loaded
  bool loaded() const { return handle != nullptr; }

  static RingLib Load(const std::string& flag) {
    RingLib lib;
#if !defined(ARFUSE_BENCH_HAVE_RING_HEADER)
    (void)flag;
    lib.note = "this build has no client/ring library";
    return lib;
#else
    std::vector<std::string> candidates;
    if (!flag.empty()) {
      candidates.push_back(flag);
    } else {
      std::error_code ec;
      auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
      if (!ec) {
        // build/bench/arfuse-bench -> build/client/ring/libarfuse_ring.so
        candidates.push_back(
            (self.parent_path().parent_path() / "client" / "ring" / "libarfuse_ring.so").string());
        candidates.push_back((self.parent_path() / "libarfuse_ring.so").string());
      }
      candidates.push_back("libarfuse_ring.so");  // LD_LIBRARY_PATH
    }
    std::string tried;
    for (const std::string& c : candidates) {
      if (c.find('/') != std::string::npos && !std::filesystem::exists(c)) {
        absl::StrAppend(&tried, tried.empty() ? "" : ", ", c, " (absent)");
        continue;
      }
      void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (h == nullptr) {
        const char* e = dlerror();
        absl::StrAppend(&tried, tried.empty() ? "" : ", ", c, " (", e ? e : "dlopen failed", ")");
        continue;
      }
      bool ok = true;
      auto sym = [&](auto& fn, const char* name) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
        if (fn == nullptr) ok = false;
      };
      sym(lib.open, "arfuse_open_doorbell");
      sym(lib.close, "arfuse_close_doorbell");
      sym(lib.ring, "arfuse_ring");
      sym(lib.error, "arfuse_doorbell_error");
      sym(lib.error_name, "arfuse_doorbell_error_name");
      sym(lib.check_values, "arfuse_doorbell_check_values");
      sym(lib.strerror, "arfuse_ring_strerror");
      if (!ok) {
        absl::StrAppend(&tried, tried.empty() ? "" : ", ", c, " (symbols missing)");
        dlclose(h);
        continue;
      }
      lib.handle = h;
      return lib;
    }
    lib.note = absl::StrCat("libarfuse_ring.so not loaded: ", tried, "; pass --ring_lib=PATH");
    return lib;
#endif
  }
};

struct Gpu {
  int device = 0;
  int devices = 0;
  bool shared = false;  // more ranks than GPUs: ranks share (MPS)
  int per_gpu = 1;
  int sms = 0;
  cudaStream_t stream = nullptr;
  // eager: the client's interprocess event (recorded after "producing" the input) and the
  // sidecar's done events, opened once each (the sidecar reuses a ring of them).
  cudaEvent_t wait_event = nullptr;
  std::string wait_handle;
  std::map<std::string, cudaEvent_t> done_events;
  // in-process rows
  std::unique_ptr<FusionWorkspace> ws;
  std::string ws_note;
  std::unique_ptr<NcclComm> nccl;
  std::string nccl_note;
  RingLib ring;

  ~Gpu() {
    for (auto& [h, e] : done_events) cudaEventDestroy(e);
    if (wait_event != nullptr) cudaEventDestroy(wait_event);
    nccl.reset();
    ws.reset();
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  absl::Status Init(int rank, int world) {
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&devices));
    if (devices == 0) return absl::FailedPreconditionError("no GPU visible");
    device = rank % devices;  // as the sidecar picks its GPU (arfused --gpu=-1)
    shared = world > devices;
    per_gpu = (world + devices - 1) / devices;
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    ARFUSE_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    ARFUSE_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&wait_event, cudaEventInterprocess | cudaEventDisableTiming));
    cudaIpcEventHandle_t h;
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaIpcGetEventHandle(&h, wait_event));
    wait_handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
    return absl::OkStatus();
  }

  absl::StatusOr<cudaEvent_t> DoneEvent(const std::string& handle) {
    auto it = done_events.find(handle);
    if (it != done_events.end()) return it->second;
    if (handle.size() != sizeof(cudaIpcEventHandle_t)) {
      return absl::InternalError("done_event is not a 64-byte handle");
    }
    cudaIpcEventHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    cudaEvent_t e = nullptr;
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaIpcOpenEventHandle(&e, h));
    done_events[handle] = e;
    return e;
  }
};

// Replays a graph of f.graph_ops x enqueue() once as a warm-up and f.repeats times timed; every
// replay starts after a barrier of the client ranks. Returns us per op of each timed replay.
absl::StatusOr<std::vector<double>> TimeGraph(Exchange& ex, cudaStream_t s, const Flags& f,
                                              const std::function<absl::Status()>& enqueue,
                                              const std::string& tag) {
  // One op outside capture first: NCCL connects lazily, and nothing lazy may happen in capture.
  ARFUSE_RETURN_IF_ERROR(ex.Barrier(tag + "/eager", absl::Now() + absl::Seconds(120)));
  ARFUSE_RETURN_IF_ERROR(enqueue());
  ARFUSE_RETURN_IF_ERROR(WaitStream(s, absl::Now() + absl::Seconds(60)));
  cudaGraph_t graph = nullptr;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  absl::Status captured;
  for (int i = 0; i < f.graph_ops && captured.ok(); ++i) captured = enqueue();
  absl::Status ended = ARFUSE_CUDA_STATUS(cudaStreamEndCapture(s, &graph));
  ARFUSE_RETURN_IF_ERROR(captured);
  ARFUSE_RETURN_IF_ERROR(ended);
  cudaGraphExec_t exec = nullptr;
  absl::Status inst = ARFUSE_CUDA_STATUS(cudaGraphInstantiate(&exec, graph, 0));
  cudaGraphDestroy(graph);
  ARFUSE_RETURN_IF_ERROR(inst);
  cudaEvent_t start = nullptr, stop = nullptr;
  absl::Status st = ARFUSE_CUDA_STATUS(cudaEventCreate(&start));
  if (st.ok()) st = ARFUSE_CUDA_STATUS(cudaEventCreate(&stop));
  std::vector<double> per_op;
  for (int r = 0; r < 1 + f.repeats && st.ok(); ++r) {
    st = ex.Barrier(absl::StrCat(tag, "/", r), absl::Now() + absl::Seconds(120));
    if (!st.ok()) break;
    st = ARFUSE_CUDA_STATUS(cudaEventRecord(start, s));
    if (st.ok()) st = ARFUSE_CUDA_STATUS(cudaGraphLaunch(exec, s));
    if (st.ok()) st = ARFUSE_CUDA_STATUS(cudaEventRecord(stop, s));
    if (st.ok()) st = WaitEvent(stop, absl::Now() + absl::Seconds(120));
    float ms = 0;
    if (st.ok()) st = ARFUSE_CUDA_STATUS(cudaEventElapsedTime(&ms, start, stop));
    if (st.ok() && r > 0) per_op.push_back(1000.0 * ms / f.graph_ops);
  }
  if (start != nullptr) cudaEventDestroy(start);
  if (stop != nullptr) cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  ARFUSE_RETURN_IF_ERROR(st);
  return per_op;
}

#endif  // ARFUSE_BENCH_CUDA

// ------------------------------------------------------------------------------------ client

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
    for (BusyKernel& k : busy_kernels) {
      if (k.ok && db_ok) {
        const std::string row = k.row + "_idle";
        AddGraphRow(row, tokens, hidden, TimeGraph(ex, s, f, enqueue_busy(k), tag + "/" + row), "-",
                    "the same kernel while the doorbell plane waits for the next ring");
      }
    }
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
    for (BusyKernel& k : busy_kernels) {
      if (k.ok && is_ok) {
        const std::string row = k.row + "_instream";
        AddGraphRow(row, tokens, hidden, TimeGraph(ex, s, f, enqueue_busy(k), tag + "/" + row), "-",
                    "the same kernel while attached in-stream (nothing of the sidecar resident)");
      }
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
      const MpsInfo mps = DetectMps();
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

// ------------------------------------------------------------------------------------ launcher

std::string FindArfused(const Flags& f) {
  if (!f.arfused.empty()) return f.arfused;
  std::filesystem::path self = SelfExe();
  if (!self.empty()) {
    // build/bench/arfuse-bench -> build/server/daemon/arfused
    auto p = self.parent_path().parent_path() / "server" / "daemon" / "arfused";
    if (std::filesystem::exists(p)) return p.string();
    auto q = self.parent_path() / "arfused";
    if (std::filesystem::exists(q)) return q.string();
  }
  return "arfused";  // from PATH
}

// posix_spawn with stdout and stderr to `log` (empty: inherited).
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& args, const std::string& log) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (!log.empty()) {
    posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  }
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  int rc = posix_spawnp(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat("cannot start ", args[0], ": ", std::strerror(rc)));
  }
  return pid;
}

// The exit code, or -1 when `until` passed first.
int WaitUntil(pid_t pid, absl::Time until) {
  for (;;) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (r < 0) return -2;
    if (absl::Now() > until) return -1;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

std::string DefaultDevice() {
#if defined(ARFUSE_BENCH_CUDA)
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) return "cuda";
  cudaGetLastError();
#endif
  return "host";
}

std::string Fmt(double v) { return std::isnan(v) ? std::string("-") : absl::StrFormat("%.1f", v); }
std::string Json(double v) {
  return std::isnan(v) ? std::string("null") : absl::StrFormat("%.3f", v);
}
std::string JsonStr(const std::string& s) {
  std::string o = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') {
      o += '\\';
      o += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      o += ' ';
    } else {
      o += ch;
    }
  }
  return o + "\"";
}

struct Check {
  std::string what;
  uint32_t tokens = 0, hidden = 0;
  double value = NAN;  // ratio or difference
  double target = NAN;
  std::string unit;  // "x" or "us"
  bool met = false;
};

int Launch(Flags f) {
  if (f.device.empty()) f.device = DefaultDevice();
#if !defined(ARFUSE_BENCH_CUDA)
  if (f.device == "cuda") {
    std::fprintf(stderr, "arfuse-bench sidecar: this build has no CUDA; use --device=host\n");
    return 2;
  }
#endif
  const std::string self = SelfExe();
  if (self.empty()) {
    std::fprintf(stderr, "arfuse-bench sidecar: cannot find its own executable\n");
    return 1;
  }
  char tmpl[] = "/tmp/arfbench-sc-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    std::fprintf(stderr, "arfuse-bench sidecar: cannot make a work directory\n");
    return 1;
  }
  const std::string dir = tmpl;
  std::filesystem::create_directories(dir + "/peers");
  std::filesystem::create_directories(dir + "/clients");
  const std::string arfused = FindArfused(f);
  const uint32_t max_t = *std::max_element(f.tokens.begin(), f.tokens.end());
  const uint32_t max_h = *std::max_element(f.hidden.begin(), f.hidden.end());
  const absl::Time until = absl::Now() + absl::Seconds(f.timeout_s);

  std::vector<pid_t> sidecars, clients;
  int rc = 0;
  for (int r = 0; r < f.ranks && rc == 0; ++r) {
    std::vector<std::string> args = {arfused,
                                     "--device=" + f.device,
                                     absl::StrCat("--rank=", r),
                                     absl::StrCat("--world-size=", f.ranks),
                                     "--peer-dir=" + dir + "/peers",
                                     "--socket=" + SocketOf(dir, r),
                                     "--health-port=0",
                                     absl::StrCat("--max-tokens=", max_t),
                                     absl::StrCat("--hidden=", max_h),
                                     "--dtype=bf16",
                                     "--log-level=info",
                                     "--spin-timeout=5"};
    if (!f.backend.empty()) args.push_back("--flashinfer-allreduce-fusion-backend=" + f.backend);
    auto pid = Spawn(args, absl::StrCat(dir, "/arfused.", r, ".log"));
    if (!pid.ok()) {
      std::fprintf(stderr, "arfuse-bench sidecar: %s\n", pid.status().ToString().c_str());
      rc = 1;
      break;
    }
    sidecars.push_back(*pid);
  }
  // The clients run on the device chosen here, whatever the user's --device said.
  std::vector<std::string> client_flags = {"--device=" + f.device};
  for (const std::string& a : f.raw) {
    if (a.rfind("--device=", 0) != 0) client_flags.push_back(a);
  }
  for (int r = 0; r < f.ranks && rc == 0; ++r) {
    auto pid = Spawn(RankCommand(self, "sidecar", "client_rank", r, dir, client_flags), "");
    if (!pid.ok()) {
      std::fprintf(stderr, "arfuse-bench sidecar: %s\n", pid.status().ToString().c_str());
      rc = 1;
      break;
    }
    clients.push_back(*pid);
  }
  // Wait for the clients. A sidecar that exits meanwhile ends the run at once: its client would
  // only wait for it until --timeout.
  std::vector<std::string> launch_errors;
  {
    std::vector<int> client_code(clients.size(), -3);
    std::vector<bool> sidecar_gone(sidecars.size(), false);
    bool stop = false;
    for (;;) {
      bool pending = false;
      for (size_t i = 0; i < clients.size(); ++i) {
        if (client_code[i] != -3) continue;
        int status = 0;
        pid_t r = waitpid(clients[i], &status, WNOHANG);
        if (r == clients[i]) {
          client_code[i] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        } else if (r < 0) {
          client_code[i] = -2;
        } else {
          pending = true;
        }
      }
      for (size_t i = 0; i < sidecars.size(); ++i) {
        if (sidecar_gone[i]) continue;
        int status = 0;
        if (waitpid(sidecars[i], &status, WNOHANG) == sidecars[i]) {
          sidecar_gone[i] = true;
          if (pending) {
            launch_errors.push_back(absl::StrCat("arfused rank ", i, " exited during the run (",
                                                 WIFEXITED(status)
                                                     ? absl::StrCat("code ", WEXITSTATUS(status))
                                                     : absl::StrCat("signal ", WTERMSIG(status)),
                                                 ")"));
            stop = true;
          }
        }
      }
      if (!pending) break;
      if (absl::Now() > until) {
        launch_errors.push_back("a client did not finish within --timeout");
        stop = true;
      }
      if (stop) {
        for (size_t i = 0; i < clients.size(); ++i) {
          if (client_code[i] == -3) kill(clients[i], SIGKILL);
        }
        for (size_t i = 0; i < clients.size(); ++i) {
          if (client_code[i] == -3)
            client_code[i] = WaitUntil(clients[i], absl::Now() + absl::Seconds(5));
        }
        break;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    for (int code : client_code) {
      if (code != 0) rc = 1;
    }
    for (size_t i = 0; i < sidecars.size(); ++i) {
      if (sidecar_gone[i]) sidecars[i] = -1;
    }
  }
  for (pid_t p : sidecars) {
    if (p > 0) kill(p, SIGTERM);
  }
  for (pid_t p : sidecars) {
    if (p > 0 && WaitUntil(p, absl::Now() + absl::Seconds(15)) == -1) {
      kill(p, SIGKILL);
      WaitUntil(p, absl::Now() + absl::Seconds(5));
    }
  }

  // Gather: the slowest rank's figures per row.
  std::map<std::string, std::string> info;
  std::vector<RowResult> rows;
  std::vector<std::string> errors = launch_errors;
  int reported = 0;
  for (int r = 0; r < f.ranks; ++r) {
    std::ifstream in(absl::StrCat(dir, "/result.", r));
    std::string line;
    bool any = false;
    while (std::getline(in, line)) {
      any = true;
      if (line.rfind("error\t", 0) == 0) {
        errors.push_back(absl::StrCat("rank ", r, ": ", line.substr(6)));
        continue;
      }
      if (line.rfind("info\t", 0) == 0) {
        std::vector<std::string> p = absl::StrSplit(line, absl::MaxSplits('\t', 2));
        if (p.size() == 3) info[p[1]] = p[2];
        continue;
      }
      RowResult got;
      if (!Deserialize(line, &got)) continue;
      bool merged = false;
      for (RowResult& have : rows) {
        if (have.row != got.row || have.tokens != got.tokens || have.hidden != got.hidden) continue;
        auto worst = [](double a, double b) {
          return std::isnan(a) ? b : (std::isnan(b) ? a : std::max(a, b));
        };
        have.p50 = worst(have.p50, got.p50);
        have.p99 = worst(have.p99, got.p99);
        have.mean = worst(have.mean, got.mean);
        have.samples = std::min(have.samples, got.samples);
        have.failed = have.failed || got.failed;
        if (got.failed && !have.note.empty() && have.note != got.note) have.note = got.note;
        merged = true;
      }
      if (!merged) rows.push_back(got);
    }
    if (any) ++reported;
  }
  if (reported != f.ranks) {
    errors.push_back(absl::StrCat(reported, " of ", f.ranks, " client ranks reported"));
  }
  auto order = [](const std::string& row) {
    for (size_t i = 0; i < std::size(kRows); ++i) {
      if (row == kRows[i]) return i;
    }
    return std::size(kRows);
  };
  std::stable_sort(rows.begin(), rows.end(), [&](const RowResult& a, const RowResult& b) {
    if (a.hidden != b.hidden) return a.hidden < b.hidden;
    if (a.tokens != b.tokens) return a.tokens < b.tokens;
    return order(a.row) < order(b.row);
  });
  auto find = [&](const std::string& row, uint32_t t, uint32_t h) -> const RowResult* {
    for (const RowResult& r : rows) {
      if (r.row == row && r.tokens == t && r.hidden == h && !r.failed && !std::isnan(r.p50))
        return &r;
    }
    return nullptr;
  };
  // Targets (design §7): eager p50 <= 1.25x echo p50; doorbell <= inproc + 3 us; the layer loop
  // through the doorbell <= 0.7x in-process NCCL + add-RMSNorm at <= 128 tokens.
  const bool cuda = f.device == "cuda";
  std::vector<Check> checks;
  std::map<const RowResult*, std::string> vs;
  for (uint32_t h : f.hidden) {
    for (uint32_t t : f.tokens) {
      const RowResult* echo = find("echo", t, h);
      if (const RowResult* e = find("eager", t, h); e && echo) {
        Check k{"eager_p50_over_echo_p50", t, h, e->p50 / echo->p50, 1.25, "x"};
        k.met = k.value <= k.target;
        checks.push_back(k);
        vs[e] = absl::StrFormat("%.2fx echo", k.value);
      }
      if (const RowResult* e = find("eager", t, h); e && echo && !cuda) {
        if (const RowResult* in = find("inproc", t, h)) {
          // Host mode: what the plane adds over the op itself, against the echo.
          vs[e] += absl::StrFormat("; less the op: %.2fx", (e->p50 - in->p50) / echo->p50);
        }
      }
      if (const RowResult* e = find("eager_rpc", t, h); e && echo) {
        vs[e] = absl::StrFormat("%.2fx echo", e->p50 / echo->p50);
      }
      if (const RowResult* e = find("eager_sync", t, h); e && echo) {
        vs[e] = absl::StrFormat("%.2fx echo", e->p50 / echo->p50);
      }
      const RowResult* inproc = find("inproc", t, h);
      if (const RowResult* d = find("doorbell", t, h); d && inproc) {
        Check k{"doorbell_minus_inproc_us", t, h, d->p50 - inproc->p50, 3.0, "us"};
        k.met = k.value <= k.target;
        checks.push_back(k);
        vs[d] = absl::StrFormat("%+.1f us vs inproc", k.value);
      }
      if (const RowResult* is = find("instream", t, h); is && inproc) {
        Check k{"instream_minus_inproc_us", t, h, is->p50 - inproc->p50, 0.3, "us"};
        k.met = k.value <= k.target;
        checks.push_back(k);
        vs[is] = absl::StrFormat("%+.1f us vs inproc", k.value);
      }
      for (const auto& [idle_row, base_row] :
           {std::pair<const char*, const char*>{"busy_idle", "busy"},
            {"busy_sm_idle", "busy_sm"},
            {"busy_instream", "busy"},
            {"busy_sm_instream", "busy_sm"}}) {
        const RowResult* bi = find(idle_row, t, h);
        const RowResult* b = find(base_row, t, h);
        if (bi != nullptr && b != nullptr) {
          vs[bi] =
              absl::StrFormat("%.3fx %s (%+.1f us)", bi->p50 / b->p50, base_row, bi->p50 - b->p50);
        }
      }
      // Nothing of the sidecar stays resident: a register-heavy client kernel runs as fast
      // attached as before (design.md §7: 1.000x; a thousandth is the run-to-run spread).
      if (const RowResult* bi = find("busy_sm_instream", t, h); bi) {
        if (const RowResult* b = find("busy_sm", t, h); b) {
          Check k{"busy_sm_instream_over_busy_sm", t, h, bi->p50 / b->p50, 1.001, "x"};
          k.met = k.value <= k.target;
          checks.push_back(k);
        }
      }
      const RowResult* compute = find("compute", t, h);
      const RowResult* lin = find("layer_inproc", t, h);
      const RowResult* ldb = find("layer_doorbell", t, h);
      const RowResult* lnccl = find("layer_nccl", t, h);
      if (ldb && lin) {
        vs[ldb] = absl::StrFormat("%.2fx layer_inproc", ldb->p50 / lin->p50);
      }
      if (ldb && lnccl && t <= 128) {
        Check k{"layer_doorbell_over_layer_nccl", t, h, ldb->p50 / lnccl->p50, 0.7, "x"};
        k.met = k.value <= k.target;
        checks.push_back(k);
        vs[ldb] = absl::StrFormat("%.2fx layer_nccl", k.value);
      }
      if (const RowResult* lis = find("layer_instream", t, h); lis && lin) {
        vs[lis] = absl::StrFormat("%+.1f us vs layer_inproc", lis->p50 - lin->p50);
      }
      if (lin && compute) vs[lin] = absl::StrFormat("compute %+.1f us", lin->p50 - compute->p50);
      if (lnccl && compute)
        vs[lnccl] = absl::StrFormat("compute %+.1f us", lnccl->p50 - compute->p50);
    }
  }
  bool row_failed = false;
  for (const RowResult& r : rows) row_failed = row_failed || r.failed;
  if (!errors.empty() || row_failed) rc = 1;

  const std::string command = absl::StrCat("arfuse-bench sidecar ", absl::StrJoin(f.raw, " "));
  std::string where = "host mode (CPU op)";
  if (cuda) {
    where = info.count("gpu") == 0
                ? std::string("CUDA (no GPU reported)")
                : absl::StrCat(info["gpu"], ", ", info["gpus"], " GPU(s), ",
                               info["shared_gpu"] == "1" ? "ranks share a GPU" : "one per rank",
                               ", ", info["mps"]);
  }
  std::printf("arfuse-bench sidecar: %d rank(s), %s, backend=%s, bf16\n", f.ranks, where.c_str(),
              info["backend"].empty() ? "?" : info["backend"].c_str());
  std::printf(
      "per-call rows: us per call over %d calls (after %d warm-up), echo and Execute "
      "alternating in blocks of %d; slowest rank\n",
      f.iters, f.warmup, f.block);
  if (cuda) {
    std::printf(
        "graph rows: us per op, graph of %d ops, %d replays (p50: median replay, p99: "
        "slowest replay); slowest rank\n",
        f.graph_ops, f.repeats);
  }
  std::printf("| tokens | hidden | row | path | p50 us | p99 us | vs | note |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (const RowResult& r : rows) {
    std::string v = vs.count(&r) ? vs[&r] : "";
    std::printf("| %u | %u | %s | %s | %s | %s | %s | %s%s |\n", r.tokens, r.hidden, r.row.c_str(),
                r.path.c_str(), Fmt(r.p50).c_str(), Fmt(r.p99).c_str(), v.c_str(),
                r.failed ? "FAILED: " : "", r.note.c_str());
  }
  for (const Check& k : checks) {
    std::printf("target %-32s %ux%u: %.2f%s (target <= %.2f%s) %s\n", k.what.c_str(), k.tokens,
                k.hidden, k.value, k.unit.c_str(), k.target, k.unit.c_str(),
                k.met ? "met" : "NOT MET");
  }

  std::ofstream json(f.json);
  json << "{\n  \"command\": " << JsonStr(command)
       << ",\n  \"version\": " << JsonStr(absl::StrCat(kVersion, "+", kGitRevision))
       << ",\n  \"device\": " << JsonStr(f.device) << ",\n  \"ranks\": " << f.ranks;
  for (const auto& [k, v] : info) json << ",\n  " << JsonStr(k) << ": " << JsonStr(v);
  json << ",\n  \"iters\": " << f.iters << ",\n  \"warmup\": " << f.warmup
       << ",\n  \"graph_ops\": " << f.graph_ops << ",\n  \"repeats\": " << f.repeats
       << ",\n  \"compute_us\": " << f.compute_us << ",\n  \"unit\": \"us\",\n  \"rows\": [\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const RowResult& r = rows[i];
    json << "    {\"row\": " << JsonStr(r.row) << ", \"tokens\": " << r.tokens
         << ", \"hidden\": " << r.hidden << ", \"path\": " << JsonStr(r.path)
         << ", \"p50_us\": " << Json(r.p50) << ", \"p99_us\": " << Json(r.p99)
         << ", \"mean_us\": " << Json(r.mean) << ", \"samples\": " << r.samples
         << ", \"ran\": " << (std::isnan(r.p50) ? "false" : "true")
         << ", \"failed\": " << (r.failed ? "true" : "false") << ", \"note\": " << JsonStr(r.note)
         << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
  }
  json << "  ],\n  \"targets\": [\n";
  for (size_t i = 0; i < checks.size(); ++i) {
    const Check& k = checks[i];
    json << "    {\"what\": " << JsonStr(k.what) << ", \"tokens\": " << k.tokens
         << ", \"hidden\": " << k.hidden << ", \"value\": " << Json(k.value)
         << ", \"target\": " << Json(k.target) << ", \"unit\": " << JsonStr(k.unit)
         << ", \"met\": " << (k.met ? "true" : "false") << "}" << (i + 1 < checks.size() ? "," : "")
         << "\n";
  }
  json << "  ],\n  \"errors\": [";
  for (size_t i = 0; i < errors.size(); ++i) json << (i ? ", " : "") << JsonStr(errors[i]);
  json << "],\n  \"ok\": " << (rc == 0 ? "true" : "false") << "\n}\n";
  json.close();
  if (json) {
    std::printf("wrote %s\n", f.json.c_str());
  } else {
    std::fprintf(stderr, "arfuse-bench sidecar: cannot write %s\n", f.json.c_str());
    rc = 1;
  }

  for (const std::string& e : errors) std::fprintf(stderr, "%s\n", e.c_str());
  if (rc != 0) {
    for (int r = 0; r < f.ranks; ++r) {
      std::ifstream log(absl::StrCat(dir, "/arfused.", r, ".log"));
      std::vector<std::string> lines;
      for (std::string line; std::getline(log, line);) lines.push_back(line);
      for (size_t i = lines.size() > 8 ? lines.size() - 8 : 0; i < lines.size(); ++i) {
        std::fprintf(stderr, "arfused.%d: %s\n", r, lines[i].substr(0, 300).c_str());
      }
    }
    std::fprintf(stderr, "arfuse-bench sidecar: FAILED; logs kept in %s\n", dir.c_str());
  } else {
    std::filesystem::remove_all(dir);
  }
  return rc;
}

}  // namespace

int SidecarMain(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  absl::StatusOr<Flags> f = ParseFlags(argc, argv);
  if (!f.ok()) {
    std::fprintf(stderr, "arfuse-bench sidecar: %s\n", f.status().ToString().c_str());
    return 2;
  }
  if (f->outcome != FlagOutcome::kRun) {
    Flags defaults;
    return PrintHelpOrVersion(f->outcome, "sidecar", kDescription, SidecarFlagTable(&defaults));
  }
  if (f->client_rank >= 0) {
    if (f->dir.empty()) {
      std::fprintf(stderr, "arfuse-bench sidecar: --client_rank needs --dir\n");
      return 2;
    }
    return ClientMain(*f);
  }
  return Launch(*f);
}

}  // namespace arfuse::bench
