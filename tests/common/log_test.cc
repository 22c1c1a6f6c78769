#include "common/log.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace arfuse {
namespace {

TEST(LogRateLimiter, FirstLineOfAKeyIsWrittenThenHeldBackWithinTheInterval) {
  LogRateLimiter limiter(absl::Seconds(1));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  uint64_t held_back = 99;
  EXPECT_TRUE(limiter.Allow("INVALID_ARGUMENT", t0, &held_back));
  EXPECT_EQ(held_back, 0u);
  for (int i = 1; i <= 5; ++i) {
    EXPECT_FALSE(limiter.Allow("INVALID_ARGUMENT", t0 + absl::Milliseconds(100 * i), &held_back));
  }
  // At the interval: written, with the count of what was held back, which then restarts.
  EXPECT_TRUE(limiter.Allow("INVALID_ARGUMENT", t0 + absl::Seconds(1), &held_back));
  EXPECT_EQ(held_back, 5u);
  EXPECT_TRUE(limiter.Allow("INVALID_ARGUMENT", t0 + absl::Seconds(3), &held_back));
  EXPECT_EQ(held_back, 0u);
}

TEST(LogRateLimiter, KeysAreLimitedIndependently) {
  LogRateLimiter limiter(absl::Seconds(1));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  uint64_t held_back = 0;
  EXPECT_TRUE(limiter.Allow("ABORTED", t0, &held_back));
  EXPECT_TRUE(limiter.Allow("UNAVAILABLE", t0, &held_back));
  EXPECT_FALSE(limiter.Allow("ABORTED", t0 + absl::Milliseconds(1), &held_back));
  EXPECT_TRUE(limiter.Allow("DEADLINE_EXCEEDED", t0 + absl::Milliseconds(1), &held_back));
}

TEST(LogRateLimiter, ConcurrentCallersWriteOneLinePerIntervalAndCountTheRest) {
  LogRateLimiter limiter(absl::Hours(1));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  std::atomic<int> written{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      uint64_t held_back = 0;
      for (int i = 0; i < 1000; ++i) {
        if (limiter.Allow("k", t0, &held_back)) ++written;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(written.load(), 1);
  uint64_t held_back = 0;
  EXPECT_TRUE(limiter.Allow("k", t0 + absl::Hours(1), &held_back));
  EXPECT_EQ(held_back, 3999u);
}

}  // namespace
}  // namespace arfuse
