#include "common/fd/fd_wire.h"

#include <errno.h>
#include <poll.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace arfuse {

std::string EncodeFdMessage(FdOp op, absl::string_view body, uint16_t nfds) {
  FdMessageHeader h{};
  h.magic = kFdWireMagic;
  h.version = kFdWireVersion;
  h.op = static_cast<uint8_t>(op);
  h.nfds = nfds;
  h.body_len = static_cast<uint32_t>(body.size());
  std::string out(sizeof(h) + body.size(), '\0');
  std::memcpy(out.data(), &h, sizeof(h));
  std::memcpy(out.data() + sizeof(h), body.data(), body.size());
  return out;
}

std::string EncodeFdError(const absl::Status& status) {
  const uint32_t code = static_cast<uint32_t>(status.code());
  std::string body(sizeof(code), '\0');
  std::memcpy(body.data(), &code, sizeof(code));
  // Bounded: the reply must fit the limit the client enforces.
  absl::string_view msg = status.message();
  body.append(msg.data(), std::min<size_t>(msg.size(), kMaxFdBody - sizeof(code)));
  return EncodeFdMessage(FdOp::kError, body);
}

absl::Status DecodeFdError(absl::string_view body) {
  uint32_t code = 0;
  if (body.size() < sizeof(code)) return absl::InternalError("malformed fd channel error message");
  std::memcpy(&code, body.data(), sizeof(code));
  if (code == 0 || code > 16) code = static_cast<uint32_t>(absl::StatusCode::kUnknown);
  return absl::Status(static_cast<absl::StatusCode>(code), body.substr(sizeof(code)));
}

size_t FdMessageBytesMissing(const std::string& buf) {
  if (buf.size() < sizeof(FdMessageHeader)) return sizeof(FdMessageHeader) - buf.size();
  FdMessageHeader h;
  std::memcpy(&h, buf.data(), sizeof(h));
  // An oversized body is refused by TakeFdMessage; never ask for more than the limit.
  const size_t want = sizeof(h) + std::min<uint32_t>(h.body_len, kMaxFdBody);
  return buf.size() >= want ? 0 : want - buf.size();
}

absl::StatusOr<std::optional<FdMessage>> TakeFdMessage(std::string& buf,
                                                       std::deque<UniqueFd>& fds) {
  if (buf.size() < sizeof(FdMessageHeader)) return std::optional<FdMessage>();
  FdMessageHeader h;
  std::memcpy(&h, buf.data(), sizeof(h));
  if (h.magic != kFdWireMagic) {
    return absl::InvalidArgumentError("fd channel message has a bad magic: not an arfuse client");
  }
  if (h.version != kFdWireVersion) {
    return absl::InvalidArgumentError(absl::StrCat("fd channel version ", h.version,
                                                   " is not supported (this build speaks version ",
                                                   kFdWireVersion, ")"));
  }
  if (h.op < 1 || h.op > kMaxFdOp) {
    return absl::InvalidArgumentError(absl::StrCat("unknown fd channel op ", h.op));
  }
  if (h.reserved != 0) {
    return absl::InvalidArgumentError("fd channel message has a nonzero reserved field");
  }
  if (h.body_len > kMaxFdBody) {
    return absl::InvalidArgumentError(absl::StrCat("fd channel message body of ", h.body_len,
                                                   " bytes exceeds the limit of ", kMaxFdBody));
  }
  if (h.nfds > kMaxFdChannelFds) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fd channel message announces ", h.nfds, " descriptors (at most ", kMaxFdChannelFds, ")"));
  }
  if (buf.size() < sizeof(h) + h.body_len) return std::optional<FdMessage>();
  if (fds.size() < h.nfds) {
    return absl::InvalidArgumentError(absl::StrCat("fd channel message announces ", h.nfds,
                                                   " descriptors but ", fds.size(), " arrived"));
  }
  FdMessage m;
  m.op = static_cast<FdOp>(h.op);
  m.body = buf.substr(sizeof(h), h.body_len);
  buf.erase(0, sizeof(h) + h.body_len);
  m.fds = TakeFds(fds, h.nfds);
  return std::optional<FdMessage>(std::move(m));
}

namespace {

constexpr char kWhat[] = "fd channel";

}  // namespace

absl::Status SendFdMessage(int fd, FdOp op, absl::string_view body, const std::vector<int>& fds,
                           absl::Time deadline) {
  if (fds.size() > kMaxFdChannelFds) {
    return absl::InvalidArgumentError(absl::StrCat("an fd channel message carries at most ",
                                                   kMaxFdChannelFds, " descriptors, got ",
                                                   fds.size()));
  }
  const std::string data = EncodeFdMessage(op, body, static_cast<uint16_t>(fds.size()));
  size_t offset = 0;
  for (;;) {
    absl::Status s = SendWithFds(fd, data, &offset, fds, kWhat);
    if (!s.ok()) return s;
    if (offset == data.size()) return absl::OkStatus();
    absl::StatusOr<bool> ready = WaitForSocket(fd, POLLOUT, deadline);
    if (!ready.ok()) return ready.status();
    if (!*ready) return absl::DeadlineExceededError("timed out sending to the fd channel");
  }
}

absl::StatusOr<FdMessage> RecvFdMessage(int fd, absl::Time deadline) {
  std::string buf;
  std::deque<UniqueFd> fds;
  for (;;) {
    absl::StatusOr<std::optional<FdMessage>> m = TakeFdMessage(buf, fds);
    if (!m.ok()) return m.status();
    if (m->has_value()) return std::move(**m);
    bool eof = false;
    absl::Status s =
        RecvWithFds(fd, buf, fds, &eof, kWhat, FdMessageBytesMissing(buf), kMaxFdChannelFds);
    if (!s.ok()) return s;
    m = TakeFdMessage(buf, fds);
    if (!m.ok()) return m.status();
    if (m->has_value()) return std::move(**m);
    if (eof) return absl::UnavailableError("the fd channel closed the connection");
    absl::StatusOr<bool> ready = WaitForSocket(fd, POLLIN, deadline);
    if (!ready.ok()) return ready.status();
    if (!*ready) return absl::DeadlineExceededError("timed out waiting on the fd channel");
  }
}

}  // namespace arfuse
