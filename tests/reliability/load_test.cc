// Load (docs/reliability.md, "Load held"): K clients per rank drive two host-mode sidecars at a
// sustained rate for a bounded time. Reports p50/p99 latency, errors and wrong results (both must
// be 0), sessions and client mappings (Admin.GetStats, /proc/PID/maps) and the sidecars' RSS
// before, during and after; sessions and mappings must return to the baseline, RSS within a
// tolerance.
//
// Small in CI. Longer: ARFUSE_LOAD_SECONDS=120 ARFUSE_LOAD_CLIENTS=4 ARFUSE_LOAD_RATE=100
// (per client), ARFUSE_LOAD_TOKENS, ARFUSE_LOAD_HIDDEN, ARFUSE_LOAD_DTYPE=bf16|fp16|fp32.
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/reliability/device_config.h"
#include "tests/reliability/harness.h"

namespace arfuse::reliability {
namespace {

// Under ASan/TSan the sidecars' RSS includes the sanitizer's quarantine and shadow memory,
// which grows with every allocation and is not given back: RSS is reported, not compared.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kRssComparable = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kRssComparable = false;
#else
constexpr bool kRssComparable = true;
#endif
#else
constexpr bool kRssComparable = true;
#endif

double EnvNumber(const char* name, double def) {
  const char* v = std::getenv(name);
  double out = def;
  if (v != nullptr && !absl::SimpleAtod(v, &out)) out = def;
  return out;
}

struct ClientResult {
  int rank = 0;
  int ops = 0, ok = 0, errors = 0, wrong = 0;
  std::vector<double> latency_us;
  std::string first_error;
};

struct SidecarSample {
  int64_t rss_kib = -1;
  uint32_t sessions = 0;
  int mappings = -1;
};

SidecarSample Sample(Sidecar& s) {
  SidecarSample out;
  out.rss_kib = VmRssKiB(s.pid());
  out.mappings = ClientShmMappings(s.pid());
  auto st = GetStats(s.socket());
  if (st.ok()) out.sessions = st->sessions();
  return out;
}

TEST(Load, SustainedRateThroughTwoSidecarsNothingLostNothingLeaked) {
  const double seconds = EnvNumber("ARFUSE_LOAD_SECONDS", 4);
  const int clients = static_cast<int>(EnvNumber("ARFUSE_LOAD_CLIENTS", 2));
  const double rate = EnvNumber("ARFUSE_LOAD_RATE", 40);
  ShapeConfig shape;
  shape.tokens = static_cast<uint32_t>(EnvNumber("ARFUSE_LOAD_TOKENS", 16));
  shape.hidden = static_cast<uint32_t>(EnvNumber("ARFUSE_LOAD_HIDDEN", 1024));
  const char* dt = std::getenv("ARFUSE_LOAD_DTYPE");
  std::string dtype = dt != nullptr ? dt : "bf16";
  shape.dtype = dtype == "fp32" ? DType::kFP32 : dtype == "fp16" ? DType::kFP16 : DType::kBF16;
  const int ops_per_client = std::max(1, static_cast<int>(seconds * rate));
  constexpr int kWorld = 2;

  SidecarConfig cfg = Config();
  cfg.spin_timeout_s = 5;
  cfg.max_tokens = static_cast<int>(shape.tokens);
  cfg.hidden = static_cast<int>(shape.hidden);
  cfg.dtype = dtype;
  Group g(kWorld, cfg);
  ASSERT_TRUE(g.StartAll()) << g.Logs();
  ASSERT_TRUE(g.WaitAllReady(kFormTimeout)) << g.Logs();

  // Warm-up: gRPC's threads and pools, the first mappings; then everything released.
  {
    std::vector<std::unique_ptr<RankClient>> warm;
    for (int r = 0; r < kWorld; ++r) {
      auto c = NewClient(g[r].socket(), r, kWorld, shape, 0, "warm");
      ASSERT_TRUE(c.ok()) << c.status();
      warm.push_back(std::move(*c));
    }
    std::vector<std::thread> t;
    for (auto& c : warm) {
      t.emplace_back([p = c.get()] {
        for (int i = 0; i < 20; ++i) {
          p->Prepare(i);
          (void)p->Run();
        }
      });
    }
    for (auto& th : t) th.join();
  }
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(WaitUntil([&] { auto s = Sample(g[r]); return s.sessions == 0 && s.mappings == 0; },
                          absl::Seconds(15)));
  }
  SidecarSample before[kWorld], during[kWorld], after[kWorld];
  for (int r = 0; r < kWorld; ++r) before[r] = Sample(g[r]);

  // K clients per rank. Every client of a rank sends the same input (the sidecars pair ops by
  // arrival, whichever client sent them); the residual differs per client and op, so a result
  // delivered to the wrong client or left unwritten is caught.
  std::vector<std::unique_ptr<RankClient>> all;
  for (int k = 0; k < clients; ++k) {
    for (int r = 0; r < kWorld; ++r) {
      auto c = NewClient(g[r].socket(), r, kWorld, shape, 0, absl::StrCat("load", k));
      ASSERT_TRUE(c.ok()) << c.status();
      all.push_back(std::move(*c));
    }
  }
  std::vector<ClientResult> results(all.size());
  std::atomic<int> started{0};
  const absl::Time start = absl::Now() + absl::Milliseconds(200);
  std::vector<std::thread> threads;
  for (size_t idx = 0; idx < all.size(); ++idx) {
    threads.emplace_back([&, idx] {
      RankClient& c = *all[idx];
      ClientResult& res = results[idx];
      res.rank = static_cast<int>(idx % kWorld);
      res.latency_us.reserve(ops_per_client);
      ++started;
      for (int i = 0; i < ops_per_client; ++i) {
        // Open-loop pacing at `rate` per client: op i is due at start + i / rate.
        absl::Time due = start + absl::Seconds(i / rate);
        if (absl::Now() < due) absl::SleepFor(due - absl::Now());
        c.Prepare((idx + 1) * 1000003ull + i);
        absl::Time t0 = absl::Now();
        auto r = c.Run(absl::Seconds(10));
        res.latency_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
        ++res.ops;
        std::string why;
        if (!r.ok()) {
          ++res.errors;
          if (res.first_error.empty()) res.first_error = r.status().ToString();
        } else if (!c.Check(&why)) {
          ++res.wrong;
          if (res.first_error.empty()) res.first_error = "wrong result: " + why;
        } else {
          ++res.ok;
        }
      }
    });
  }
  // Sample the sidecars in the middle of the run.
  absl::SleepFor(std::max(absl::ZeroDuration(),
                          start + absl::Seconds(seconds / 2) - absl::Now()));
  for (int r = 0; r < kWorld; ++r) during[r] = Sample(g[r]);
  for (auto& t : threads) t.join();
  const double wall_s = absl::ToDoubleSeconds(absl::Now() - start);
  all.clear();  // sessions end; the sidecars release every region

  for (int r = 0; r < kWorld; ++r) {
    WaitUntil([&] { auto s = Sample(g[r]); return s.sessions == before[r].sessions &&
                                                  s.mappings == before[r].mappings; },
              absl::Seconds(15));
    after[r] = Sample(g[r]);
  }

  // The table.
  std::string out = absl::StrFormat(
      "\narfuse load: %d %s sidecars, %d clients per rank at %.0f ops/s each for %.1f s "
      "(%d ops each), %ux%u %s\n",
      kWorld, DeviceName(kDevice), clients, rate, seconds, ops_per_client, shape.tokens,
      shape.hidden, dtype);
  absl::StrAppend(&out, absl::StrFormat("%-5s %7s %7s %6s %6s %9s %9s %9s %9s\n", "rank", "ops",
                                        "ok", "errors", "wrong", "p50_us", "p99_us", "max_us",
                                        "ops/s"));
  int total_errors = 0, total_wrong = 0, total_ops = 0;
  std::string first_error;
  for (int r = 0; r < kWorld; ++r) {
    std::vector<double> lat;
    int ops = 0, ok = 0, errors = 0, wrong = 0;
    for (const auto& res : results) {
      if (res.rank != r) continue;
      lat.insert(lat.end(), res.latency_us.begin(), res.latency_us.end());
      ops += res.ops;
      ok += res.ok;
      errors += res.errors;
      wrong += res.wrong;
      if (first_error.empty()) first_error = res.first_error;
    }
    total_errors += errors;
    total_wrong += wrong;
    total_ops += ops;
    absl::StrAppend(&out, absl::StrFormat("%-5d %7d %7d %6d %6d %9.0f %9.0f %9.0f %9.1f\n", r, ops,
                                          ok, errors, wrong, Percentile(lat, 50),
                                          Percentile(lat, 99), Percentile(lat, 100),
                                          ops / wall_s));
  }
  absl::StrAppend(&out, absl::StrFormat("%-8s %14s %14s %14s %18s %18s\n", "sidecar",
                                        "rss_before_KiB", "rss_during_KiB", "rss_after_KiB",
                                        "sessions b/d/a", "mappings b/d/a"));
  for (int r = 0; r < kWorld; ++r) {
    absl::StrAppend(
        &out, absl::StrFormat("%-8d %14d %14d %14d %18s %18s\n", r, before[r].rss_kib,
                              during[r].rss_kib, after[r].rss_kib,
                              absl::StrCat(before[r].sessions, "/", during[r].sessions, "/",
                                           after[r].sessions),
                              absl::StrCat(before[r].mappings, "/", during[r].mappings, "/",
                                           after[r].mappings)));
  }
  std::printf("%s", out.c_str());
  std::fflush(stdout);

  EXPECT_EQ(total_ops, ops_per_client * clients * kWorld);
  EXPECT_EQ(total_errors, 0) << first_error << g.Logs();
  EXPECT_EQ(total_wrong, 0) << first_error;
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(during[r].sessions, before[r].sessions + clients) << "rank " << r;
    EXPECT_EQ(after[r].sessions, before[r].sessions) << "rank " << r;
    EXPECT_EQ(after[r].mappings, before[r].mappings) << "rank " << r;
    // RSS back to the baseline: within 10% or 8 MiB, whichever is larger (allocator slack).
    const int64_t tolerance = std::max<int64_t>(8 * 1024, before[r].rss_kib / 10);
    if (kRssComparable) {
      EXPECT_LE(after[r].rss_kib, before[r].rss_kib + tolerance) << "rank " << r;
    }
  }
}

}  // namespace
}  // namespace arfuse::reliability
