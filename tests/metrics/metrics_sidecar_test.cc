// The region gauges of a real host-mode arfused follow its registry: scraped over HTTP after
// clients register, unregister and disconnect.
#include <regex>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "client/cpp/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/metrics/scrape.h"
#include "tests/support/daemon_process.h"

namespace arfuse {
namespace {

using ::arfuse::client::Client;
using ::arfuse::client::HostShmBuffer;
using ::arfuse::testing::DaemonProcess;
using ::arfuse::testing::HttpGet;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

// The value of an unlabelled-but-rank gauge in a scrape ("arfuse_regions{rank="0"} 2"), or -1.
double Gauge(const std::string& scrape, const std::string& name) {
  std::smatch m;
  std::regex re("\n" + name + "\\{rank=\"0\"\\} ([0-9.e+]+)\n");
  if (!std::regex_search(scrape, m, re)) return -1;
  return std::stod(m[1]);
}

class MetricsSidecarTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<DaemonProcess>(std::vector<std::string>{"--metrics-port=0"});
    ASSERT_TRUE(daemon_->ready) << daemon_->proc->Stderr();
    // The port picked for metrics is in the daemon's "event=listening" line.
    std::smatch m;
    const std::string log = daemon_->proc->Stdout() + daemon_->proc->Stderr();
    ASSERT_TRUE(std::regex_search(log, m, std::regex("event=listening .*metrics_port=(\\d+)")))
        << log;
    port_ = std::stoi(m[1]);
    ASSERT_GT(port_, 0) << log;
  }

  std::string Scrape() {
    std::string body = HttpGet(port_, "/metrics");
    EXPECT_THAT(body, HasSubstr("200 OK"));
    return body;
  }

  // Scrapes until `name` reads `want` (the sidecar sees a client's end asynchronously), at most
  // 15 s; returns the last value read.
  double AwaitGauge(const std::string& name, double want) {
    double v = -1;
    for (absl::Time until = absl::Now() + absl::Seconds(15); absl::Now() < until;) {
      v = Gauge(Scrape(), name);
      if (v == want) break;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return v;
  }

  std::unique_ptr<DaemonProcess> daemon_;
  int port_ = 0;
};

TEST_F(MetricsSidecarTest, RegionGaugesFollowRegisterUnregisterAndDisconnect) {
  const std::string before = Scrape();
  EXPECT_EQ(Gauge(before, "arfuse_regions"), 0);
  EXPECT_EQ(Gauge(before, "arfuse_region_bytes"), 0);

  auto a = Client::Connect({.target = daemon_->socket, .client_name = "metrics-a"});
  auto b = Client::Connect({.target = daemon_->socket, .client_name = "metrics-b"});
  ASSERT_TRUE(a.ok() && b.ok());
  auto buf1 = HostShmBuffer::Create(65536, "one");
  auto buf2 = HostShmBuffer::Create(4096, "two");
  auto buf3 = HostShmBuffer::Create(8192, "three");
  ASSERT_TRUE(buf1.ok() && buf2.ok() && buf3.ok());
  auto r1 = (*a)->RegisterHostBuffer("one", *buf1);
  auto r2 = (*a)->RegisterHostBuffer("two", *buf2);
  auto r3 = (*b)->RegisterHostBuffer("three", *buf3);
  ASSERT_TRUE(r1.ok() && r2.ok() && r3.ok());

  // Registration answers after the registry changed, so the gauges are current at once.
  const std::string registered = Scrape();
  EXPECT_EQ(Gauge(registered, "arfuse_regions"), 3);
  EXPECT_EQ(Gauge(registered, "arfuse_region_bytes"), 65536 + 4096 + 8192);

  // A refused registration (the object is smaller than byte_size) changes nothing.
  auto too_big = (*b)->RegisterHostFd("big", buf2->fd(), 4097);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_big.status().message(), HasSubstr("byte_size 4097 exceeds"));
  EXPECT_EQ(Gauge(Scrape(), "arfuse_regions"), 3);

  ASSERT_TRUE((*a)->Unregister(*r1).ok());
  const std::string unregistered = Scrape();
  EXPECT_EQ(Gauge(unregistered, "arfuse_regions"), 2);
  EXPECT_EQ(Gauge(unregistered, "arfuse_region_bytes"), 4096 + 8192);

  // Client a disconnects holding "two": its session's end releases it.
  a->reset();
  EXPECT_EQ(AwaitGauge("arfuse_regions", 1), 1);
  EXPECT_EQ(Gauge(Scrape(), "arfuse_region_bytes"), 8192);

  b->reset();
  EXPECT_EQ(AwaitGauge("arfuse_regions", 0), 0);
  EXPECT_EQ(Gauge(Scrape(), "arfuse_region_bytes"), 0);
}

// The metrics port of an arfused in "event=listening"; -1 when absent.
int MetricsPortOf(const DaemonProcess& d) {
  std::smatch m;
  const std::string log = d.proc->Stdout() + d.proc->Stderr();
  if (!std::regex_search(log, m, std::regex("event=listening .*metrics_port=(\\d+)"))) return -1;
  return std::stoi(m[1]);
}

// docs/security.md: the metrics port binds --metrics-host, by default --health-host's address,
// instead of every address. Bound to 127.0.0.1, another loopback address (127.0.0.2) is refused.
TEST(MetricsHost, DefaultsToTheHealthHostAndCanBeSetApart) {
  DaemonProcess loopback({"--metrics-port=0", "--health-host=127.0.0.1"});
  ASSERT_TRUE(loopback.ready) << loopback.proc->Stderr();
  const int port = MetricsPortOf(loopback);
  ASSERT_GT(port, 0);
  EXPECT_THAT(HttpGet(port, "/metrics", "127.0.0.1"), HasSubstr("200 OK"));
  EXPECT_EQ(HttpGet(port, "/metrics", "127.0.0.2"), "");

  DaemonProcess apart({"--metrics-port=0", "--health-host=127.0.0.1", "--metrics-host=0.0.0.0"});
  ASSERT_TRUE(apart.ready) << apart.proc->Stderr();
  const int any = MetricsPortOf(apart);
  ASSERT_GT(any, 0);
  EXPECT_THAT(HttpGet(any, "/metrics", "127.0.0.2"), HasSubstr("200 OK"));
}

}  // namespace
}  // namespace arfuse
