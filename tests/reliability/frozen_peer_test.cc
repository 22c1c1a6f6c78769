// A peer sidecar frozen (SIGSTOP) while its group is idle: its connections stay open, so only the
// peer channel's heartbeats (--peer-heartbeat-timeout) can tell. The other rank must report
// NOT_SERVING within the heartbeat timeout without any op, count a peer fault and re-form; once
// the frozen rank is continued, the group serves again under a new workspace generation. A
// healthy idle group must never trip it. Host-mode sidecars (tests/reliability/harness.h).
#include <signal.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/reliability/device_config.h"
#include "tests/reliability/harness.h"

namespace arfuse::reliability {
namespace {

using ::testing::HasSubstr;

// Short, so the test is quick; a beat goes every 200 ms.
constexpr absl::Duration kHeartbeatTimeout = absl::Seconds(1);

SidecarConfig FrozenConfig() {
  SidecarConfig c = Config();
  c.extra_flags.push_back(
      absl::StrCat("--peer-heartbeat-timeout=", absl::ToDoubleSeconds(kHeartbeatTimeout)));
  return c;
}

std::vector<std::unique_ptr<RankClient>> Clients(Group& g) {
  std::vector<std::unique_ptr<RankClient>> c;
  for (int r = 0; r < g.world_size(); ++r) {
    auto rc = NewClient(g[r].socket(), r, g.world_size());
    EXPECT_TRUE(rc.ok()) << rc.status();
    if (rc.ok()) c.push_back(std::move(*rc));
  }
  return c;
}

TEST(FrozenPeer, HealthyIdleGroupStaysServing) {
  Group g(2, FrozenConfig());
  ASSERT_TRUE(g.StartAll()) << g.Logs();
  ASSERT_TRUE(g.WaitAllReady(kFormTimeout)) << g.Logs();
  // Three heartbeat timeouts with nothing to do: readiness never drops, no peer fault counted.
  const absl::Time until = absl::Now() + 3 * kHeartbeatTimeout;
  while (absl::Now() < until) {
    for (int r = 0; r < 2; ++r) {
      auto serving = Serving(g[r].socket(), kReadiness);
      ASSERT_TRUE(serving.ok() && *serving) << "rank " << r << "\n" << g.Logs();
    }
    absl::SleepFor(absl::Milliseconds(100));  // sampling an observation, not a synchronization
  }
  for (int r = 0; r < 2; ++r) {
    auto stats = GetStats(g[r].socket());
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->poisonings(), 0u) << "rank " << r;
    EXPECT_EQ(stats->reinitializations(), 0u) << "rank " << r;
  }
}

class FrozenPeerTest : public ::testing::TestWithParam<int> {};

TEST_P(FrozenPeerTest, IdleFrozenPeerIsNoticedWithoutAnOpAndTheGroupReforms) {
  const int victim = GetParam();
  const int survivor = 1 - victim;
  Group g(2, FrozenConfig());
  ASSERT_TRUE(g.StartAll()) << g.Logs();
  ASSERT_TRUE(g.WaitAllReady(kFormTimeout)) << g.Logs();
  std::vector<std::unique_ptr<RankClient>> c = Clients(g);
  ASSERT_EQ(c.size(), 2u);
  auto before = c[survivor]->client().GetWorkspaceInfo();
  ASSERT_TRUE(before.ok()) << before.status();

  g[victim].Signal(SIGSTOP);
  const absl::Time stopped = absl::Now();
  // No op: only the heartbeats can tell the survivor.
  ASSERT_TRUE(WaitReadiness(g[survivor].socket(), false, absl::Seconds(10)))
      << "the survivor still reports SERVING with its peer frozen\n"
      << g.Logs();
  const absl::Duration noticed = absl::Now() - stopped;
  EXPECT_GE(noticed, kHeartbeatTimeout / 2);
  // The timeout, the supervisor's 50 ms watch, readiness polling and a loaded machine.
  EXPECT_LT(noticed, kHeartbeatTimeout + absl::Seconds(2)) << g.Logs();
  auto stats = GetStats(g[survivor].socket());
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GE(stats->poisonings(), 1u);
  const std::string log = g[survivor].Log();
  EXPECT_THAT(log, HasSubstr("reason=peer_lost"));
  EXPECT_THAT(log,
              HasSubstr(victim == 0 ? "the coordinator (rank 0) of group 'rel' stopped answering"
                                    : "rank 1 of group 'rel' went away: stopped answering"));

  g[victim].Signal(SIGCONT);
  const absl::Time continued = absl::Now();
  // Both ranks re-form under a new workspace generation and serve, still without any op.
  EXPECT_TRUE(g.WaitAllReady(absl::Seconds(30))) << g.Logs();
  const absl::Duration reformed = absl::Now() - continued;
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(WaitUntil(
        [&] {
          auto info = c[r]->client().GetWorkspaceInfo();
          return info.ok() && info->generation() > before->generation() &&
                 info->state() == v1::WORKSPACE_STATE_READY;
        },
        absl::Seconds(30)))
        << "rank " << r << "\n"
        << g.Logs();
  }
  auto after0 = c[0]->client().GetWorkspaceInfo();
  auto after1 = c[1]->client().GetWorkspaceInfo();
  ASSERT_TRUE(after0.ok() && after1.ok());
  EXPECT_EQ(after0->generation(), after1->generation());
  std::printf(
      "[frozen] rank %d frozen: rank %d NOT_SERVING after %s; all ready %s after "
      "SIGCONT; workspace generation %llu -> %llu\n",
      victim, survivor, absl::FormatDuration(noticed).c_str(),
      absl::FormatDuration(reformed).c_str(), static_cast<unsigned long long>(before->generation()),
      static_cast<unsigned long long>(after0->generation()));
}

INSTANTIATE_TEST_SUITE_P(Victim, FrozenPeerTest, ::testing::Values(1, 0),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat("rank", info.param);
                         });

}  // namespace
}  // namespace arfuse::reliability
