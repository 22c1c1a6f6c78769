// The sidecar's reading of the attachments' op counter pages (server/instream/op_counters.h,
// attachments.h): what a client writes into its page reaches only its own attachment's numbers,
// within the per-read bound; counters wrap at 2^64 and still count right; an ended attachment's
// counts stay in the sums; the page is sealed so that no client can shrink it under the sidecar.
#include "server/instream/op_counters.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <memory>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/instream/attachments.h"

namespace arfuse {
namespace {

using instream::DeclineReason;
using instream::kMaxOpCounterDelta;
using instream::OpCounterPage;

// The client's view of a page: mapped shared and writable, as libarfuse_client maps it.
class ClientView {
 public:
  explicit ClientView(int fd) {
    map_ =
        ::mmap(nullptr, instream::kOpCounterObjectBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    EXPECT_NE(map_, MAP_FAILED);
  }
  ~ClientView() { ::munmap(map_, instream::kOpCounterObjectBytes); }
  OpCounterPage& page() { return *static_cast<OpCounterPage*>(map_); }

 private:
  void* map_;
};

std::shared_ptr<InStreamOpCounterPage> NewPage() {
  absl::StatusOr<std::unique_ptr<InStreamOpCounterPage>> p = InStreamOpCounterPage::Create();
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? std::shared_ptr<InStreamOpCounterPage>(std::move(*p)) : nullptr;
}

constexpr uint32_t kRange = static_cast<uint32_t>(DeclineReason::kRange);
constexpr uint32_t kDtype = static_cast<uint32_t>(DeclineReason::kDtype);

TEST(OpCounterBuckets, TokenBucketsAreTheDocumentedRanges) {
  using instream::OpTokenBucket;
  EXPECT_EQ(OpTokenBucket(1), 0u);
  EXPECT_EQ(OpTokenBucket(2), 1u);
  EXPECT_EQ(OpTokenBucket(8), 1u);
  EXPECT_EQ(OpTokenBucket(9), 2u);
  EXPECT_EQ(OpTokenBucket(64), 2u);
  EXPECT_EQ(OpTokenBucket(65), 3u);
  EXPECT_EQ(OpTokenBucket(512), 3u);
  EXPECT_EQ(OpTokenBucket(513), 4u);
  EXPECT_EQ(OpTokenBucket(UINT32_MAX), 4u);
}

TEST(OpCounterPageTest, ThePageIsSealedAgainstShrinkingAndGrowing) {
  auto page = NewPage();
  ASSERT_NE(page, nullptr);
  const int seals = ::fcntl(page->fd(), F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  EXPECT_NE(::ftruncate(page->fd(), 0), 0);  // a client holding a duplicate cannot either
  EXPECT_EQ(page->Sample(), InStreamOpCounts{});
}

TEST(OpCounterPageTest, SlotsCountWhatTheClientAddedAndWrapAtTwoToTheSixtyFour) {
  auto page = NewPage();
  ASSERT_NE(page, nullptr);
  ClientView client(page->fd());
  client.page().fused[1][0] = 3;
  client.page().declined[kRange] = 2;
  InStreamOpCounts want;
  want.fused[1][0] = 3;
  want.declined[kRange] = 2;
  EXPECT_EQ(page->Sample(), want);
  // The client's counter nears 2^64 (a garbage-sized jump: refused, taken as the new baseline),
  // then wraps: 2^64 - 2 -> 1 is 3 ops.
  client.page().declined[kDtype] = UINT64_MAX - 1;
  EXPECT_EQ(page->Sample(), want);
  EXPECT_EQ(page->refused_reads(), 1u);
  client.page().declined[kDtype] = 1;
  want.declined[kDtype] = 3;
  EXPECT_EQ(page->Sample(), want);
  // Exactly the bound still counts; one more does not.
  client.page().fused[0][4] = kMaxOpCounterDelta;
  want.fused[0][4] = kMaxOpCounterDelta;
  EXPECT_EQ(page->Sample(), want);
  client.page().fused[0][4] = 2 * kMaxOpCounterDelta + 1;
  EXPECT_EQ(page->Sample(), want);
  EXPECT_EQ(page->refused_reads(), 2u);
}

TEST(OpCounterPageTest, LoweringACounterAddsNothingAndCountingResumesFromThere) {
  auto page = NewPage();
  ASSERT_NE(page, nullptr);
  ClientView client(page->fd());
  client.page().fused[0][2] = 10;
  EXPECT_EQ(page->Sample().fused[0][2], 10u);
  client.page().fused[0][2] = 4;  // lowered: a difference of 2^64 - 6
  EXPECT_EQ(page->Sample().fused[0][2], 10u);
  client.page().fused[0][2] = 5;
  EXPECT_EQ(page->Sample().fused[0][2], 11u);
}

TEST(OpCounterPageTest, GarbageInOneAttachmentsPageChangesOnlyItsNumbers) {
  InStreamAttachments a([](uint64_t, const AttachEventData&) {}, [] { return InStreamProbe{}; });
  auto good = NewPage(), bad = NewPage();
  ASSERT_NE(good, nullptr);
  ASSERT_NE(bad, nullptr);
  absl::StatusOr<uint64_t> good_id = a.Add(1, 5, good);
  absl::StatusOr<uint64_t> bad_id = a.Add(2, 5, bad);
  ASSERT_TRUE(good_id.ok() && bad_id.ok());
  ClientView good_client(good->fd()), bad_client(bad->fd());
  good_client.page().fused[1][1] = 7;
  good_client.page().declined[kRange] = 2;
  bad_client.page().fused[1][1] = 1;
  const InStreamOpCounts good_before = *a.op_counts(*good_id);
  ASSERT_EQ(good_before.fused[1][1], 7u);
  ASSERT_EQ(a.op_counts().fused[1][1], 8u);

  // The bad client fills its whole page (and the rest of its object) with garbage.
  std::memset(&bad_client.page(), 0xa5, sizeof(OpCounterPage));
  const InStreamOpCounts bad_after = *a.op_counts(*bad_id);
  const InStreamOpCounts total = a.op_counts();
  EXPECT_EQ(*a.op_counts(*good_id), good_before);
  // 0xa5a5... is beyond the bound from 0 and from 1: no slot of the bad page moved.
  EXPECT_EQ(bad_after.fused[1][1], 1u);
  EXPECT_EQ(bad_after.fused_total(), 1u);
  EXPECT_EQ(bad_after.declined_total(), 0u);
  EXPECT_EQ(total.fused[1][1], 8u);
  EXPECT_EQ(total.declined[kRange], 2u);
  EXPECT_EQ(total.fused_total(), 8u);

  // A bounded garbage value lands in the bad attachment's slot only.
  bad_client.page().declined[kDtype] = 0xa5a5a5a5a5a5a5a5ull + 1000;
  EXPECT_EQ(a.op_counts(*bad_id)->declined[kDtype], 1000u);
  EXPECT_EQ(*a.op_counts(*good_id), good_before);
  EXPECT_EQ(a.op_counts().declined[kDtype], 1000u);
}

TEST(OpCounterPageTest, AnEndedAttachmentsCountsStayInTheSums) {
  InStreamAttachments a([](uint64_t, const AttachEventData&) {}, [] { return InStreamProbe{}; });
  auto page = NewPage();
  ASSERT_NE(page, nullptr);
  absl::StatusOr<uint64_t> id = a.Add(1, 5, page);
  ASSERT_TRUE(id.ok());
  {
    ClientView client(page->fd());
    client.page().fused[0][0] = 4;
    client.page().declined[kDtype] = 1;
  }
  // Not read before the detach: the last read happens as it ends.
  ASSERT_TRUE(a.Remove(1, *id).ok());
  EXPECT_FALSE(a.op_counts(*id).has_value());
  EXPECT_EQ(a.op_counts().fused[0][0], 4u);
  EXPECT_EQ(a.op_counts().declined[kDtype], 1u);
  // A new attachment adds to them.
  auto next = NewPage();
  ASSERT_NE(next, nullptr);
  absl::StatusOr<uint64_t> id2 = a.Add(1, 5, next);
  ASSERT_TRUE(id2.ok());
  ClientView client(next->fd());
  client.page().fused[0][0] = 1;
  EXPECT_EQ(a.op_counts().fused[0][0], 5u);
  a.RemoveSession(1);
  EXPECT_EQ(a.op_counts().fused[0][0], 5u);
  EXPECT_FALSE(a.op_counts(12345).has_value());
}

}  // namespace
}  // namespace arfuse
