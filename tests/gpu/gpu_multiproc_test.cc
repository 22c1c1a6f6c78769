// Multi-process GPU tests (ctest label gpu): every rank is a separately exec'd arfuse-gpu-rank
// process. With fewer GPUs than ranks, ranks share GPUs (rank r uses GPU r % count) and MPS must
// run, or every cross-process hop costs a context switch (docs/gpu-tests.md).
#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/cuda_device/mps.h"
#include "tests/gpu/process_util.h"

namespace arfuse::testing {
namespace {

// The worker sits next to this test binary (found through /proc/self/exe, so the build folder
// may move, e.g. when it travels to a GPU machine).
std::string WorkerPath() {
  char self[4096] = {};
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return ARFUSE_BINARY_DIR "/tests/gpu/arfuse-gpu-rank";
  return (std::filesystem::path(self).parent_path() / "arfuse-gpu-rank").string();
}

struct Run {
  int world;
  std::string backend;
  std::string scenario;
  std::string vmm = "posix_fd";
  int spin_ms = 2000;
  // NCCL refuses two ranks on one GPU: such runs need a GPU per rank.
  bool gpu_per_rank = false;
};

void RunRanks(const Run& run) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no CUDA device: GPU tests run on the GPU machines (docs/gpu-tests.md)";
  }
  if (run.gpu_per_rank && run.world > devices) {
    GTEST_SKIP() << run.world << " ranks need a GPU each (NCCL), " << devices << " visible";
  }
  if (run.world > devices) {
    const MpsInfo mps = DetectMps();
    ASSERT_TRUE(mps.active()) << run.world << " ranks share " << devices
                              << " GPU(s): start MPS first (docs/gpu-tests.md); " << mps.Describe();
  }
  char tmpl[] = "/tmp/arfgpu-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::vector<pid_t> pids;
  for (int r = 0; r < run.world; ++r) {
    absl::StatusOr<pid_t> pid =
        SpawnProcess({WorkerPath(), absl::StrCat("--rank=", r), absl::StrCat("--world=", run.world),
                      absl::StrCat("--dir=", dir), absl::StrCat("--backend=", run.backend),
                      absl::StrCat("--scenario=", run.scenario), absl::StrCat("--vmm=", run.vmm),
                      absl::StrCat("--spin_ms=", run.spin_ms)});
    ASSERT_TRUE(pid.ok()) << pid.status();
    pids.push_back(*pid);
  }
  std::vector<int> codes = WaitProcesses(pids, absl::Now() + absl::Seconds(150));
  std::filesystem::remove_all(dir);
  for (int r = 0; r < run.world; ++r) {
    EXPECT_EQ(codes[r], 0) << "rank " << r << " of " << run.world << " " << run.backend << " "
                           << run.scenario << (codes[r] == -1 ? " hung and was killed" : " failed")
                           << " (its FAIL line is above)";
  }
}

TEST(GpuMultiProc, TrtllmCorrectnessWorld2) { RunRanks({2, "trtllm", "correctness"}); }
TEST(GpuMultiProc, TrtllmCorrectnessWorld4) { RunRanks({4, "trtllm", "correctness"}); }
TEST(GpuMultiProc, TrtllmCorrectnessWorld8) { RunRanks({8, "trtllm", "correctness"}); }
TEST(GpuMultiProc, MnnvlPosixFdCorrectnessWorld2) { RunRanks({2, "mnnvl", "correctness"}); }
TEST(GpuMultiProc, MnnvlPosixFdCorrectnessWorld4) { RunRanks({4, "mnnvl", "correctness"}); }
TEST(GpuMultiProc, MnnvlPosixFdCorrectnessWorld8) { RunRanks({8, "mnnvl", "correctness"}); }
// Auto handle type: FABRIC where every rank can create, export and import it, else POSIX FDs.
TEST(GpuMultiProc, MnnvlAutoHandlesWorld2) { RunRanks({2, "mnnvl", "graph", "auto"}); }
TEST(GpuMultiProc, TrtllmGraphReplayWorld2) { RunRanks({2, "trtllm", "graph"}); }
TEST(GpuMultiProc, MnnvlGraphReplayWorld4) { RunRanks({4, "mnnvl", "graph"}); }
TEST(GpuMultiProc, TrtllmMissingRankTimesOutThenReinitWorld2) {
  RunRanks({2, "trtllm", "timeout", "posix_fd", 500});
}
TEST(GpuMultiProc, MnnvlMissingRankTimesOutThenReinitWorld4) {
  RunRanks({4, "mnnvl", "timeout", "posix_fd", 500});
}
TEST(GpuMultiProc, NcclUnfusedWorld1) { RunRanks({1, "none", "nccl"}); }
// Two ranks on two GPUs: the sidecar's NCCL path across NVLink, alone (backend none) and forced
// on an engine that also has the fused workspace.
TEST(GpuMultiProc, NcclUnfusedWorld2) { RunRanks({2, "none", "nccl", "posix_fd", 2000, true}); }
TEST(GpuMultiProc, TrtllmForcedUnfusedWorld2) {
  RunRanks({2, "trtllm", "nccl", "posix_fd", 2000, true});
}
// The NCCL path's bounds: racing ops of one element count refused on both ranks; a rank that
// never calls fails the other within the spin timeout, then the group re-initializes.
TEST(GpuMultiProc, NcclMissingRankTimesOutThenReinitWorld2) {
  RunRanks({2, "none", "nccl_timeout", "posix_fd", 1000, true});
}
// A peer that agreed to an op and never ran it: the op fails at its deadline, destroying the
// engine returns at once and marks the device wedged (the daemon exits to be restarted), and
// the process exits although its NCCL kernel still waits.
TEST(GpuMultiProc, NcclAgreedOpNeverRunWedgesTheDeviceWorld2) {
  RunRanks({2, "none", "nccl_stuck", "posix_fd", 1000, true});
}

}  // namespace
}  // namespace arfuse::testing
