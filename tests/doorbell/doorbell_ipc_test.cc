// Two processes: the sidecars (this process, ranks simulated on one GPU as in
// doorbell_gpu_test.cc) and one exec'd doorbell-ring-client per rank, which opens its rank's slot
// from the IPC handle and offset alone (what CreatePlan hands a client) and rings from CUDA
// graphs through libarfuse_ring. Needs MPS to be fast (each cross-process hop otherwise costs a
// context switch); correct either way.
// Run: ctest --test-dir <build> -L gpu -R DoorbellIpc --output-on-failure
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "kernels/doorbell/doorbell.h"
#include "server/cuda_device/mps.h"
#include "server/doorbell/doorbell_plane.h"
#include "tests/doorbell/doorbell_test_util.h"

extern char** environ;

namespace arfuse {
namespace {

using doorbell_test::GroupShape;
using doorbell_test::HostOp;
using doorbell_test::RankGroup;

// The helper sits next to this test binary (found through /proc/self/exe, so the build folder
// may travel to a GPU machine).
std::string HelperPath() {
  char self[4096] = {};
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return ARFUSE_BINARY_DIR "/tests/doorbell/doorbell-ring-client";
  return (std::filesystem::path(self).parent_path() / "doorbell-ring-client").string();
}

// A child started with posix_spawn (exec, never a bare fork of this CUDA process), with pipes to
// its stdin and from its stdout.
class Child {
 public:
  explicit Child(const std::vector<std::string>& argv) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) return;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    if (posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
    close(in[0]);
    close(out[1]);
    to_child_ = in[1];
    from_child_ = out[0];
  }
  ~Child() {
    if (to_child_ >= 0) close(to_child_);
    if (from_child_ >= 0) close(from_child_);
    if (pid_ > 0 && !Wait(std::chrono::seconds(5)).has_value()) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  bool started() const { return pid_ > 0; }
  bool Send(const std::string& line) {
    const std::string l = line + "\n";
    return write(to_child_, l.data(), l.size()) == static_cast<ssize_t>(l.size());
  }
  // The next line of output, or "" after `timeout` or at end of output.
  std::string ReadLine(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      const size_t nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return "";
      pollfd p{from_child_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[512];
      const ssize_t n = read(from_child_, chunk, sizeof(chunk));
      if (n <= 0) return "";
      buffer_.append(chunk, static_cast<size_t>(n));
    }
  }
  std::optional<int> Wait(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      usleep(10'000);
    }
    return std::nullopt;
  }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string buffer_;
};

std::string Hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

TEST(DoorbellIpc, ClientProcessesRingThroughIpcHandles) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no CUDA device: GPU tests run on the GPU machines";
  }
  const int world = 2;
  int device = 0;
  cudaGetDevice(&device);
  RankGroup g(GroupShape{world, 64, 2048, DType::kBF16});
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g.Init().ok());
  std::vector<std::unique_ptr<DoorbellPlane>> planes;
  std::vector<std::unique_ptr<Child>> clients;
  for (int r = 0; r < world; ++r) {
    DoorbellPlaneOptions o;
    o.device = device;
    o.stream = g.sidecar(r);
    o.local_workspace = g.workspace(r);
    o.layout = g.layout();
    o.host_abort = g.host_abort().device();
    o.poll_interval = absl::Microseconds(10);
    auto plane = DoorbellPlane::Create(o);
    ASSERT_TRUE(plane.ok()) << plane.status();
    auto h = (*plane)->AddPlan(g.Params(r, 0, FusionAlgo::kOneShot), {64, 32});
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE((*plane)->Start().ok());
    ASSERT_EQ(h->ipc_handle.size(), 64u);
    clients.push_back(std::make_unique<Child>(std::vector<std::string>{
        HelperPath(), absl::StrCat("--device=", device), "--handle=" + Hex(h->ipc_handle),
        absl::StrCat("--offset=", h->offset), "--timeout_ms=20000"}));
    ASSERT_TRUE(clients.back()->started()) << HelperPath();
    ASSERT_EQ(clients.back()->ReadLine(std::chrono::seconds(30)), "ready") << "rank " << r;
    planes.push_back(std::move(*plane));
  }
  std::mt19937 rng(99);
  const uint32_t cycle[] = {1, 5, 31, 32, 64};
  const int replays = 100;
  for (int i = 0; i < replays; ++i) {
    const uint32_t t = cycle[i % 5];
    SCOPED_TRACE(::testing::Message() << "replay " << i << " tokens " << t);
    HostOp op(world, t, 2048, DType::kBF16);
    op.FillRandom(rng);
    ASSERT_TRUE(op.Upload(g).ok());
    for (auto& c : clients) ASSERT_TRUE(c->Send(absl::StrCat("ring ", t, " 1")));
    for (auto& c : clients) ASSERT_EQ(c->ReadLine(std::chrono::seconds(60)), "done 0");
    ASSERT_EQ(op.Verify(g, Pattern::kAllReduceResidualRmsNorm), "");
  }
  // Cross-process latency: both clients replay graphs of 100 rings, concurrently.
  for (uint32_t t : {1u, 32u}) {
    for (auto& c : clients) ASSERT_TRUE(c->Send(absl::StrCat("bench ", t, " 20 100")));
    for (int r = 0; r < world; ++r) {
      const std::string line = clients[r]->ReadLine(std::chrono::seconds(120));
      const std::vector<std::string> parts = absl::StrSplit(line, ' ');
      ASSERT_EQ(parts.size(), 3u) << line;
      EXPECT_EQ(parts[0], "bench");
      EXPECT_EQ(parts[2], "0") << "slot error after the bench";
      std::printf("cross-process doorbell, rank %d, %u tokens: %s us per op (%s)\n", r, t,
                  parts[1].c_str(), DetectMps().Describe().c_str());
    }
  }
  for (auto& c : clients) {
    ASSERT_TRUE(c->Send("quit"));
    EXPECT_EQ(c->Wait(std::chrono::seconds(30)), std::optional<int>(0));
  }
  for (int r = 0; r < world; ++r) {
    const DoorbellPlaneStatus s = planes[r]->Status();
    EXPECT_TRUE(s.health.ok()) << s.health;
    EXPECT_EQ(s.failed, 0u);
    EXPECT_GE(s.served, static_cast<uint64_t>(replays));
  }
}

}  // namespace
}  // namespace arfuse
