// The small interface every cross-rank handshake goes through: workspace handle exchange, the
// NCCL unique id, the config vote. Implemented by the sidecars' peer channel (gRPC to rank 0)
// and by in-process harnesses in tests. No gRPC and no CUDA here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace arfuse {

struct VoteResult {
  bool all_yes = false;
  // "rank N: reason" for every rank that voted no, in rank order.
  std::vector<std::string> reasons;
};

class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Ranks on this rank's node share IPC handles and file descriptors directly.
  virtual int nnodes() const { return 1; }

  // Every rank contributes `payload` under `tag`; returns all payloads indexed by rank.
  // Tags must be used in the same order on every rank. DEADLINE_EXCEEDED or UNAVAILABLE (naming
  // the missing ranks) when the group does not complete before `deadline`.
  virtual absl::StatusOr<std::vector<std::string>> Allgather(const std::string& tag,
                                                             const std::string& payload,
                                                             absl::Time deadline) = 0;

  virtual absl::Status Barrier(const std::string& tag, absl::Time deadline) = 0;

  // Logical AND across ranks; all ranks get the same result.
  virtual absl::StatusOr<VoteResult> Vote(const std::string& tag, bool yes,
                                          const std::string& reason, absl::Time deadline) = 0;

  // Sends open file descriptors to every other rank of this node and receives theirs (POSIX-FD
  // VMM handles travel this way, with SCM_RIGHTS). Returns one fd per rank (this rank's own entry
  // is a dup of `fd`); the caller owns and closes them. UNIMPLEMENTED where the channel cannot
  // pass descriptors.
  virtual absl::StatusOr<std::vector<int>> AllgatherFd(const std::string& tag, int fd,
                                                       absl::Time deadline) = 0;

  // Whether this rank's link to the group is still up, checked without any collective so that a
  // peer that died, or froze with its connection open (heartbeats), while the group was idle is
  // noticed before the next op needs it. OK while up; UNAVAILABLE naming the rank that went away
  // or stopped answering once it is not (the group must then be re-formed). Never blocks.
  // In-process exchanges have no link to lose.
  virtual absl::Status LinkStatus() { return absl::OkStatus(); }

  // Gossip: a small payload of this rank (at most 1 KiB) that travels with the link's heartbeats
  // rather than in a collective, so the ranks need not call anything in the same order and
  // nothing waits for a slow rank. SetGossip replaces what the next heartbeat carries; Gossip()
  // is every rank's latest payload as rank 0 last echoed it (index = rank, empty for a rank not
  // heard from yet; empty as a whole before the first echo). Exchanges without heartbeats carry
  // none: Gossip() stays empty.
  virtual void SetGossip(std::string payload) { (void)payload; }
  virtual std::vector<std::string> Gossip() { return {}; }
};

}  // namespace arfuse
