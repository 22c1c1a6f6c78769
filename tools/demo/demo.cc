// arfuse-demo: starts N arfused sidecars and N client processes (one per rank) and runs the fused
// op for several shapes on each data plane: in-stream (the default plane: the client attaches and
// libarfuse_client runs the op, in host mode the CPU op in the client process, with CUDA the
// sidecar's kernel captured in a CUDA graph and replayed with new inputs), eager (one
// Fusion.Execute per op on registered regions) and, with --device=cuda, doorbell (a ring kernel
// captured in a CUDA graph). It checks every output against the CPU reference and prints a table
// (shape, plane, path, us per op, cost against the in-stream row, max error). Exits non-zero on
// any wrong result or failed call.
//
//   arfuse-demo --ranks=2 --tokens=1,16,128 --hidden=1024,4096 [--device=host|cuda] [--json]
//               [--planes=instream,eager,doorbell] [--doorbell=auto|on|off]
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
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/json.h"
#include "common/version.h"
#include "tools/demo/demo_client.h"
#include "tools/demo/demo_flags.h"
#include "tools/demo/demo_shape.h"
#if defined(ARFUSE_DEMO_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace arfuse::demo {
namespace {

// ---------------------------------------------------------------- parent

std::string FindArfused(const char* argv0) {
  std::string flag = absl::GetFlag(FLAGS_arfused);
  if (!flag.empty()) return flag;
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    // build/tools/demo/arfuse-demo -> build/server/daemon/arfused
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
  auto planes = ParsePlanes(absl::GetFlag(FLAGS_planes), device, absl::GetFlag(FLAGS_doorbell));
  for (const absl::Status& s : {tokens.status(), hidden.status(), dt.status(), planes.status()}) {
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
    std::vector<std::string> args = {
        arfused,
        "--device=" + device,
        absl::StrCat("--rank=", r),
        absl::StrCat("--world-size=", ranks),
        "--peer-dir=" + dir + "/peers",
        "--socket=" + SocketOf(dir, r),
        "--health-port=0",
        absl::StrCat("--max-tokens=", max_t),
        absl::StrCat("--hidden=", max_h),
        "--dtype=" + absl::GetFlag(FLAGS_dtype),
        "--log-level=info",
        absl::StrCat("--spin-timeout=", 5),
        absl::GetFlag(FLAGS_backend).empty()
            ? std::string("--enable-deterministic-inference=false")
            : "--flashinfer-allreduce-fusion-backend=" + absl::GetFlag(FLAGS_backend)};
    // Host mode has no GPU to decide on: the sidecars decide as an SM 90 (H200) group, as the
    // host-mode tests do, so that --backend=auto turns fusion on and the in-stream plane can
    // attach (without it the config rules leave fusion off on a CPU machine).
    if (device == "host") args.push_back("--sm=90");
    sidecars.push_back(Spawn(args, absl::StrCat(dir, "/arfused.", r, ".log")));
  }
  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  for (int r = 0; r < ranks; ++r) {
    clients.push_back(Spawn(
        {self, absl::StrCat("--client_rank=", r), "--work_dir=" + dir,
         absl::StrCat("--ranks=", ranks), "--device=" + device,
         "--tokens=" + absl::GetFlag(FLAGS_tokens), "--hidden=" + absl::GetFlag(FLAGS_hidden),
         "--dtype=" + absl::GetFlag(FLAGS_dtype),
         absl::StrCat("--iters=", absl::GetFlag(FLAGS_iters)),
         "--planes=" + absl::GetFlag(FLAGS_planes), "--doorbell=" + absl::GetFlag(FLAGS_doorbell),
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

  // Gather: one row per shape and plane, worst case over ranks.
  struct Row {
    Plane plane = Plane::kEager;
    uint32_t t = 0, h = 0;
    std::string path = "-";
    double us = 0, err = 0;
    bool ok = true;
    int seen = 0;
    std::string why;
    // Not run on this plane (a refused attach or doorbell plan, a declined shape), not failed.
    bool skipped() const { return ok && (path == "skipped" || path == "declined"); }
  };
  std::vector<Row> rows;  // by shape, then plane (the table's order)
  for (uint32_t t : *tokens)
    for (uint32_t h : *hidden)
      for (Plane p : planes->planes()) {
        Row row;
        row.plane = p;
        row.t = t;
        row.h = h;
        rows.push_back(row);
      }
  std::vector<std::string> errors;
  for (int r = 0; r < ranks; ++r) {
    std::ifstream in(absl::StrCat(dir, "/result.", r));
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      std::string kind, plane;
      ls >> kind;
      if (kind == "error") {
        errors.push_back(absl::StrCat("rank ", r, ": ", line.substr(6)));
        continue;
      }
      if (kind != "row") continue;
      Row got;
      int ok = 0;
      ls >> plane >> got.t >> got.h >> got.path >> got.us >> got.err >> ok;
      std::getline(ls, got.why);
      for (Row& row : rows) {
        if (PlaneName(row.plane) != plane || row.t != got.t || row.h != got.h) continue;
        row.seen++;
        row.path = got.path;
        row.us = std::max(row.us, got.us);
        row.err = std::max(row.err, got.err);
        if (!ok || ((got.path == "skipped" || got.path == "declined") && row.why.empty())) {
          row.why = absl::StrCat("rank ", r, ":", got.why);
        }
        if (!ok) row.ok = false;
      }
    }
  }
  for (Row& row : rows) {
    if (row.seen != ranks) {
      row.ok = false;
      if (row.why.empty()) row.why = absl::StrCat(row.seen, " of ", ranks, " ranks reported");
    }
    if (!row.ok) rc = 1;
  }
  if (!errors.empty()) rc = 1;
  // What a row costs against the in-stream row of its shape (us per op over the in-stream row's),
  // where that row ran.
  auto vs_instream = [&](const Row& row) -> std::optional<double> {
    for (const Row& is : rows) {
      if (is.plane != Plane::kInStream || is.t != row.t || is.h != row.h) continue;
      if (!is.ok || is.skipped() || !row.ok || row.skipped() || !(is.us > 0)) return std::nullopt;
      return row.us / is.us;
    }
    return std::nullopt;
  };
  const char* dname = DTypeName(*dt);
  std::vector<std::string> names;
  for (Plane p : planes->planes()) names.push_back(PlaneName(p));
  if (absl::GetFlag(FLAGS_json)) {
    std::vector<std::string> items;
    for (const Row& row : rows) {
      const std::optional<double> vs = vs_instream(row);
      // JsonNumber: a NaN error (a rank's output not a number) is null, not printf's "nan".
      items.push_back(absl::StrFormat(
          "{\"tokens\":%u,\"hidden\":%u,\"dtype\":%s,\"plane\":%s,\"path\":%s,"
          "\"us_per_op\":%s,\"vs_instream\":%s,\"max_error\":%s,\"ok\":%s,\"skipped\":%s,"
          "\"reason\":%s}",
          row.t, row.h, JsonQuote(dname), JsonQuote(PlaneName(row.plane)), JsonQuote(row.path),
          JsonNumber(row.us, 2), vs ? JsonNumber(*vs, 2) : std::string("null"),
          JsonNumber(row.err, 3, 'g'), JsonBool(row.ok), JsonBool(row.skipped()),
          JsonQuote(std::string(absl::StripAsciiWhitespace(row.why)))));
    }
    std::cout << absl::StrFormat(
        "{\"device\":%s,\"ranks\":%d,\"planes\":[%s],\"results\":[%s],\"ok\":%s}\n",
        JsonQuote(device), ranks,
        absl::StrJoin(names, ",", [](std::string* o, const std::string& n) { *o += JsonQuote(n); }),
        absl::StrJoin(items, ","), JsonBool(rc == 0));
  } else {
    std::cout << absl::StrFormat(
        "arfuse-demo: device=%s ranks=%d dtype=%s (planes: %s; %s)\n", device, ranks, dname,
        absl::StrJoin(names, ", "),
        device != "cuda"
            ? "host mode: in-stream runs the CPU op in the client process, doorbell needs "
              "--device=cuda"
        : planes->runs(Plane::kDoorbell)
            ? "the in-stream op and the doorbell ring captured in CUDA graphs and replayed"
            : "the in-stream op captured in a CUDA graph and replayed");
    std::cout << absl::StrFormat("%-10s %-9s %-8s %10s %11s %10s  %s\n", "shape", "plane", "path",
                                 "us/op", "vs instream", "max err", "result");
    for (const Row& row : rows) {
      const std::optional<double> vs = vs_instream(row);
      std::string result = "ok";
      if (!row.ok) {
        result = "FAIL " + row.why;
      } else if (row.skipped()) {
        result = absl::StrCat(row.path, " (", absl::StripAsciiWhitespace(row.why), ")");
      }
      std::cout << absl::StrFormat(
          "%-10s %-9s %-8s %10.1f %11s %10.3g  %s\n", absl::StrCat(row.t, "x", row.h),
          PlaneName(row.plane), row.path, row.us,
          vs ? absl::StrFormat(*vs < 10 ? "%.2fx" : "%.1fx", *vs) : std::string("-"), row.err,
          result);
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
