// GuardedCopy: a copy from or to client memory that shrank under it is an error, not a SIGBUS
// that kills the daemon; a fault anywhere else still kills the process.
#include "server/host/guarded_copy.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;

// A shared mapping of `size` bytes whose memfd is then truncated to 0: every page faults.
class VanishedMemory {
 public:
  explicit VanishedMemory(size_t size) : size_(size) {
    fd_ = memfd_create("arfuse-guard-test", MFD_CLOEXEC);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(size)), 0);
    base_ = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EXPECT_NE(base_, MAP_FAILED);
    EXPECT_EQ(ftruncate(fd_, 0), 0);
  }
  ~VanishedMemory() {
    munmap(base_, size_);
    close(fd_);
  }
  char* data() const { return static_cast<char*>(base_); }

 private:
  size_t size_;
  int fd_ = -1;
  void* base_ = nullptr;
};

TEST(GuardedCopy, CopiesLikeMemcpy) {
  std::vector<char> src(1000), dst(1000, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i);
  ASSERT_TRUE(GuardedCopy(dst.data(), src.data(), src.size(), "input").ok());
  EXPECT_EQ(dst, src);
}

TEST(GuardedCopy, AFaultReadingOrWritingIsAnErrorAndTheThreadGoesOn) {
  VanishedMemory gone(1 << 16);
  std::vector<char> local(1 << 16, 'x');
  for (int i = 0; i < 3; ++i) {  // the signal mask is restored each time
    absl::Status read = GuardedCopy(local.data(), gone.data(), local.size(), "residual_in");
    EXPECT_EQ(read.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(read.message(), HasSubstr("residual_in: the client's memory faulted (SIGBUS)"));
    absl::Status write = GuardedCopy(gone.data(), local.data(), local.size(), "norm_out");
    EXPECT_EQ(write.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(write.message(), HasSubstr("norm_out"));
  }
  sigset_t mask;
  ASSERT_EQ(pthread_sigmask(SIG_SETMASK, nullptr, &mask), 0);
  EXPECT_FALSE(sigismember(&mask, SIGBUS));
  ASSERT_TRUE(GuardedCopy(local.data(), local.data() + 8, 8, "ok").ok());
}

TEST(GuardedCopy, FaultsOnSeveralThreadsAtOnceAreEachTheirOwn) {
  VanishedMemory gone(1 << 16);
  std::vector<std::thread> threads;
  std::vector<int> caught(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<char> local(4096);
      for (int i = 0; i < 50; ++i) {
        if (!GuardedCopy(local.data(), gone.data(), local.size(), "input").ok()) ++caught[t];
        std::vector<char> src(4096, 'a');
        if (GuardedCopy(local.data(), src.data(), src.size(), "input").ok() && local[7] == 'a') {
          ++caught[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(caught[t], 100) << t;
}

// The guard catches faults inside GuardedCopy only: any other SIGBUS is a bug and goes to the
// handler that was there before, which ends the process (the default disposition: killed by
// SIGBUS; under AddressSanitizer, its report and exit code).
TEST(GuardedCopyDeathTest, AFaultOutsideTheGuardStillKillsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        VanishedMemory gone(4096);
        std::vector<char> local(16);
        (void)GuardedCopy(local.data(), gone.data(), local.size(), "installs the handler");
        volatile char c = gone.data()[0];
        (void)c;
        _exit(0);
      },
      "");
}

}  // namespace
}  // namespace arfuse
