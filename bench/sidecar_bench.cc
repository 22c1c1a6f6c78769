// arfuse-bench sidecar: the sidecar's data planes per op, each against its yardstick measured in
// the same run (the targets: docs/performance.md).
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
//                after the enqueue, the client's stream waits on done_event (docs/api.md). Host
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
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/rank_launch.h"
#include "bench/sidecar_client.h"
#include "bench/sidecar_flags.h"
#include "bench/sidecar_report.h"
#include "bench/sidecar_rows.h"
#include "bench/subcommands.h"

#if defined(ARFUSE_BENCH_CUDA)
#include <cuda_runtime_api.h>
#endif

extern char** environ;

namespace arfuse::bench {
namespace {

using sidecar::Check;
using sidecar::Gathered;
using sidecar::RowResult;
using sidecar::SocketOf;
using Flags = SidecarFlags;

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

  Gathered g = sidecar::GatherResults(dir, f.ranks, std::move(launch_errors));
  const std::vector<std::string>& errors = g.errors;
  std::map<const RowResult*, std::string> vs;
  const std::vector<Check> checks = sidecar::CheckTargets(f, g.rows, &vs);
  bool row_failed = false;
  for (const RowResult& r : g.rows) row_failed = row_failed || r.failed;
  if (!errors.empty() || row_failed) rc = 1;

  rc = sidecar::Report(f, g, checks, vs, rc);

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
  absl::StatusOr<Flags> f = ParseSidecarFlags(argc, argv);
  if (!f.ok()) {
    std::fprintf(stderr, "arfuse-bench sidecar: %s\n", f.status().ToString().c_str());
    return 2;
  }
  if (f->outcome != FlagOutcome::kRun) return PrintSidecarHelpOrVersion(f->outcome);
  if (f->client_rank >= 0) {
    if (f->dir.empty()) {
      std::fprintf(stderr, "arfuse-bench sidecar: --client_rank needs --dir\n");
      return 2;
    }
    return sidecar::ClientMain(*f);
  }
  return Launch(*f);
}

}  // namespace arfuse::bench
