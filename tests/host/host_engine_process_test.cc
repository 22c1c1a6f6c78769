// Host mode with ranks as processes (posix_spawn + exec of host_rank_helper): correct results
// through real shared memory, and a rank killed or stopped mid-op.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/line_process.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;

// One rank: host_rank_helper with `args`; its stdout lines are what the test reads.
class Proc : public testing::LineProcess {
 public:
  explicit Proc(const std::vector<std::string>& args)
      : LineProcess("tests/host/host_rank_helper", args) {}
  std::string Await(const std::string& prefix, absl::Duration timeout = absl::Seconds(90)) {
    return LineProcess::Await(prefix, timeout);
  }
};

class HostProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/arfh-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    procs_.clear();
    ASSERT_EQ(std::system(("rm -rf " + dir_).c_str()), 0);
  }
  Proc& Spawn(int rank, int world, const std::string& mode, const std::string& extra = "") {
    std::vector<std::string> a = {absl::StrCat("--rank=", rank), absl::StrCat("--world=", world),
                                  "--mode=" + mode, "--dir=" + dir_, "--group=h"};
    if (!extra.empty()) a.push_back(extra);
    procs_.push_back(std::make_unique<Proc>(a));
    return *procs_.back();
  }
  std::string dir_;
  std::vector<std::unique_ptr<Proc>> procs_;
};

TEST_F(HostProcessTest, FourProcessesGetCorrectResultsCallAfterCall) {
  for (int r = 0; r < 4; ++r) Spawn(r, 4, "run", "--calls=200");
  for (auto& p : procs_) EXPECT_EQ(p->Await("OK"), "OK 200");
}

std::vector<std::string> Fields(const std::string& line) {
  return absl::StrSplit(line, absl::MaxSplits(' ', 3));
}

void ExpectSurvivorsTimedOutNaming(std::vector<Proc*> survivors, const std::string& ranks) {
  for (Proc* p : survivors) {
    auto f = Fields(p->Await("RESULT"));
    ASSERT_EQ(f.size(), 4u);
    // The first survivor to give up times out; it raises the abort word, so a survivor still
    // waiting leaves at once with ABORTED. Either way the missing rank is named.
    if (f[1] == "DEADLINE_EXCEEDED") {
      EXPECT_THAT(f[3], HasSubstr(absl::StrCat("ranks ", ranks, " did not arrive")));
    } else {
      EXPECT_EQ(f[1], "ABORTED");
      EXPECT_THAT(f[3], HasSubstr(absl::StrCat("stops waiting for ranks ", ranks)));
    }
    // The op's deadline is 2 s; generous slack for a loaded machine, far from a hang.
    EXPECT_LT(std::stoll(f[2]), 2000 + 10000);
    EXPECT_EQ(p->Await("STATE"), "STATE 3");  // WorkspaceState::kPoisoned
  }
}

TEST_F(HostProcessTest, KilledRankMidOpLeavesSurvivorsPoisonedWithinTheDeadline) {
  Proc& s0 = Spawn(0, 3, "survivor", "--op_ms=2000");
  Proc& s1 = Spawn(1, 3, "survivor", "--op_ms=2000");
  Proc& v = Spawn(2, 3, "victim");
  ASSERT_EQ(v.Await("READY"), "READY");
  ASSERT_EQ(s0.Await("ENTER"), "ENTER");
  ASSERT_EQ(s1.Await("ENTER"), "ENTER");
  ASSERT_EQ(::kill(v.pid(), SIGKILL), 0);
  ExpectSurvivorsTimedOutNaming({&s0, &s1}, "2");
}

TEST_F(HostProcessTest, StoppedRankMidOpLeavesSurvivorsPoisonedWithinTheDeadline) {
  Proc& s0 = Spawn(0, 2, "survivor", "--op_ms=2000");
  Proc& v = Spawn(1, 2, "victim");
  ASSERT_EQ(v.Await("READY"), "READY");
  ASSERT_EQ(::kill(v.pid(), SIGSTOP), 0);
  ExpectSurvivorsTimedOutNaming({&s0}, "1");
  ::kill(v.pid(), SIGCONT);
}

}  // namespace
}  // namespace arfuse
