// The peer channel's framing: round trip, and frames that are not ours.
#include "server/peers/wire.h"

#include <fcntl.h>
#include <sys/socket.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
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

TEST(Wire, RefusesOversizedBodiesAndTooManyAnnouncedDescriptors) {
  std::string big = EncodeFrame(FrameType::kJoin, 1, 0, "x");
  uint32_t huge = kMaxFrameBody + 1;
  std::memcpy(big.data() + 8, &huge, 4);
  EXPECT_EQ(Parse(big).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Parse(big).message(),
              HasSubstr(absl::StrCat("peer frame body of ", huge, " bytes exceeds the limit of ",
                                     kMaxFrameBody)));
  std::string many = EncodeFrame(FrameType::kCollectiveFd, 1, 0, "x", kMaxFrameFds + 1);
  EXPECT_EQ(Parse(many).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Parse(many).message(), HasSubstr("peer frame announces 65 fds (max 64)"));
}

TEST(Wire, MalformedErrorAndJoinBodies) {
  absl::Status s = DecodeError("ab");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("malformed peer error frame"));
  // A code outside 1..16 reads as UNKNOWN, never as OK.
  for (uint32_t code : {0u, 17u, 99u}) {
    std::string body(sizeof(code), '\0');
    std::memcpy(body.data(), &code, sizeof(code));
    EXPECT_EQ(DecodeError(body + "why").code(), absl::StatusCode::kUnknown) << code;
  }
  std::string group, req;
  absl::Status j = DecodeJoinBody("x", &group, &req);
  EXPECT_EQ(j.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(j.message(), HasSubstr("malformed join request"));
}

// Both ends of a connected Unix stream socket.
struct SocketPair {
  SocketPair() {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    a.reset(sv[0]);
    b.reset(sv[1]);
  }
  UniqueFd a, b;
};

TEST(Wire, MoreDescriptorsThanAFrameMayCarryAreRefused) {
  SocketPair p;
  std::vector<UniqueFd> held;
  std::vector<int> raw;
  for (int i = 0; i <= kMaxFrameFds; ++i) {
    held.emplace_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(held.back().valid());
    raw.push_back(held.back().get());
  }
  char byte = 'x';
  iovec iov{&byte, 1};
  std::vector<uint64_t> ctrl((CMSG_SPACE(sizeof(int) * raw.size()) + 7) / 8);
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctrl.data();
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * raw.size());
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * raw.size());
  std::memcpy(CMSG_DATA(c), raw.data(), sizeof(int) * raw.size());
  ASSERT_EQ(::sendmsg(p.a.get(), &msg, 0), 1);
  std::string buf;
  std::deque<UniqueFd> fds;
  bool eof = false;
  absl::Status s = ReadAvailable(p.b.get(), buf, fds, &eof);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      s.message(),
      HasSubstr("peer socket: the sender attached more file descriptors than a message may carry"));
}

TEST(Wire, SocketErrorsAreUnavailable) {
  std::string buf;
  std::deque<UniqueFd> fds;
  bool eof = false;
  absl::Status r = ReadAvailable(-1, buf, fds, &eof);
  EXPECT_EQ(r.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.message(), HasSubstr("peer socket read failed"));
  size_t offset = 0;
  absl::Status w = SendSome(-1, "x", &offset, {});
  EXPECT_EQ(w.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(w.message(), HasSubstr("peer socket write failed"));
}

// A frame never carries more descriptors than the control buffer (and a receiver) takes: refused
// before anything is written.
TEST(Wire, SendingMoreDescriptorsThanAFrameMayCarryIsRefused) {
  SocketPair p;
  UniqueFd null_fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(null_fd.valid());
  const std::vector<int> raw(kMaxFrameFds + 1, null_fd.get());
  std::string frame = EncodeFrame(FrameType::kJoin, 1, 0, "body", kMaxFrameFds + 1);
  absl::Status sent = SendAll(p.a.get(), frame, raw, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(sent.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(sent.message(), HasSubstr("peer socket: a message carries at most 64 fds, got 65"));
  std::string buf;
  std::deque<UniqueFd> fds;
  bool eof = false;
  ASSERT_TRUE(ReadAvailable(p.b.get(), buf, fds, &eof).ok());
  EXPECT_TRUE(buf.empty());
  EXPECT_TRUE(fds.empty());
}

TEST(Wire, DeadlinesAndAClosedPeerAreNamed) {
  SocketPair p;
  std::string buf;
  std::deque<UniqueFd> fds;
  auto waited = RecvFrame(p.b.get(), buf, fds, absl::Now());
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(waited.status().message(), HasSubstr("timed out waiting on the peer channel"));
  // Nobody reads: more than the socket buffers hold cannot go out before the deadline.
  absl::Status sent =
      SendAll(p.a.get(), std::string(16 << 20, 'x'), {}, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(sent.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(sent.message(), HasSubstr("timed out sending to the peer channel"));
  // The peer goes away: what it sent is no whole frame.
  SocketPair q;
  std::string frame = EncodeFrame(FrameType::kJoin, 1, 0, "body");
  ASSERT_TRUE(SendAll(q.a.get(), frame.substr(0, 10), {}, absl::Now() + absl::Seconds(5)).ok());
  q.a.reset();
  auto closed = RecvFrame(q.b.get(), buf, fds, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(closed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(closed.status().message(), HasSubstr("connection closed by the peer"));
}

}  // namespace
}  // namespace arfuse::peers
