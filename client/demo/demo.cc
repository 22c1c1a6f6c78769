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
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/demo/demo_client.h"
#include "client/demo/demo_flags.h"
#include "client/demo/demo_shape.h"
#include "server/core/json.h"
#include "server/core/version.h"
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
