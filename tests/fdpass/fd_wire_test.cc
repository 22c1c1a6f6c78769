// The fd channel's framing: layout, strict decoding, and the blocking client helpers.
#include "common/fd/fd_wire.h"

#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/fdpass/fd_test_util.h"

namespace arfuse {
namespace {

using ::arfuse::testing::Pipe;
using ::arfuse::testing::SocketPair;
using ::testing::HasSubstr;

FdMessageHeader HeaderOf(const std::string& bytes) {
  FdMessageHeader h;
  std::memcpy(&h, bytes.data(), sizeof(h));
  return h;
}

absl::Status TakeError(std::string bytes, size_t fds_arrived = 0) {
  std::deque<UniqueFd> fds;
  for (size_t i = 0; i < fds_arrived; ++i) fds.emplace_back(::open("/dev/null", O_RDONLY));
  return TakeFdMessage(bytes, fds).status();
}

TEST(FdWire, HeaderIsLittleEndianAndPinned) {
  std::string m = EncodeFdMessage(FdOp::kPickup, "abc", 0);
  ASSERT_EQ(m.size(), 16u + 3u);
  EXPECT_EQ(m.substr(0, 4), "ARFD");
  EXPECT_EQ(m[4], 1);  // version
  EXPECT_EQ(m[5], 3);  // PICKUP
  EXPECT_EQ(HeaderOf(m).body_len, 3u);
  EXPECT_EQ(m.substr(16), "abc");
}

TEST(FdWire, TakesOneMessageAtATimeWithItsDescriptors) {
  std::string buf = EncodeFdMessage(FdOp::kDeposit, "", 2) + EncodeFdMessage(FdOp::kPickup, "t");
  std::deque<UniqueFd> fds;
  fds.emplace_back(::open("/dev/null", O_RDONLY));
  fds.emplace_back(::open("/dev/null", O_RDONLY));
  auto first = TakeFdMessage(buf, fds);
  ASSERT_TRUE(first.ok() && first->has_value()) << first.status();
  EXPECT_EQ((*first)->op, FdOp::kDeposit);
  EXPECT_EQ((*first)->fds.size(), 2u);
  EXPECT_TRUE(fds.empty());
  auto second = TakeFdMessage(buf, fds);
  ASSERT_TRUE(second.ok() && second->has_value());
  EXPECT_EQ((*second)->body, "t");
  EXPECT_TRUE(buf.empty());
}

TEST(FdWire, PartialMessagesWaitAndSayHowManyBytesAreMissing) {
  std::string whole = EncodeFdMessage(FdOp::kPickup, "0123456789");
  std::string buf = whole.substr(0, 7);
  EXPECT_EQ(FdMessageBytesMissing(buf), 9u);
  std::deque<UniqueFd> fds;
  auto partial = TakeFdMessage(buf, fds);
  ASSERT_TRUE(partial.ok());
  EXPECT_FALSE(partial->has_value());
  buf = whole.substr(0, 20);
  EXPECT_EQ(FdMessageBytesMissing(buf), 6u);
  buf = whole;
  EXPECT_EQ(FdMessageBytesMissing(buf), 0u);
}

TEST(FdWire, RefusesWhatIsNotOurs) {
  std::string m = EncodeFdMessage(FdOp::kPickup, "x");
  std::string bad = m;
  bad[0] = 'X';
  EXPECT_THAT(TakeError(bad).message(), HasSubstr("bad magic"));
  bad = m;
  bad[4] = 9;
  EXPECT_THAT(TakeError(bad).message(), HasSubstr("fd channel version 9 is not supported"));
  bad = m;
  bad[5] = 0;
  EXPECT_THAT(TakeError(bad).message(), HasSubstr("unknown fd channel op 0"));
  bad = m;
  bad[5] = 6;
  EXPECT_THAT(TakeError(bad).message(), HasSubstr("unknown fd channel op 6"));
  bad = m;
  bad[12] = 1;
  EXPECT_THAT(TakeError(bad).message(), HasSubstr("nonzero reserved field"));
  FdMessageHeader h = HeaderOf(m);
  h.body_len = kMaxFdBody + 1;
  std::memcpy(bad.data(), &h, sizeof(h));
  absl::Status big = TakeError(bad);
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(big.message(), HasSubstr("exceeds the limit of 1024"));
  EXPECT_THAT(TakeError(EncodeFdMessage(FdOp::kDeposit, "", 17)).message(),
              HasSubstr("announces 17 descriptors (at most 16)"));
  EXPECT_THAT(TakeError(EncodeFdMessage(FdOp::kDeposit, "", 2), 1).message(),
              HasSubstr("announces 2 descriptors but 1 arrived"));
}

TEST(FdWire, ErrorsCarryTheirCodeAndABoundedMessage) {
  std::string m = EncodeFdError(absl::NotFoundError(std::string(5000, 'm')));
  std::deque<UniqueFd> fds;
  auto taken = TakeFdMessage(m, fds);
  ASSERT_TRUE(taken.ok() && taken->has_value()) << taken.status();
  absl::Status s = DecodeFdError((*taken)->body);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message().size(), kMaxFdBody - 4);
  EXPECT_EQ(DecodeFdError("").code(), absl::StatusCode::kInternal);
  std::string odd(4, '\0');
  odd[0] = 99;  // no such code
  EXPECT_EQ(DecodeFdError(odd).code(), absl::StatusCode::kUnknown);
}

TEST(FdWire, SendAndReceiveCarryDescriptorsAcrossASocket) {
  SocketPair sp;
  Pipe p;
  ASSERT_TRUE(SendFdMessage(sp.a.get(), FdOp::kPickupOk, "", {p.write_end.get()},
                            absl::Now() + absl::Seconds(5))
                  .ok());
  p.write_end.reset();
  absl::StatusOr<FdMessage> got = RecvFdMessage(sp.b.get(), absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->fds.size(), 1u);
  EXPECT_EQ(::write(got->fds[0].get(), "y", 1), 1);
  char c = 0;
  EXPECT_EQ(::read(p.read_end.get(), &c, 1), 1);
  EXPECT_EQ(c, 'y');
}

TEST(FdWire, ReceivingIsBoundedByTheDeadlineAndNamesAClosedPeer) {
  SocketPair sp;
  auto waited = RecvFdMessage(sp.b.get(), absl::Now() + absl::Milliseconds(20));
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(waited.status().message(), HasSubstr("timed out waiting on the fd channel"));
  std::string half = EncodeFdMessage(FdOp::kPickup, "abc").substr(0, 10);
  ASSERT_EQ(::write(sp.a.get(), half.data(), half.size()), 10);
  sp.a.reset();
  auto closed = RecvFdMessage(sp.b.get(), absl::Now() + absl::Seconds(5));
  EXPECT_EQ(closed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(closed.status().message(), HasSubstr("closed the connection"));
}

TEST(FdWire, SendingMoreThanSixteenDescriptorsIsRefusedBeforeAnythingIsWritten) {
  SocketPair sp;
  std::vector<int> many(17, 0);
  absl::Status s = SendFdMessage(sp.a.get(), FdOp::kDeposit, "", many, absl::Now());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("at most 16 descriptors, got 17"));
  char c;
  EXPECT_EQ(::recv(sp.b.get(), &c, 1, MSG_DONTWAIT), -1);
}

}  // namespace
}  // namespace arfuse
