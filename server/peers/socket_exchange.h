// The Exchange ConnectPeers() returns (peer_exchange.h), inside the peers library only. Its code
// is split by job: peer_exchange.cc joins the group and leaves it, peer_link.cc connects to rank
// 0 and runs the link thread, peer_collectives.cc makes the collective calls over that link.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "arfuse/v1/peer.pb.h"
#include "common/fd/unique_fd.h"
#include "server/fdpass/wake_fd.h"
#include "server/peers/coordinator_server.h"
#include "server/peers/peer_exchange.h"
#include "server/peers/wire.h"

namespace arfuse::peers {

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
  // Stops the link thread, then tells the coordinator this rank leaves (peer_exchange.cc).
  ~SocketExchange() override;

  // Rank 0 starts the coordinator; every rank joins, then starts its link thread.
  absl::Status Start(absl::Time deadline);

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  int nnodes() const override { return options_.nnodes; }
  uint64_t epoch() const override { return epoch_; }
  const std::vector<MemberInfo>& members() const override { return members_; }
  std::shared_ptr<Coordinator> coordinator() const override {
    return server_ ? server_->coordinator() : nullptr;
  }
  int tcp_port() const override { return server_ ? server_->tcp_port() : 0; }

  absl::Status LinkStatus() override;
  void SetGossip(std::string payload) override;
  std::vector<std::string> Gossip() override;

  absl::StatusOr<std::vector<std::string>> Allgather(const std::string& tag,
                                                     const std::string& payload,
                                                     absl::Time deadline) override;
  absl::Status Barrier(const std::string& tag, absl::Time deadline) override;
  absl::StatusOr<VoteResult> Vote(const std::string& tag, bool yes, const std::string& reason,
                                  absl::Time deadline) override;
  absl::StatusOr<std::vector<int>> AllgatherFd(const std::string& tag, int fd,
                                               absl::Time deadline) override;

 private:
  // ---- join (peer_exchange.cc) ----
  absl::Status Join(absl::Time deadline);

  // ---- the link (peer_link.cc) ----

  // One connection attempt to rank 0: the Unix socket, or TCP (with the TLS handshake when the
  // group uses TLS: done, including rank 0's acceptance of this rank's certificate, before the
  // join is sent).
  absl::StatusOr<std::unique_ptr<PeerStream>> Open(const std::string& target, absl::Time deadline);
  // mu_ held. The link is gone for good: every waiting and later call gets this.
  absl::Status LostLocked(const std::string& tag, const absl::Status& cause);
  // mu_ held. The link thread found the link gone: named after the call waiting, if any.
  void LinkLostLocked(const absl::Status& cause);
  void LinkLost(const absl::Status& cause);
  void RankZeroSilent(absl::Duration silence);
  // Hands an answer to the call waiting for it; drops late answers and heartbeat echoes (their
  // bytes already counted as a sign of life).
  void Deliver(Frame f);
  // mu_ held. A heartbeat frame announcing this rank's timeout and carrying its gossip (link
  // thread, or before it starts).
  OutFrame HeartbeatLocked();
  void LinkLoop();

  // ---- collectives (peer_collectives.cc) ----
  v1::CollectiveRequest Request(const std::string& tag, v1::CollectiveKind kind) const;
  // One request/answer exchange with the coordinator, through the link thread. An answer that
  // comes after this call gave up (an older seq) is dropped there, with its descriptors.
  absl::StatusOr<Frame> Call(FrameType type, const v1::CollectiveRequest& req, int fd,
                             absl::Time deadline);

  const PeerOptions options_;
  const bool unix_;
  std::shared_ptr<const PeerTls> tls_;  // TCP with TLS only
  std::unique_ptr<CoordinatorServer> server_;
  std::unique_ptr<PeerStream> conn_;  // the link thread's alone while it runs
  // Link thread only.
  std::string in_;
  std::deque<UniqueFd> in_fds_;
  WakeFd wake_;
  std::atomic<bool> stop_{false};
  std::thread link_thread_;
  uint64_t beats_ = 0;  // heartbeats sent (their seq); the link thread's once it runs
  uint64_t epoch_ = 0;
  std::vector<MemberInfo> members_;

  std::mutex call_mu_;  // one call at a time
  std::mutex mu_;       // guards what follows; never held across a wait for the peer
  std::condition_variable answer_cv_;
  std::deque<OutFrame> out_;
  uint64_t seq_ = 1;
  uint64_t waiting_seq_ = 0;  // the call waiting for an answer; 0: none
  std::string waiting_tag_;
  std::optional<Frame> answer_;
  absl::Status lost_;
  std::string gossip_out_;              // what the next heartbeat carries
  std::vector<std::string> gossip_in_;  // every rank's, as rank 0 last echoed it
};

}  // namespace arfuse::peers
