#include "server/cuda_device/mps.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace arfuse {
namespace {

// A fake /proc and pipe directory in a temporary folder.
class MpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/arfuse-mps-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    std::filesystem::create_directories(root_ + "/proc");
    std::filesystem::create_directories(root_ + "/pipe");
  }
  void TearDown() override { std::filesystem::remove_all(root_); }
  void AddProcess(int pid, const std::string& comm, const std::string& argv0) {
    const std::string dir = root_ + "/proc/" + std::to_string(pid);
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/comm") << comm << "\n";
    std::ofstream cmd(dir + "/cmdline");
    cmd << argv0;
    cmd.put('\0');
  }
  std::string root_;
};

TEST_F(MpsTest, NothingRunning) {
  AddProcess(10, "bash", "/bin/bash");
  MpsInfo info = DetectMps(root_ + "/pipe", root_ + "/proc");
  EXPECT_FALSE(info.active());
  EXPECT_FALSE(info.control_pipe_present);
  EXPECT_FALSE(info.control_daemon_running);
  EXPECT_NE(info.Describe().find("mps=inactive"), std::string::npos);
}

TEST_F(MpsTest, DaemonAndPipeMeanActive) {
  ASSERT_EQ(mkfifo((root_ + "/pipe/control").c_str(), 0600), 0);
  AddProcess(20, "nvidia-cuda-mps", "nvidia-cuda-mps-control");
  MpsInfo info = DetectMps(root_ + "/pipe", root_ + "/proc");
  EXPECT_TRUE(info.active());
  EXPECT_FALSE(info.server_running);
  AddProcess(21, "nvidia-cuda-mps", "/usr/bin/nvidia-cuda-mps-server");
  info = DetectMps(root_ + "/pipe", root_ + "/proc");
  EXPECT_TRUE(info.server_running);
  EXPECT_NE(info.Describe().find("mps=active pipe_dir=" + root_ + "/pipe"), std::string::npos);
}

TEST_F(MpsTest, DaemonWithoutOurPipeIsInactive) {
  // A daemon serving another pipe directory does not serve this process.
  AddProcess(20, "nvidia-cuda-mps", "nvidia-cuda-mps-control");
  MpsInfo info = DetectMps(root_ + "/pipe", root_ + "/proc");
  EXPECT_FALSE(info.active());
  EXPECT_TRUE(info.control_daemon_running);
}

TEST_F(MpsTest, RegularFileIsNotAControlPipe) {
  std::ofstream(root_ + "/pipe/control") << "x";
  AddProcess(20, "nvidia-cuda-mps", "nvidia-cuda-mps-control");
  EXPECT_FALSE(DetectMps(root_ + "/pipe", root_ + "/proc").control_pipe_present);
}

TEST_F(MpsTest, UnsetEnvironmentUsesCudaDefaultPipeDir) {
  EXPECT_EQ(DetectMps("", root_ + "/proc").pipe_directory, "/tmp/nvidia-mps");
}

// The driver's CU_DEVICE_ATTRIBUTE_MPS_ENABLED decides when it answers: it sees a control daemon
// in another container that the scan of our /proc cannot, and it knows when ours does not serve
// this process.
TEST_F(MpsTest, DriverAnswerWinsOverTheScan) {
  MpsInfo info = DetectMps(root_ + "/pipe", root_ + "/proc", DriverMps::kEnabled);
  EXPECT_FALSE(info.control_daemon_running);
  EXPECT_TRUE(info.active());
  EXPECT_NE(info.Describe().find("mps=active"), std::string::npos);
  EXPECT_NE(info.Describe().find(" driver=enabled"), std::string::npos);

  ASSERT_EQ(mkfifo((root_ + "/pipe/control").c_str(), 0600), 0);
  AddProcess(20, "nvidia-cuda-mps", "nvidia-cuda-mps-control");
  info = DetectMps(root_ + "/pipe", root_ + "/proc", DriverMps::kDisabled);
  EXPECT_TRUE(info.control_daemon_running);
  EXPECT_FALSE(info.active());
  EXPECT_NE(info.Describe().find(" driver=disabled"), std::string::npos);
}

TEST_F(MpsTest, UnknownDriverAnswerFallsBackToTheScan) {
  ASSERT_EQ(mkfifo((root_ + "/pipe/control").c_str(), 0600), 0);
  AddProcess(20, "nvidia-cuda-mps", "nvidia-cuda-mps-control");
  MpsInfo info = DetectMps(root_ + "/pipe", root_ + "/proc", DriverMps::kUnknown);
  EXPECT_TRUE(info.active());
  // The line reads as it did before the driver was asked.
  EXPECT_EQ(info.Describe().find("driver="), std::string::npos);
}

TEST(DriverMpsFromAttribute, SuccessDecidesAnyErrorIsUnknown) {
  EXPECT_EQ(DriverMpsFromAttribute(0, 1), DriverMps::kEnabled);
  EXPECT_EQ(DriverMpsFromAttribute(0, 0), DriverMps::kDisabled);
  // CUDA_ERROR_INVALID_VALUE (1): a driver older than the attribute (CUDA 12.3).
  EXPECT_EQ(DriverMpsFromAttribute(1, 1), DriverMps::kUnknown);
  // CUDA_ERROR_NOT_INITIALIZED (3): no driver (the shim's answer), value untouched.
  EXPECT_EQ(DriverMpsFromAttribute(3, 0), DriverMps::kUnknown);
}

}  // namespace
}  // namespace arfuse
