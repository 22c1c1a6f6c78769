// The group's rendezvous logic, hosted by rank 0: joins, then collectives matched across ranks.
// No I/O here: the socket server (coordinator_server.h) and the in-process group
// (local_exchange.h) feed it and deliver its answers.
//
// Matching: the k-th call of rank r with tag T meets the k-th call of every other rank with T,
// so a tag may be reused (a barrier per step) and tags must be called in the same order on every
// rank. A collective completes for all ranks at once or fails for all ranks at once: the first
// deadline to pass, a kind mismatch, or a rank leaving fails it for everyone waiting, and a rank
// arriving later gets the same failure instead of waiting for ranks that already gave up.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/fd/unique_fd.h"

namespace arfuse::peers {

enum class CollectiveKind : uint8_t { kAllgather = 1, kBarrier = 2, kVote = 3, kAllgatherFd = 4 };
const char* CollectiveKindName(CollectiveKind k);

struct MemberInfo {
  int rank = -1;
  int world_size = 0;
  int nnodes = 1;
  std::string group;
  std::string node_id;
  std::string build_version;
};

struct JoinResult {
  absl::Status status;
  uint64_t epoch = 0;
  std::vector<MemberInfo> members;  // index = rank
};
using JoinDone = std::function<void(JoinResult)>;

struct Contribution {
  CollectiveKind kind = CollectiveKind::kAllgather;
  std::string tag;
  uint64_t epoch = 0;
  int rank = -1;
  std::string payload;
  bool yes = true;
  std::string reason;
  UniqueFd fd;  // kAllgatherFd
  absl::Time deadline = absl::InfiniteFuture();
};

struct CollectiveResult {
  absl::Status status;
  std::vector<std::string> payloads;  // kAllgather
  bool all_yes = false;               // kVote
  std::vector<std::string> reasons;   // kVote: "rank N: reason"
  std::vector<UniqueFd> fds;          // kAllgatherFd: one per rank, owned by the receiver
};
using CollectiveDone = std::function<void(CollectiveResult)>;

class Coordinator {
 public:
  // `participant` identifies who delivers answers (a connection, an in-process rank); it is what
  // ParticipantGone names when that connection closes.
  Coordinator(std::string group, int world_size, int nnodes);
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  const std::string& group() const { return group_; }
  int world_size() const { return world_size_; }
  // Unique per coordinator instance (a re-formed group gets a new one); never 0.
  uint64_t epoch() const { return epoch_; }

  // Answers (through `done`, maybe before returning, never under the lock) when every rank has
  // joined, or with an error: INVALID_ARGUMENT (group, world size, node count, rank),
  // FAILED_PRECONDITION (rank already joined), ABORTED (group broken: retry against a re-formed
  // coordinator), UNAVAILABLE (deadline passed, naming the ranks that did not join).
  void Join(uint64_t participant, const MemberInfo& info, absl::Time deadline, JoinDone done);

  void Contribute(uint64_t participant, Contribution c, CollectiveDone done);

  // The participant's connection closed (or it left): a joined rank that goes away breaks the
  // formed group; every pending and future collective fails with UNAVAILABLE naming it.
  void ParticipantGone(uint64_t participant, const std::string& reason);

  // Gossip: each rank's latest small payload, carried by its heartbeats instead of a collective
  // (no agreement on order across ranks, nothing waits for a slow rank). Records `payload` for
  // the rank `participant` holds in the formed group (ignored before the group formed, for a
  // participant that holds no rank, and when longer than kMaxGossipBytes) and returns every
  // rank's latest payload, index = rank (empty for a rank not heard from yet). An empty
  // `payload` (a rank that offers none) records nothing and gets no table.
  std::vector<std::string> Gossip(uint64_t participant, std::string payload);

  // Fails everything whose deadline is <= now. Call at NextDeadline().
  void Expire(absl::Time now);
  absl::Time NextDeadline() const;

  bool formed() const;
  // Non-OK once a rank of the formed group went away.
  absl::Status broken() const;

 private:
  struct Joiner {
    uint64_t participant = 0;
    MemberInfo info;
    absl::Time deadline;
    JoinDone done;
  };
  struct Pending {
    CollectiveKind kind = CollectiveKind::kAllgather;
    std::string tag;
    std::vector<bool> arrived;
    std::vector<Contribution> contributions;
    std::vector<CollectiveDone> done;  // empty function once answered
    int num_arrived = 0;
    absl::Status failed;  // non-OK once failed; later arrivals get it
    absl::Time created;
  };
  using Key = std::pair<std::string, uint64_t>;  // (tag, occurrence)
  using Deferred = std::vector<std::function<void()>>;

  void FailPendingLocked(Pending& p, const absl::Status& status, Deferred& out);
  void CompleteLocked(Pending& p, Deferred& out);
  std::string MissingRanksLocked(const Pending& p) const;
  void CollectGarbageLocked();

  const std::string group_;
  const int world_size_;
  const int nnodes_;
  const uint64_t epoch_;

  mutable std::mutex mu_;
  std::vector<Joiner> joiners_;         // index = rank; participant 0 = not joined
  std::vector<uint64_t> participants_;  // index = rank, once formed
  bool formed_ = false;
  absl::Status broken_;
  std::vector<std::map<std::string, uint64_t>> occurrences_;  // per rank: tag -> calls so far
  std::map<Key, Pending> pending_;
  std::vector<std::string> gossip_;  // index = rank, once formed
};

// The most one rank's gossip payload may hold: a heartbeat stays one small frame.
inline constexpr size_t kMaxGossipBytes = 1024;

}  // namespace arfuse::peers
