// The link of one rank to rank 0's coordinator: connecting (Unix socket, TCP, TLS), and the link
// thread that carries every frame, delivers the answers, sends the heartbeats and notices a lost
// link (socket_exchange.h).
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "server/peers/peer_credentials.h"
#include "server/peers/peer_sockets.h"
#include "server/peers/socket_exchange.h"
#include "spdlog/spdlog.h"

namespace arfuse::peers {
namespace {

// One connection attempt; UNAVAILABLE (retryable) when nobody listens yet.
absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(absl::StrCat("connect ", path, ": ", strerror(errno)));
  }
  // The listener's credentials, before the join is sent (peer_credentials.h): a process of
  // another user holding the group's path is not rank 0 of this group, and retrying cannot
  // change who holds it.
  ARFUSE_ASSIGN_OR_RETURN(const SocketCredentials cred, PeerSocketCredentials(fd.get()));
  if (!PeerUserAllowed(cred.uid)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the peer socket ", path, " is held by a process of uid ", cred.uid,
        ", neither this sidecar's user (uid ", ::geteuid(),
        ") nor root: refusing to join through it (is --peer-dir shared with another user?)"));
  }
  int flags = ::fcntl(fd.get(), F_GETFL);
  ::fcntl(fd.get(), F_SETFL, flags | O_NONBLOCK);
  return fd;
}

absl::StatusOr<UniqueFd> ConnectTcp(const std::string& address, absl::Time deadline) {
  std::string host, port;
  ARFUSE_RETURN_IF_ERROR(SplitHostPort(address, &host, &port));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", address, ": ", gai_strerror(rc)));
  }
  std::string last = "no address";
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    UniqueFd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) continue;
    int r = ::connect(fd.get(), a->ai_addr, a->ai_addrlen);
    if (r != 0 && errno == EINPROGRESS) {
      pollfd p{fd.get(), POLLOUT, 0};
      int ms = static_cast<int>(std::min<uint32_t>(RemainingMs(deadline), 1000));
      if (::poll(&p, 1, ms) == 1) {
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        r = err == 0 ? 0 : -1;
        errno = err;
      } else {
        errno = ETIMEDOUT;
      }
    }
    if (r == 0) {
      int one = 1;
      ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      EnableKeepalive(fd.get());
      ::freeaddrinfo(res);
      return fd;
    }
    last = strerror(errno);
  }
  ::freeaddrinfo(res);
  return absl::UnavailableError(absl::StrCat("connect ", address, ": ", last));
}

int PollTimeoutMs(absl::Duration wait) {
  if (wait <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(wait) + 1, 1000));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PeerStream>> SocketExchange::Open(const std::string& target,
                                                                 absl::Time deadline) {
  if (unix_) {
    ARFUSE_ASSIGN_OR_RETURN(UniqueFd fd, ConnectUnix(target));
    return std::unique_ptr<PeerStream>(new PlainStream(std::move(fd)));
  }
  ARFUSE_ASSIGN_OR_RETURN(UniqueFd fd, ConnectTcp(target, deadline));
  if (tls_ == nullptr) {
    return std::unique_ptr<PeerStream>(new PlainStream(std::move(fd)));
  }
  ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<TlsStream> tls, TlsStream::Connect(*tls_, std::move(fd)));
  ARFUSE_RETURN_IF_ERROR(tls->HandshakeUntil(deadline));
  return std::unique_ptr<PeerStream>(std::move(tls));
}

absl::Status SocketExchange::LinkStatus() {
  // Rank 0 hosts the coordinator, which hears every rank's connection close (or its Leave, or
  // its heartbeats stop).
  if (server_) {
    absl::Status broken = server_->coordinator()->broken();
    if (!broken.ok()) {
      return absl::UnavailableError(
          absl::StrCat("peer group '", options_.group, "' is broken: ", broken.message()));
    }
  }
  // Whatever the link thread found; mu_ is only ever held briefly (never across a wait).
  std::lock_guard<std::mutex> lock(mu_);
  return lost_;
}

absl::Status SocketExchange::LostLocked(const std::string& tag, const absl::Status& cause) {
  if (lost_.ok()) {
    lost_ = absl::UnavailableError(absl::StrCat(
        "rank ", options_.rank, " lost its connection to the coordinator (rank 0) of group '",
        options_.group, "' during '", tag, "': ", cause.message(), "; rank 0 went away"));
    spdlog::warn("event=peer_lost group={} rank=0 seen_by={} error=\"{}\"", options_.group,
                 options_.rank, std::string(cause.message()));
    answer_cv_.notify_all();
    wake_.Notify();  // the link thread stops
  }
  return lost_;
}

void SocketExchange::LinkLostLocked(const absl::Status& cause) {
  (void)LostLocked(waiting_seq_ != 0 ? waiting_tag_ : "an idle link check", cause);
}

void SocketExchange::LinkLost(const absl::Status& cause) {
  std::lock_guard<std::mutex> lock(mu_);
  LinkLostLocked(cause);
}

void SocketExchange::RankZeroSilent(absl::Duration silence) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!lost_.ok()) return;
  lost_ = absl::UnavailableError(
      absl::StrCat("rank ", options_.rank, ": the coordinator (rank 0) of group '", options_.group,
                   "' stopped answering: nothing heard from rank 0 for ",
                   absl::FormatDuration(absl::Trunc(silence, absl::Milliseconds(1))),
                   " (peer heartbeat timeout ", absl::FormatDuration(options_.heartbeat_timeout),
                   "); is rank 0 stopped (SIGSTOP) or hung?"));
  spdlog::warn("event=peer_lost group={} rank=0 seen_by={} reason=heartbeat silence_ms={}",
               options_.group, options_.rank, absl::ToInt64Milliseconds(silence));
  answer_cv_.notify_all();
}

void SocketExchange::Deliver(Frame f) {
  std::lock_guard<std::mutex> lock(mu_);
  if (f.type == FrameType::kHeartbeat) {
    std::optional<std::vector<std::string>> table = DecodeGossipTable(f.body);
    if (!f.body.empty() && table && table->size() == static_cast<size_t>(options_.world_size)) {
      gossip_in_ = std::move(*table);
    }
    return;
  }
  if (waiting_seq_ == 0 || f.seq != waiting_seq_ || answer_.has_value()) return;
  answer_ = std::move(f);
  answer_cv_.notify_all();
}

OutFrame SocketExchange::HeartbeatLocked() {
  const int64_t timeout_ms = absl::ToInt64Milliseconds(options_.heartbeat_timeout);
  OutFrame hb;
  hb.data = EncodeFrame(FrameType::kHeartbeat, ++beats_,
                        static_cast<uint32_t>(std::max<int64_t>(1, timeout_ms)), gossip_out_);
  return hb;
}

void SocketExchange::SetGossip(std::string payload) {
  if (payload.size() > kMaxGossipBytes) return;
  std::lock_guard<std::mutex> lock(mu_);
  gossip_out_ = std::move(payload);
}

std::vector<std::string> SocketExchange::Gossip() {
  std::lock_guard<std::mutex> lock(mu_);
  return gossip_in_;
}

void SocketExchange::LinkLoop() {
  const bool beat = options_.heartbeat_timeout > absl::ZeroDuration();
  const absl::Duration interval = options_.heartbeat_interval;
  const absl::Duration timeout = options_.heartbeat_timeout;
  // This loop never sleeps longer than one interval; a longer gap means this thread did not run
  // (this process was stopped or starved), and the silence is its own, not rank 0's.
  const absl::Duration stalled = interval + timeout / 2;
  absl::Time last_heard = absl::Now();
  absl::Time last_woke = last_heard;
  absl::Time next_beat = last_heard + interval;  // Start() queued the first one
  while (!stop_.load(std::memory_order_acquire)) {
    short events = POLLIN;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!lost_.ok()) return;
      if (!out_.empty()) events |= POLLOUT;
    }
    absl::Time now = absl::Now();
    absl::Time wake_at = now + absl::Seconds(1);
    if (beat) wake_at = std::min({wake_at, next_beat, last_heard + timeout});
    pollfd fds[2] = {{wake_.fd(), POLLIN, 0},
                     {conn_->fd(), conn_->PollEvents((events & POLLOUT) != 0), 0}};
    int n = ::poll(fds, 2, PollTimeoutMs(wake_at - now));
    if (n < 0 && errno != EINTR) {
      return LinkLost(absl::InternalError(absl::StrCat("poll failed: ", strerror(errno))));
    }
    if (fds[0].revents & POLLIN) wake_.Drain();
    now = absl::Now();
    if (now - last_woke > stalled) last_heard = now;
    last_woke = now;

    const size_t before = in_.size();
    bool eof = false;
    absl::Status read = conn_->ReadAvailable(in_, in_fds_, &eof);
    if (in_.size() != before) last_heard = now;
    for (;;) {
      auto frame = TakeFrame(in_, in_fds_);
      if (!frame.ok()) return LinkLost(frame.status());
      if (!frame->has_value()) break;
      Deliver(std::move(**frame));
    }
    if (!read.ok()) return LinkLost(read);
    if (eof) return LinkLost(absl::UnavailableError("connection closed"));

    {
      std::lock_guard<std::mutex> lock(mu_);
      if (beat && now >= next_beat) {
        // Only onto an empty queue: a frame still going out is as good a sign of life, and
        // beats must not pile up behind a coordinator that stopped reading.
        if (out_.empty()) out_.push_back(HeartbeatLocked());
        next_beat = now + interval;
      }
      absl::Status sent = FlushFrames(*conn_, out_);
      if (!sent.ok()) return LinkLostLocked(sent);
    }
    if (beat && now - last_heard > timeout) return RankZeroSilent(now - last_heard);
  }
}

}  // namespace arfuse::peers
