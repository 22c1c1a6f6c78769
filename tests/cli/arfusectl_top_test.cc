// arfusectl top against two real host-mode sidecars (a group of two, --sm=90): one line per rank
// and refresh, rates from two samples, a sidecar killed while top runs reported on its line and
// found again when it comes back; the exposition parser and quantiles in process; bad input.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "arfuse/v1/fusion.grpc.pb.h"
#include "client/cpp/client.h"
#include "tests/support/subprocess.h"
#include "tools/arfusectl/cli.h"
#include "tools/arfusectl/top.h"

namespace arfuse {
namespace {

using ::arfuse::client::Client;
using ::arfuse::client::HostShmBuffer;
using ::arfuse::client::OpDesc;
using ::arfuse::client::TensorLoc;
using ::arfuse::testing::BinaryPath;
using ::arfuse::testing::MakeTempDir;
using ::arfuse::testing::RunToCompletion;
using ::arfuse::testing::Subprocess;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;

constexpr uint32_t kHidden = 256;
constexpr uint32_t kTokens = 4;
constexpr uint64_t kTensorBytes = uint64_t{kTokens} * kHidden * 4;  // fp32

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  for (absl::string_view l : absl::StrSplit(text, '\n', absl::SkipEmpty())) out.emplace_back(l);
  return out;
}

class TopTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir();
    for (int r = 0; r < 2; ++r) {
      sockets_.push_back(dir_ + "/arfused.sock" + (r > 0 ? ".rank" + std::to_string(r) : ""));
      daemons_.push_back(Start(r));
    }
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(daemons_[r]->WaitForOutput("event=ready", 60s)) << daemons_[r]->Stderr();
      metrics_.push_back(MetricsAddress(*daemons_[r]));
      ASSERT_FALSE(metrics_[r].empty()) << daemons_[r]->Stderr();
    }
  }

  std::unique_ptr<Subprocess> Start(int r) {
    return std::make_unique<Subprocess>(std::vector<std::string>{
        BinaryPath("server/daemon/arfused"), "--device=host", "--sm=90",
        "--rank=" + std::to_string(r), "--world-size=2", "--peer-dir=" + dir_,
        "--socket=" + sockets_[r], "--health-port=0", "--metrics-port=0", "--max-tokens=16",
        "--hidden=" + std::to_string(kHidden), "--dtype=fp32",
        "--flashinfer-allreduce-fusion-backend=trtllm", "--peer-timeout=20"});
  }

  static std::string MetricsAddress(Subprocess& p) {
    std::smatch m;
    const std::string text = p.Stdout() + p.Stderr();
    if (!std::regex_search(text, m, std::regex("event=listening [^\n]*metrics_port=(\\d+)"))) {
      return "";
    }
    return absl::StrCat("127.0.0.1:", m[1].str());
  }

  std::string Addr(int r) const { return "unix:" + sockets_[r]; }
  std::string Both() const { return Addr(0) + "," + Addr(1); }
  std::string BothMetrics() const { return metrics_[0] + "," + metrics_[1]; }

  std::pair<int, std::string> Top(std::vector<std::string> args) {
    args.insert(args.begin(), {BinaryPath("tools/arfusectl/arfusectl"), "top"});
    return RunToCompletion(args, {}, 60s);
  }

  // Eager ops on both ranks (each op is collective) until `stop`; the last op of one rank may
  // fail after `stop`, its peer having left.
  void DriveOps(std::atomic<bool>& stop, std::atomic<int>& done, std::vector<std::thread>& out) {
    for (int r = 0; r < 2; ++r) {
      out.emplace_back([this, r, &stop, &done] {
        auto c = Client::Connect({.target = sockets_[r], .client_name = "top-test"});
        ASSERT_TRUE(c.ok()) << c.status();
        auto buf = HostShmBuffer::Create(3 * kTensorBytes + kHidden * 4, "t");
        ASSERT_TRUE(buf.ok()) << buf.status();
        auto region = (*c)->RegisterHostBuffer("t", *buf);
        ASSERT_TRUE(region.ok()) << region.status();
        OpDesc op;
        op.pattern = Pattern::kAllReduceResidualRmsNorm;
        op.dtype = DType::kFP32;
        op.hidden = kHidden;
        op.max_tokens = kTokens;
        op.input = TensorLoc{*region, 0};
        op.residual_in = TensorLoc{*region, kTensorBytes};
        op.residual_out = op.residual_in;
        op.norm_out = TensorLoc{*region, 2 * kTensorBytes};
        op.gamma = TensorLoc{*region, 3 * kTensorBytes};
        auto plan = (*c)->CreatePlan(op);
        ASSERT_TRUE(plan.ok()) << plan.status();
        while (!stop.load()) {
          auto st = (*c)->Execute(*plan, kTokens);
          if (!st.ok()) {
            // Once `stop` is set one rank can leave while its peer's next op already waits for
            // it: that op ends at the spin timeout. Any other failure is one.
            ASSERT_TRUE(stop.load()) << st.status();
            break;
          }
          done.fetch_add(1);
        }
      });
    }
  }

  std::string dir_;
  std::vector<std::string> sockets_;
  std::vector<std::string> metrics_;
  std::vector<std::unique_ptr<Subprocess>> daemons_;
};

TEST_F(TopTest, OneLinePerRankAndRefreshWithRatesFromTwoSamples) {
  std::atomic<bool> stop{false};
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  DriveOps(stop, done, threads);
  for (auto until = std::chrono::steady_clock::now() + 30s;
       done.load() < 4 && std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(10ms);
  }
  auto [code, out] = Top({"--addr=" + Both(), "--metrics=" + BothMetrics(), "--iterations=3",
                          "--interval-ms=300", "--json"});
  stop = true;
  for (auto& t : threads) t.join();
  ASSERT_EQ(code, 0) << out;
  const std::vector<std::string> lines = Lines(out);
  ASSERT_EQ(lines.size(), 6u) << out;
  // Whether this sidecar exports the client library's per-op counters decides the fused and
  // declined columns: numbers when it does, null ("-") when it does not.
  auto scrape = cli::ScrapeMetrics(metrics_[0], 5000ms);
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  const bool counted = absl::StrContains(*scrape, "arfuse_instream_ops_total");
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& l = lines[i];
    const int rank = static_cast<int>(i % 2);
    EXPECT_THAT(l, HasSubstr(absl::StrCat("\"iteration\":", i / 2 + 1, ",")));
    EXPECT_THAT(l, HasSubstr(absl::StrCat("\"addr\":\"", Addr(rank), "\",\"rank\":", rank)));
    EXPECT_THAT(l, HasSubstr("\"reachable\":true,\"state\":\"READY\""));
    EXPECT_THAT(l, HasSubstr("\"backend\":\"trtllm\",\"generation\":1,"));
    EXPECT_THAT(l, HasSubstr("\"poisonings\":0,\"metrics_error\":null"));
    // Eager ops ran through both sidecars the whole time: a rate, a latency, the eager plane.
    EXPECT_THAT(l, HasSubstr("\"plane\":\"eager\"")) << l;
    EXPECT_THAT(l, Not(HasSubstr("\"sidecar_ops_per_s\":0.000"))) << l;
    EXPECT_THAT(l, Not(HasSubstr("\"sidecar_ops_per_s\":null"))) << l;
    EXPECT_THAT(l, Not(HasSubstr("\"p50_us\":null"))) << l;
    EXPECT_THAT(l, Not(HasSubstr("\"p99_us\":null"))) << l;
    EXPECT_EQ(absl::StrContains(l, "\"fused_per_s\":null,\"declined_per_s\":null"), !counted) << l;
  }
}

TEST_F(TopTest, WithoutMetricsTheMetricColumnsShowADash) {
  auto [code, out] = Top({"--addr=" + Both(), "--iterations=2", "--interval-ms=100"});
  ASSERT_EQ(code, 0) << out;
  const std::vector<std::string> lines = Lines(out);
  ASSERT_EQ(lines.size(), 5u) << out;
  EXPECT_THAT(lines[0], HasSubstr("RANK STATE"));
  for (const char* column : {"PLANE", "BACKEND", "GEN", "FUSED/S", "DECLINED/S", "TOP-DECLINE",
                             "SIDECAR/S", "P50", "P99", "POISON", "ADDR"}) {
    EXPECT_THAT(lines[0], HasSubstr(column));
  }
  for (size_t i = 1; i < lines.size(); ++i) {
    const int rank = static_cast<int>((i - 1) % 2);
    EXPECT_THAT(lines[i], ::testing::MatchesRegex(absl::StrCat(
                              rank, " +READY +- +trtllm +1 +- +- +- +0\\.0 +- +- +0 +",
                              std::regex_replace(Addr(rank), std::regex("\\."), "\\."))))
        << lines[i];
  }
}

// A sidecar that goes away: its line says so at every refresh while the other rank's lines go
// on, and it is asked again until it answers; top runs its iterations to the end.
TEST_F(TopTest, AKilledSidecarIsReportedAndFoundAgain) {
  Subprocess top({BinaryPath("tools/arfusectl/arfusectl"), "top", "--addr=" + Both(),
                  "--iterations=40", "--interval-ms=200", "--plain"});
  ASSERT_TRUE(top.WaitForOutput(Addr(1) + "\n", 30s)) << top.Stdout() << top.Stderr();
  daemons_[1]->Signal(SIGKILL);
  ASSERT_TRUE(daemons_[1]->Wait(10s).has_value());
  ASSERT_TRUE(top.WaitForOutput("UNREACHABLE", 10s)) << top.Stdout();
  // Three more refreshes that find it gone, then it comes back on the same socket.
  std::this_thread::sleep_for(700ms);
  daemons_[1] = Start(1);
  ASSERT_TRUE(daemons_[1]->WaitForOutput("ready to accept", 30s)) << daemons_[1]->Stderr();
  std::optional<int> code = top.Wait(60s);
  ASSERT_TRUE(code.has_value()) << top.Stdout();
  const std::vector<std::string> lines = Lines(top.Stdout());
  ASSERT_EQ(lines.size(), 81u) << top.Stdout() << top.Stderr();
  int rank0 = 0, gone = 0, back_after_gone = 0;
  for (size_t i = 1; i < lines.size(); ++i) {
    if (i % 2 == 1) {
      EXPECT_THAT(lines[i], ::testing::StartsWith("0 ")) << lines[i];
      EXPECT_THAT(lines[i], Not(HasSubstr("UNREACHABLE")));
      ++rank0;
      continue;
    }
    if (absl::StrContains(lines[i], "UNREACHABLE")) {
      // The rank it had, the address, why, and that top keeps asking.
      EXPECT_THAT(lines[i], ::testing::StartsWith("1    UNREACHABLE  arfused at " + Addr(1) +
                                                  " does not answer (UNAVAILABLE: "));
      EXPECT_THAT(lines[i], HasSubstr("trying again every 200 ms"));
      ++gone;
      EXPECT_EQ(back_after_gone, 0) << "reported gone again after it came back: " << lines[i];
    } else if (gone > 0) {
      EXPECT_THAT(lines[i], ::testing::StartsWith("1 ")) << lines[i];
      ++back_after_gone;
    }
  }
  EXPECT_EQ(rank0, 40);
  EXPECT_GE(gone, 3);
  EXPECT_GE(back_after_gone, 1) << top.Stdout();
  // Every rank answered at the last refresh.
  EXPECT_EQ(*code, 0) << top.Stdout();
}

TEST_F(TopTest, ARankGoneAtTheLastRefreshExitsThree) {
  daemons_[1]->Signal(SIGKILL);
  ASSERT_TRUE(daemons_[1]->Wait(10s).has_value());
  auto [code, out] = Top({"--addr=" + Both(), "--iterations=1", "--interval-ms=50", "--json"});
  EXPECT_EQ(code, cli::kExitUnreachable) << out;
  EXPECT_THAT(out,
              HasSubstr(absl::StrCat("\"addr\":\"", Addr(0), "\",\"rank\":0,\"reachable\":true")));
  // Never answered since top started: its rank is unknown.
  EXPECT_THAT(out, HasSubstr(absl::StrCat(
                       "\"addr\":\"", Addr(1),
                       "\",\"rank\":null,\"reachable\":false,\"error\":\"UNAVAILABLE: ")));
}

// ---- in process ----

struct Result {
  int code;
  std::string out, err;
};

Result RunCtl(const std::vector<std::string>& args) {
  std::ostringstream out, err;
  Result r;
  r.code = cli::RunArfusectl(args, out, err);
  r.out = out.str();
  r.err = err.str();
  return r;
}

TEST(ArfusectlTopInput, BadInputExitsTwoWithOneLine) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"top", "--iterations=0"}, "--iterations must be >= 1"},
      {{"top", "--iterations=x"}, "--iterations \"x\" is not a positive integer"},
      {{"top", "--interval-ms=-5"}, "--interval-ms \"-5\" is not a positive integer"},
      {{"top", "--timeout-ms=0"}, "--timeout-ms must be >= 1"},
      {{"top", "--addr=unix:/a,unix:/b", "--metrics=127.0.0.1:1"},
       "--metrics names 1 endpoint(s) for 2 address(es)"},
      {{"top", "--addr=unix:/a", "--metrics=localhost"},
       "--metrics: \"localhost\" is not HOST:PORT"},
      {{"top", "--addr=unix:/a,", "--iterations=1"}, "--addr has an empty address"},
      {{"top", "--plain", "--plain"}, "--plain given more than once"},
      {{"top", "--bogus"}, "bogus"},
  };
  for (const Case& c : cases) {
    Result r = RunCtl(c.args);
    EXPECT_EQ(r.code, cli::kExitUsage) << c.args.back() << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message)) << c.args.back();
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.out, "");
  }
}

TEST(ArfusectlTopInput, HelpListsTheOptions) {
  Result r = RunCtl({"top", "--help"});
  EXPECT_EQ(r.code, 0);
  for (const char* o : {"--metrics", "--interval-ms", "--iterations", "--plain", "--json"}) {
    EXPECT_THAT(r.out, HasSubstr(o));
  }
  EXPECT_THAT(RunCtl({"--help"}).out, HasSubstr("  top "));
}

TEST(ArfusectlTopParse, ExpositionLinesLabelsAndEscapes) {
  auto got = cli::ParseExposition(
      "# HELP arfuse_ops_total Ops\n# TYPE arfuse_ops_total counter\n"
      "arfuse_ops_total{plane=\"eager\",reason=\"a \\\"b\\\" \\\\ c\"} 12\n"
      "arfuse_ready 1 1700000000\n"
      "arfuse_op_latency_seconds_bucket{le=\"+Inf\",path=\"host\"} 3.5e2\n");
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 3u);
  EXPECT_EQ((*got)[0].name, "arfuse_ops_total");
  EXPECT_EQ((*got)[0].labels.at("plane"), "eager");
  EXPECT_EQ((*got)[0].labels.at("reason"), "a \"b\" \\ c");
  EXPECT_EQ((*got)[0].value, 12);
  EXPECT_EQ((*got)[1].name, "arfuse_ready");
  EXPECT_TRUE((*got)[1].labels.empty());
  EXPECT_EQ((*got)[2].labels.at("le"), "+Inf");
  EXPECT_EQ((*got)[2].value, 350);
  for (const char* bad : {"x{a=\"b} 1\n", "x{a=b} 1\n", "x\n", "{a=\"b\"} 1\n", "x 1z\n"}) {
    auto r = cli::ParseExposition(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(r.status().message(), HasSubstr("metrics line 1: ")) << bad;
  }
}

TEST(ArfusectlTopParse, QuantilesInterpolateWithinTheBucket) {
  const double inf = std::numeric_limits<double>::infinity();
  // 10 observations at or below 1e-4, 10 more up to 2e-4.
  std::map<double, double> h = {{1e-4, 10}, {2e-4, 20}, {inf, 20}};
  EXPECT_DOUBLE_EQ(*cli::HistogramQuantile(0.5, h), 1e-4);
  EXPECT_DOUBLE_EQ(*cli::HistogramQuantile(0.75, h), 1.5e-4);
  EXPECT_DOUBLE_EQ(*cli::HistogramQuantile(0.25, h), 0.5e-4);
  // Observations above every finite bound: the largest finite bound, as Prometheus answers.
  EXPECT_DOUBLE_EQ(*cli::HistogramQuantile(0.99, {{1e-4, 1}, {inf, 100}}), 1e-4);
  EXPECT_FALSE(cli::HistogramQuantile(0.5, {{1e-4, 0}, {inf, 0}}).has_value());
  EXPECT_FALSE(cli::HistogramQuantile(0.5, {}).has_value());
}

TEST(ArfusectlTopParse, ScrapingNothingIsUnavailable) {
  auto r = cli::ScrapeMetrics("127.0.0.1:1", 2000ms);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("cannot reach metrics at 127.0.0.1:1"));
  EXPECT_EQ(cli::ScrapeMetrics("nocolon", 100ms).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace arfuse
