// doorbell_bench: µs per op of the doorbell plane against the same fused kernel launched
// in-process, on one GPU with N ranks simulated in one process (docs/performance.md: the doorbell
// may add at most 3 µs per op; the probe's floor is 2.3 µs under MPS).
//
//   in-process: each rank replays a CUDA graph of `--per_graph` by-value fused launches
//               (LaunchAllReduceFusion) on its client stream;
//   doorbell:   each rank replays a graph of `--per_graph` ring kernels on its client stream,
//               served by its DoorbellPlane on the sidecar stream (waiter, indirect fused
//               launch, completion, kept queued by the plane's host thread).
// Both are timed with events on every client stream (the slowest rank counts), after a warm-up
// replay; the last op's outputs are checked against the CPU. Also runs the plane's self-test.
//
// usage: doorbell_bench [--world=2] [--hidden=4096] [--tokens=1,8,32,128] [--ops=3000]
//                       [--per_graph=100] [--algo=oneshot|twoshot] [--queue=32] [--poll_us=5]
//                       [--pdl] [--serve_blocks=32] [--trace] [--system_scope] [--json=PATH]
//                       [--max_poll_us=N] [--resident_ms=300]
// --trace: rank 0's plane keeps a trace of its in-place ops (DoorbellPlaneOptions::trace_ops);
// after each token count the bench prints where an op's time went (trace line, medians); with
// ARFUSE_RING_TRACE=1 also the ring kernel's side (its stamps on the request line).
// --system_scope: ring at system scope (kDoorbellRequest) instead of the scope the client library
// picks for a ring on the slot's own GPU.
// --max_poll_us: the planes' max_poll_interval (default: DoorbellPlaneOptions'; --poll_us's value
// turns the host thread's back-off off). After the rows the planes stay resident, unrung, for
// --resident_ms: the bench reports their host threads' looks per second and the process's CPU
// time over that spell (the main thread sleeps through it).
#include <cuda_runtime_api.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "common/flags.h"
#include "common/json.h"
#include "common/version.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/doorbell/doorbell.h"
#include "server/cuda_device/mps.h"
#include "server/cuda_device/mps_driver.h"
#include "server/doorbell/doorbell_dispatch.h"
#include "server/doorbell/doorbell_plane.h"
#include "server/doorbell/doorbell_report.h"
#include "server/doorbell/self_test.h"
#include "tests/doorbell/doorbell_test_util.h"

// Defaults as Args' (the run reads the flags into Args).
ABSL_FLAG(int, world, 2, "ranks simulated in this process");
ABSL_FLAG(uint32_t, hidden, 4096, "hidden size (a multiple of 8)");
ABSL_FLAG(arfuse::flags::PositiveList, tokens, (arfuse::flags::PositiveList{{1, 8, 32, 128}}),
          "token counts, comma-separated");
ABSL_FLAG(int, ops, 3000, "timed ops per row");
ABSL_FLAG(int, per_graph, 100, "ops per CUDA graph");
ABSL_FLAG(std::string, algo, "oneshot", "oneshot or twoshot");
ABSL_FLAG(uint32_t, queue, 32, "the planes' queue depth");
ABSL_FLAG(int, poll_us, 5, "the planes' host thread poll interval, us");
ABSL_FLAG(int, max_poll_us, -1, "the host thread's back-off limit (-1: the plane's)");
ABSL_FLAG(int, resident_ms, 300, "how long the planes stay resident and unrung (< 1000)");
ABSL_FLAG(bool, pdl, false, "programmatic dependent launch for the in-process kernels");
ABSL_FLAG(bool, trace, false, "where rank 0's in-place ops spend their time");
ABSL_FLAG(bool, system_scope, false, "ring at system scope");
ABSL_FLAG(uint32_t, serve_blocks, 32, "serving blocks per plane");
ABSL_FLAG(std::string, json, "", "also write the rows as JSON");

namespace arfuse {
namespace {

using doorbell_test::GroupShape;
using doorbell_test::HostOp;
using doorbell_test::RankGroup;

struct Args {
  int world = 2;
  uint32_t hidden = 4096;
  std::vector<uint32_t> tokens = {1, 8, 32, 128};
  int ops = 3000;
  int per_graph = 100;
  FusionAlgo algo = FusionAlgo::kOneShot;
  uint32_t queue = 32;
  int poll_us = 5;
  bool pdl = false;
  uint32_t serve_blocks = 32;
  bool trace = false;
  bool system_scope = false;
  int max_poll_us = -1;  // -1: the plane's default
  int resident_ms = 300;
  std::string json;
};

constexpr char kUsage[] =
    "usage: doorbell_bench [--flag=value ...]\n"
    "The doorbell plane against the same fused kernel launched in-process, us per op, on one GPU\n"
    "with --world ranks simulated in one process; the last op's outputs are checked against the\n"
    "CPU. One progress line per token count goes to stderr, the table to stdout.\n\n"
    "flags (with their defaults):\n"
    "  --world=2          ranks simulated in this process\n"
    "  --hidden=4096      hidden size (a multiple of 8)\n"
    "  --tokens=1,8,32,128  token counts, comma-separated\n"
    "  --ops=3000         timed ops per row\n"
    "  --per_graph=100    ops per CUDA graph\n"
    "  --algo=oneshot     oneshot or twoshot\n"
    "  --queue=32         the planes' queue depth\n"
    "  --poll_us=5        the planes' host thread poll interval, us\n"
    "  --max_poll_us=N    the host thread's back-off limit (default: the plane's; --poll_us's\n"
    "                     value turns the back-off off)\n"
    "  --serve_blocks=32  serving blocks per plane\n"
    "  --resident_ms=300  after the rows, how long the planes stay resident and unrung (< 1000)\n"
    "  --pdl              programmatic dependent launch for the in-process kernels\n"
    "  --trace            where rank 0's in-place ops spend their time, per token count\n"
    "  --system_scope     ring at system scope\n"
    "  --json=PATH        also write the rows as JSON\n"
    "  --help, --version\n";

// 0: run; 1: --help or --version was answered (exit 0).
int HelpOrVersion(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 1;
    }
    if (arg == "--version") {
      std::printf("%s\n", VersionLine("doorbell_bench").c_str());
      return 1;
    }
  }
  return 0;
}

const flags::FlagSet& BenchFlags() {
  static const flags::FlagSet set(
      "doorbell_bench",
      {"world", "hidden", "tokens", "ops", "per_graph", "algo", "queue", "poll_us", "max_poll_us",
       "resident_ms", "pdl", "trace", "system_scope", "serve_blocks", "json"});
  return set;
}

bool Parse(int argc, char** argv, Args* a) {
  absl::StatusOr<std::vector<flags::GivenFlag>> given = BenchFlags().Parse(argc, argv);
  if (!given.ok()) {
    std::fprintf(stderr, "doorbell_bench: %s\n", std::string(given.status().message()).c_str());
    return false;
  }
  a->world = absl::GetFlag(FLAGS_world);
  a->hidden = absl::GetFlag(FLAGS_hidden);
  a->tokens = absl::GetFlag(FLAGS_tokens).values;
  a->ops = absl::GetFlag(FLAGS_ops);
  a->per_graph = absl::GetFlag(FLAGS_per_graph);
  const std::string algo = absl::GetFlag(FLAGS_algo);
  a->algo = algo == "twoshot" ? FusionAlgo::kTwoShot : FusionAlgo::kOneShot;
  a->queue = absl::GetFlag(FLAGS_queue);
  a->poll_us = absl::GetFlag(FLAGS_poll_us);
  a->max_poll_us = absl::GetFlag(FLAGS_max_poll_us);
  a->resident_ms = absl::GetFlag(FLAGS_resident_ms);
  a->pdl = absl::GetFlag(FLAGS_pdl);
  a->trace = absl::GetFlag(FLAGS_trace);
  a->system_scope = absl::GetFlag(FLAGS_system_scope);
  a->serve_blocks = absl::GetFlag(FLAGS_serve_blocks);
  a->json = absl::GetFlag(FLAGS_json);
  // Range checks the flags' types cannot make. --max_poll_us's -1 (the plane's default) is only
  // the default: a value given must be an interval.
  const auto bad = [](const char* what) {
    std::fprintf(stderr, "doorbell_bench: bad argument %s (see --help)\n", what);
    return false;
  };
  if (algo != "oneshot" && algo != "twoshot") return bad("--algo (oneshot or twoshot)");
  if (flags::WasGiven(*given, "max_poll_us") && a->max_poll_us < 0) {
    return bad("--max_poll_us (at least 0)");
  }
  if (a->resident_ms < 0 || a->resident_ms >= 1000) return bad("--resident_ms (0..999)");
  if (a->serve_blocks > kSharedGpuDoorbellServeBlocks) {
    // Every simulated rank's serving launch shares this GPU: above the sidecars' cap for a shared
    // GPU the rows stalled (server/doorbell/doorbell_dispatch.h).
    std::fprintf(stderr,
                 "doorbell_bench: --serve_blocks must be at most %u (ranks share one GPU)\n",
                 kSharedGpuDoorbellServeBlocks);
    return false;
  }
  if (a->per_graph < 1 || a->ops < a->per_graph || a->tokens.empty()) {
    std::fprintf(stderr, "doorbell_bench: need --ops >= --per_graph >= 1 and some --tokens\n");
    return false;
  }
  return true;
}

#define BENCH_CHECK(cond, what)                                  \
  do {                                                           \
    if (!(cond)) {                                               \
      std::fprintf(stderr, "doorbell_bench: %s failed\n", what); \
      return -1.0;                                               \
    }                                                            \
  } while (false)

// Replays every rank's graph `replays` times (after one warm-up), concurrently; returns µs per
// op of the slowest rank, or a negative value on failure.
double TimeReplays(RankGroup& g, const std::vector<cudaGraphExec_t>& execs, int replays,
                   int per_graph) {
  const int world = g.world();
  std::vector<cudaEvent_t> start(world), stop(world);
  for (int r = 0; r < world; ++r) {
    cudaEventCreate(&start[r]);
    cudaEventCreate(&stop[r]);
  }
  for (int r = 0; r < world; ++r) cudaGraphLaunch(execs[r], g.client(r));  // warm-up
  BENCH_CHECK(g.SyncClients(absl::Seconds(60)).ok(), "warm-up replay");
  for (int r = 0; r < world; ++r) cudaEventRecord(start[r], g.client(r));
  for (int i = 0; i < replays; ++i) {
    for (int r = 0; r < world; ++r) cudaGraphLaunch(execs[r], g.client(r));
  }
  for (int r = 0; r < world; ++r) cudaEventRecord(stop[r], g.client(r));
  BENCH_CHECK(g.SyncClients(absl::Seconds(120)).ok(), "timed replays");
  float worst_ms = 0;
  for (int r = 0; r < world; ++r) {
    float ms = 0;
    cudaEventElapsedTime(&ms, start[r], stop[r]);
    worst_ms = std::max(worst_ms, ms);
    cudaEventDestroy(start[r]);
    cudaEventDestroy(stop[r]);
  }
  BENCH_CHECK(cudaGetLastError() == cudaSuccess, "CUDA");
  return worst_ms * 1000.0 / (static_cast<double>(replays) * per_graph);
}

template <typename Launch>
std::vector<cudaGraphExec_t> CaptureEach(RankGroup& g, int per_graph, Launch launch) {
  std::vector<cudaGraphExec_t> execs;
  PrepareDoorbellRing();  // no lazy module loading inside the capture
  for (int r = 0; r < g.world(); ++r) {
    cudaStream_t s = g.client(r);
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    for (int i = 0; i < per_graph; ++i) launch(r, s);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    if (cudaStreamEndCapture(s, &graph) == cudaSuccess &&
        cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
      execs.push_back(exec);
    }
    if (graph != nullptr) cudaGraphDestroy(graph);
  }
  return execs;
}

double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One line on where rank 0's in-place ops of `tokens` tokens spent their time, from its plane's
// trace: the serving launch's steps (block 0's view) and, between one op's completion and the
// next op's taking, the client's side (it sees the completion, its ring kernel ends, the next
// ring kernel starts, checks the slot and rings) plus the poll that notices the ring.
void PrintTrace(const std::vector<DoorbellTraceRecord>& trace, uint32_t tokens) {
  std::vector<DoorbellTraceRecord> ops;
  for (const DoorbellTraceRecord& r : trace) {
    if (r.op != 0 && r.tokens == tokens && r.completed > r.taken && r.completed_ns > r.taken_ns) {
      ops.push_back(r);
    }
  }
  if (ops.size() < 2) {
    std::printf("trace %u tokens: %zu in-place ops recorded\n", tokens, ops.size());
    return;
  }
  std::sort(ops.begin(), ops.end(), [](const DoorbellTraceRecord& x, const DoorbellTraceRecord& y) {
    return x.taken_ns < y.taken_ns;
  });
  // SM cycles to ns from the global timer between consecutive ops' `taken` stamps (block 0's
  // SM both times; the timer's resolution averages out). `completed_ns` is the completing
  // block's, which for an op of several blocks is not block 0.
  double cycles = 0, ns = 0;
  for (size_t i = 0; i + 1 < ops.size(); ++i) {
    if (ops[i + 1].op != ops[i].op + 1) continue;
    cycles += static_cast<double>(ops[i + 1].taken - ops[i].taken);
    ns += static_cast<double>(ops[i + 1].taken_ns - ops[i].taken_ns);
  }
  if (cycles <= 0) {
    std::printf("trace %u tokens: no consecutive in-place ops recorded\n", tokens);
    return;
  }
  const double us_per_cycle = ns / cycles / 1000.0;
  std::vector<double> announce, rows, all, complete, sidecar, gap, period, turnover, checks, take;
  for (size_t i = 0; i < ops.size(); ++i) {
    const DoorbellTraceRecord& r = ops[i];
    sidecar.push_back((static_cast<double>(r.completed_ns) - r.taken_ns) / 1000.0);
    announce.push_back((r.announced - r.taken) * us_per_cycle);
    rows.push_back((r.rows_done - r.announced) * us_per_cycle);
    all.push_back((r.all_done - r.rows_done) * us_per_cycle);
    complete.push_back((r.completed - r.all_done) * us_per_cycle);
    // Consecutive ops of one launch: the same block 0, so the same SM's cycle counter.
    if (i + 1 < ops.size() && ops[i + 1].op == r.op + 1) {
      gap.push_back((static_cast<double>(ops[i + 1].taken_ns) - r.completed_ns) / 1000.0);
      period.push_back((ops[i + 1].taken - r.taken) * us_per_cycle);
      const DoorbellTraceRecord& n = ops[i + 1];
      if (n.ring_start_ns != 0 && n.ring_release_ns >= n.ring_start_ns) {
        // Global timer: the completion's store -> the next ring kernel past griddepcontrol.wait
        // -> its release -> the serving warp took it.
        turnover.push_back((static_cast<double>(n.ring_start_ns) - r.completed_ns) / 1000.0);
        checks.push_back((n.ring_release_ns - n.ring_start_ns) / 1000.0);
        take.push_back((static_cast<double>(n.taken_ns) - n.ring_release_ns) / 1000.0);
      }
    }
  }
  std::printf(
      "trace %u tokens, rank 0, %zu ops (medians, us): taken->announced %.2f, announced->rows "
      "done %.2f, rows->all blocks %.2f, all->completed %.2f (block 0's view) | taken->completed "
      "%.2f | completed->next taken %.2f (client side + poll) | taken->next taken %.2f (%zu "
      "pairs; %.3f ns per SM cycle)\n",
      tokens, ops.size(), Median(announce), Median(rows), Median(all), Median(complete),
      Median(sidecar), Median(gap), Median(period), gap.size(), us_per_cycle * 1000.0);
  if (!turnover.empty()) {
    std::printf(
        "  ring stamps (%zu): completed->next ring started %.2f, ring checks %.2f, ring "
        "release->taken %.2f\n",
        turnover.size(), Median(turnover), Median(checks), Median(take));
  }
}

struct Row {
  uint32_t tokens = 0;
  double inprocess_us = 0;
  double doorbell_us = 0;
  bool correct = false;
  uint64_t idle = 0;
};

int Main(int argc, char** argv) {
  Args a;
  if (HelpOrVersion(argc, argv)) return 0;
  if (!Parse(argc, argv, &a)) return 2;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "doorbell_bench: no CUDA device\n");
    return 2;
  }
  int device = 0;
  cudaGetDevice(&device);
  const MpsInfo mps = DetectMpsOnDevice(device);
  DoorbellSelfTestOptions so;
  so.device = device;
  so.hidden = a.hidden;
  so.programmatic_launch = a.pdl;
  auto self = RunDoorbellSelfTest(so);
  DoorbellHopReport hop;
  if (self.ok()) {
    hop = *self;
  } else {
    hop.error = self.status().ToString();
  }
  std::printf("%s\n", DescribeDoorbell(hop, mps.active()).c_str());
  std::printf(
      "world=%d hidden=%u dtype=bf16 algo=%s ops=%d per_graph=%d queue=%u poll_us=%d "
      "max_poll_us=%s pdl=%d serve_blocks=%u; ranks simulated in one process on one GPU; %s\n",
      a.world, a.hidden, a.algo == FusionAlgo::kOneShot ? "oneshot" : "twoshot", a.ops, a.per_graph,
      a.queue, a.poll_us, a.max_poll_us < 0 ? "default" : absl::StrCat(a.max_poll_us).c_str(),
      a.pdl ? 1 : 0, a.serve_blocks, mps.Describe().c_str());
  const uint32_t max_tokens = *std::max_element(a.tokens.begin(), a.tokens.end());
  RankGroup g(GroupShape{a.world, max_tokens, a.hidden, DType::kBF16});
  if (!g.ok() || !g.Init().ok()) {
    std::fprintf(stderr, "doorbell_bench: could not set up %d ranks\n", a.world);
    return 1;
  }
  DoorbellPlaneOptions po;
  po.device = device;
  po.queue_depth = a.queue;
  po.poll_interval = absl::Microseconds(a.poll_us);
  if (a.max_poll_us >= 0) po.max_poll_interval = absl::Microseconds(a.max_poll_us);
  po.idle_timeout = absl::Seconds(1);
  po.programmatic_launch = a.pdl;
  po.serve_blocks = a.serve_blocks;
  std::vector<std::unique_ptr<DoorbellPlane>> planes;
  for (int r = 0; r < a.world; ++r) {
    DoorbellPlaneOptions o = po;
    o.stream = g.sidecar(r);
    o.local_workspace = g.workspace(r);
    o.layout = g.layout();
    o.host_abort = g.host_abort().device();
    if (a.trace && r == 0) o.trace_ops = 8192;
    auto p = DoorbellPlane::Create(o);
    if (!p.ok()) {
      std::fprintf(stderr, "doorbell_bench: %s\n", p.status().ToString().c_str());
      return 1;
    }
    planes.push_back(std::move(*p));
  }
  std::vector<DoorbellSlot*> slots;
  for (int r = 0; r < a.world; ++r) {
    DoorbellPlanOptions opts;
    opts.max_tokens = max_tokens;
    opts.twoshot_min_tokens = a.algo == FusionAlgo::kTwoShot ? 1 : 0xffffffffu;
    auto h = planes[r]->AddPlan(g.Params(r, 0, a.algo), opts);
    if (!h.ok() || !planes[r]->Start().ok()) {
      std::fprintf(stderr, "doorbell_bench: plan: %s\n", h.status().ToString().c_str());
      return 1;
    }
    slots.push_back(planes[r]->slot_for_testing(h->slot));
  }
  // The scope libarfuse_ring would pick (GPU scope: every simulated rank is on the slots' GPU),
  // or system scope with --system_scope.
  std::vector<DoorbellScope> scopes(a.world, DoorbellScope::kSystem);
  for (int r = 0; r < a.world && !a.system_scope; ++r) {
    if (PrepareDoorbellRing() != cudaSuccess ||
        DoorbellRingScopeForSlot(slots[r], &scopes[r]) != cudaSuccess) {
      std::fprintf(stderr, "doorbell_bench: cannot work out the ring scope\n");
      return 1;
    }
  }
  std::printf("ring scope: %s\n",
              scopes[0] == DoorbellScope::kDevice ? "device (kDoorbellRequestLocal)" : "system");
  std::mt19937 rng(1);
  const int replays = a.ops / a.per_graph;
  std::vector<Row> rows;
  bool all_ok = true;
  std::printf("\n%8s %16s %16s %12s %8s\n", "tokens", "in-process us", "doorbell us", "hop us",
              "check");
  for (uint32_t t : a.tokens) {
    Row row;
    row.tokens = t;
    HostOp op(a.world, t, a.hidden, DType::kBF16);
    op.FillRandom(rng);
    if (!op.Upload(g).ok()) return 1;
    auto reference = CaptureEach(g, a.per_graph, [&](int r, cudaStream_t s) {
      LaunchAllReduceFusion(g.Params(r, t, a.algo), s);
    });
    auto rings = CaptureEach(g, a.per_graph, [&](int r, cudaStream_t s) {
      LaunchDoorbellRing(slots[r], t, 10'000'000'000ull, s, scopes[r]);
    });
    if (static_cast<int>(reference.size()) != a.world ||
        static_cast<int>(rings.size()) != a.world) {
      std::fprintf(stderr, "doorbell_bench: graph capture failed\n");
      return 1;
    }
    row.inprocess_us = TimeReplays(g, reference, replays, a.per_graph);
    // The in-process ops ran on the client streams; the doorbell ops run on the sidecar streams.
    // Both use the same workspaces in the same order on every rank, so they may follow each other.
    const uint64_t idle_before = planes[0]->Status().idle;
    if (a.trace && !planes[0]->ClearTrace().ok()) return 1;
    {
      // A run that stalls says what the planes see (ops served, waiters that idled out, launches
      // in flight) every 2 s after the first 5.
      absl::Notification done;
      std::thread watchdog([&] {
        for (int waited = 0; !done.WaitForNotificationWithTimeout(absl::Seconds(waited ? 2 : 5));
             ++waited) {
          for (int r = 0; r < a.world; ++r) {
            const DoorbellPlaneStatus st = planes[r]->Status();
            std::printf(
                "stalled? tokens=%u rank=%d served=%llu idle=%llu kicked=%llu inflight=%u "
                "health=%s\n",
                t, r, static_cast<unsigned long long>(st.served),
                static_cast<unsigned long long>(st.idle),
                static_cast<unsigned long long>(st.kicked), st.inflight,
                st.health.ok() ? "ok" : std::string(st.health.message()).c_str());
          }
          std::fflush(stdout);
        }
      });
      row.doorbell_us = TimeReplays(g, rings, replays, a.per_graph);
      done.Notify();
      watchdog.join();
    }
    row.idle = planes[0]->Status().idle - idle_before;
    if (a.trace) {
      auto trace = planes[0]->ReadTrace();
      if (!trace.ok()) {
        std::fprintf(stderr, "doorbell_bench: %s\n", trace.status().ToString().c_str());
        return 1;
      }
      PrintTrace(*trace, t);
    }
    uint32_t slot_error = 0;
    for (int r = 0; r < a.world; ++r) {
      DoorbellSlot s;
      cudaMemcpy(&s, slots[r], sizeof(s), cudaMemcpyDeviceToHost);
      slot_error |= s.error;
    }
    row.correct = slot_error == 0 && op.Verify(g, Pattern::kAllReduceResidualRmsNorm).empty();
    all_ok = all_ok && row.correct && row.inprocess_us > 0 && row.doorbell_us > 0;
    std::printf("%8u %16.2f %16.2f %+12.2f %8s\n", t, row.inprocess_us, row.doorbell_us,
                row.doorbell_us - row.inprocess_us, row.correct ? "ok" : "WRONG");
    std::fprintf(stderr,
                 "doorbell_bench: [%zu/%zu] %u tokens: in-process %.2f us, doorbell %.2f us%s\n",
                 rows.size() + 1, a.tokens.size(), t, row.inprocess_us, row.doorbell_us,
                 row.correct ? "" : " WRONG");
    for (cudaGraphExec_t e : reference) cudaGraphExecDestroy(e);
    for (cudaGraphExec_t e : rings) cudaGraphExecDestroy(e);
    rows.push_back(row);
  }
  // The serving launches stay resident (idle timeout 1 s) and nothing rings: what the planes' host
  // threads cost while a serving client pauses between steps.
  double resident_looks_per_s = 0, resident_cpu_percent = 0;
  if (a.resident_ms > 0) {
    uint64_t looks = 0;
    for (auto& p : planes) looks -= p->Status().host_polls;
    const double cpu0 = ProcessCpuSeconds();
    absl::SleepFor(absl::Milliseconds(a.resident_ms));
    const double cpu = ProcessCpuSeconds() - cpu0;
    for (auto& p : planes) looks += p->Status().host_polls;
    resident_looks_per_s = static_cast<double>(looks) / a.world / (a.resident_ms * 1e-3);
    resident_cpu_percent = 100.0 * cpu / (a.resident_ms * 1e-3);
    std::printf(
        "\nresident %d ms, no rings: %.0f host-thread looks/s per plane, process CPU %.1f%% of a "
        "core (%d planes)\n",
        a.resident_ms, resident_looks_per_s, resident_cpu_percent, a.world);
  }
  if (!a.json.empty()) {
    // JsonNumber: a figure that could not be measured (NaN) is null, not printf's "nan".
    std::string j = absl::StrFormat(
        "{\"world\": %d, \"hidden\": %u, \"algo\": \"%s\", \"ops\": %d, \"queue\": %u, "
        "\"pdl\": %s, \"poll_us\": %d, \"max_poll_us\": %s, \"resident_ms\": %d, "
        "\"resident_looks_per_s\": %s, \"resident_cpu_percent\": %s, "
        "\"mps\": %s, \"self_test\": {\"measured\": %s, \"hop_us\": %s, \"doorbell_us\": %s, "
        "\"inprocess_us\": %s}, \"rows\": [",
        a.world, a.hidden, a.algo == FusionAlgo::kOneShot ? "oneshot" : "twoshot", a.ops, a.queue,
        JsonBool(a.pdl), a.poll_us, JsonNumber(absl::ToDoubleMicroseconds(po.max_poll_interval), 0),
        a.resident_ms, JsonNumber(resident_looks_per_s, 1), JsonNumber(resident_cpu_percent, 2),
        JsonBool(mps.active()), JsonBool(hop.measured), JsonNumber(hop.hop_us, 3),
        JsonNumber(hop.doorbell_us_per_op, 3), JsonNumber(hop.inprocess_us_per_op, 3));
    for (size_t i = 0; i < rows.size(); ++i) {
      absl::StrAppendFormat(&j,
                            "%s{\"tokens\": %u, \"inprocess_us\": %s, \"doorbell_us\": %s, "
                            "\"hop_us\": %s, \"correct\": %s, \"idle_waiters\": %u}",
                            i == 0 ? "" : ", ", rows[i].tokens, JsonNumber(rows[i].inprocess_us, 3),
                            JsonNumber(rows[i].doorbell_us, 3),
                            JsonNumber(rows[i].doorbell_us - rows[i].inprocess_us, 3),
                            JsonBool(rows[i].correct), static_cast<unsigned>(rows[i].idle));
    }
    j += "]}\n";
    std::ofstream(a.json) << j;
  }
  planes.clear();
  return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace arfuse

int main(int argc, char** argv) { return arfuse::Main(argc, argv); }
