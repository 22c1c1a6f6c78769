// The sidecar's in-stream attachments (server/instream/attachments.h): one per session, drains
// with acknowledgements, and the events the watcher sends when the workspace changes.
#include "server/instream/attachments.h"

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;

struct Recorder {
  std::mutex mu;
  std::vector<std::pair<uint64_t, AttachEventData>> events;
  void operator()(uint64_t session, const AttachEventData& e) {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back({session, e});
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return events.size();
  }
};

struct FakeEngine {
  std::mutex mu;
  InStreamProbe probe{true, 5, 0, "", 0, 0};
  InStreamProbe Get() {
    std::lock_guard<std::mutex> lock(mu);
    return probe;
  }
};

bool WaitFor(const std::function<bool()>& done) {
  for (int i = 0; i < 400; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return done();
}

TEST(InStreamAttachments, OnePerSessionAndRemovedBySessionEnd) {
  Recorder rec;
  FakeEngine engine;
  InStreamAttachments a([&](uint64_t s, const AttachEventData& e) { rec(s, e); },
                        [&] { return engine.Get(); }, absl::Milliseconds(5));
  absl::StatusOr<uint64_t> id = a.Add(1, 5);
  ASSERT_TRUE(id.ok());
  EXPECT_TRUE(a.Busy());
  absl::StatusOr<uint64_t> again = a.Add(1, 5);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(again.status().message(), HasSubstr("already holds attachment"));
  // Another session's id and an id nobody holds get one answer, which names no id.
  absl::Status other = a.Remove(2, *id);
  EXPECT_EQ(other.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(other.message(), HasSubstr("not held by this session"));
  EXPECT_THAT(std::string(other.message()), ::testing::Not(HasSubstr(absl::StrCat(*id))));
  EXPECT_EQ(a.Remove(2, *id ^ 1), other);
  a.RemoveSession(1);
  EXPECT_FALSE(a.Busy());
  EXPECT_EQ(a.Remove(1, *id), other);
}

TEST(InStreamAttachments, DrainWaitsForAcknowledgements) {
  Recorder rec;
  FakeEngine engine;
  InStreamAttachments* table = nullptr;
  InStreamAttachments a(
      [&](uint64_t s, const AttachEventData& e) {
        rec(s, e);
        // The client answers from its session stream, on another thread.
        if (e.kind == AttachEventKind::kDrain) {
          std::thread([table, s, id = e.attach_id] { table->Acknowledge(s, id); }).detach();
        }
      },
      [&] { return engine.Get(); }, absl::Milliseconds(5));
  table = &a;
  ASSERT_TRUE(a.Add(1, 5).ok());
  ASSERT_TRUE(a.Add(2, 5).ok());
  EXPECT_EQ(a.Drain("backend switch to trtllm", absl::Now() + absl::Seconds(5)), 0u);
  EXPECT_FALSE(a.Busy());
  ASSERT_EQ(rec.size(), 2u);
  EXPECT_EQ(rec.events[0].second.kind, AttachEventKind::kDrain);
  EXPECT_EQ(rec.events[0].second.reason, "backend switch to trtllm");
}

TEST(InStreamAttachments, DrainGivesUpOnSilentClientsAtTheDeadline) {
  Recorder rec;
  FakeEngine engine;
  InStreamAttachments a([&](uint64_t s, const AttachEventData& e) { rec(s, e); },
                        [&] { return engine.Get(); }, absl::Milliseconds(5));
  ASSERT_TRUE(a.Add(1, 5).ok());
  const absl::Time start = absl::Now();
  EXPECT_EQ(a.Drain("shutdown", absl::Now() + absl::Milliseconds(50)), 1u);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_FALSE(a.Busy());  // gone either way
}

TEST(InStreamAttachments, RefusesAttachDuringADrain) {
  Recorder rec;
  FakeEngine engine;
  InStreamAttachments* table = nullptr;
  absl::Status during;
  InStreamAttachments a(
      [&](uint64_t, const AttachEventData&) { during = table->Add(9, 5).status(); },
      [&] { return engine.Get(); }, absl::Milliseconds(5));
  table = &a;
  ASSERT_TRUE(a.Add(1, 5).ok());
  a.Drain("switch", absl::Now() + absl::Milliseconds(20));
  EXPECT_EQ(during.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(during.message(), HasSubstr("draining"));
  EXPECT_TRUE(a.Add(9, 5).ok());  // after it
}

TEST(InStreamAttachments, WatcherReportsPoisoningOnceAndARebuiltWorkspace) {
  Recorder rec;
  FakeEngine engine;
  InStreamAttachments a([&](uint64_t s, const AttachEventData& e) { rec(s, e); },
                        [&] { return engine.Get(); }, absl::Milliseconds(5));
  ASSERT_TRUE(a.Add(1, 5).ok());
  {
    std::lock_guard<std::mutex> lock(engine.mu);
    engine.probe.error = 1;
    engine.probe.error_name = "timeout";
    engine.probe.launches = 10;
  }
  ASSERT_TRUE(WaitFor([&] { return rec.size() >= 1; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  ASSERT_EQ(rec.size(), 1u);  // once, not every probe
  EXPECT_EQ(rec.events[0].second.kind, AttachEventKind::kPoisoned);
  EXPECT_THAT(rec.events[0].second.reason, HasSubstr("timeout"));
  EXPECT_EQ(a.launches(), 10u);
  {
    std::lock_guard<std::mutex> lock(engine.mu);
    engine.probe = InStreamProbe{true, 6, 0, "", 3, 1};  // the group re-formed: a new workspace
  }
  ASSERT_TRUE(WaitFor([&] { return rec.size() >= 2; }));
  EXPECT_EQ(rec.events[1].second.kind, AttachEventKind::kReinitialized);
  EXPECT_THAT(rec.events[1].second.reason, HasSubstr("attach again"));
  EXPECT_FALSE(a.Busy());
  EXPECT_TRUE(WaitFor([&] { return a.launches() == 13u; }));  // counters carry across workspaces
}

}  // namespace
}  // namespace arfuse
