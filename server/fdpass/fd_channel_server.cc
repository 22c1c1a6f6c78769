#include "server/fdpass/fd_channel_server.h"

#include <errno.h>
#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <list>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/fd/fd_wire.h"
#include "common/fd/scm_rights.h"
#include "common/log.h"
#include "spdlog/spdlog.h"

namespace arfuse {

namespace {
constexpr char kWhat[] = "fd channel";
}  // namespace

struct FdChannelServer::Conn {
  UniqueFd fd;
  SocketCredentials creds;
  absl::Time last_progress;
  std::string in;
  std::deque<UniqueFd> in_fds;
  // in_fds, charged to the client's uid from the moment they arrived.
  FdCharge in_charge;
  // The reply being sent; its descriptors go with its first byte and are dropped once it left.
  std::string out;
  size_t out_offset = 0;
  std::vector<UniqueFd> out_fds;
  FdCharge out_charge;
  // Descriptors of replies sent that the client has not read yet (the socket's output queue is
  // not empty).
  FdCharge unread;
  // A protocol error was answered: close once the reply is out.
  bool close_after_reply = false;
};

absl::StatusOr<std::unique_ptr<FdChannelServer>> FdChannelServer::Start(
    FdTicketBroker* broker, FdChannelServerOptions options) {
  std::unique_ptr<FdChannelServer> s(new FdChannelServer(broker, options));
  absl::Status woke = s->wake_.Open();
  if (!woke.ok()) return woke;
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

FdChannelServer::FdChannelServer(FdTicketBroker* broker, FdChannelServerOptions options)
    : broker_(broker), options_(options) {}

FdChannelServer::~FdChannelServer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.Notify();
  if (thread_.joinable()) thread_.join();
}

void FdChannelServer::Adopt(UniqueFd conn, const SocketCredentials& creds) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;  // closes conn
    adopted_.emplace_back(std::move(conn), creds);
  }
  wake_.Notify();
}

FdReply AnswerFdRequest(FdTicketBroker& broker, const SocketCredentials& client, FdMessage request,
                        absl::Duration ticket_ttl, FdCharge inbound) {
  FdReply reply;
  absl::Status status;
  switch (request.op) {
    case FdOp::kDeposit: {
      if (request.fds.empty()) {
        status = absl::InvalidArgumentError("DEPOSIT carries no descriptor");
      } else if (!request.body.empty()) {
        status = absl::InvalidArgumentError("DEPOSIT has no body");
      } else {
        const size_t n = request.fds.size();
        absl::StatusOr<std::string> ticket =
            broker.Deposit(client.uid, std::move(request.fds), ticket_ttl, std::move(inbound));
        if (ticket.ok()) {
          // Never the ticket itself: it is a capability.
          spdlog::debug("event=fd_deposit uid={} fds={}", client.uid, n);
          reply.bytes = EncodeFdMessage(FdOp::kDepositOk, *ticket);
          return reply;
        }
        status = ticket.status();
      }
      break;
    }
    case FdOp::kPickup: {
      if (!request.fds.empty()) {
        status = absl::InvalidArgumentError("PICKUP carries no descriptors");
      } else {
        absl::StatusOr<FdPickup> picked = broker.PickupCharged(request.body, client.uid);
        if (picked.ok()) {
          spdlog::debug("event=fd_pickup uid={} fds={}", client.uid, picked->fds.size());
          reply.bytes =
              EncodeFdMessage(FdOp::kPickupOk, "", static_cast<uint16_t>(picked->fds.size()));
          reply.fds = std::move(picked->fds);
          reply.charge = std::move(picked->charge);
          return reply;
        }
        status = picked.status();
      }
      break;
    }
    default:
      status = absl::InvalidArgumentError(absl::StrCat(
          "fd channel op ", static_cast<int>(request.op), " is an answer, not a request"));
      reply.close_after = true;
      break;
  }
  reply.bytes = EncodeFdError(status);
  return reply;
}

bool FdChannelServer::OnReadable(Conn& c, absl::Time now) {
  bool eof = false;
  const size_t before = c.in.size();
  // Exactly the bytes of the message under way: descriptors of a next one stay in the socket.
  absl::Status read = RecvWithFds(c.fd.get(), c.in, c.in_fds, &eof, kWhat,
                                  FdMessageBytesMissing(c.in), kMaxFdChannelFds);
  if (c.in.size() != before) c.last_progress = now;
  absl::Status problem = read;
  // Descriptors that arrived count against the client's budget at once, before the message they
  // belong to is complete: a client cannot park descriptors in a half-sent request.
  if (problem.ok() && c.in_fds.size() > c.in_charge.count()) {
    absl::StatusOr<FdCharge> more =
        broker_->Charge(c.creds.uid, c.in_fds.size() - c.in_charge.count());
    if (more.ok()) {
      c.in_charge.Absorb(*std::move(more));
    } else {
      problem = more.status();
    }
  }
  if (problem.ok()) {
    absl::StatusOr<std::optional<FdMessage>> m = TakeFdMessage(c.in, c.in_fds);
    if (!m.ok()) {
      problem = m.status();
    } else if (m->has_value()) {
      // Descriptors beyond those the message announced: refused, not kept.
      if (!c.in_fds.empty()) {
        problem = absl::InvalidArgumentError(
            "fd channel message came with more descriptors than it announced");
      } else {
        requests_.fetch_add(1, std::memory_order_relaxed);
        FdReply reply = AnswerFdRequest(*broker_, c.creds, std::move(**m), options_.ticket_ttl,
                                        std::move(c.in_charge));
        c.in_charge.Reset();
        c.out = std::move(reply.bytes);
        c.out_offset = 0;
        c.out_fds = std::move(reply.fds);
        c.out_charge = std::move(reply.charge);
        c.close_after_reply = reply.close_after;
        return true;
      }
    }
  }
  if (!problem.ok()) {
    protocol_errors_.fetch_add(1, std::memory_order_relaxed);
    spdlog::debug("event=fd_channel_protocol_error uid={} error=\"{}\"", c.creds.uid,
                  std::string(problem.message()));
    c.in.clear();
    c.in_fds.clear();
    c.in_charge.Reset();
    if (problem.code() == absl::StatusCode::kUnavailable) return false;
    c.out = EncodeFdError(problem);
    c.out_offset = 0;
    c.close_after_reply = true;
    return true;
  }
  return !eof;
}

bool FdChannelServer::OnWritable(Conn& c) {
  std::vector<int> raw;
  for (const UniqueFd& f : c.out_fds) raw.push_back(f.get());
  absl::Status sent = SendWithFds(c.fd.get(), c.out, &c.out_offset, raw, kWhat);
  if (!sent.ok()) return false;
  // The descriptors left with the first byte: the kernel holds its own references now, which
  // stay charged until the client has read them (UnreadDrained).
  if (c.out_offset > 0) {
    c.out_fds.clear();
    c.unread.Absorb(std::move(c.out_charge));
    c.out_charge.Reset();
  }
  if (c.out_offset < c.out.size()) return true;
  c.out.clear();
  c.out_offset = 0;
  return !c.close_after_reply;
}

namespace {

// Whether the client has read everything sent on `fd` (its descriptors included): a Unix socket's
// output queue holds what the other end has not consumed yet.
bool UnreadDrained(int fd) {
  int queued = 0;
  return ::ioctl(fd, SIOCOUTQ, &queued) != 0 || queued == 0;
}

}  // namespace

void FdChannelServer::Loop() {
  std::list<Conn> conns;
  LogRateLimiter refusals(absl::Seconds(1));
  absl::Time next_expiry = absl::Now();
  for (;;) {
    std::vector<std::pair<UniqueFd, SocketCredentials>> adopted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) break;
      adopted.swap(adopted_);
    }
    const absl::Time now = absl::Now();
    for (auto& [fd, creds] : adopted) {
      if (conns.size() >= options_.max_connections) {
        uint64_t held_back = 0;
        if (refusals.Allow("cap", now, &held_back)) {
          spdlog::warn(
              "event=fd_channel_refused uid={} reason=\"{} connections open\" held_back={}",
              creds.uid, conns.size(), held_back);
        }
        continue;  // fd closes
      }
      Conn& c = conns.emplace_back();
      c.fd = std::move(fd);
      c.creds = creds;
      c.last_progress = now;
    }
    open_.store(conns.size(), std::memory_order_relaxed);
    if (now >= next_expiry) {
      broker_->ExpireNow(now);
      next_expiry = now + absl::Seconds(1);
    }

    // A client's read makes no event on our side of the socket: while any reply's descriptors
    // are unread, the loop looks again every few milliseconds.
    size_t unread = 0;
    for (Conn& c : conns) {
      if (c.unread.count() != 0 && UnreadDrained(c.fd.get())) c.unread.Reset();
      unread += c.unread.count();
    }
    unread_fds_.store(unread, std::memory_order_relaxed);

    std::vector<pollfd> fds;
    fds.reserve(conns.size() + 1);
    fds.push_back({wake_.fd(), POLLIN, 0});
    absl::Time wake_by = next_expiry;
    if (unread != 0) wake_by = std::min(wake_by, now + absl::Milliseconds(10));
    for (const Conn& c : conns) {
      fds.push_back({c.fd.get(), static_cast<short>(c.out.empty() ? POLLIN : POLLOUT), 0});
      if (c.unread.count() == 0) {
        wake_by = std::min(wake_by, c.last_progress + options_.idle_timeout);
      }
    }
    const int64_t wait_ms =
        std::clamp<int64_t>(absl::ToInt64Milliseconds(wake_by - absl::Now()) + 1, 0, 1000);
    int n = ::poll(fds.data(), fds.size(), static_cast<int>(wait_ms));
    if (n < 0 && errno != EINTR) {
      spdlog::error("event=fd_channel_poll_failed error=\"{}\"", std::strerror(errno));
      break;
    }
    if (fds[0].revents & POLLIN) wake_.Drain();
    const absl::Time woke = absl::Now();
    size_t i = 1;
    for (auto it = conns.begin(); it != conns.end(); ++i) {
      Conn& c = *it;
      const short rev = n > 0 ? fds[i].revents : 0;
      bool keep = true;
      if (rev & POLLNVAL) {
        keep = false;
      } else if (!c.out.empty() && (rev & (POLLOUT | POLLERR | POLLHUP))) {
        keep = OnWritable(c);
        if (keep) c.last_progress = woke;
      } else if (c.out.empty() && (rev & (POLLIN | POLLERR | POLLHUP))) {
        keep = OnReadable(c, woke);
        // An answer is ready: try to send it at once.
        if (keep && !c.out.empty()) keep = OnWritable(c);
      }
      // Not while the client has descriptors unread: closing would leave them in its queue,
      // uncounted.
      if (keep && c.unread.count() == 0 && woke - c.last_progress >= options_.idle_timeout) {
        spdlog::debug("event=fd_channel_idle_closed uid={}", c.creds.uid);
        keep = false;
      }
      it = keep ? std::next(it) : conns.erase(it);
    }
    open_.store(conns.size(), std::memory_order_relaxed);
  }
  open_.store(0, std::memory_order_relaxed);
  unread_fds_.store(0, std::memory_order_relaxed);
}

}  // namespace arfuse
