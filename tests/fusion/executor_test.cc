// The Fusion service's Executor: bounded FIFO queue, one task per worker slot, and the inline
// fast path (RunInlineIfIdle) that runs an op on the caller's thread when nothing waits.
#include "server/services/fusion/executor.h"

#include <atomic>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace arfuse {
namespace {

bool WaitFor(const std::function<bool()>& cond, absl::Duration timeout = absl::Seconds(30)) {
  const absl::Time until = absl::Now() + timeout;
  while (!cond()) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

TEST(ExecutorTest, IdleExecutorRunsTheTaskOnTheCallersThread) {
  Executor ex(1, 4);
  std::thread::id ran_on;
  bool cancelled = true;
  EXPECT_TRUE(ex.RunInlineIfIdle([&](bool c) {
    ran_on = std::this_thread::get_id();
    cancelled = c;
  }));
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_FALSE(cancelled);
}

TEST(ExecutorTest, NoInlineRunWhileATaskRunsOrWaits) {
  absl::Notification started, release;  // outlive the executor's workers
  Executor ex(1, 4);
  ASSERT_TRUE(ex.Submit([&](bool) {
                  started.Notify();
                  release.WaitForNotification();
                }).ok());
  started.WaitForNotification();
  bool ran = false;
  // The worker slot is taken: the caller must queue instead.
  EXPECT_FALSE(ex.RunInlineIfIdle([&](bool) { ran = true; }));
  EXPECT_FALSE(ran);
  ASSERT_TRUE(ex.Submit([](bool) {}).ok());
  EXPECT_EQ(ex.queued(), 1u);
  release.Notify();
  ASSERT_TRUE(WaitFor([&] { return ex.queued() == 0; }));
}

TEST(ExecutorTest, TasksSubmittedDuringAnInlineTaskRunAfterItInOrder) {
  std::mutex mu;
  std::vector<int> order;
  auto record = [&](int i) {
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(i);
  };
  absl::Notification inside, release;
  Executor ex(1, 8);
  std::thread caller([&] {
    EXPECT_TRUE(ex.RunInlineIfIdle([&](bool) {
      inside.Notify();
      release.WaitForNotification();
      record(0);
    }));
  });
  inside.WaitForNotification();
  // The inline task holds the only slot: these wait for it, in arrival order.
  for (int i = 1; i <= 3; ++i) ASSERT_TRUE(ex.Submit([&, i](bool) { record(i); }).ok());
  absl::SleepFor(absl::Milliseconds(20));
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_TRUE(order.empty());
  }
  EXPECT_EQ(ex.queued(), 3u);
  release.Notify();
  caller.join();
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard<std::mutex> lock(mu);
    return order.size() == 4;
  }));
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
}

TEST(ExecutorTest, TheQueueBoundDoesNotCountTheRunningTask) {
  absl::Notification inside, release;
  Executor ex(1, 1);
  std::thread caller([&] {
    EXPECT_TRUE(ex.RunInlineIfIdle([&](bool) {
      inside.Notify();
      release.WaitForNotification();
    }));
  });
  inside.WaitForNotification();
  EXPECT_TRUE(ex.Submit([](bool) {}).ok());
  absl::Status full = ex.Submit([](bool) {});
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), ::testing::HasSubstr("1 ops already wait for this workspace"));
  release.Notify();
  caller.join();
  ASSERT_TRUE(WaitFor([&] { return ex.queued() == 0; }));
}

TEST(ExecutorTest, ShutdownCancelsQueuedTasksAndRefusesInlineRuns) {
  absl::Notification inside, release;
  std::atomic<int> cancelled{0}, ran{0};
  Executor ex(1, 8);
  std::thread caller([&] {
    ex.RunInlineIfIdle([&](bool) {
      inside.Notify();
      release.WaitForNotification();
    });
  });
  inside.WaitForNotification();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(ex.Submit([&](bool c) { (c ? cancelled : ran)++; }).ok());
  }
  ex.Shutdown();
  EXPECT_EQ(cancelled.load(), 3);
  EXPECT_FALSE(ex.RunInlineIfIdle([&](bool) { ran++; }));
  absl::Status stopped = ex.Submit([](bool) {});
  EXPECT_EQ(stopped.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(stopped.message(), ::testing::HasSubstr("sidecar is shutting down"));
  release.Notify();
  caller.join();
  EXPECT_EQ(ran.load(), 0);
}

TEST(ExecutorTest, SeveralWorkersRunTasksSideBySide) {
  absl::Notification a_in, b_in, release;
  Executor ex(2, 8);
  ASSERT_TRUE(ex.Submit([&](bool) {
                  a_in.Notify();
                  release.WaitForNotification();
                }).ok());
  ASSERT_TRUE(ex.Submit([&](bool) {
                  b_in.Notify();
                  release.WaitForNotification();
                }).ok());
  EXPECT_TRUE(a_in.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(b_in.WaitForNotificationWithTimeout(absl::Seconds(30)));
  // Both slots are busy now.
  EXPECT_FALSE(ex.RunInlineIfIdle([](bool) {}));
  release.Notify();
}

}  // namespace
}  // namespace arfuse
