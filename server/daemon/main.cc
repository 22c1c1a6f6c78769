// arfused: the arfuse sidecar of one GPU rank.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <thread>

#include "common/log.h"
#include "common/version.h"
#include "server/daemon/options.h"
#include "server/daemon/sidecar.h"
#include "spdlog/spdlog.h"

namespace {

// Bad input to the process exits 2 with one line naming the problem.
constexpr int kUsageExit = 2;

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "arfused: %s\n", std::string(status.message()).c_str());
  return kUsageExit;
}

}  // namespace

int main(int argc, char** argv) {
  // Signals are taken by one thread with sigwait; block them before any other thread exists so
  // that gRPC's threads inherit the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A peer or client that goes away must not kill us through a write to its socket.
  signal(SIGPIPE, SIG_IGN);

  auto parsed = arfuse::ParseDaemonCommandLine(argc, argv);
  if (!parsed.ok()) return Fail(parsed.status());
  if (parsed->outcome == arfuse::ParseOutcome::kHelp) {
    std::fputs(arfuse::DaemonUsage().c_str(), stdout);
    return 0;
  }
  if (parsed->outcome == arfuse::ParseOutcome::kVersion) {
    std::printf("%s\n", arfuse::VersionLine("arfused").c_str());
    return 0;
  }
  arfuse::DaemonOptions options = std::move(parsed->options);
  if (auto st = arfuse::InitLogging(options.log_level, options.log_format); !st.ok()) {
    return Fail(st);
  }
  for (const std::string& w : options.warnings)
    spdlog::warn("event=config_warning warning=\"{}\"", w);
  spdlog::info("event=start version={} git={} config=\"{}\"", arfuse::kVersion,
               arfuse::kGitRevision, arfuse::DescribeOptions(options));

  arfuse::Sidecar sidecar(std::move(options));
  if (auto st = sidecar.Start(); !st.ok()) {
    spdlog::error("event=start_failed error=\"{}\"", st.message());
    return Fail(st);
  }
  std::printf("arfused ready to accept: socket=%s health_port=%d\n", sidecar.socket_path().c_str(),
              sidecar.health_port());
  std::fflush(stdout);

  std::thread signal_thread([&sidecar, signals] {
    int sig = 0;
    sigwait(&signals, &sig);
    sidecar.RequestShutdown(sig == SIGTERM ? "SIGTERM" : "SIGINT");
  });
  int code = sidecar.Wait();
  // The signal thread may still be in sigwait when shutdown came from elsewhere; wake it.
  pthread_kill(signal_thread.native_handle(), SIGTERM);
  signal_thread.join();
  // The group supervisor may still be waiting for peers (bounded by --peer-timeout); exit without
  // running destructors that would wait for it.
  spdlog::shutdown();
  std::fflush(nullptr);
  std::_Exit(code);
}
