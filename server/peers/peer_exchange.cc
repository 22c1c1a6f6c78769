#include "server/peers/peer_exchange.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "arfuse/v1/peer.pb.h"
#include "kernels/common/op_types.h"
#include "server/core/status_macros.h"
#include "server/core/version.h"
#include "server/fdpass/wake_fd.h"
#include "server/peers/coordinator_server.h"
#include "server/peers/peer_credentials.h"
#include "server/peers/wire.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

using peers::Frame;
using peers::FrameType;

// How long a call waits past its deadline for the coordinator's verdict (see Call).
constexpr absl::Duration kVerdictGrace = absl::Milliseconds(500);

absl::Status ValidateOptions(const PeerOptions& o) {
  if (o.world_size < 1 || o.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size ", o.world_size, " is out of range [1, ", kMaxWorldSize, "]"));
  }
  if (o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", o.rank, " is out of range for world_size ", o.world_size));
  }
  if (o.nnodes < 1 || o.nnodes > o.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("nnodes ", o.nnodes, " is out of range [1, world_size ", o.world_size, "]"));
  }
  if (o.group.empty() || o.group.size() > 64) {
    return absl::InvalidArgumentError("peer group name must have 1 to 64 characters");
  }
  for (char c : o.group) {
    if (!isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-') {
      return absl::InvalidArgumentError(absl::StrCat(
          "peer group name \"", o.group, "\" may only contain letters, digits, '_', '.', '-'"));
    }
  }
  if (o.nnodes > 1 && o.rank0_address.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("nnodes is ", o.nnodes, ": several nodes need rank 0's TCP address"));
  }
  if (o.peer_dir.empty() && o.rank0_address.empty()) {
    return absl::InvalidArgumentError(
        "peers need a peer directory (one node) or rank 0's TCP address (several nodes)");
  }
  if (o.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("peer timeout must be positive");
  }
  if (o.heartbeat_timeout < absl::ZeroDuration() || o.heartbeat_timeout > absl::Hours(24)) {
    return absl::InvalidArgumentError(absl::StrCat("peer heartbeat timeout ",
                                                   absl::FormatDuration(o.heartbeat_timeout),
                                                   " is out of range [0 (off), 24h]"));
  }
  if (o.heartbeat_timeout > absl::ZeroDuration() &&
      (o.heartbeat_interval <= absl::ZeroDuration() ||
       o.heartbeat_interval * 2 > o.heartbeat_timeout)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "peer heartbeat interval ", absl::FormatDuration(o.heartbeat_interval),
        " must be positive and at most half the heartbeat timeout (",
        absl::FormatDuration(o.heartbeat_timeout), "), so one late heartbeat is not a loss"));
  }
  return absl::OkStatus();
}

std::string HostName() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

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
  if (!peers::PeerUserAllowed(cred.uid)) {
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
  ARFUSE_RETURN_IF_ERROR(peers::SplitHostPort(address, &host, &port));
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
      int ms = static_cast<int>(std::min<uint32_t>(peers::RemainingMs(deadline), 1000));
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
      peers::EnableKeepalive(fd.get());
      ::freeaddrinfo(res);
      return fd;
    }
    last = strerror(errno);
  }
  ::freeaddrinfo(res);
  return absl::UnavailableError(absl::StrCat("connect ", address, ": ", last));
}

// One rank's link to the coordinator. After the join, a link thread owns the socket: it writes
// the callers' requests, reads every answer and hands each to the call waiting for it (by seq),
// and keeps the link checked while no call runs: a closed connection, or (with heartbeats) rank 0
// silent for the heartbeat timeout, marks the link lost, which LinkStatus() and every later call
// report. The thread only ever waits in poll, so it keeps beating while the caller's threads are
// busy and while a collective waits for a slow rank, and stopping it is prompt.
class SocketExchange final : public PeerExchange {
 public:
  SocketExchange(const PeerOptions& options, bool unix_transport)
      : options_(options), unix_(unix_transport) {}

  ~SocketExchange() override {
    stop_.store(true, std::memory_order_release);
    wake_.Notify();
    if (link_thread_.joinable()) link_thread_.join();
    if (conn_) {
      // Tell the coordinator we leave on purpose (best effort, never blocks), then close; the
      // server (rank 0) shuts its thread down after. Not behind a half-written frame: the Leave
      // would corrupt it, and the close says the same.
      bool clean = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        clean = out_.empty() || out_.front().offset == 0;
      }
      if (clean) {
        v1::LeaveRequest req;
        req.set_epoch(epoch_);
        req.set_rank(options_.rank);
        req.set_reason("exchange closed");
        std::string data = peers::EncodeFrame(FrameType::kLeave, 0, 0, req.SerializeAsString());
        size_t offset = 0;
        (void)conn_->SendSome(data, &offset, {});
      }
      conn_.reset();
    }
    server_.reset();
  }

  absl::Status Start(absl::Time deadline) {
    if (!unix_ && options_.tls.any()) {
      ARFUSE_ASSIGN_OR_RETURN(tls_, peers::PeerTls::Load(options_.tls));
    }
    if (options_.rank == 0) {
      peers::CoordinatorServerOptions so;
      so.group = options_.group;
      so.world_size = options_.world_size;
      so.nnodes = options_.nnodes;
      if (!options_.peer_dir.empty()) {
        ARFUSE_ASSIGN_OR_RETURN(so.unix_path, PeerSocketPath(options_.peer_dir, options_.group));
      }
      // TCP only when some rank connects through it.
      if (!unix_) {
        so.tcp_address = options_.rank0_address;
        so.tls = tls_;
      }
      ARFUSE_ASSIGN_OR_RETURN(server_, peers::CoordinatorServer::Start(so));
    }
    ARFUSE_RETURN_IF_ERROR(wake_.Open());
    ARFUSE_RETURN_IF_ERROR(Join(deadline));
    if (options_.heartbeat_timeout > absl::ZeroDuration()) {
      // The link's first frame, ahead of any call: the coordinator watches this rank from when it
      // arrives, so a rank that freezes right after joining is noticed too (one that freezes
      // before it is sent fails the group's next collective at its deadline instead).
      std::lock_guard<std::mutex> lock(mu_);
      out_.push_back(Heartbeat());
    }
    link_thread_ = std::thread([this] { LinkLoop(); });
    return absl::OkStatus();
  }

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  int nnodes() const override { return options_.nnodes; }
  uint64_t epoch() const override { return epoch_; }
  const std::vector<peers::MemberInfo>& members() const override { return members_; }
  std::shared_ptr<peers::Coordinator> coordinator() const override {
    return server_ ? server_->coordinator() : nullptr;
  }
  int tcp_port() const override { return server_ ? server_->tcp_port() : 0; }

  absl::Status LinkStatus() override {
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

  absl::StatusOr<std::vector<std::string>> Allgather(const std::string& tag,
                                                     const std::string& payload,
                                                     absl::Time deadline) override {
    v1::CollectiveRequest req = Request(tag, v1::COLLECTIVE_KIND_ALLGATHER);
    req.set_payload(payload);
    ARFUSE_ASSIGN_OR_RETURN(Frame f, Call(FrameType::kCollective, req, -1, deadline));
    v1::CollectiveResponse resp;
    ARFUSE_RETURN_IF_ERROR(ParseResponse(f, &resp));
    if (resp.payloads_size() != options_.world_size) {
      return absl::InternalError(absl::StrCat("allgather '", tag, "' returned ",
                                              resp.payloads_size(), " payloads for world_size ",
                                              options_.world_size));
    }
    return std::vector<std::string>(resp.payloads().begin(), resp.payloads().end());
  }

  absl::Status Barrier(const std::string& tag, absl::Time deadline) override {
    v1::CollectiveRequest req = Request(tag, v1::COLLECTIVE_KIND_BARRIER);
    ARFUSE_ASSIGN_OR_RETURN(Frame f, Call(FrameType::kCollective, req, -1, deadline));
    v1::CollectiveResponse resp;
    return ParseResponse(f, &resp);
  }

  absl::StatusOr<VoteResult> Vote(const std::string& tag, bool yes, const std::string& reason,
                                  absl::Time deadline) override {
    v1::CollectiveRequest req = Request(tag, v1::COLLECTIVE_KIND_VOTE);
    req.set_yes(yes);
    req.set_reason(reason);
    ARFUSE_ASSIGN_OR_RETURN(Frame f, Call(FrameType::kCollective, req, -1, deadline));
    v1::CollectiveResponse resp;
    ARFUSE_RETURN_IF_ERROR(ParseResponse(f, &resp));
    VoteResult v;
    v.all_yes = resp.all_yes();
    v.reasons.assign(resp.reasons().begin(), resp.reasons().end());
    return v;
  }

  absl::StatusOr<std::vector<int>> AllgatherFd(const std::string& tag, int fd,
                                               absl::Time deadline) override {
    if (!unix_) {
      return absl::UnimplementedError(
          "AllgatherFd needs the Unix-socket peer channel (one node with --peer-dir); this group "
          "connects over TCP");
    }
    if (fd < 0) return absl::InvalidArgumentError("AllgatherFd needs an open descriptor");
    v1::CollectiveRequest req = Request(tag, v1::COLLECTIVE_KIND_ALLGATHER);
    ARFUSE_ASSIGN_OR_RETURN(Frame f, Call(FrameType::kCollectiveFd, req, fd, deadline));
    v1::CollectiveResponse resp;
    ARFUSE_RETURN_IF_ERROR(ParseResponse(f, &resp));
    if (f.fds.size() != static_cast<size_t>(options_.world_size)) {
      return absl::InternalError(absl::StrCat("allgather_fd '", tag, "' delivered ", f.fds.size(),
                                              " descriptors for world_size ", options_.world_size));
    }
    std::vector<int> out;
    for (auto& u : f.fds) out.push_back(u.release());
    return out;
  }

 private:
  v1::CollectiveRequest Request(const std::string& tag, v1::CollectiveKind kind) const {
    v1::CollectiveRequest req;
    req.set_epoch(epoch_);
    req.set_tag(tag);
    req.set_kind(kind);
    req.set_rank(static_cast<uint32_t>(options_.rank));
    return req;
  }

  static absl::Status ParseResponse(const Frame& f, v1::CollectiveResponse* resp) {
    if (f.type != FrameType::kCollectiveOk || !resp->ParseFromString(f.body)) {
      return absl::InternalError("malformed collective answer from the coordinator");
    }
    return absl::OkStatus();
  }

  // One request/answer exchange with the coordinator, through the link thread. An answer that
  // comes after this call gave up (an older seq) is dropped there, with its descriptors.
  absl::StatusOr<Frame> Call(FrameType type, const v1::CollectiveRequest& req, int fd,
                             absl::Time deadline) {
    std::lock_guard<std::mutex> one_call(call_mu_);
    std::unique_lock<std::mutex> lock(mu_);
    if (!lost_.ok()) return lost_;
    peers::OutFrame out;
    out.seq = ++seq_;
    out.data = peers::EncodeFrame(type, out.seq, peers::RemainingMs(deadline),
                                  req.SerializeAsString(), fd >= 0 ? 1 : 0);
    if (fd >= 0) {
      // The caller may close its descriptor as soon as this returns, sent or not.
      out.fds.emplace_back(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
      if (!out.fds.back()) {
        return absl::ResourceExhaustedError(absl::StrCat("could not duplicate the descriptor for '",
                                                         req.tag(), "': ", strerror(errno)));
      }
    }
    const uint64_t seq = out.seq;
    out_.push_back(std::move(out));
    waiting_seq_ = seq;
    waiting_tag_ = req.tag();
    answer_.reset();
    wake_.Notify();
    auto done = [this] { return answer_.has_value() || !lost_.ok(); };
    if (deadline == absl::InfiniteFuture()) {
      answer_cv_.wait(lock, done);
    } else {
      // The coordinator decides every collective for all ranks at once and fails it a little
      // before the deadline it was sent, but on a loaded machine its answer can still arrive after
      // ours. Waiting a moment past our own deadline for that verdict keeps this rank from giving
      // up on a collective its peers saw complete: the unfused path's op agreement relies on it
      // (a rank that enqueues an NCCL op its peer gave up on waits forever).
      answer_cv_.wait_until(lock, absl::ToChronoTime(deadline + kVerdictGrace), done);
    }
    std::optional<Frame> answer = std::move(answer_);
    answer_.reset();
    waiting_seq_ = 0;
    if (answer) {
      if (answer->type == FrameType::kError) return peers::DecodeError(answer->body);
      return std::move(*answer);
    }
    if (!lost_.ok()) return lost_;
    for (const peers::OutFrame& o : out_) {
      if (o.seq == seq) {
        // Rank 0 did not even read the request in time; the stream now ends mid-frame or holds
        // a call nobody waits for, so the link is as good as gone.
        return LostLocked(req.tag(),
                          absl::DeadlineExceededError("timed out sending to the peer channel"));
      }
    }
    return absl::DeadlineExceededError(
        absl::StrCat("rank ", options_.rank, ": no answer from the coordinator (rank 0) for '",
                     req.tag(), "' before the deadline (is rank 0 stopped?)"));
  }

  // mu_ held. The link is gone for good: every waiting and later call gets this.
  absl::Status LostLocked(const std::string& tag, const absl::Status& cause) {
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

  // mu_ held. The link thread found the link gone: named after the call waiting, if any.
  void LinkLostLocked(const absl::Status& cause) {
    (void)LostLocked(waiting_seq_ != 0 ? waiting_tag_ : "an idle link check", cause);
  }

  void LinkLost(const absl::Status& cause) {
    std::lock_guard<std::mutex> lock(mu_);
    LinkLostLocked(cause);
  }

  void RankZeroSilent(absl::Duration silence) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!lost_.ok()) return;
    lost_ = absl::UnavailableError(
        absl::StrCat("rank ", options_.rank, ": the coordinator (rank 0) of group '",
                     options_.group, "' stopped answering: nothing heard from rank 0 for ",
                     absl::FormatDuration(absl::Trunc(silence, absl::Milliseconds(1))),
                     " (peer heartbeat timeout ", absl::FormatDuration(options_.heartbeat_timeout),
                     "); is rank 0 stopped (SIGSTOP) or hung?"));
    spdlog::warn("event=peer_lost group={} rank=0 seen_by={} reason=heartbeat silence_ms={}",
                 options_.group, options_.rank, absl::ToInt64Milliseconds(silence));
    answer_cv_.notify_all();
  }

  // Hands an answer to the call waiting for it; drops late answers and heartbeat echoes (their
  // bytes already counted as a sign of life).
  void Deliver(Frame f) {
    if (f.type == FrameType::kHeartbeat) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (waiting_seq_ == 0 || f.seq != waiting_seq_ || answer_.has_value()) return;
    answer_ = std::move(f);
    answer_cv_.notify_all();
  }

  // A heartbeat frame announcing this rank's timeout (link thread, or before it starts).
  peers::OutFrame Heartbeat() {
    const int64_t timeout_ms = absl::ToInt64Milliseconds(options_.heartbeat_timeout);
    peers::OutFrame hb;
    hb.data = peers::EncodeFrame(FrameType::kHeartbeat, ++beats_,
                                 static_cast<uint32_t>(std::max<int64_t>(1, timeout_ms)), "");
    return hb;
  }

  void LinkLoop() {
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
        auto frame = peers::TakeFrame(in_, in_fds_);
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
          if (out_.empty()) out_.push_back(Heartbeat());
          next_beat = now + interval;
        }
        absl::Status sent = peers::FlushFrames(*conn_, out_);
        if (!sent.ok()) return LinkLostLocked(sent);
      }
      if (beat && now - last_heard > timeout) return RankZeroSilent(now - last_heard);
    }
  }

  static int PollTimeoutMs(absl::Duration wait) {
    if (wait <= absl::ZeroDuration()) return 0;
    return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(wait) + 1, 1000));
  }

  absl::Status Join(absl::Time deadline) {
    std::string target;
    if (unix_) {
      ARFUSE_ASSIGN_OR_RETURN(target, PeerSocketPath(options_.peer_dir, options_.group));
    } else {
      target = options_.rank0_address;
    }
    v1::JoinRequest req;
    req.set_rank(options_.rank);
    req.set_world_size(options_.world_size);
    req.set_nnodes(options_.nnodes);
    req.set_node_id(options_.node_id.empty() ? HostName() : options_.node_id);
    req.mutable_api()->set_major(kApiMajor);
    req.mutable_api()->set_minor(kApiMinor);
    req.set_build_version(kVersion);
    const std::string body = peers::EncodeJoinBody(options_.group, req.SerializeAsString());
    absl::Duration backoff = absl::Milliseconds(10);
    absl::Status last = absl::UnavailableError("no attempt made");
    bool reached = false;
    bool closed_unanswered = false;
    // Retries cover rank 0 not listening yet and a broken group being re-formed (ABORTED);
    // everything else the coordinator says is final.
    while (absl::Now() < deadline) {
      absl::StatusOr<std::unique_ptr<peers::PeerStream>> fd = Open(target, deadline);
      if (fd.ok()) {
        reached = true;
        std::string in;
        std::deque<UniqueFd> in_fds;
        absl::Status s = peers::SendAll(
            **fd, peers::EncodeFrame(FrameType::kJoin, 1, peers::RemainingMs(deadline), body), {},
            deadline);
        absl::StatusOr<Frame> f =
            s.ok() ? peers::RecvFrame(**fd, in, in_fds, deadline) : absl::StatusOr<Frame>(s);
        if (f.ok() && f->type == FrameType::kJoinOk) {
          v1::JoinResponse resp;
          if (!resp.ParseFromString(f->body) || resp.members_size() != options_.world_size) {
            return absl::InternalError("malformed join answer from the coordinator");
          }
          epoch_ = resp.epoch();
          for (const auto& m : resp.members()) {
            peers::MemberInfo mi;
            mi.rank = static_cast<int>(m.rank());
            mi.world_size = static_cast<int>(m.world_size());
            mi.nnodes = static_cast<int>(m.nnodes());
            mi.group = options_.group;
            mi.node_id = m.node_id();
            mi.build_version = m.build_version();
            members_.push_back(std::move(mi));
          }
          conn_ = std::move(*fd);
          in_ = std::move(in);
          spdlog::info("event=peer_joined group={} rank={} world_size={}", options_.group,
                       options_.rank, options_.world_size);
          return absl::OkStatus();
        }
        if (f.ok() && f->type == FrameType::kError) {
          absl::Status err = peers::DecodeError(f->body);
          if (!absl::IsAborted(err)) return err;
          last = err;
        } else if (!f.ok() && absl::IsInvalidArgument(f.status())) {
          // Not this build's protocol (another wire version, or not a peer channel): retrying
          // cannot change that.
          return absl::FailedPreconditionError(
              absl::StrCat("rank ", options_.rank, " cannot join group '", options_.group, "' at ",
                           unix_ ? "unix:" : "tcp:", target, ": ", f.status().message()));
        } else if (!f.ok()) {
          last = f.status();
          // Kept for the final message: the only hint an older coordinator gives.
          closed_unanswered |= s.ok() && absl::IsUnavailable(last);
        } else {
          return absl::InternalError("unexpected answer to a join");
        }
      } else {
        last = fd.status();
        if (absl::IsInvalidArgument(last) || absl::IsPermissionDenied(last)) return last;
        if (absl::IsUnauthenticated(last)) {
          // A certificate either side refuses stays refused: retrying cannot change it.
          return absl::UnauthenticatedError(
              absl::StrCat("rank ", options_.rank, " cannot join group '", options_.group,
                           "' at tcp:", target, ": ", last.message()));
        }
      }
      absl::SleepFor(std::min(backoff, deadline - absl::Now()));  // retry pacing, not sync
      backoff = std::min(backoff * 2, absl::Milliseconds(200));
    }
    return absl::UnavailableError(absl::StrCat(
        "rank ", options_.rank, " could not join group '", options_.group, "' within ",
        absl::FormatDuration(options_.timeout), ": ",
        reached ? "the coordinator (rank 0) did not complete the group"
                : "the coordinator (rank 0) was not reachable; missing ranks: 0",
        " (", unix_ ? "unix:" : "tcp:", target, "; last error: ", last.message(), ")",
        closed_unanswered
            ? "; rank 0 closed the connection without answering the join (a rank 0 re-forming "
              "its group does that, and so does an arfused on an older peer wire version: check "
              "that every rank runs the same build)"
            : ""));
  }

  // One connection attempt to rank 0: the Unix socket, or TCP (with the TLS handshake when the
  // group uses TLS: done, including rank 0's acceptance of this rank's certificate, before the
  // join is sent).
  absl::StatusOr<std::unique_ptr<peers::PeerStream>> Open(const std::string& target,
                                                          absl::Time deadline) {
    if (unix_) {
      ARFUSE_ASSIGN_OR_RETURN(UniqueFd fd, ConnectUnix(target));
      return std::unique_ptr<peers::PeerStream>(new peers::PlainStream(std::move(fd)));
    }
    ARFUSE_ASSIGN_OR_RETURN(UniqueFd fd, ConnectTcp(target, deadline));
    if (tls_ == nullptr) {
      return std::unique_ptr<peers::PeerStream>(new peers::PlainStream(std::move(fd)));
    }
    ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<peers::TlsStream> tls,
                            peers::TlsStream::Connect(*tls_, std::move(fd)));
    ARFUSE_RETURN_IF_ERROR(tls->HandshakeUntil(deadline));
    return std::unique_ptr<peers::PeerStream>(std::move(tls));
  }

  const PeerOptions options_;
  const bool unix_;
  std::shared_ptr<const peers::PeerTls> tls_;  // TCP with TLS only
  std::unique_ptr<peers::CoordinatorServer> server_;
  std::unique_ptr<peers::PeerStream> conn_;  // the link thread's alone while it runs
  // Link thread only.
  std::string in_;
  std::deque<UniqueFd> in_fds_;
  WakeFd wake_;
  std::atomic<bool> stop_{false};
  std::thread link_thread_;
  uint64_t beats_ = 0;  // heartbeats sent (their seq); the link thread's once it runs
  uint64_t epoch_ = 0;
  std::vector<peers::MemberInfo> members_;

  std::mutex call_mu_;  // one call at a time
  std::mutex mu_;       // guards what follows; never held across a wait for the peer
  std::condition_variable answer_cv_;
  std::deque<peers::OutFrame> out_;
  uint64_t seq_ = 1;
  uint64_t waiting_seq_ = 0;  // the call waiting for an answer; 0: none
  std::string waiting_tag_;
  std::optional<Frame> answer_;
  absl::Status lost_;
};

}  // namespace

absl::StatusOr<std::string> PeerSocketPath(const std::string& peer_dir, const std::string& group) {
  if (peer_dir.empty()) return absl::InvalidArgumentError("peer directory is empty");
  std::string path = peer_dir;
  if (path.back() != '/') path += '/';
  absl::StrAppend(&path, group, "-rank0.sock");
  constexpr size_t kMax = sizeof(sockaddr_un::sun_path) - 1;
  if (path.size() > kMax) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer socket path \"", path, "\" is ", path.size(),
                     " bytes; Unix sockets allow at most ", kMax, ": use a shorter --peer-dir"));
  }
  return path;
}

absl::StatusOr<std::unique_ptr<PeerExchange>> ConnectPeers(const PeerOptions& options) {
  ARFUSE_RETURN_IF_ERROR(ValidateOptions(options));
  const absl::Time deadline = absl::Now() + options.timeout;
  const bool unix_transport = !options.peer_dir.empty() && options.nnodes == 1;
  auto ex = std::make_unique<SocketExchange>(options, unix_transport);
  absl::Status s = ex->Start(deadline);
  if (!s.ok()) {
    spdlog::warn("event=peer_join_failed group={} rank={} code={} error=\"{}\"", options.group,
                 options.rank, absl::StatusCodeToString(s.code()), std::string(s.message()));
    return s;
  }
  return std::unique_ptr<PeerExchange>(std::move(ex));
}

}  // namespace arfuse
