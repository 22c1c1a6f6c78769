// The collective calls of a rank (Allgather, Barrier, Vote, AllgatherFd): each is one request to
// the coordinator and its answer, carried by the link thread (socket_exchange.h).
#include <fcntl.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/peers/socket_exchange.h"

namespace arfuse::peers {
namespace {

// How long a call waits past its deadline for the coordinator's verdict (see Call).
constexpr absl::Duration kVerdictGrace = absl::Milliseconds(500);

absl::Status ParseResponse(const Frame& f, v1::CollectiveResponse* resp) {
  if (f.type != FrameType::kCollectiveOk || !resp->ParseFromString(f.body)) {
    return absl::InternalError("malformed collective answer from the coordinator");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> SocketExchange::Allgather(const std::string& tag,
                                                                   const std::string& payload,
                                                                   absl::Time deadline) {
  v1::CollectiveRequest req = Request(tag, v1::COLLECTIVE_KIND_ALLGATHER);
  req.set_payload(payload);
  ARFUSE_ASSIGN_OR_RETURN(Frame f, Call(FrameType::kCollective, req, -1, deadline));
  v1::CollectiveResponse resp;
  ARFUSE_RETURN_IF_ERROR(ParseResponse(f, &resp));
  if (resp.payloads_size() != options_.world_size) {
    return absl::InternalError(absl::StrCat("allgather '", tag, "' returned ", resp.payloads_size(),
                                            " payloads for world_size ", options_.world_size));
  }
  return std::vector<std::string>(resp.payloads().begin(), resp.payloads().end());
}

absl::Status SocketExchange::Barrier(const std::string& tag, absl::Time deadline) {
  v1::CollectiveRequest req = Request(tag, v1::COLLECTIVE_KIND_BARRIER);
  ARFUSE_ASSIGN_OR_RETURN(Frame f, Call(FrameType::kCollective, req, -1, deadline));
  v1::CollectiveResponse resp;
  return ParseResponse(f, &resp);
}

absl::StatusOr<VoteResult> SocketExchange::Vote(const std::string& tag, bool yes,
                                                const std::string& reason, absl::Time deadline) {
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

absl::StatusOr<std::vector<int>> SocketExchange::AllgatherFd(const std::string& tag, int fd,
                                                             absl::Time deadline) {
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

v1::CollectiveRequest SocketExchange::Request(const std::string& tag,
                                              v1::CollectiveKind kind) const {
  v1::CollectiveRequest req;
  req.set_epoch(epoch_);
  req.set_tag(tag);
  req.set_kind(kind);
  req.set_rank(static_cast<uint32_t>(options_.rank));
  return req;
}

absl::StatusOr<Frame> SocketExchange::Call(FrameType type, const v1::CollectiveRequest& req, int fd,
                                           absl::Time deadline) {
  std::lock_guard<std::mutex> one_call(call_mu_);
  std::unique_lock<std::mutex> lock(mu_);
  if (!lost_.ok()) return lost_;
  OutFrame out;
  out.seq = ++seq_;
  out.data =
      EncodeFrame(type, out.seq, RemainingMs(deadline), req.SerializeAsString(), fd >= 0 ? 1 : 0);
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
    if (answer->type == FrameType::kError) return DecodeError(answer->body);
    return std::move(*answer);
  }
  if (!lost_.ok()) return lost_;
  for (const OutFrame& o : out_) {
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

}  // namespace arfuse::peers
