// Metrics are scraped over HTTP the way Prometheus does it.
#include "server/metrics/metrics.h"

#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/metrics/scrape.h"

namespace arfuse {
namespace {

using ::arfuse::testing::HttpGet;
using ::testing::HasSubstr;

TEST(Metrics, ScrapeShowsOpsLatencyAndState) {
  Metrics metrics(1, 2, "host", {"0.1.0", "abc1234", "1.0"});
  ASSERT_TRUE(metrics.Serve("0.0.0.0", 0).ok());
  ASSERT_GT(metrics.port(), 0);
  metrics.RecordOp({"eager", "trtllm", "oneshot", "dispatch", true, 12e-6, 4096});
  metrics.RecordOp({"eager", "trtllm", "oneshot", "dispatch", true, 14e-6, 4096});
  metrics.RecordOp({"doorbell", "none", "unfused", "fusion_disabled", false, 1e-3, 4096});
  metrics.SetRegions(3, 3 << 20);
  metrics.SetWorkspaceBytes(1 << 30);
  metrics.SetBackend("trtllm", true);
  metrics.IncPoisonings();
  metrics.IncReinitializations();
  metrics.SetPeersReady(2);
  metrics.SetMps(true, 2.5e-6);
  metrics.SetReady(true);

  std::string body = HttpGet(metrics.port(), "/metrics");
  ASSERT_THAT(body, HasSubstr("200 OK"));
  EXPECT_THAT(body, HasSubstr("arfuse_ops_total{rank=\"1\",backend=\"trtllm\",path=\"oneshot\","
                              "plane=\"eager\",reason=\"dispatch\",result=\"ok\"} 2"));
  EXPECT_THAT(body, HasSubstr("result=\"error\"} 1"));
  EXPECT_THAT(body, HasSubstr("arfuse_op_latency_seconds_count{rank=\"1\",path=\"oneshot\","
                              "plane=\"eager\"} 2"));
  // Failed ops do not count as reduced bytes.
  EXPECT_THAT(body, HasSubstr("arfuse_bytes_reduced_total{rank=\"1\",path=\"oneshot\"} 8192"));
  EXPECT_THAT(body, HasSubstr("arfuse_regions{rank=\"1\"} 3"));
  EXPECT_THAT(body, HasSubstr("arfuse_region_bytes{rank=\"1\"} 3145728"));
  EXPECT_THAT(body, HasSubstr("arfuse_workspace_bytes{rank=\"1\"} 1073741824"));
  EXPECT_THAT(
      body,
      HasSubstr("arfuse_backend_info{rank=\"1\",backend=\"trtllm\",fusion_enabled=\"true\"}"));
  EXPECT_THAT(body, HasSubstr("arfuse_poisonings_total{rank=\"1\"} 1"));
  EXPECT_THAT(body, HasSubstr("arfuse_reinitializations_total{rank=\"1\"} 1"));
  EXPECT_THAT(body, HasSubstr("arfuse_peers_ready{rank=\"1\"} 2"));
  EXPECT_THAT(body, HasSubstr("arfuse_mps_detected{rank=\"1\"} 1"));
  EXPECT_THAT(body, HasSubstr("arfuse_ready{rank=\"1\"} 1"));
  EXPECT_THAT(body, HasSubstr("arfuse_build_info{rank=\"1\",api_version=\"1.0\",device=\"host\","
                              "revision=\"abc1234\",version=\"0.1.0\",world_size=\"2\"} 1"));
  EXPECT_THAT(body, HasSubstr("arfuse_world_size{rank=\"1\"} 2"));
}

TEST(Metrics, OpTotalsCountResultsPathsAndBytes) {
  Metrics metrics(0, 2, "host", {"0.1.0", "abc1234", "1.0"});
  EXPECT_EQ(metrics.op_totals().ok, 0u);
  metrics.RecordOp({"eager", "trtllm", "oneshot", "dispatch", true, 1e-5, 4096});
  metrics.RecordOp({"eager", "trtllm", "twoshot", "dispatch", true, 1e-5, 8192});
  metrics.RecordOp({"eager", "none", "unfused", "fusion_disabled", true, 1e-5, 1024});
  metrics.RecordOp({"eager", "none", "host", "fusion_disabled", true, 1e-5, 512});
  metrics.RecordOp({"eager", "trtllm", "none", "error", false, 1e-3, 65536});
  const OpTotals t = metrics.op_totals();
  EXPECT_EQ(t.ok, 4u);
  EXPECT_EQ(t.failed, 1u);
  // One-shot and two-shot are the fused kernels; NCCL and the CPU implementation are not.
  EXPECT_EQ(t.fused, 2u);
  EXPECT_EQ(t.unfused, 2u);
  // A failed op reduced nothing.
  EXPECT_EQ(t.bytes_reduced, 4096u + 8192 + 1024 + 512);
}

TEST(Metrics, OpTotalsAreExactUnderConcurrentRecording) {
  Metrics metrics(0, 1, "host", {"0.1.0", "abc1234", "1.0"});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&metrics, t] {
      for (int i = 0; i < 500; ++i) {
        const bool ok = i % 5 != 0;
        metrics.RecordOp({"eager", "none", t % 2 == 0 ? "oneshot" : "host",
                          ok ? "dispatch" : "error", ok, 1e-6, 16});
      }
    });
  }
  for (auto& th : threads) th.join();
  const OpTotals t = metrics.op_totals();
  EXPECT_EQ(t.failed, 4u * 100);
  EXPECT_EQ(t.ok, 4u * 400);
  EXPECT_EQ(t.fused, 2u * 400);
  EXPECT_EQ(t.unfused, 2u * 400);
  EXPECT_EQ(t.bytes_reduced, 4u * 400 * 16);
}

TEST(Metrics, BackendSwitchLeavesOneCurrentBackend) {
  Metrics metrics(0, 2, "host", {"0.1.0", "abc1234", "1.0"});
  metrics.SetBackend("trtllm", true);
  metrics.SetBackend("none", false);
  std::string text = metrics.Render();
  EXPECT_THAT(text, HasSubstr("{rank=\"0\",backend=\"trtllm\",fusion_enabled=\"true\"} 0"));
  EXPECT_THAT(text, HasSubstr("{rank=\"0\",backend=\"none\",fusion_enabled=\"false\"} 1"));
}

TEST(Metrics, DivergenceIsCountedByTheRankThatDeclinedFromZero) {
  Metrics metrics(0, 3, "host", {"0.1.0", "abc1234", "1.0"});
  std::string text = metrics.Render();
  // Every rank's series from the first scrape.
  for (const char* r : {"0", "1", "2"}) {
    EXPECT_THAT(text, HasSubstr(std::string("arfuse_instream_divergence_total{rank=\"0\","
                                            "diverged_rank=\"") +
                                r + "\"} 0"));
  }
  metrics.IncInStreamDivergence(2);
  metrics.IncInStreamDivergence(2);
  text = metrics.Render();
  EXPECT_THAT(text,
              HasSubstr("arfuse_instream_divergence_total{rank=\"0\",diverged_rank=\"2\"} 2"));
  EXPECT_THAT(text,
              HasSubstr("arfuse_instream_divergence_total{rank=\"0\",diverged_rank=\"1\"} 0"));
}

TEST(Metrics, PortInUseIsUnavailable) {
  Metrics first(0, 1, "host", {"0.1.0", "abc1234", "1.0"});
  ASSERT_TRUE(first.Serve("0.0.0.0", 0).ok());
  Metrics second(0, 1, "host", {"0.1.0", "abc1234", "1.0"});
  absl::Status st = second.Serve("0.0.0.0", first.port());
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(st.message()), HasSubstr("cannot serve metrics on 0.0.0.0:"));
}

// The metrics port binds the host it is given, not every address: bound to 127.0.0.1, another
// loopback address (127.0.0.2, local on Linux) is refused.
TEST(Metrics, BindsOnlyTheGivenHost) {
  Metrics loopback(0, 1, "host", {"0.1.0", "abc1234", "1.0"});
  ASSERT_TRUE(loopback.Serve("127.0.0.1", 0).ok());
  EXPECT_THAT(HttpGet(loopback.port(), "/metrics", "127.0.0.1"), HasSubstr("200 OK"));
  EXPECT_EQ(HttpGet(loopback.port(), "/metrics", "127.0.0.2"), "");
  Metrics any(0, 1, "host", {"0.1.0", "abc1234", "1.0"});
  ASSERT_TRUE(any.Serve("0.0.0.0", 0).ok());
  EXPECT_THAT(HttpGet(any.port(), "/metrics", "127.0.0.2"), HasSubstr("200 OK"));
}

TEST(Metrics, AnAddressThatCannotBeBoundIsUnavailable) {
  Metrics m(0, 1, "host", {"0.1.0", "abc1234", "1.0"});
  absl::Status st = m.Serve("192.0.2.1", 0);  // TEST-NET-1: not an address of this host
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(st.message()), HasSubstr("cannot serve metrics on 192.0.2.1:0"));
}

}  // namespace
}  // namespace arfuse
