// The sidecar's in-stream attachments (server/instream/attachments.h): one per session, drains
// with acknowledgements, and the events sent when the workspace changes: queued where the change
// is seen (the supervisor, the watcher's probe, a drain) and delivered in that order.
#include "server/instream/attachments.h"

#include <atomic>
#include <limits>
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
  InStreamProbe probe{true, 5, 0, "", 0, 0, std::nullopt};
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
  EXPECT_TRUE(a.RemoveSession(2).empty());  // another session's end leaves it alone
  EXPECT_TRUE(a.Busy());
  // The session's end names the attachment that ended with it (its op is retired by the engine).
  EXPECT_EQ(a.RemoveSession(1), std::vector<uint64_t>{*id});
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
    // The group re-formed: a new workspace.
    engine.probe = InStreamProbe{true, 6, 0, "", 3, 1, std::nullopt};
  }
  ASSERT_TRUE(WaitFor([&] { return rec.size() >= 2; }));
  EXPECT_EQ(rec.events[1].second.kind, AttachEventKind::kReinitialized);
  EXPECT_THAT(rec.events[1].second.reason, HasSubstr("attach again"));
  EXPECT_FALSE(a.Busy());
  EXPECT_TRUE(WaitFor([&] { return a.launches() == 13u; }));  // counters carry across workspaces
}

// The kinds and attach ids a session heard, in order.
std::vector<std::pair<AttachEventKind, uint64_t>> Heard(Recorder& rec, uint64_t session) {
  std::lock_guard<std::mutex> lock(rec.mu);
  std::vector<std::pair<AttachEventKind, uint64_t>> out;
  for (const auto& [s, e] : rec.events) {
    if (s == session) out.push_back({e.kind, e.attach_id});
  }
  return out;
}

// A poisoning the probe never sees (the supervisor drops the workspace and the group re-forms
// between two probes) still reaches every session as POISONED with its cause, then
// REINITIALIZED; round after round.
TEST(InStreamAttachments, PoisonedIsDeliveredBeforeReinitializedHoweverFastTheGroupReforms) {
  Recorder rec;
  FakeEngine engine;  // always healthy: the probe never sees an error word
  // A probe interval far longer than the test: only the recorded transitions can deliver.
  InStreamAttachments a([&](uint64_t s, const AttachEventData& e) { rec(s, e); },
                        [&] { return engine.Get(); }, absl::Seconds(3600));
  uint64_t generation = 5;
  for (int round = 0; round < 20; ++round) {
    absl::StatusOr<uint64_t> id1 = a.Add(1, generation);
    absl::StatusOr<uint64_t> id2 = a.Add(2, generation);
    ASSERT_TRUE(id1.ok() && id2.ok()) << "round " << round;
    a.Poisoned(generation, "host workspace poisoned by an in-stream op (timeout)");
    a.Reinitialized(generation + 1);  // at once: the re-formed group serves
    ASSERT_TRUE(WaitFor([&] { return rec.size() == 4u * (round + 1); })) << "round " << round;
    EXPECT_FALSE(a.Busy());
    for (auto [session, id] : {std::pair<uint64_t, uint64_t>{1, *id1}, {2, *id2}}) {
      auto heard = Heard(rec, session);
      ASSERT_EQ(heard.size(), 2u * (round + 1));
      EXPECT_EQ(heard[2 * round], std::make_pair(AttachEventKind::kPoisoned, id));
      EXPECT_EQ(heard[2 * round + 1], std::make_pair(AttachEventKind::kReinitialized, id));
    }
    {
      std::lock_guard<std::mutex> lock(rec.mu);
      const AttachEventData& poisoned = rec.events[4 * round].second;
      EXPECT_EQ(poisoned.kind, AttachEventKind::kPoisoned);
      EXPECT_EQ(poisoned.reason,
                "host workspace poisoned by an in-stream op (timeout); the group re-forms");
    }
    ++generation;
  }
}

// One thread delivers, in queue order, even when a delivery is slow and transitions keep coming
// meanwhile (a session whose stream is busy).
TEST(InStreamAttachments, DeliveryKeepsTheOrderOfTheTransitions) {
  Recorder rec;
  FakeEngine engine;
  std::atomic<int> in_notify{0};
  std::atomic<bool> overlapped{false};
  InStreamAttachments a(
      [&](uint64_t s, const AttachEventData& e) {
        if (in_notify.fetch_add(1) != 0) overlapped = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        rec(s, e);
        in_notify.fetch_sub(1);
      },
      [&] { return engine.Get(); }, absl::Seconds(3600));
  std::vector<uint64_t> ids;
  for (uint64_t g = 10; g < 20; ++g) {
    absl::StatusOr<uint64_t> id = a.Add(7, g);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
    a.Poisoned(g, absl::StrCat("cause ", g));
    a.Reinitialized(g + 1);
  }
  ASSERT_TRUE(WaitFor([&] { return rec.size() == 20u; }));
  EXPECT_FALSE(overlapped);
  std::lock_guard<std::mutex> lock(rec.mu);
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(rec.events[2 * i].second.kind, AttachEventKind::kPoisoned);
    EXPECT_EQ(rec.events[2 * i].second.attach_id, ids[i]);
    EXPECT_EQ(rec.events[2 * i].second.reason,
              absl::StrCat("cause ", 10 + i, "; the group re-forms"));
    EXPECT_EQ(rec.events[2 * i + 1].second.kind, AttachEventKind::kReinitialized);
    EXPECT_EQ(rec.events[2 * i + 1].second.attach_id, ids[i]);
  }
}

// The supervisor and the probe both see the same poisoning: each session hears it once, with the
// cause recorded first.
TEST(InStreamAttachments, APoisoningSeenTwiceIsToldOnce) {
  Recorder rec;
  FakeEngine engine;
  InStreamAttachments a([&](uint64_t s, const AttachEventData& e) { rec(s, e); },
                        [&] { return engine.Get(); }, absl::Milliseconds(5));
  ASSERT_TRUE(a.Add(1, 5).ok());
  a.Poisoned(5, "peer link lost (rank 1 went away)");
  {
    std::lock_guard<std::mutex> lock(engine.mu);
    engine.probe.error = 1;
    engine.probe.error_name = "timeout";
  }
  ASSERT_TRUE(WaitFor([&] { return rec.size() >= 1; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(40));  // several probes see the error
  a.Poisoned(5, "again");
  a.Reinitialized(6);
  ASSERT_TRUE(WaitFor([&] { return rec.size() >= 2; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::lock_guard<std::mutex> lock(rec.mu);
  ASSERT_EQ(rec.events.size(), 2u);
  EXPECT_EQ(rec.events[0].second.kind, AttachEventKind::kPoisoned);
  EXPECT_EQ(rec.events[0].second.reason, "peer link lost (rank 1 went away); the group re-forms");
  EXPECT_EQ(rec.events[1].second.kind, AttachEventKind::kReinitialized);
}

// An attach whose export raced the poisoning or the re-form is refused: it would never hear the
// events already sent for its workspace.
TEST(InStreamAttachments, RefusesAnAttachToAPoisonedOrReplacedWorkspace) {
  Recorder rec;
  FakeEngine engine;
  InStreamAttachments a([&](uint64_t s, const AttachEventData& e) { rec(s, e); },
                        [&] { return engine.Get(); }, absl::Seconds(3600));
  a.Poisoned(5, "host workspace poisoned by an in-stream op (timeout)");
  absl::StatusOr<uint64_t> poisoned = a.Add(1, 5);
  EXPECT_EQ(poisoned.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(poisoned.status().message(), HasSubstr("poisoned (host workspace poisoned by an "
                                                     "in-stream op (timeout))"));
  a.Reinitialized(6);
  absl::StatusOr<uint64_t> old = a.Add(1, 5);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(old.status().message(), HasSubstr("rebuilt"));
  EXPECT_TRUE(a.Add(1, 6).ok());
  // A poisoning recorded for a workspace already gone changes nothing.
  a.Poisoned(5, "late");
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(rec.size(), 0u);
  EXPECT_TRUE(a.Busy());
}

// A drain's events follow the ones queued before it, and a re-form without a poisoning (a
// requested re-initialization) is REINITIALIZED alone.
TEST(InStreamAttachments, ADrainFollowsEarlierEventsAndAPlainReformIsReinitializedOnly) {
  Recorder rec;
  FakeEngine engine;
  InStreamAttachments a([&](uint64_t s, const AttachEventData& e) { rec(s, e); },
                        [&] { return engine.Get(); }, absl::Seconds(3600));
  ASSERT_TRUE(a.Add(1, 5).ok());
  ASSERT_TRUE(a.Add(2, 5).ok());
  a.Poisoned(5, "cause");
  EXPECT_EQ(a.Drain("shutdown", absl::Now() + absl::Milliseconds(30)), 2u);
  {
    std::lock_guard<std::mutex> lock(rec.mu);
    ASSERT_EQ(rec.events.size(), 4u);  // the drain waited for its own events' delivery
    EXPECT_EQ(rec.events[0].second.kind, AttachEventKind::kPoisoned);
    EXPECT_EQ(rec.events[1].second.kind, AttachEventKind::kPoisoned);
    EXPECT_EQ(rec.events[2].second.kind, AttachEventKind::kDrain);
    EXPECT_EQ(rec.events[3].second.kind, AttachEventKind::kDrain);
  }
  absl::StatusOr<uint64_t> id = a.Add(3, 7);
  ASSERT_TRUE(id.ok());
  a.Reinitialized(8);
  ASSERT_TRUE(WaitFor([&] { return rec.size() == 5u; }));
  std::lock_guard<std::mutex> lock(rec.mu);
  EXPECT_EQ(rec.events[4].first, 3u);
  EXPECT_EQ(rec.events[4].second.kind, AttachEventKind::kReinitialized);
  EXPECT_EQ(rec.events[4].second.attach_id, *id);
}

}  // namespace
}  // namespace arfuse

namespace arfuse {
namespace {

// The kernels' per-attachment launch counts (FusionControl::instream_ops), as the probe reads
// them: each attachment gets its own slot, the slot's launches are its fused ops, a reused slot
// starts from a fresh baseline, and what a client writes into the table stays bounded.
struct TableEngine {
  std::mutex mu;
  InStreamProbe probe{true, 5, 0, "", 0, 0, instream::InStreamOpTable{}};
  std::atomic<int> probes{0};
  InStreamProbe Get() {
    std::lock_guard<std::mutex> lock(mu);
    ++probes;
    return probe;
  }
  void Launch(uint32_t slot, int pattern_index, uint32_t tokens, uint64_t n = 1) {
    std::lock_guard<std::mutex> lock(mu);
    probe.ops->ops[slot][pattern_index][instream::OpTokenBucket(tokens)] += n;
  }
  void Set(uint32_t slot, int pattern_index, uint32_t bucket, uint64_t v) {
    std::lock_guard<std::mutex> lock(mu);
    probe.ops->ops[slot][pattern_index][bucket] = v;
  }
  // Waits until two more probes completed (the table's next read has been applied).
  void Settle() {
    const int want = probes.load() + 2;
    WaitFor([&] { return probes.load() >= want; });
  }
};

uint64_t Fused(const InStreamOpCounts& c, int pattern_index, uint32_t tokens) {
  return c.fused[pattern_index][instream::OpTokenBucket(tokens)];
}

TEST(InStreamKernelCounts, EachAttachmentCountsItsOwnSlotReplaysIncluded) {
  TableEngine engine;
  InStreamAttachments a([](uint64_t, const AttachEventData&) {}, [&] { return engine.Get(); },
                        absl::Milliseconds(2));
  absl::StatusOr<uint64_t> x = a.Add(1, 5);
  absl::StatusOr<uint64_t> y = a.Add(2, 5);
  ASSERT_TRUE(x.ok() && y.ok());
  const uint32_t sx = *a.counter_slot(*x), sy = *a.counter_slot(*y);
  EXPECT_NE(sx, sy);
  EXPECT_LT(sx, instream::kInStreamAttachSlots);
  EXPECT_LT(sy, instream::kInStreamAttachSlots);
  EXPECT_FALSE(a.counter_slot(424242).has_value());
  engine.Launch(sx, 1, 1, 100);  // one captured op replayed 100 times
  engine.Launch(sx, 0, 600, 2);
  engine.Launch(sy, 1, 7, 3);
  engine.Settle();
  EXPECT_TRUE(a.kernel_counted());
  EXPECT_EQ(Fused(*a.op_counts(*x), 1, 1), 100u);
  EXPECT_EQ(Fused(*a.op_counts(*x), 0, 600), 2u);
  EXPECT_EQ(a.op_counts(*x)->fused_total(), 102u);
  EXPECT_EQ(a.op_counts(*y)->fused_total(), 3u);
  EXPECT_EQ(Fused(*a.op_counts(*y), 1, 7), 3u);
  EXPECT_EQ(a.op_counts().fused_total(), 105u);
  // Without counter pages the library's own counts are unknown.
  EXPECT_FALSE(a.library_op_counts(*x).has_value());
}

TEST(InStreamKernelCounts, AGarbageSlotIndexCountsForTheRankOnly) {
  TableEngine engine;
  InStreamAttachments a([](uint64_t, const AttachEventData&) {}, [&] { return engine.Get(); },
                        absl::Milliseconds(2));
  absl::StatusOr<uint64_t> x = a.Add(1, 5);
  ASSERT_TRUE(x.ok());
  // The kernels count a launch with an index out of range in the last slot.
  engine.Launch(instream::kInStreamUnattributedSlot, 0, 4, 9);
  engine.Launch(*a.counter_slot(*x), 0, 4, 1);
  engine.Settle();
  EXPECT_EQ(a.unattributed_launches(), 9u);
  EXPECT_EQ(a.op_counts(*x)->fused_total(), 1u);
  EXPECT_EQ(a.op_counts().fused_total(), 10u);
}

TEST(InStreamKernelCounts, AJumpOrADecreaseIsRefusedAndReadFromItsNewValueOn) {
  TableEngine engine;
  InStreamAttachments a([](uint64_t, const AttachEventData&) {}, [&] { return engine.Get(); },
                        absl::Milliseconds(2));
  absl::StatusOr<uint64_t> x = a.Add(1, 5);
  ASSERT_TRUE(x.ok());
  const uint32_t s = *a.counter_slot(*x);
  engine.Launch(s, 1, 1, 5);
  engine.Settle();
  ASSERT_EQ(a.op_counts(*x)->fused_total(), 5u);
  // A client wrote garbage into the (writable) workspace: the read adds nothing.
  engine.Set(s, 1, 0, uint64_t{1} << 50);
  engine.Settle();
  EXPECT_EQ(a.op_counts(*x)->fused_total(), 5u);
  EXPECT_GE(a.refused_kernel_reads(), 1u);
  engine.Launch(s, 1, 1, 2);  // counted again from the new value
  engine.Settle();
  EXPECT_EQ(a.op_counts(*x)->fused_total(), 7u);
  engine.Set(s, 1, 0, 3);  // lowered: refused too
  engine.Settle();
  EXPECT_EQ(a.op_counts(*x)->fused_total(), 7u);
}

TEST(InStreamKernelCounts, CountersWrappingAt2To64CountRight) {
  TableEngine engine;
  const uint64_t near = std::numeric_limits<uint64_t>::max() - 1;
  InStreamAttachments a([](uint64_t, const AttachEventData&) {}, [&] { return engine.Get(); },
                        absl::Milliseconds(2));
  absl::StatusOr<uint64_t> x = a.Add(1, 5);
  ASSERT_TRUE(x.ok());
  const uint32_t s = *a.counter_slot(*x);
  engine.Set(s, 0, 2, near);  // refused (a jump from 0), the baseline is now `near`
  engine.Settle();
  engine.Set(s, 0, 2, near + 5);  // wraps to 3
  engine.Settle();
  EXPECT_EQ(Fused(*a.op_counts(*x), 0, 9), 5u);
}

TEST(InStreamKernelCounts, AReusedSlotStartsFromAFreshBaseline) {
  TableEngine engine;
  InStreamAttachments a([](uint64_t, const AttachEventData&) {}, [&] { return engine.Get(); },
                        absl::Milliseconds(2));
  absl::StatusOr<uint64_t> x = a.Add(1, 5);
  ASSERT_TRUE(x.ok());
  const uint32_t s = *a.counter_slot(*x);
  engine.Launch(s, 1, 1, 40);
  engine.Settle();
  // The holder launches more and ends before the next probe: its slot is not handed out until a
  // probe read those last launches.
  engine.Launch(s, 1, 1, 2);
  ASSERT_TRUE(a.Remove(1, *x).ok());
  engine.Settle();
  EXPECT_EQ(a.op_counts().fused_total(), 42u);
  absl::StatusOr<uint64_t> z = a.Add(3, 5);
  ASSERT_TRUE(z.ok());
  EXPECT_EQ(*a.counter_slot(*z), s);  // the lowest free slot, now free again
  engine.Settle();
  EXPECT_EQ(a.op_counts(*z)->fused_total(), 0u);
  engine.Launch(s, 1, 1, 1);
  engine.Settle();
  EXPECT_EQ(a.op_counts(*z)->fused_total(), 1u);
  EXPECT_EQ(a.op_counts().fused_total(), 43u);
}

TEST(InStreamKernelCounts, ExhaustedSlotsAreSharedAsUnattributed) {
  TableEngine engine;
  InStreamAttachments a([](uint64_t, const AttachEventData&) {}, [&] { return engine.Get(); },
                        absl::Milliseconds(2));
  std::vector<uint64_t> ids;
  for (uint32_t i = 0; i < instream::kInStreamAttachSlots; ++i) {
    absl::StatusOr<uint64_t> id = a.Add(100 + i, 5);
    ASSERT_TRUE(id.ok());
    EXPECT_EQ(*a.counter_slot(*id), i);
    ids.push_back(*id);
  }
  absl::StatusOr<uint64_t> extra = a.Add(999, 5);
  ASSERT_TRUE(extra.ok());  // attached, counted for the rank only
  EXPECT_EQ(*a.counter_slot(*extra), instream::kInStreamUnattributedSlot);
  engine.Launch(instream::kInStreamUnattributedSlot, 0, 1, 4);
  engine.Settle();
  EXPECT_EQ(a.op_counts(*extra)->fused_total(), 0u);
  EXPECT_EQ(a.unattributed_launches(), 4u);
  EXPECT_EQ(a.op_counts().fused_total(), 4u);
}

TEST(InStreamKernelCounts, ANewWorkspaceStartsItsTableAtZero) {
  TableEngine engine;
  InStreamAttachments a([](uint64_t, const AttachEventData&) {}, [&] { return engine.Get(); },
                        absl::Milliseconds(2));
  absl::StatusOr<uint64_t> x = a.Add(1, 5);
  ASSERT_TRUE(x.ok());
  engine.Launch(*a.counter_slot(*x), 0, 1, 30);
  engine.Settle();
  {
    // The group re-formed: generation 6, a zeroed table.
    std::lock_guard<std::mutex> lock(engine.mu);
    engine.probe.generation = 6;
    engine.probe.ops = instream::InStreamOpTable{};
  }
  ASSERT_TRUE(WaitFor([&] { return !a.Busy(); }));  // REINITIALIZED ended the attachment
  absl::StatusOr<uint64_t> y = a.Add(2, 6);
  ASSERT_TRUE(y.ok());
  engine.Launch(*a.counter_slot(*y), 0, 1, 3);
  engine.Settle();
  EXPECT_EQ(a.op_counts(*y)->fused_total(), 3u);
  EXPECT_EQ(a.op_counts().fused_total(), 33u);
}

TEST(InStreamKernelCounts, HostModeKeepsTheLibrarysCounts) {
  FakeEngine engine;  // probes without a table
  InStreamAttachments a([](uint64_t, const AttachEventData&) {}, [&] { return engine.Get(); },
                        absl::Milliseconds(2));
  absl::StatusOr<uint64_t> x = a.Add(1, 5);
  ASSERT_TRUE(x.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(a.kernel_counted());
  EXPECT_FALSE(a.op_counts(*x).has_value());  // no page, no kernel counts
  a.ExpectKernelCounts();                     // a CUDA attach
  EXPECT_TRUE(a.kernel_counted());
  EXPECT_EQ(a.op_counts(*x)->fused_total(), 0u);
}

}  // namespace
}  // namespace arfuse
