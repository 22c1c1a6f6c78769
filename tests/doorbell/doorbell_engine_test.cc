// The doorbell plane wired into the CUDA engine (label gpu): two exec'd doorbell-engine-rank
// processes, each a CudaEngine of a two-rank group (ranks share one GPU under MPS when there is
// only one), play doorbell_engine_rank.cc's phases: grants, rings of both algorithms from
// captured graphs checked against the CPU reference, eager ops beside a doorbell plan, refusals,
// a poisoned workspace re-initialized in place with the plan re-armed, removal, teardown.
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

std::string WorkerPath() {
  char self[4096] = {};
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return ARFUSE_BINARY_DIR "/tests/doorbell/doorbell-engine-rank";
  return (std::filesystem::path(self).parent_path() / "doorbell-engine-rank").string();
}

TEST(DoorbellEngine, TwoRanksRingPauseReinitRemove) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no CUDA device: GPU tests run on the GPU machines (docs/gpu-tests.md)";
  }
  constexpr int kWorld = 2;
  if (kWorld > devices) {
    const MpsInfo mps = DetectMps();
    ASSERT_TRUE(mps.active()) << kWorld << " ranks share " << devices
                              << " GPU(s): start MPS first (docs/doorbell.md); " << mps.Describe();
  }
  char tmpl[] = "/tmp/arfdb-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::vector<pid_t> pids;
  for (int r = 0; r < kWorld; ++r) {
    absl::StatusOr<pid_t> pid =
        SpawnProcess({WorkerPath(), absl::StrCat("--rank=", r), absl::StrCat("--world=", kWorld),
                      absl::StrCat("--dir=", dir), "--spin_ms=2000"});
    ASSERT_TRUE(pid.ok()) << pid.status();
    pids.push_back(*pid);
  }
  std::vector<int> codes = WaitProcesses(pids, absl::Now() + absl::Seconds(240));
  std::filesystem::remove_all(dir);
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(codes[r], 0) << "rank " << r
                           << (codes[r] == -1 ? " hung and was killed" : " failed")
                           << " (its FAIL line is above)";
  }
}

}  // namespace
}  // namespace arfuse::testing
