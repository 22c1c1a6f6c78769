// The live backend switch, re-initialization, drain and stats through arfusectl against two
// host-mode sidecars (--sm makes them resolve backends as a GPU of that architecture would).
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/subprocess.h"

namespace arfuse {
namespace {

using ::arfuse::testing::BinaryPath;
using ::arfuse::testing::MakeTempDir;
using ::arfuse::testing::RunToCompletion;
using ::arfuse::testing::Subprocess;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

class AdminTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir();
    for (int r = 0; r < 2; ++r) {
      sockets_.push_back(dir_ + "/r" + std::to_string(r) + ".sock");
      daemons_.push_back(std::make_unique<Subprocess>(std::vector<std::string>{
          BinaryPath("server/daemon/arfused"), "--device=host", "--sm=" + sm_,
          "--rank=" + std::to_string(r), "--world-size=2", "--peer-dir=" + dir_,
          "--socket=" + sockets_[r], "--health-port=0", "--max-tokens=16", "--hidden=256",
          "--flashinfer-allreduce-fusion-backend=trtllm", "--peer-timeout=20"}));
    }
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(daemons_[r]->WaitForOutput("event=ready", 60s)) << daemons_[r]->Stderr();
    }
  }

  std::pair<int, std::string> Ctl(std::vector<std::string> args) {
    args.insert(args.begin(), BinaryPath("client/arfusectl/arfusectl"));
    return RunToCompletion(args, {}, 60s);
  }
  std::string Addr(int r) { return "unix:" + sockets_[r]; }
  std::string Both() { return Addr(0) + "," + Addr(1); }

  std::string sm_ = "90";
  std::string dir_;
  std::vector<std::string> sockets_;
  std::vector<std::unique_ptr<Subprocess>> daemons_;
};

TEST_F(AdminTest, SwitchOnEveryRankThenBack) {
  auto [code, out] = Ctl({"set-backend", "--backend=mnnvl", "--addr=" + Both()});
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr(Addr(0) + ": backend trtllm -> mnnvl, fusion enabled"));
  EXPECT_THAT(out, HasSubstr(Addr(1) + ": backend trtllm -> mnnvl, fusion enabled"));
  auto [scode, stats] = Ctl({"stats", "--addr=" + Addr(1), "--json"});
  ASSERT_EQ(scode, 0) << stats;
  EXPECT_THAT(stats, HasSubstr("\"backend\":\"mnnvl\""));
  auto [hcode, health] = Ctl({"health", "--addr=" + Addr(0), "--service=arfuse.v1.Fusion"});
  EXPECT_EQ(hcode, 0) << health;
  // "none": the unfused path for all.
  auto [ncode, nout] = Ctl({"set-backend", "--backend=none", "--addr=" + Both()});
  ASSERT_EQ(ncode, 0) << nout;
  EXPECT_THAT(nout, HasSubstr("mnnvl -> none, fusion disabled"));
}

TEST_F(AdminTest, RanksThatDisagreeAreRefusedAndKeepServing) {
  std::pair<int, std::string> a, b;
  std::thread t([&] { a = Ctl({"set-backend", "--backend=mnnvl", "--addr=" + Addr(0)}); });
  b = Ctl({"set-backend", "--backend=auto", "--addr=" + Addr(1)});
  t.join();
  EXPECT_EQ(a.first, 1) << a.second;
  EXPECT_EQ(b.first, 1) << b.second;
  EXPECT_THAT(a.second, HasSubstr("ABORTED: ranks disagree on the backend"));
  EXPECT_THAT(a.second, HasSubstr("rank 1 asked for auto"));
  EXPECT_THAT(a.second, HasSubstr("backend unchanged: trtllm"));
  auto [scode, stats] = Ctl({"stats", "--addr=" + Addr(0), "--json"});
  EXPECT_THAT(stats, HasSubstr("\"backend\":\"trtllm\""));
  EXPECT_THAT(stats, HasSubstr("\"state\":\"READY\""));
}

TEST_F(AdminTest, OneRankAloneTimesOutAndReinitializeHeals) {
  auto [code, out] =
      Ctl({"set-backend", "--backend=mnnvl", "--addr=" + Addr(0), "--timeout-ms=4000"});
  EXPECT_NE(code, 0) << out;
  auto [code2, out2] = Ctl({"set-backend", "--backend=mnnvl", "--addr=" + Both()});
  EXPECT_EQ(code2, 1) << out2;
  EXPECT_THAT(out2, HasSubstr("run `arfusectl reinitialize` on every rank first"));
  auto [rcode, rout] = Ctl({"reinitialize", "--addr=" + Both()});
  ASSERT_EQ(rcode, 0) << rout;
  EXPECT_THAT(rout, HasSubstr("re-initialized"));
  auto [code3, out3] = Ctl({"set-backend", "--backend=mnnvl", "--addr=" + Both()});
  EXPECT_EQ(code3, 0) << out3;
}

TEST_F(AdminTest, UnknownBackendIsAUsageError) {
  auto [code, out] = Ctl({"set-backend", "--backend=nccl", "--addr=" + Both()});
  EXPECT_EQ(code, 2);
  EXPECT_THAT(out, HasSubstr("unknown backend \"nccl\""));
}

// SM80 has no fused backend: a switch to one is refused, and the group keeps its unfused path.
class AdminSm80Test : public AdminTest {
 protected:
  void SetUp() override {
    sm_ = "80";
    AdminTest::SetUp();
  }
};

TEST_F(AdminSm80Test, InfeasibleBackendIsRefused) {
  auto [code, out] = Ctl({"set-backend", "--backend=trtllm", "--addr=" + Both()});
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("FAILED_PRECONDITION: backend trtllm is not feasible"));
  EXPECT_THAT(out, HasSubstr("backend unchanged: none"));
  auto [hcode, h] = Ctl({"health", "--addr=" + Addr(1), "--service=arfuse.v1.Fusion"});
  EXPECT_EQ(hcode, 0) << h;
}

TEST_F(AdminTest, DrainStopsOpsAndReadinessUntilReinitialized) {
  auto [code, out] = Ctl({"drain", "--addr=" + Addr(0)});
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("drained (waited for 0 op(s))"));
  auto [hcode, h] = Ctl({"health", "--addr=" + Addr(0), "--service=arfuse.v1.Fusion"});
  EXPECT_EQ(hcode, 1) << h;
  auto [rcode, rout] = Ctl({"reinitialize", "--addr=" + Both()});
  ASSERT_EQ(rcode, 0) << rout;
  auto [h2code, h2] = Ctl({"health", "--addr=" + Addr(0), "--service=arfuse.v1.Fusion"});
  EXPECT_EQ(h2code, 0) << h2;
}

}  // namespace
}  // namespace arfuse
