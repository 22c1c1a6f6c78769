#include "server/peers/coordinator_server.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "arfuse/v1/peer.pb.h"
#include "common/status_macros.h"
#include "server/peers/peer_credentials.h"
#include "server/peers/peer_sockets.h"
#include "spdlog/spdlog.h"

namespace arfuse::peers {

struct CoordinatorServer::Conn {
  uint64_t id = 0;
  std::unique_ptr<PeerStream> io;
  // TLS connections (the TCP listener with tls): `io` itself, and whether the handshake finished;
  // no frame is read before it has.
  TlsStream* tls = nullptr;
  bool authenticated = true;
  absl::Time accepted;
  std::string in;
  std::deque<UniqueFd> in_fds;
  // I/O thread only: when a byte last arrived, and how long the peer said it may stay silent
  // (its last kHeartbeat's timeout_ms; infinite until it sends one).
  absl::Time last_heard;
  absl::Duration heartbeat_timeout = absl::InfiniteDuration();
  // Answers may be produced on other threads (a gRPC caller completing a collective), so the
  // output queue has its own lock; only the I/O thread writes to the socket.
  std::mutex out_mu;
  std::deque<OutFrame> out;
  bool closed = false;  // guarded by out_mu: answers to a closed connection are dropped

  void Push(std::string data, std::vector<UniqueFd> fds, Wake& wake) {
    {
      std::lock_guard<std::mutex> lock(out_mu);
      if (closed) return;
      out.push_back(OutFrame{std::move(data), std::move(fds)});
    }
    wake.Notify();
  }
};

namespace {

// How long a TCP connection may take to authenticate before it is closed: a handshake is a few
// round trips, and a connection that never starts one must not hold a descriptor.
constexpr absl::Duration kTlsHandshakeTimeout = absl::Seconds(10);

// Pre-formed groups answer joins only until the earliest of their deadlines; answering a little
// before the sender's own deadline lets the sender hear which ranks were missing instead of
// timing out blind.
absl::Time CoordinatorDeadline(uint32_t timeout_ms) {
  absl::Duration t = absl::Milliseconds(timeout_ms);
  absl::Duration margin = std::min(t / 10, absl::Milliseconds(50));
  return absl::Now() + t - margin;
}

}  // namespace

CoordinatorServer::CoordinatorServer(const CoordinatorServerOptions& options)
    : options_(options),
      coordinator_(
          std::make_shared<Coordinator>(options.group, options.world_size, options.nnodes)),
      wake_(std::make_shared<Wake>()) {}

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const CoordinatorServerOptions& options) {
  if (options.unix_path.empty() && options.tcp_address.empty()) {
    return absl::InvalidArgumentError(
        "the coordinator needs a peer directory (one node) or a TCP address (several nodes)");
  }
  std::unique_ptr<CoordinatorServer> s(new CoordinatorServer(options));
  ARFUSE_RETURN_IF_ERROR(s->wake_->Open());
  if (!options.unix_path.empty()) {
    ARFUSE_ASSIGN_OR_RETURN(s->unix_listen_, ListenUnix(options.unix_path, &s->unix_inode_));
  }
  if (!options.tcp_address.empty()) {
    ARFUSE_ASSIGN_OR_RETURN(s->tcp_listen_, ListenTcp(options.tcp_address, &s->tcp_port_));
  }
  spdlog::info("event=peer_coordinator_start group={} world_size={} unix={} tcp_port={}",
               options.group, options.world_size, !options.unix_path.empty(), s->tcp_port_);
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

CoordinatorServer::~CoordinatorServer() {
  stop_.store(true, std::memory_order_release);
  wake_->Notify();
  if (thread_.joinable()) thread_.join();
  for (auto& [id, c] : conns_) {
    std::lock_guard<std::mutex> lock(c->out_mu);
    c->closed = true;
  }
  conns_.clear();
  if (unix_listen_ && unix_inode_ != 0) {
    struct stat st {};
    // Only remove the path while it is still our socket: a re-formed group may own it now.
    if (::stat(options_.unix_path.c_str(), &st) == 0 && st.st_ino == unix_inode_) {
      ::unlink(options_.unix_path.c_str());
    }
  }
}

void CoordinatorServer::CloseConn(uint64_t id, const std::string& reason) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  {
    std::lock_guard<std::mutex> lock(it->second->out_mu);
    it->second->closed = true;
    it->second->out.clear();
  }
  conns_.erase(it);
  coordinator_->ParticipantGone(id, reason);
}

void CoordinatorServer::HandleFrame(const std::shared_ptr<Conn>& conn, Frame frame) {
  std::weak_ptr<Conn> weak = conn;
  std::shared_ptr<Wake> wake = wake_;
  const uint64_t seq = frame.seq;
  auto send_error = [weak, wake, seq](const absl::Status& s) {
    if (auto c = weak.lock())
      c->Push(EncodeFrame(FrameType::kError, seq, 0, EncodeError(s)), {}, *wake);
  };
  switch (frame.type) {
    case FrameType::kJoin: {
      v1::JoinRequest req;
      std::string group, req_bytes;
      if (!DecodeJoinBody(frame.body, &group, &req_bytes).ok() || !req.ParseFromString(req_bytes)) {
        send_error(absl::InvalidArgumentError("malformed join request"));
        return;
      }
      MemberInfo info;
      info.rank = static_cast<int>(req.rank());
      info.world_size = static_cast<int>(req.world_size());
      info.nnodes = static_cast<int>(req.nnodes());
      info.group = group;
      info.node_id = req.node_id();
      info.build_version = req.build_version();
      coordinator_->Join(
          conn->id, info, CoordinatorDeadline(frame.timeout_ms),
          [weak, wake, seq, send_error](JoinResult r) {
            if (!r.status.ok()) return send_error(r.status);
            v1::JoinResponse resp;
            resp.set_epoch(r.epoch);
            for (const auto& m : r.members) {
              auto* j = resp.add_members();
              j->set_rank(m.rank);
              j->set_world_size(m.world_size);
              j->set_nnodes(m.nnodes);
              j->set_node_id(m.node_id);
              j->set_build_version(m.build_version);
            }
            if (auto c = weak.lock()) {
              c->Push(EncodeFrame(FrameType::kJoinOk, seq, 0, resp.SerializeAsString()), {}, *wake);
            }
          });
      return;
    }
    case FrameType::kCollective:
    case FrameType::kCollectiveFd: {
      v1::CollectiveRequest req;
      if (!req.ParseFromString(frame.body)) {
        send_error(absl::InvalidArgumentError("malformed collective request"));
        return;
      }
      Contribution c;
      const bool with_fd = frame.type == FrameType::kCollectiveFd;
      switch (req.kind()) {
        case v1::COLLECTIVE_KIND_ALLGATHER:
          c.kind = with_fd ? CollectiveKind::kAllgatherFd : CollectiveKind::kAllgather;
          break;
        case v1::COLLECTIVE_KIND_BARRIER:
          c.kind = CollectiveKind::kBarrier;
          break;
        case v1::COLLECTIVE_KIND_VOTE:
          c.kind = CollectiveKind::kVote;
          break;
        default:
          send_error(absl::InvalidArgumentError(
              absl::StrCat("unknown collective kind ", static_cast<int>(req.kind()))));
          return;
      }
      if (with_fd != (frame.fds.size() == 1)) {
        send_error(absl::InvalidArgumentError("a descriptor collective carries exactly one fd"));
        return;
      }
      if (with_fd) c.fd = std::move(frame.fds[0]);
      c.tag = req.tag();
      c.epoch = req.epoch();
      c.rank = static_cast<int>(req.rank());
      c.payload = std::move(*req.mutable_payload());
      c.yes = req.yes();
      c.reason = req.reason();
      c.deadline = CoordinatorDeadline(frame.timeout_ms);
      coordinator_->Contribute(
          conn->id, std::move(c), [weak, wake, seq, send_error](CollectiveResult r) {
            if (!r.status.ok()) return send_error(r.status);
            v1::CollectiveResponse resp;
            for (auto& p : r.payloads) resp.add_payloads(p);
            resp.set_all_yes(r.all_yes);
            for (auto& reason : r.reasons) resp.add_reasons(reason);
            // nfds first: argument evaluation order would otherwise race the move of r.fds.
            const auto nfds = static_cast<uint16_t>(r.fds.size());
            std::string data =
                EncodeFrame(FrameType::kCollectiveOk, seq, 0, resp.SerializeAsString(), nfds);
            if (auto conn = weak.lock()) {
              conn->Push(std::move(data), std::move(r.fds), *wake);
            }
          });
      return;
    }
    case FrameType::kHeartbeat:
      // Echoed at once (a sign of life while this thread runs), with every rank's gossip (wire.h).
      conn->heartbeat_timeout =
          frame.timeout_ms == 0 ? absl::InfiniteDuration() : absl::Milliseconds(frame.timeout_ms);
      conn->Push(
          EncodeFrame(FrameType::kHeartbeat, seq, 0,
                      EncodeGossipTable(coordinator_->Gossip(conn->id, std::move(frame.body)))),
          {}, *wake);
      return;
    case FrameType::kLeave: {
      v1::LeaveRequest req;
      req.ParseFromString(frame.body);
      coordinator_->ParticipantGone(conn->id, absl::StrCat("left: ", req.reason().substr(0, 200)));
      return;
    }
    default:
      send_error(absl::InvalidArgumentError("unexpected frame type from a peer"));
      return;
  }
}

absl::Time CoordinatorServer::ExpireSilentConns(absl::Time now) {
  std::vector<std::pair<uint64_t, std::string>> silent;
  absl::Time next = absl::InfiniteFuture();
  std::vector<std::shared_ptr<Conn>> unauthenticated;
  for (auto& [id, c] : conns_) {
    if (!c->authenticated) {
      const absl::Time due = c->accepted + kTlsHandshakeTimeout;
      if (due <= now) {
        unauthenticated.push_back(c);
      } else {
        next = std::min(next, due);
      }
      continue;
    }
    if (c->heartbeat_timeout == absl::InfiniteDuration()) continue;
    const absl::Time due = c->last_heard + c->heartbeat_timeout;
    pollfd pending{c->io->fd(), POLLIN, 0};
    if (due > now || ::poll(&pending, 1, 0) != 0) {
      // Bytes (or the close) waiting to be read mean it did not stop answering: this thread did
      // not run (the process was stopped) and reads them on its next turn.
      next = std::min(next, std::max(due, now));
      continue;
    }
    silent.emplace_back(
        id,
        absl::StrCat("stopped answering: nothing heard from it for ",
                     absl::FormatDuration(absl::Trunc(now - c->last_heard, absl::Milliseconds(1))),
                     " (its peer heartbeat timeout is ", absl::FormatDuration(c->heartbeat_timeout),
                     "); is it stopped (SIGSTOP) or hung?"));
  }
  for (auto& [id, reason] : silent) {
    spdlog::warn("event=peer_heartbeat_lost group={} conn={} reason=\"{}\"", options_.group, id,
                 reason);
    CloseConn(id, reason);
  }
  for (auto& c : unauthenticated) {
    RefuseUnauthenticated(
        c, absl::UnauthenticatedError(absl::StrCat("the TLS handshake did not complete within ",
                                                   absl::FormatDuration(kTlsHandshakeTimeout))));
  }
  return next;
}

void CoordinatorServer::RefuseUnauthenticated(const std::shared_ptr<Conn>& c,
                                              const absl::Status& why) {
  unauthenticated_.fetch_add(1, std::memory_order_relaxed);
  spdlog::warn("event=peer_connection_unauthenticated group={} conn={} reason=\"{}\"",
               options_.group, c->id, std::string(why.message()));
  // Whatever the peer sent is read and dropped first: closing a socket with unread bytes resets
  // the connection, and the reset can overtake the TLS alert that tells the joiner why.
  char sink[4096];
  while (::recv(c->io->fd(), sink, sizeof(sink), MSG_DONTWAIT) > 0) {
  }
  ::shutdown(c->io->fd(), SHUT_WR);
  CloseConn(c->id, absl::StrCat("unauthenticated: ", why.message()));
}

bool CoordinatorServer::AdvanceHandshake(const std::shared_ptr<Conn>& c) {
  if (c->in.empty() && c->tls == nullptr) {
    // Not yet handed to TLS: a joiner that speaks the plain protocol is told, in that protocol,
    // why it is not served (its join fails at once instead of retrying until its timeout).
    char head[4];
    const ssize_t n = ::recv(c->io->fd(), head, sizeof(head), MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) {
      CloseConn(c->id, "connection closed before the TLS handshake");
      return false;
    }
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return true;
      CloseConn(c->id,
                absl::StrCat("connection reset before the TLS handshake: ", strerror(errno)));
      return false;
    }
    const std::optional<bool> plain =
        LooksLikePlainFrame(std::string(head, static_cast<size_t>(n)));
    if (!plain.has_value()) return true;  // more bytes decide it
    if (*plain) {
      const absl::Status why = absl::UnauthenticatedError(absl::StrCat(
          "rank 0 of peer group '", options_.group,
          "' accepts peers over TCP only with mutual TLS: give every rank the group's peer "
          "certificate, key and CA (arfused: --peer-tls-cert, --peer-tls-key, --peer-tls-ca)"));
      std::string reply = EncodeFrame(FrameType::kError, 1, 0, EncodeError(why));
      size_t offset = 0;
      (void)SendSome(c->io->fd(), reply, &offset, {});
      RefuseUnauthenticated(c, absl::UnauthenticatedError("a plain (not TLS) peer connection"));
      return false;
    }
    UniqueFd fd(::dup(c->io->fd()));
    absl::StatusOr<std::unique_ptr<TlsStream>> tls =
        fd ? TlsStream::Accept(*options_.tls, std::move(fd))
           : absl::StatusOr<std::unique_ptr<TlsStream>>(
                 absl::ResourceExhaustedError(strerror(errno)));
    if (!tls.ok()) {
      CloseConn(c->id, absl::StrCat("cannot start TLS: ", tls.status().message()));
      return false;
    }
    c->tls = tls->get();
    c->io = *std::move(tls);
  }
  bool done = false;
  absl::Status s = c->tls->Handshake(&done);
  if (!s.ok()) {
    RefuseUnauthenticated(c, s);
    return false;
  }
  if (done) {
    c->authenticated = true;
    spdlog::debug("event=peer_connection_authenticated group={} conn={}", options_.group, c->id);
  }
  return true;
}

void CoordinatorServer::Loop() {
  bool listening = true;
  while (!stop_.load(std::memory_order_acquire)) {
    // A broken group stops accepting, so restarted ranks retry until rank 0 re-forms the group
    // behind a fresh listener instead of joining a group that can never complete.
    if (listening && !coordinator_->broken().ok()) {
      unix_listen_.reset();  // keeps unix_inode_ so the destructor can still clean the path
      tcp_listen_.reset();
      listening = false;
    }
    const absl::Time heartbeat_due = ExpireSilentConns(absl::Now());
    std::vector<pollfd> fds;
    std::vector<uint64_t> ids;
    fds.push_back({wake_->fd(), POLLIN, 0});
    // Out of descriptors, the listeners rest a moment (poll ignores a negative fd).
    const bool accepting = absl::Now() >= accept_paused_until_;
    fds.push_back({accepting ? unix_listen_.get() : -1, POLLIN, 0});
    fds.push_back({accepting ? tcp_listen_.get() : -1, POLLIN, 0});
    for (auto& [id, c] : conns_) {
      short ev = POLLIN;
      {
        std::lock_guard<std::mutex> lock(c->out_mu);
        if (!c->out.empty()) ev |= POLLOUT;
      }
      if (!c->authenticated) {
        ev = c->tls != nullptr ? c->tls->PollEvents(false) : POLLIN;
      } else {
        ev = c->io->PollEvents(ev & POLLOUT);
      }
      fds.push_back({c->io->fd(), ev, 0});
      ids.push_back(id);
    }
    absl::Duration wait = std::min(coordinator_->NextDeadline(), heartbeat_due) - absl::Now();
    int timeout_ms = 1000;
    if (wait < absl::Seconds(1)) {
      timeout_ms =
          wait <= absl::ZeroDuration() ? 0 : static_cast<int>(absl::ToInt64Milliseconds(wait)) + 1;
    }
    if (!accepting) {
      timeout_ms = std::min<int>(
          timeout_ms,
          static_cast<int>(absl::ToInt64Milliseconds(accept_paused_until_ - absl::Now())) + 1);
      timeout_ms = std::max(timeout_ms, 0);
    }
    int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) {
      spdlog::error("event=peer_coordinator_poll_failed error=\"{}\"", strerror(errno));
      break;
    }
    if (n > 0 && (fds[0].revents & POLLIN)) wake_->Drain();
    const absl::Time woke = absl::Now();
    for (int l = 1; l <= 2 && n > 0; ++l) {
      if (fds[l].fd < 0 || !(fds[l].revents & POLLIN)) continue;
      for (;;) {
        int cfd = ::accept4(fds[l].fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (cfd < 0) {
          // Out of descriptors the listener stays readable: shed the pending connection and
          // rest instead of spinning on it (accept_reserve.h).
          if (errno == EMFILE || errno == ENFILE) {
            const int err = errno;
            const bool shed = accept_reserve_.Shed(fds[l].fd);
            accept_paused_until_ = absl::Now() + AcceptReserve::ShedPause(shed);
            uint64_t held_back = 0;
            if (accept_log_.Allow("accept_failed", absl::Now(), &held_back)) {
              spdlog::warn("event=peer_accept_failed group={} error=\"{}\" shed={} held_back={}",
                           options_.group, strerror(err), shed ? "yes" : "no", held_back);
            }
          }
          break;
        }
        if (l == 1) {
          // Before a byte is read: another user's process gets nothing, not even an answer.
          absl::StatusOr<SocketCredentials> cred = PeerSocketCredentials(cfd);
          if (!cred.ok() || !PeerUserAllowed(cred->uid)) {
            refused_.fetch_add(1, std::memory_order_relaxed);
            spdlog::warn(
                "event=peer_connection_refused group={} uid={} reason=\"{}\"", options_.group,
                cred.ok() ? static_cast<int64_t>(cred->uid) : -1,
                cred.ok() ? "runs as another user than this sidecar" : "credentials unknown");
            ::close(cfd);
            continue;
          }
        }
        if (l == 2) {
          int one = 1;
          ::setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          EnableKeepalive(cfd);
        }
        auto c = std::make_shared<Conn>();
        c->id = next_conn_id_++;
        c->io = std::make_unique<PlainStream>(UniqueFd(cfd));
        c->last_heard = woke;
        c->accepted = woke;
        c->authenticated = !(l == 2 && options_.tls != nullptr);
        conns_[c->id] = c;
      }
    }
    for (size_t i = 0; i < ids.size() && n > 0; ++i) {
      const pollfd& p = fds[i + 3];
      if (p.revents == 0) continue;
      auto it = conns_.find(ids[i]);
      if (it == conns_.end()) continue;
      std::shared_ptr<Conn> c = it->second;
      if (!c->authenticated) {
        if (!AdvanceHandshake(c) || !c->authenticated) continue;
        c->last_heard = woke;
        // Bytes the handshake already decrypted are read below.
      }
      if (p.revents & (POLLIN | POLLHUP | POLLERR | POLLOUT)) {
        bool eof = false;
        const size_t before = c->in.size();
        absl::Status s = c->io->ReadAvailable(c->in, c->in_fds, &eof);
        // Any byte is a sign of life, a heartbeat or the slice of a large collective alike.
        // Heartbeats that queued up while this process was stopped count too: ExpireSilentConns
        // skips a connection with bytes waiting until this has read them.
        if (c->in.size() != before) c->last_heard = woke;
        std::string close_reason;
        while (s.ok()) {
          auto frame = TakeFrame(c->in, c->in_fds);
          if (!frame.ok()) {
            s = frame.status();
            // A peer on another wire version hears why before the connection closes.
            if (std::optional<std::string> reply = WrongVersionReply(c->in)) {
              size_t offset = 0;
              (void)c->io->SendSome(*reply, &offset, {});
            }
            break;
          }
          if (!frame->has_value()) break;
          HandleFrame(c, std::move(**frame));
        }
        if (!s.ok()) close_reason = absl::StrCat("protocol error: ", s.message());
        if (eof) close_reason = "connection closed";
        if (!close_reason.empty()) {
          CloseConn(c->id, close_reason);
          continue;
        }
      }
    }
    coordinator_->Expire(absl::Now());
    // Flush answers; a peer that does not read (SIGSTOP) only fills its own queue.
    std::vector<uint64_t> dead;
    for (auto& [id, c] : conns_) {
      std::lock_guard<std::mutex> lock(c->out_mu);
      if (c->authenticated && !FlushFrames(*c->io, c->out).ok()) dead.push_back(id);
    }
    for (uint64_t id : dead) CloseConn(id, "connection reset");
  }
}

}  // namespace arfuse::peers
