#include "server/peers/peer_exchange.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>

#include "absl/strings/str_cat.h"
#include "arfuse/v1/peer.pb.h"
#include "kernels/common/op_types.h"
#include "server/core/status_macros.h"
#include "server/core/version.h"
#include "server/peers/coordinator_server.h"
#include "server/peers/wire.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

using peers::Frame;
using peers::FrameType;

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

class SocketExchange final : public PeerExchange {
 public:
  SocketExchange(const PeerOptions& options, bool unix_transport)
      : options_(options), unix_(unix_transport) {}

  ~SocketExchange() override {
    // Tell the coordinator we leave on purpose (best effort, never blocks), then close; the
    // server (rank 0) shuts its thread down after.
    if (conn_) {
      v1::LeaveRequest req;
      req.set_epoch(epoch_);
      req.set_rank(options_.rank);
      req.set_reason("exchange closed");
      std::string data = peers::EncodeFrame(FrameType::kLeave, 0, 0, req.SerializeAsString());
      size_t offset = 0;
      (void)peers::SendSome(conn_.get(), data, &offset, {});
      conn_.reset();
    }
    server_.reset();
  }

  absl::Status Start(absl::Time deadline) {
    if (options_.rank == 0) {
      peers::CoordinatorServerOptions so;
      so.group = options_.group;
      so.world_size = options_.world_size;
      so.nnodes = options_.nnodes;
      if (!options_.peer_dir.empty()) {
        ARFUSE_ASSIGN_OR_RETURN(so.unix_path, PeerSocketPath(options_.peer_dir, options_.group));
      }
      // TCP only when some rank connects through it.
      if (!unix_) so.tcp_address = options_.rank0_address;
      ARFUSE_ASSIGN_OR_RETURN(server_, peers::CoordinatorServer::Start(so));
    }
    return Join(deadline);
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
    // Rank 0 hosts the coordinator, which hears every rank's connection close (or its Leave).
    if (server_) {
      absl::Status broken = server_->coordinator()->broken();
      if (!broken.ok()) {
        return absl::UnavailableError(absl::StrCat("peer group '", options_.group, "' epoch ",
                                                   epoch_, " is broken: ", broken.message()));
      }
    }
    // A collective in progress owns the connection and reports a lost link itself, within its
    // own deadline; checking again after it is enough.
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) return absl::OkStatus();
    if (!lost_.ok()) return lost_;
    if (!conn_) return absl::UnavailableError("this rank has no connection to its peer group");
    pollfd p{conn_.get(), POLLIN, 0};
    int ready = ::poll(&p, 1, 0);
    if (ready < 0) {
      if (errno == EINTR) return absl::OkStatus();
      return absl::InternalError(
          absl::StrCat("poll on the peer connection failed: ", strerror(errno)));
    }
    if (ready == 0) return absl::OkStatus();
    // Readable while idle: the coordinator closed the connection (it died, or re-formed the group
    // without this rank), or a late answer to a call this rank gave up on arrived. Such answers
    // stay buffered; Call() skips them by seq.
    bool eof = false;
    absl::Status read = peers::ReadAvailable(conn_.get(), in_, in_fds_, &eof);
    if (!read.ok()) return Lost("an idle link check", read);
    if (eof) return Lost("an idle link check", absl::UnavailableError("connection closed"));
    return absl::OkStatus();
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

  // One request/answer exchange with the coordinator. Answers to calls this rank already gave
  // up on (older seq) are dropped, with their descriptors.
  absl::StatusOr<Frame> Call(FrameType type, const v1::CollectiveRequest& req, int fd,
                             absl::Time deadline) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!lost_.ok()) return lost_;
    const uint64_t seq = ++seq_;
    std::string data = peers::EncodeFrame(type, seq, peers::RemainingMs(deadline),
                                          req.SerializeAsString(), fd >= 0 ? 1 : 0);
    std::vector<int> fds;
    if (fd >= 0) fds.push_back(fd);
    absl::Status sent = peers::SendAll(conn_.get(), data, fds, deadline);
    if (!sent.ok()) return Lost(req.tag(), sent);
    for (;;) {
      auto f = peers::RecvFrame(conn_.get(), in_, in_fds_, deadline);
      if (!f.ok()) {
        if (absl::IsDeadlineExceeded(f.status())) {
          return absl::DeadlineExceededError(absl::StrCat(
              "rank ", options_.rank, ": no answer from the coordinator (rank 0) for '", req.tag(),
              "' before the deadline (is rank 0 stopped?)"));
        }
        return Lost(req.tag(), f.status());
      }
      if (f->seq != seq) continue;
      if (f->type == FrameType::kError) return peers::DecodeError(f->body);
      return std::move(*f);
    }
  }

  absl::Status Lost(const std::string& tag, const absl::Status& cause) {
    lost_ = absl::UnavailableError(absl::StrCat(
        "rank ", options_.rank, " lost its connection to the coordinator (rank 0) of group '",
        options_.group, "' during '", tag, "': ", cause.message(), "; rank 0 went away"));
    spdlog::warn("event=peer_lost group={} rank=0 seen_by={}", options_.group, options_.rank);
    return lost_;
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
    // Retries cover rank 0 not listening yet and a broken group being re-formed (ABORTED);
    // everything else the coordinator says is final.
    while (absl::Now() < deadline) {
      absl::StatusOr<UniqueFd> fd = unix_ ? ConnectUnix(target) : ConnectTcp(target, deadline);
      if (fd.ok()) {
        reached = true;
        std::string in;
        std::deque<UniqueFd> in_fds;
        absl::Status s = peers::SendAll(
            fd->get(), peers::EncodeFrame(FrameType::kJoin, 1, peers::RemainingMs(deadline), body),
            {}, deadline);
        absl::StatusOr<Frame> f =
            s.ok() ? peers::RecvFrame(fd->get(), in, in_fds, deadline) : absl::StatusOr<Frame>(s);
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
          spdlog::info("event=peer_joined group={} rank={} world_size={} epoch={}", options_.group,
                       options_.rank, options_.world_size, epoch_);
          return absl::OkStatus();
        }
        if (f.ok() && f->type == FrameType::kError) {
          absl::Status err = peers::DecodeError(f->body);
          if (!absl::IsAborted(err)) return err;
          last = err;
        } else if (!f.ok()) {
          last = f.status();
        } else {
          return absl::InternalError("unexpected answer to a join");
        }
      } else {
        last = fd.status();
        if (absl::IsInvalidArgument(last)) return last;
      }
      absl::SleepFor(std::min(backoff, deadline - absl::Now()));  // retry pacing, not sync
      backoff = std::min(backoff * 2, absl::Milliseconds(200));
    }
    return absl::UnavailableError(absl::StrCat(
        "rank ", options_.rank, " could not join group '", options_.group, "' within ",
        absl::FormatDuration(options_.timeout), ": ",
        reached ? "the coordinator (rank 0) did not complete the group"
                : "the coordinator (rank 0) was not reachable; missing ranks: 0",
        " (", unix_ ? "unix:" : "tcp:", target, "; last error: ", last.message(), ")"));
  }

  const PeerOptions options_;
  const bool unix_;
  std::unique_ptr<peers::CoordinatorServer> server_;
  std::mutex mu_;  // one call at a time on the connection
  UniqueFd conn_;
  std::string in_;
  std::deque<UniqueFd> in_fds_;
  uint64_t seq_ = 1;
  uint64_t epoch_ = 0;
  absl::Status lost_;
  std::vector<peers::MemberInfo> members_;
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
