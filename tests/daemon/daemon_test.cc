// arfused as a process: flags and their errors, the socket cases, health on both endpoints,
// graceful shutdown.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <regex>
#include <string>
#include <thread>

#include "arfuse/v1/fusion.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/daemon/daemon_test_util.h"
#include "tests/support/daemon_process.h"
#include "tests/support/subprocess.h"

namespace arfuse {
namespace {

using ::arfuse::testing::ArfusedPath;
using ::arfuse::testing::ExitsWith2;
using ::arfuse::testing::HealthCheck;
using ::arfuse::testing::MakeTempDir;
using ::arfuse::testing::RunToCompletion;
using ::arfuse::testing::Subprocess;
using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

// A running arfused on a fresh socket; waits for its "ready to accept" line.
using Daemon = ::arfuse::testing::DaemonProcess;

TEST(DaemonFlags, UnknownFlagExits2WithOneLine) {
  auto [code, out] = RunToCompletion({ArfusedPath(), "--bogus-flag=1"});
  EXPECT_EQ(code, 2);
  EXPECT_THAT(out, HasSubstr("unknown flag --bogus-flag"));
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
}

TEST(DaemonFlags, MalformedValueExits2) {
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--rank=x"}, "bad value \"x\" for --rank"));
}

TEST(DaemonFlags, RankOutsideWorldSizeExits2) {
  EXPECT_TRUE(
      ExitsWith2({ArfusedPath(), "--rank=2", "--world-size=2"}, "--rank must be in [0, 2)"));
}

TEST(DaemonFlags, DoorbellServeBlocksOutOfRangeExits2) {
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--doorbell-serve-blocks=129"},
                         "--doorbell-serve-blocks must be 0..128, got 129"));
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--doorbell-serve-blocks=-1"},
                         "--doorbell-serve-blocks must be 0..128, got -1"));
}

TEST(DaemonFlags, SmBudgetOutOfRangeExits2) {
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--sm-budget=-1"},
                         "--sm-budget must be 0..1024 (0: automatic), got -1"));
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--sm-budget=1025"},
                         "--sm-budget must be 0..1024 (0: automatic), got 1025"));
}

TEST(DaemonFlags, PeerHeartbeatTimeoutOutOfRangeExits2) {
  for (const char* bad : {"-1", "0.05", "3601", "nan"}) {
    EXPECT_TRUE(ExitsWith2({ArfusedPath(), std::string("--peer-heartbeat-timeout=") + bad},
                           "--peer-heartbeat-timeout must be 0 (off) or between 0.1 and 3600 "
                           "seconds, got"))
        << bad;
  }
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--device=host"},
                         "bad value \"soon\" for --peer-heartbeat-timeout",
                         {"ARFUSE_PEER_HEARTBEAT_TIMEOUT=soon"}));
}

TEST(DaemonFlags, BadEnumValuesExit2) {
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--device=tpu"}, "--device: expected one of cuda, host"));
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--flashinfer-allreduce-fusion-backend=nccl"},
                         "expected one of auto, trtllm, mnnvl"));
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--log-level=loud"}, "--log-level"));
}

TEST(DaemonFlags, RangeAndChoiceChecksExit2) {
  struct Case {
    std::vector<std::string> args;
    std::string text;
  };
  const Case cases[] = {
      {{"--world-size=0"}, "--world-size must be between 1 and 16, got 0"},
      // Above the workspace's rank slots: refused at startup, not left never becoming ready.
      {{"--world-size=17"}, "--world-size must be between 1 and 16, got 17"},
      {{"--world-size=2", "--nnodes=3"}, "--nnodes must be between 1 and --world-size (2), got 3"},
      {{"--health-port=65536"}, "--health-port must be between 0 and 65535, got 65536"},
      {{"--metrics-port=-2"}, "--metrics-port must be -1 (off) or between 0 and 65535, got -2"},
      {{"--cuda-graph-mode=partial"},
       "bad value \"partial\" for --cuda-graph-mode: expected one of none, piecewise, full"},
      {{"--dtype=int8"}, "bad value \"int8\" for --dtype: expected one of bf16, fp16, fp32"},
      {{"--sm=9"}, "--sm must be major*10+minor (for example 90 or 100) between 10 and 999, got 9"},
      {{"--sm=1000"},
       "--sm must be major*10+minor (for example 90 or 100) between 10 and 999, got 1000"},
      {{"--max-tokens=0"}, "--max-tokens must be positive, got 0"},
      {{"--hidden=100"}, "--hidden must be a positive multiple of 8, got 100"},
      {{"--hidden=0"}, "--hidden must be a positive multiple of 8, got 0"},
      {{"--peer-timeout=0"}, "--peer-timeout must be a positive number of seconds, got 0"},
      {{"--spin-timeout=-1"}, "--spin-timeout must be a positive number of seconds, got -1"},
      {{"--grace-period=0"}, "--grace-period must be a positive number of seconds, got 0"},
      {{"--default-deadline=nan"},
       "--default-deadline must be a positive number of seconds, got nan"},
      {{"--max-connections-per-uid=-1"},
       "--max-connections-per-uid must be 0 (no cap) or positive, got -1"},
      {{"--max-fd-connections-per-uid=-1"},
       "--max-fd-connections-per-uid must be 0 (no cap) or positive, got -1"},
      {{"--max-pending-fds=-1"},
       "--max-pending-fds and --max-pending-fds-per-uid must be 0 (derived from RLIMIT_NOFILE) "
       "or positive, got -1 and 0"},
      {{"--max-pending-fds-per-uid=8"},
       "--max-pending-fds and --max-pending-fds-per-uid must be at least 16 (one DEPOSIT's "
       "descriptors), got 0 and 8"},
      {{"--max-pending-fds=32", "--max-pending-fds-per-uid=64"},
       "--max-pending-fds-per-uid (64) must not exceed --max-pending-fds (32)"},
      // Not an address of this host: the metrics port cannot bind it.
      {{"--metrics-port=0", "--metrics-host=192.0.2.1"}, "cannot serve metrics on 192.0.2.1:0"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {ArfusedPath(), "--device=host"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    EXPECT_TRUE(ExitsWith2(argv, c.text)) << c.args.back();
  }
}

TEST(DaemonFlags, EmptyFlagExits2) {
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--"}, "empty flag \"--\""));
}

TEST(DaemonFlags, PositionalArgumentExits2) {
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "serve"}, "unexpected argument \"serve\""));
}

TEST(DaemonFlags, MissingValueExits2) {
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--socket"}, "flag --socket needs a value"));
}

TEST(DaemonFlags, HelpExplainsHyphenatedFlags) {
  auto [code, out] = RunToCompletion({ArfusedPath(), "--help"});
  EXPECT_EQ(code, 0);
  for (const char* flag :
       {"--socket", "--health-port", "--device", "--rank", "--world-size", "--nnodes", "--peer-dir",
        "--peer-heartbeat-timeout", "--log-level", "--flashinfer-allreduce-fusion-backend",
        "--enable-flashinfer-allreduce-fusion"}) {
    EXPECT_THAT(out, HasSubstr(flag)) << flag;
  }
  EXPECT_THAT(out, HasSubstr("Deprecated"));
}

TEST(DaemonFlags, VersionPrintsVersion) {
  auto [code, out] = RunToCompletion({ArfusedPath(), "--version"});
  EXPECT_EQ(code, 0);
  EXPECT_THAT(out, HasSubstr("arfused 0."));
  EXPECT_THAT(out, HasSubstr("api 1."));
}

TEST(DaemonFlags, EnvironmentValueIsCheckedAndNamed) {
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--device=host"}, "ARFUSE_HEALTH_PORT",
                         {"ARFUSE_HEALTH_PORT=abc"}));
}

TEST(DaemonFlags, ConfigFileErrorsNameFileAndLine) {
  std::string dir = MakeTempDir();
  std::ofstream(dir + "/arfused.conf") << "# comment\nlog-level=debug\nno_such_flag=1\n";
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--config=" + dir + "/arfused.conf"},
                         "arfused.conf:3: unknown flag --no-such-flag"));
}

TEST(DaemonFlags, UnreadableOrNestedConfigFileExits2) {
  std::string dir = MakeTempDir();
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--config=" + dir + "/missing.conf"},
                         "--config: cannot read " + dir + "/missing.conf"));
  std::ofstream(dir + "/nested.conf") << "log-level=debug\nconfig=/etc/other.conf\n";
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--config=" + dir + "/nested.conf"},
                         "nested.conf:2: --config is not allowed in a file"));
}

TEST(DaemonFlags, PrecedenceCliOverEnvOverFile) {
  std::string dir = MakeTempDir();
  std::ofstream(dir + "/arfused.conf") << "group=from-file\nmax-tokens=64\nhidden=1024\n";
  Daemon d({"--config=" + dir + "/arfused.conf", "--hidden=512"},
           {"ARFUSE_MAX_TOKENS=128", "ARFUSE_HIDDEN=256"});
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  std::string log = d.proc->Stderr();
  EXPECT_THAT(log, HasSubstr("group=from-file(file)"));
  EXPECT_THAT(log, HasSubstr("max_tokens=128(env)"));
  EXPECT_THAT(log, HasSubstr("hidden=512(cli)"));
}

TEST(DaemonSocket, TooLongPathExits2) {
  std::string path = "/tmp/" + std::string(120, 'x') + ".sock";
  EXPECT_TRUE(
      ExitsWith2({ArfusedPath(), "--socket=" + path, "--device=host"}, "longer than the 107"));
}

TEST(DaemonSocket, MissingDirectoryExits2) {
  EXPECT_TRUE(
      ExitsWith2({ArfusedPath(), "--socket=/tmp/arfuse-no-such-dir-9/a.sock", "--device=host"},
                 "socket directory /tmp/arfuse-no-such-dir-9 does not exist"));
}

TEST(DaemonSocket, SecondDaemonOnLiveSocketExits2) {
  Daemon first;
  ASSERT_TRUE(first.ready) << first.proc->Stderr();
  EXPECT_TRUE(
      ExitsWith2({ArfusedPath(), "--socket=" + first.socket, "--health-port=0", "--device=host"},
                 "another arfused is already serving on"));
  // The first one is untouched.
  EXPECT_TRUE(HealthCheck("unix:" + first.socket).ok());
}

TEST(DaemonSocket, StaleSocketIsReplaced) {
  std::string dir = MakeTempDir();
  std::string path = dir + "/a.sock";
  // A socket file with nobody listening, as a killed process leaves it.
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(fd);
  Subprocess p({ArfusedPath(), "--socket=" + path, "--health-port=0", "--device=host"});
  ASSERT_TRUE(p.WaitForOutput("ready to accept", 30s)) << p.Stderr();
  EXPECT_THAT(p.Stderr(), HasSubstr("event=stale_socket_removed"));
  EXPECT_TRUE(HealthCheck("unix:" + path).ok());
}

TEST(DaemonSocket, HealthPortInUseExits2) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int port = ntohs(addr.sin_port);
  std::string dir = MakeTempDir();
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--socket=" + dir + "/a.sock",
                          "--health-port=" + std::to_string(port), "--device=host"},
                         "cannot listen on health port"));
  ::close(fd);
}

TEST(DaemonHealth, BothEntriesOnSocketAndPort) {
  Daemon d;
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  ASSERT_GT(d.health_port, 0);
  struct stat st {};
  ASSERT_EQ(::stat(d.socket.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660);
  for (const std::string& addr :
       {"unix:" + d.socket, "127.0.0.1:" + std::to_string(d.health_port)}) {
    HealthCheckResponse response;
    ASSERT_TRUE(HealthCheck(addr, "", &response).ok()) << addr;
    EXPECT_EQ(response.status(), HealthCheckResponse::SERVING) << addr;
    // A one-rank group is complete at once, so readiness follows.
    bool ready = false;
    for (int i = 0; i < 200 && !ready; ++i) {
      ASSERT_TRUE(HealthCheck(addr, "arfuse.v1.Fusion", &response).ok()) << addr;
      ready = response.status() == HealthCheckResponse::SERVING;
      if (!ready) std::this_thread::sleep_for(50ms);
    }
    EXPECT_TRUE(ready) << addr;
    grpc::Status unknown = HealthCheck(addr, "no.such.Service", &response);
    EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND) << addr;
    EXPECT_EQ(unknown.error_message(), "unknown health entry") << addr;
  }
}

TEST(DaemonHealth, ReadinessWaitsForPeers) {
  // Rank 0 of two, with rank 1 never started: alive, not ready.
  std::string peers = MakeTempDir();
  Daemon d({"--world-size=2", "--rank=0", "--peer-dir=" + peers, "--peer-timeout=300"});
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  HealthCheckResponse response;
  ASSERT_TRUE(HealthCheck("unix:" + d.socket, "", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
  ASSERT_TRUE(HealthCheck("unix:" + d.socket, "arfuse.v1.Fusion", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
}

TEST(DaemonShutdown, SigtermWithWatchInFlightExitsZeroWithinGrace) {
  Daemon d({"--grace-period=2"});
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  auto channel = grpc::CreateChannel("unix:" + d.socket, grpc::InsecureChannelCredentials());
  auto stub = Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 60s);
  HealthCheckRequest request;
  request.set_service("arfuse.v1.Fusion");
  auto reader = stub->Watch(&ctx, request);
  HealthCheckResponse update;
  // Wait until the watcher sees SERVING, then ask the daemon to stop.
  bool serving = false;
  while (!serving && reader->Read(&update))
    serving = update.status() == HealthCheckResponse::SERVING;
  ASSERT_TRUE(serving);
  auto start = std::chrono::steady_clock::now();
  d.proc->Signal(SIGTERM);
  // The in-flight watch sees readiness go NOT_SERVING before its stream ends.
  bool saw_not_serving = false;
  while (reader->Read(&update)) {
    if (update.status() == HealthCheckResponse::NOT_SERVING) saw_not_serving = true;
  }
  reader->Finish();
  EXPECT_TRUE(saw_not_serving);
  auto code = d.proc->Wait(30s);
  ASSERT_TRUE(code.has_value()) << "arfused did not exit after SIGTERM";
  EXPECT_EQ(*code, 0) << d.proc->Stderr();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);
  EXPECT_THAT(d.proc->Stderr(), HasSubstr("event=shutdown_done exit_code=0"));
}

// A client holds its Fusion.Session stream open for as long as it is connected. SIGTERM must end
// it at once (UNAVAILABLE, so the client knows to reconnect) and exit without waiting the whole
// grace period for a stream that never ends by itself, nor for gRPC's graceful GOAWAY (the server
// would wait for an idle client, one that reads its connection only on gRPC's 5 s backup poll, to
// acknowledge a PING): the sidecar stops the server as soon as no unary call is in flight.
// Measured 0.15-0.18 s here; the bound leaves room for a loaded CI machine.
TEST(DaemonShutdown, SigtermEndsOpenSessionWithUnavailableAndExitsWellBeforeTheGrace) {
  constexpr auto kGrace = 20s;
  Daemon d({"--grace-period=20"});
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  auto channel = grpc::CreateChannel("unix:" + d.socket, grpc::InsecureChannelCredentials());
  auto stub = v1::Fusion::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 60s);
  auto stream = stub->Session(&ctx);
  v1::SessionRequest request;
  request.set_client_name("shutdown-test");
  ASSERT_TRUE(stream->Write(request));
  v1::SessionResponse response;
  ASSERT_TRUE(stream->Read(&response)) << d.proc->Stderr();
  ASSERT_EQ(response.session_token().size(), 32u);

  auto start = std::chrono::steady_clock::now();
  d.proc->Signal(SIGTERM);
  EXPECT_FALSE(stream->Read(&response)) << "the stream carried another message";
  grpc::Status status = stream->Finish();
  auto stream_ended = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("sidecar shutting down"));
  auto code = d.proc->Wait(kGrace + 10s);
  auto exited = std::chrono::steady_clock::now() - start;
  ASSERT_TRUE(code.has_value()) << "arfused did not exit after SIGTERM";
  EXPECT_EQ(*code, 0) << d.proc->Stderr();
  EXPECT_LT(stream_ended, 5s);
  EXPECT_LT(exited, 3s) << "shutdown waited for the open session or the idle connection\n"
                        << d.proc->Stderr();
  std::printf(
      "[shutdown] session stream ended after %.3f s, process exited after %.3f s "
      "(grace %lld s)\n",
      std::chrono::duration<double>(stream_ended).count(),
      std::chrono::duration<double>(exited).count(), static_cast<long long>(kGrace.count()));
  EXPECT_THAT(d.proc->Stderr(), HasSubstr("event=sessions_ended_for_shutdown sessions=1"));
  EXPECT_THAT(d.proc->Stderr(), HasSubstr("event=shutdown_done exit_code=0"));
}

TEST(DaemonShutdown, SigintExitsZero) {
  Daemon d;
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  d.proc->Signal(SIGINT);
  auto code = d.proc->Wait(30s);
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0);
  EXPECT_THAT(d.proc->Stderr(), HasSubstr("reason=\"SIGINT\""));
}

}  // namespace
}  // namespace arfuse
