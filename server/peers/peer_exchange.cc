// Joining the group and leaving it: the options' checks, rank 0's coordinator, the join with its
// retries, the Leave on the way out (socket_exchange.h has the rest of SocketExchange).
#include "server/peers/peer_exchange.h"

#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "arfuse/v1/peer.pb.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "kernels/common/op_types.h"
#include "server/peers/socket_exchange.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

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

}  // namespace

namespace peers {

SocketExchange::~SocketExchange() {
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
      std::string data = EncodeFrame(FrameType::kLeave, 0, 0, req.SerializeAsString());
      size_t offset = 0;
      (void)conn_->SendSome(data, &offset, {});
    }
    conn_.reset();
  }
  server_.reset();
}

absl::Status SocketExchange::Start(absl::Time deadline) {
  if (!unix_ && options_.tls.any()) {
    ARFUSE_ASSIGN_OR_RETURN(tls_, PeerTls::Load(options_.tls));
  }
  if (options_.rank == 0) {
    CoordinatorServerOptions so;
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
    ARFUSE_ASSIGN_OR_RETURN(server_, CoordinatorServer::Start(so));
  }
  ARFUSE_RETURN_IF_ERROR(wake_.Open());
  ARFUSE_RETURN_IF_ERROR(Join(deadline));
  if (options_.heartbeat_timeout > absl::ZeroDuration()) {
    // The link's first frame, ahead of any call: the coordinator watches this rank from when it
    // arrives, so a rank that freezes right after joining is noticed too (one that freezes
    // before it is sent fails the group's next collective at its deadline instead).
    std::lock_guard<std::mutex> lock(mu_);
    out_.push_back(HeartbeatLocked());
  }
  link_thread_ = std::thread([this] { LinkLoop(); });
  return absl::OkStatus();
}

absl::Status SocketExchange::Join(absl::Time deadline) {
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
  const std::string body = EncodeJoinBody(options_.group, req.SerializeAsString());
  absl::Duration backoff = absl::Milliseconds(10);
  absl::Status last = absl::UnavailableError("no attempt made");
  bool reached = false;
  bool closed_unanswered = false;
  // Retries cover rank 0 not listening yet and a broken group being re-formed (ABORTED);
  // everything else the coordinator says is final.
  while (absl::Now() < deadline) {
    absl::StatusOr<std::unique_ptr<PeerStream>> fd = Open(target, deadline);
    if (fd.ok()) {
      reached = true;
      std::string in;
      std::deque<UniqueFd> in_fds;
      absl::Status s = SendAll(**fd, EncodeFrame(FrameType::kJoin, 1, RemainingMs(deadline), body),
                               {}, deadline);
      absl::StatusOr<Frame> f =
          s.ok() ? RecvFrame(**fd, in, in_fds, deadline) : absl::StatusOr<Frame>(s);
      if (f.ok() && f->type == FrameType::kJoinOk) {
        v1::JoinResponse resp;
        if (!resp.ParseFromString(f->body) || resp.members_size() != options_.world_size) {
          return absl::InternalError("malformed join answer from the coordinator");
        }
        epoch_ = resp.epoch();
        for (const auto& m : resp.members()) {
          MemberInfo mi;
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
        absl::Status err = DecodeError(f->body);
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
        return absl::UnauthenticatedError(absl::StrCat("rank ", options_.rank,
                                                       " cannot join group '", options_.group,
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

}  // namespace peers

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
  auto ex = std::make_unique<peers::SocketExchange>(options, unix_transport);
  absl::Status s = ex->Start(deadline);
  if (!s.ok()) {
    spdlog::warn("event=peer_join_failed group={} rank={} code={} error=\"{}\"", options.group,
                 options.rank, absl::StatusCodeToString(s.code()), std::string(s.message()));
    return s;
  }
  return std::unique_ptr<PeerExchange>(std::move(ex));
}

}  // namespace arfuse
