// The peer channel's framing: round trip, and frames that are not ours.
#include "server/peers/wire.h"

#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace arfuse::peers {
namespace {

using ::testing::HasSubstr;

TEST(Wire, RoundTripsAndWaitsForTheWholeFrame) {
  std::string bytes = EncodeFrame(FrameType::kCollective, 42, 1500, "body-bytes");
  std::deque<UniqueFd> fds;
  std::string partial = bytes.substr(0, bytes.size() - 1);
  auto none = TakeFrame(partial, fds);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  auto f = TakeFrame(bytes, fds);
  ASSERT_TRUE(f.ok() && f->has_value());
  EXPECT_EQ((*f)->type, FrameType::kCollective);
  EXPECT_EQ((*f)->seq, 42u);
  EXPECT_EQ((*f)->timeout_ms, 1500u);
  EXPECT_EQ((*f)->body, "body-bytes");
  EXPECT_TRUE(bytes.empty());
}

absl::Status Parse(std::string bytes) {
  std::deque<UniqueFd> fds;
  return TakeFrame(bytes, fds).status();
}

TEST(Wire, RefusesFramesThatAreNotOurs) {
  std::string good = EncodeFrame(FrameType::kJoin, 1, 0, "x");
  std::string bad = good;
  bad[0] = 'Z';
  EXPECT_EQ(Parse(bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Parse(bad).message(), HasSubstr("bad magic"));
  bad = good;
  bad[4] = 9;
  EXPECT_EQ(Parse(bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Parse(bad).message(), HasSubstr("peer wire version 9 is not supported (this build "
                                              "speaks version 2)"));
  EXPECT_THAT(Parse(bad).message(), HasSubstr("same arfused build"));
  bad = good;
  bad[5] = 99;
  EXPECT_EQ(Parse(bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Parse(bad).message(), HasSubstr("unknown peer frame type 99 (this build knows 1..8 "
                                              "of wire version 2)"));
  bad[5] = 0;
  EXPECT_THAT(Parse(bad).message(), HasSubstr("unknown peer frame type 0"));
  bad = good;
  uint32_t huge = kMaxFrameBody + 1;
  std::memcpy(bad.data() + 8, &huge, 4);
  EXPECT_THAT(Parse(bad).message(), HasSubstr("exceeds the limit"));
  // Announces a descriptor that never came.
  std::string fdframe = EncodeFrame(FrameType::kCollectiveFd, 1, 0, "x", 1);
  EXPECT_EQ(Parse(fdframe).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Parse(fdframe).message(), HasSubstr("announces 1 fds but 0 arrived"));
}

TEST(Wire, VersionTwoAddsTheHeartbeatFrame) {
  EXPECT_EQ(kWireVersion, 2);
  std::string bytes = EncodeFrame(FrameType::kHeartbeat, 7, 5000, "");
  EXPECT_EQ(bytes.size(), sizeof(FrameHeader));
  std::deque<UniqueFd> fds;
  auto f = TakeFrame(bytes, fds);
  ASSERT_TRUE(f.ok() && f->has_value()) << f.status();
  EXPECT_EQ((*f)->type, FrameType::kHeartbeat);
  EXPECT_EQ((*f)->seq, 7u);
  EXPECT_EQ((*f)->timeout_ms, 5000u);
}

// A frame of another version is answered in that version's framing (same header layout, same
// Error frame), so the other build can read why it was refused.
TEST(Wire, WrongVersionReplyIsFramedInThePeersVersion) {
  std::string v1 = EncodeFrame(FrameType::kJoin, 42, 1000, "join-body");
  v1[4] = 1;
  std::optional<std::string> reply = WrongVersionReply(v1);
  ASSERT_TRUE(reply.has_value());
  FrameHeader h;
  ASSERT_GE(reply->size(), sizeof(h));
  std::memcpy(&h, reply->data(), sizeof(h));
  EXPECT_EQ(h.magic, kFrameMagic);
  EXPECT_EQ(h.version, 1);
  EXPECT_EQ(h.type, static_cast<uint8_t>(FrameType::kError));
  EXPECT_EQ(h.seq, 42u);
  EXPECT_EQ(h.body_len, reply->size() - sizeof(h));
  absl::Status s = DecodeError(reply->substr(sizeof(h)));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("speaks peer wire version 2 but this rank sent version 1"));
  // Our own version, another protocol, or too few bytes to tell: nothing to say.
  EXPECT_FALSE(WrongVersionReply(EncodeFrame(FrameType::kJoin, 1, 0, "x")).has_value());
  std::string garbage = v1;
  garbage[0] = 'Z';
  EXPECT_FALSE(WrongVersionReply(garbage).has_value());
  EXPECT_FALSE(WrongVersionReply(v1.substr(0, 10)).has_value());
}

TEST(Wire, ErrorsAndJoinBodiesRoundTrip) {
  absl::Status s = DecodeError(EncodeError(absl::UnavailableError("rank 2 went away")));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "rank 2 went away");
  std::string group, req;
  ASSERT_TRUE(DecodeJoinBody(EncodeJoinBody("tp0", "proto"), &group, &req).ok());
  EXPECT_EQ(group, "tp0");
  EXPECT_EQ(req, "proto");
  absl::Status bad = DecodeJoinBody(std::string("\x09\x00"
                                                "ab",
                                                4),
                                    &group, &req);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("malformed join request"));
}

}  // namespace
}  // namespace arfuse::peers
