// Metrics are scraped over HTTP the way Prometheus does it.
#include "server/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;

std::string HttpGet(int port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "";
  }
  std::string request = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  (void)!::write(fd, request.data(), request.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
  ::close(fd);
  return out;
}

TEST(Metrics, ScrapeShowsOpsLatencyAndState) {
  Metrics metrics(1, 2, "host", "0.1.0");
  ASSERT_TRUE(metrics.Serve(0).ok());
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
  EXPECT_THAT(body, HasSubstr("arfuse_build_info{rank=\"1\",device=\"host\",version=\"0.1.0\","
                              "world_size=\"2\"} 1"));
}

TEST(Metrics, BackendSwitchLeavesOneCurrentBackend) {
  Metrics metrics(0, 2, "host", "0.1.0");
  metrics.SetBackend("trtllm", true);
  metrics.SetBackend("none", false);
  std::string text = metrics.Render();
  EXPECT_THAT(text, HasSubstr("{rank=\"0\",backend=\"trtllm\",fusion_enabled=\"true\"} 0"));
  EXPECT_THAT(text, HasSubstr("{rank=\"0\",backend=\"none\",fusion_enabled=\"false\"} 1"));
}

TEST(Metrics, PortInUseIsUnavailable) {
  Metrics first(0, 1, "host", "0.1.0");
  ASSERT_TRUE(first.Serve(0).ok());
  Metrics second(0, 1, "host", "0.1.0");
  absl::Status st = second.Serve(first.port());
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(st.message()), HasSubstr("cannot serve metrics on port"));
}

}  // namespace
}  // namespace arfuse
