#include "server/peers/wire.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/fd/scm_rights.h"
#include "common/status_macros.h"

namespace arfuse::peers {

std::string EncodeFrame(FrameType type, uint64_t seq, uint32_t timeout_ms, const std::string& body,
                        uint16_t nfds) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.version = kWireVersion;
  h.type = static_cast<uint8_t>(type);
  h.nfds = nfds;
  h.body_len = static_cast<uint32_t>(body.size());
  h.timeout_ms = timeout_ms;
  h.seq = seq;
  std::string out(sizeof(h) + body.size(), '\0');
  std::memcpy(out.data(), &h, sizeof(h));
  std::memcpy(out.data() + sizeof(h), body.data(), body.size());
  return out;
}

namespace {

absl::Status WrongVersionError(uint8_t theirs, uint8_t ours) {
  return absl::InvalidArgumentError(
      absl::StrCat("peer wire version ", theirs, " is not supported (this build speaks version ",
                   ours, "): every rank of a group must run the same arfused build"));
}

}  // namespace

absl::StatusOr<std::optional<Frame>> TakeFrame(std::string& buf, std::deque<UniqueFd>& fds) {
  if (buf.size() < sizeof(FrameHeader)) return std::optional<Frame>();
  FrameHeader h;
  std::memcpy(&h, buf.data(), sizeof(h));
  if (h.magic != kFrameMagic) {
    return absl::InvalidArgumentError("peer frame has a bad magic: not an arfuse peer channel");
  }
  if (h.version != kWireVersion) return WrongVersionError(h.version, kWireVersion);
  if (h.type < 1 || h.type > kMaxFrameType) {
    return absl::InvalidArgumentError(absl::StrCat("unknown peer frame type ", h.type,
                                                   " (this build knows 1..", kMaxFrameType,
                                                   " of wire version ", kWireVersion, ")"));
  }
  if (h.body_len > kMaxFrameBody) {
    return absl::InvalidArgumentError(absl::StrCat("peer frame body of ", h.body_len,
                                                   " bytes exceeds the limit of ", kMaxFrameBody));
  }
  if (h.nfds > kMaxFrameFds) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer frame announces ", h.nfds, " fds (max ", kMaxFrameFds, ")"));
  }
  if (buf.size() < sizeof(h) + h.body_len) return std::optional<Frame>();
  // The fds were attached to the frame's first byte, so they arrived with it.
  if (fds.size() < h.nfds) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer frame announces ", h.nfds, " fds but ", fds.size(), " arrived"));
  }
  Frame f;
  f.type = static_cast<FrameType>(h.type);
  f.timeout_ms = h.timeout_ms;
  f.seq = h.seq;
  f.body = buf.substr(sizeof(h), h.body_len);
  buf.erase(0, sizeof(h) + h.body_len);
  f.fds = TakeFds(fds, h.nfds);
  return std::optional<Frame>(std::move(f));
}

std::string EncodeError(const absl::Status& status) {
  uint32_t code = static_cast<uint32_t>(status.code());
  std::string out(sizeof(code), '\0');
  std::memcpy(out.data(), &code, sizeof(code));
  out.append(status.message().data(), status.message().size());
  return out;
}

std::optional<std::string> WrongVersionReply(const std::string& buf) {
  FrameHeader h;
  if (buf.size() < sizeof(h)) return std::nullopt;
  std::memcpy(&h, buf.data(), sizeof(h));
  if (h.magic != kFrameMagic || h.version == kWireVersion) return std::nullopt;
  const absl::Status refusal = absl::FailedPreconditionError(
      absl::StrCat("the coordinator (rank 0) speaks peer wire version ", kWireVersion,
                   " but this rank sent version ", h.version,
                   ": every rank of a group must run the same arfused build"));
  std::string reply = EncodeFrame(FrameType::kError, h.seq, 0, EncodeError(refusal));
  reply[offsetof(FrameHeader, version)] = static_cast<char>(h.version);
  return reply;
}

std::string EncodeJoinBody(const std::string& group, const std::string& join_request) {
  uint16_t len = static_cast<uint16_t>(std::min<size_t>(group.size(), 0xffff));
  std::string out(sizeof(len), '\0');
  std::memcpy(out.data(), &len, sizeof(len));
  out.append(group.data(), len);
  out.append(join_request);
  return out;
}

absl::Status DecodeJoinBody(const std::string& body, std::string* group,
                            std::string* join_request) {
  uint16_t len = 0;
  if (body.size() < sizeof(len)) return absl::InvalidArgumentError("malformed join request");
  std::memcpy(&len, body.data(), sizeof(len));
  if (body.size() < sizeof(len) + len) return absl::InvalidArgumentError("malformed join request");
  *group = body.substr(sizeof(len), len);
  *join_request = body.substr(sizeof(len) + len);
  return absl::OkStatus();
}

// More ranks than any group has: a count beyond it is not a table.
constexpr uint32_t kMaxGossipRanks = 1u << 16;

std::string EncodeGossipTable(const std::vector<std::string>& payloads) {
  std::string out;
  if (payloads.empty()) return out;  // no table: the echo of a beat without gossip
  auto put = [&out](uint32_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  put(static_cast<uint32_t>(payloads.size()));
  for (const std::string& p : payloads) {
    put(static_cast<uint32_t>(p.size()));
    out += p;
  }
  return out;
}

std::optional<std::vector<std::string>> DecodeGossipTable(const std::string& body) {
  size_t at = 0;
  auto get = [&](uint32_t* v) {
    if (body.size() - at < sizeof(*v)) return false;
    std::memcpy(v, body.data() + at, sizeof(*v));
    at += sizeof(*v);
    return true;
  };
  uint32_t n = 0;
  if (!get(&n) || n > kMaxGossipRanks) return std::nullopt;
  std::vector<std::string> out(n);
  for (std::string& p : out) {
    uint32_t len = 0;
    if (!get(&len) || body.size() - at < len) return std::nullopt;
    p = body.substr(at, len);
    at += len;
  }
  if (at != body.size()) return std::nullopt;
  return out;
}

absl::Status DecodeError(const std::string& body) {
  uint32_t code = 0;
  if (body.size() < sizeof(code)) return absl::InternalError("malformed peer error frame");
  std::memcpy(&code, body.data(), sizeof(code));
  if (code == 0 || code > 16) code = static_cast<uint32_t>(absl::StatusCode::kUnknown);
  return absl::Status(static_cast<absl::StatusCode>(code), body.substr(sizeof(code)));
}

absl::Status ReadAvailable(int fd, std::string& buf, std::deque<UniqueFd>& fds, bool* eof) {
  return RecvWithFds(fd, buf, fds, eof, "peer socket");
}

absl::Status SendSome(int fd, const std::string& data, size_t* offset,
                      const std::vector<int>& fds) {
  return SendWithFds(fd, data, offset, fds, "peer socket");
}

short PeerStream::PollEvents(bool sending) const {
  return static_cast<short>(POLLIN | (sending ? POLLOUT : 0));
}

absl::Status PlainStream::ReadAvailable(std::string& buf, std::deque<UniqueFd>& fds, bool* eof) {
  return peers::ReadAvailable(fd_.get(), buf, fds, eof);
}

absl::Status PlainStream::SendSome(const std::string& data, size_t* offset,
                                   const std::vector<int>& fds) {
  return peers::SendSome(fd_.get(), data, offset, fds);
}

namespace {

// A plain socket the caller owns, as a stream.
class BorrowedStream final : public PeerStream {
 public:
  explicit BorrowedStream(int fd) : fd_(fd) {}
  int fd() const override { return fd_; }
  absl::Status ReadAvailable(std::string& buf, std::deque<UniqueFd>& fds, bool* eof) override {
    return peers::ReadAvailable(fd_, buf, fds, eof);
  }
  absl::Status SendSome(const std::string& data, size_t* offset,
                        const std::vector<int>& fds) override {
    return peers::SendSome(fd_, data, offset, fds);
  }

 private:
  const int fd_;
};

}  // namespace

absl::Status FlushFrames(PeerStream& stream, std::deque<OutFrame>& queue) {
  while (!queue.empty()) {
    OutFrame& o = queue.front();
    std::vector<int> raw;
    for (auto& f : o.fds) raw.push_back(f.get());
    ARFUSE_RETURN_IF_ERROR(stream.SendSome(o.data, &o.offset, raw));
    if (o.offset < o.data.size()) return absl::OkStatus();  // the socket is full
    queue.pop_front();
  }
  return absl::OkStatus();
}

absl::Status FlushFrames(int fd, std::deque<OutFrame>& queue) {
  BorrowedStream stream(fd);
  return FlushFrames(stream, queue);
}

void EnableKeepalive(int fd) {
  int on = 1, idle_s = 5, interval_s = 2, probes = 3;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
}

uint32_t RemainingMs(absl::Time deadline) {
  absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  int64_t ms = absl::ToInt64Milliseconds(left);
  return static_cast<uint32_t>(std::min<int64_t>(ms, (int64_t{1} << 31) - 1));
}

absl::Status SendAll(PeerStream& stream, const std::string& data, const std::vector<int>& fds,
                     absl::Time deadline) {
  size_t offset = 0;
  for (;;) {
    absl::Status s = stream.SendSome(data, &offset, fds);
    if (!s.ok()) return s;
    if (offset == data.size()) return absl::OkStatus();
    auto ready = WaitForSocket(stream.fd(), stream.PollEvents(true), deadline);
    if (!ready.ok()) return ready.status();
    if (!*ready) return absl::DeadlineExceededError("timed out sending to the peer channel");
  }
}

absl::StatusOr<Frame> RecvFrame(PeerStream& stream, std::string& buf, std::deque<UniqueFd>& fds,
                                absl::Time deadline) {
  for (;;) {
    auto frame = TakeFrame(buf, fds);
    if (!frame.ok()) return frame.status();
    if (frame->has_value()) return std::move(**frame);
    bool eof = false;
    absl::Status s = stream.ReadAvailable(buf, fds, &eof);
    if (!s.ok()) return s;
    if (eof) {
      auto last = TakeFrame(buf, fds);
      if (last.ok() && last->has_value()) return std::move(**last);
      return absl::UnavailableError("connection closed by the peer");
    }
    frame = TakeFrame(buf, fds);
    if (!frame.ok()) return frame.status();
    if (frame->has_value()) return std::move(**frame);
    auto ready = WaitForSocket(stream.fd(), stream.PollEvents(false), deadline);
    if (!ready.ok()) return ready.status();
    if (!*ready) return absl::DeadlineExceededError("timed out waiting on the peer channel");
  }
}

absl::Status SendAll(int fd, const std::string& data, const std::vector<int>& fds,
                     absl::Time deadline) {
  BorrowedStream stream(fd);
  return SendAll(stream, data, fds, deadline);
}

absl::StatusOr<Frame> RecvFrame(int fd, std::string& buf, std::deque<UniqueFd>& fds,
                                absl::Time deadline) {
  BorrowedStream stream(fd);
  return RecvFrame(stream, buf, fds, deadline);
}

}  // namespace arfuse::peers
