#include "server/peers/coordinator.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"

namespace arfuse::peers {
namespace {

// Failed collectives are remembered so late arrivals fail at once; a rank that never arrives
// would keep them forever, so only this many are kept.
constexpr size_t kMaxFailedRecords = 256;

uint64_t NewEpoch() {
  // Distinct across coordinator instances and processes: a re-formed group (even by a restarted
  // rank 0) never reuses the epoch of the group it replaces.
  static std::atomic<uint64_t> counter{0};
  uint64_t now = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  uint64_t e = (now & ~uint64_t{0xffff}) | ((static_cast<uint64_t>(getpid()) + counter++) & 0xffff);
  return e == 0 ? 1 : e;
}

std::string RankList(const std::vector<int>& ranks) {
  return ranks.empty() ? std::string("none") : absl::StrJoin(ranks, ", ");
}

}  // namespace

const char* CollectiveKindName(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::kAllgather:
      return "allgather";
    case CollectiveKind::kBarrier:
      return "barrier";
    case CollectiveKind::kVote:
      return "vote";
    case CollectiveKind::kAllgatherFd:
      return "allgather_fd";
  }
  return "unknown";
}

Coordinator::Coordinator(std::string group, int world_size, int nnodes)
    : group_(std::move(group)),
      world_size_(world_size),
      nnodes_(nnodes),
      epoch_(NewEpoch()),
      joiners_(static_cast<size_t>(world_size)),
      participants_(static_cast<size_t>(world_size), 0),
      occurrences_(static_cast<size_t>(world_size)) {}

bool Coordinator::formed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return formed_;
}

absl::Status Coordinator::broken() const {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

void Coordinator::Join(uint64_t participant, const MemberInfo& info, absl::Time deadline,
                       JoinDone done) {
  Deferred deferred;
  auto fail = [&](absl::Status s) {
    deferred.push_back([done, s] { done(JoinResult{s, 0, {}}); });
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok()) {
      fail(absl::AbortedError(absl::StrCat("group '", group_, "' is broken (", broken_.message(),
                                           "); rank 0 must re-form it")));
    } else if (info.group != group_) {
      fail(absl::InvalidArgumentError(absl::StrCat("rank ", info.rank, " asked to join group '",
                                                   info.group, "' but this coordinator serves '",
                                                   group_, "'")));
    } else if (info.world_size != world_size_) {
      fail(absl::InvalidArgumentError(absl::StrCat("rank ", info.rank, " has world_size ",
                                                   info.world_size, " but group '", group_,
                                                   "' has world_size ", world_size_)));
    } else if (info.nnodes != nnodes_) {
      fail(absl::InvalidArgumentError(absl::StrCat("rank ", info.rank, " has nnodes ", info.nnodes,
                                                   " but group '", group_, "' has nnodes ",
                                                   nnodes_)));
    } else if (info.rank < 0 || info.rank >= world_size_) {
      fail(absl::InvalidArgumentError(
          absl::StrCat("rank ", info.rank, " is out of range for world_size ", world_size_)));
    } else if (formed_ || joiners_[info.rank].participant != 0) {
      fail(absl::FailedPreconditionError(absl::StrCat("rank ", info.rank,
                                                      " has already joined group '", group_,
                                                      "' (two processes with the same rank?)")));
    } else {
      joiners_[info.rank] = Joiner{participant, info, deadline, std::move(done)};
      int joined = 0;
      for (const auto& j : joiners_) joined += j.participant != 0 ? 1 : 0;
      spdlog::info("event=peer_join group={} rank={} joined={} world_size={}", group_, info.rank,
                   joined, world_size_);
      if (joined == world_size_) {
        formed_ = true;
        std::vector<MemberInfo> members;
        for (auto& j : joiners_) members.push_back(j.info);
        for (int r = 0; r < world_size_; ++r) {
          participants_[r] = joiners_[r].participant;
          JoinDone d = std::move(joiners_[r].done);
          joiners_[r].done = nullptr;
          deferred.push_back([d, members, e = epoch_] {
            d(JoinResult{absl::OkStatus(), e, members});
          });
        }
        spdlog::info("event=peer_group_formed group={} world_size={}", group_, world_size_);
      }
    }
  }
  for (auto& f : deferred) f();
}

std::string Coordinator::MissingRanksLocked(const Pending& p) const {
  std::vector<int> missing, arrived;
  for (int r = 0; r < world_size_; ++r) (p.arrived[r] ? arrived : missing).push_back(r);
  return absl::StrCat("ranks ", RankList(missing), " did not arrive (arrived: ", RankList(arrived),
                      ")");
}

void Coordinator::FailPendingLocked(Pending& p, const absl::Status& status, Deferred& out) {
  if (p.failed.ok()) p.failed = status;
  for (int r = 0; r < world_size_; ++r) {
    if (p.done[r]) {
      CollectiveDone d = std::move(p.done[r]);
      p.done[r] = nullptr;
      out.push_back([d, status] { d(CollectiveResult{status, {}, false, {}, {}}); });
    }
    p.contributions[r].fd.reset();
  }
}

void Coordinator::CompleteLocked(Pending& p, Deferred& out) {
  CollectiveResult base;
  base.status = absl::OkStatus();
  if (p.kind == CollectiveKind::kAllgather) {
    for (auto& c : p.contributions) base.payloads.push_back(c.payload);
  } else if (p.kind == CollectiveKind::kVote) {
    base.all_yes = true;
    for (int r = 0; r < world_size_; ++r) {
      const Contribution& c = p.contributions[r];
      if (!c.yes) {
        base.all_yes = false;
        base.reasons.push_back(
            absl::StrCat("rank ", r, ": ", c.reason.empty() ? "(no reason given)" : c.reason));
      }
    }
  }
  for (int r = 0; r < world_size_; ++r) {
    CollectiveResult res;
    res.status = base.status;
    res.payloads = base.payloads;
    res.all_yes = base.all_yes;
    res.reasons = base.reasons;
    if (p.kind == CollectiveKind::kAllgatherFd) {
      for (auto& c : p.contributions) {
        int d = ::fcntl(c.fd.get(), F_DUPFD_CLOEXEC, 0);
        if (d < 0) {
          res = CollectiveResult{};
          res.status = absl::ResourceExhaustedError(
              absl::StrCat("could not duplicate a descriptor for rank ", r, ": ", strerror(errno)));
          break;
        }
        res.fds.emplace_back(d);
      }
    }
    CollectiveDone d = std::move(p.done[r]);
    p.done[r] = nullptr;
    auto shared = std::make_shared<CollectiveResult>(std::move(res));
    out.push_back([d, shared] { d(std::move(*shared)); });
  }
  for (auto& c : p.contributions) c.fd.reset();
}

void Coordinator::Contribute(uint64_t participant, Contribution c, CollectiveDone done) {
  Deferred deferred;
  auto fail = [&](absl::Status s) {
    deferred.push_back([done, s] { done(CollectiveResult{s, {}, false, {}, {}}); });
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (c.epoch != epoch_) {
      // The epoch is never echoed: it authenticates a rank's calls to the group.
      fail(absl::AbortedError(
          absl::StrCat("stale epoch for group '", group_, "': the group was re-formed; re-join")));
    } else if (!broken_.ok()) {
      fail(broken_);
    } else if (!formed_) {
      fail(absl::FailedPreconditionError(
          absl::StrCat("group '", group_, "' has not formed yet: join before collectives")));
    } else if (c.rank < 0 || c.rank >= world_size_) {
      fail(absl::InvalidArgumentError(
          absl::StrCat("rank ", c.rank, " is out of range for world_size ", world_size_)));
    } else if (participant != 0 && participants_[c.rank] != participant) {
      fail(absl::FailedPreconditionError(absl::StrCat(
          "a collective for rank ", c.rank, " came from a connection that did not join as it")));
    } else {
      const int rank = c.rank;
      uint64_t occ = occurrences_[rank][c.tag]++;
      Key key{c.tag, occ};
      auto [it, inserted] = pending_.try_emplace(key);
      Pending& p = it->second;
      if (inserted) {
        p.kind = c.kind;
        p.tag = c.tag;
        p.arrived.assign(world_size_, false);
        p.contributions.resize(world_size_);
        p.done.resize(world_size_);
        p.created = absl::Now();
      }
      p.arrived[rank] = true;
      ++p.num_arrived;
      if (!p.failed.ok()) {
        fail(absl::AbortedError(absl::StrCat(
            "collective '", c.tag, "' already failed on the other ranks: ", p.failed.message())));
      } else if (p.kind != c.kind) {
        std::string msg = absl::StrCat("collective '", c.tag, "': rank ", rank, " called ",
                                       CollectiveKindName(c.kind), " but other ranks called ",
                                       CollectiveKindName(p.kind));
        fail(absl::InvalidArgumentError(msg));
        FailPendingLocked(p, absl::InvalidArgumentError(msg), deferred);
      } else {
        p.contributions[rank] = std::move(c);
        p.done[rank] = std::move(done);
        if (p.num_arrived == world_size_) CompleteLocked(p, deferred);
      }
      if (p.num_arrived == world_size_) pending_.erase(it);
      CollectGarbageLocked();
    }
  }
  for (auto& f : deferred) f();
}

void Coordinator::CollectGarbageLocked() {
  size_t failed = 0;
  for (auto& [k, p] : pending_) failed += p.failed.ok() ? 0 : 1;
  while (failed > kMaxFailedRecords) {
    auto oldest = pending_.end();
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
      if (!it->second.failed.ok() &&
          (oldest == pending_.end() || it->second.created < oldest->second.created)) {
        oldest = it;
      }
    }
    pending_.erase(oldest);
    --failed;
  }
}

std::vector<std::string> Coordinator::Gossip(uint64_t participant, std::string payload) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!formed_ || payload.empty()) return {};
  gossip_.resize(static_cast<size_t>(world_size_));
  if (participant != 0 && payload.size() <= kMaxGossipBytes) {
    for (int r = 0; r < world_size_; ++r) {
      if (participants_[r] == participant) gossip_[r] = std::move(payload);
    }
  }
  return gossip_;
}

void Coordinator::ParticipantGone(uint64_t participant, const std::string& reason) {
  if (participant == 0) return;
  Deferred deferred;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (formed_) {
      for (int r = 0; r < world_size_; ++r) {
        if (participants_[r] != participant) continue;
        if (broken_.ok()) {
          broken_ = absl::UnavailableError(
              absl::StrCat("rank ", r, " of group '", group_, "' went away: ", reason));
          spdlog::warn("event=peer_lost group={} rank={} reason=\"{}\"", group_, r, reason);
        }
        for (auto& [k, p] : pending_) {
          if (p.failed.ok()) FailPendingLocked(p, broken_, deferred);
        }
      }
    } else {
      for (auto& j : joiners_) {
        if (j.participant == participant) j = Joiner{};
      }
    }
  }
  for (auto& f : deferred) f();
}

void Coordinator::Expire(absl::Time now) {
  Deferred deferred;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!formed_) {
      std::vector<int> joined, missing;
      for (int r = 0; r < world_size_; ++r) {
        (joiners_[r].participant != 0 ? joined : missing).push_back(r);
      }
      bool expired = false;
      for (const auto& j : joiners_) expired |= j.participant != 0 && j.deadline <= now;
      // One joiner giving up fails them all: most often it is rank 0, whose coordinator goes
      // away with it, and every rank should hear which ranks were missing rather than a bare
      // "connection closed".
      for (auto& j : joiners_) {
        if (!expired || j.participant == 0) continue;
        absl::Status s = absl::UnavailableError(
            absl::StrCat("group '", group_, "': ranks ", RankList(missing),
                         " did not join before the deadline (joined: ", RankList(joined), ")"));
        spdlog::warn("event=peer_join_timeout group={} rank={} missing=\"{}\"", group_, j.info.rank,
                     RankList(missing));
        JoinDone d = std::move(j.done);
        deferred.push_back([d, s] { d(JoinResult{s, 0, {}}); });
        j = Joiner{};
      }
    }
    for (auto& [k, p] : pending_) {
      if (!p.failed.ok()) continue;
      bool expired = false;
      for (int r = 0; r < world_size_; ++r) {
        if (p.done[r] && p.contributions[r].deadline <= now) expired = true;
      }
      if (!expired) continue;
      absl::Status s = absl::DeadlineExceededError(
          absl::StrCat("collective '", p.tag, "' (", CollectiveKindName(p.kind), ") of group '",
                       group_, "' timed out: ", MissingRanksLocked(p)));
      spdlog::warn("event=peer_collective_timeout group={} tag={} detail=\"{}\"", group_, p.tag,
                   MissingRanksLocked(p));
      FailPendingLocked(p, s, deferred);
    }
  }
  for (auto& f : deferred) f();
}

absl::Time Coordinator::NextDeadline() const {
  std::lock_guard<std::mutex> lock(mu_);
  absl::Time next = absl::InfiniteFuture();
  if (!formed_) {
    for (const auto& j : joiners_) {
      if (j.participant != 0) next = std::min(next, j.deadline);
    }
  }
  for (const auto& [k, p] : pending_) {
    if (!p.failed.ok()) continue;
    for (int r = 0; r < world_size_; ++r) {
      if (p.done[r]) next = std::min(next, p.contributions[r].deadline);
    }
  }
  return next;
}

}  // namespace arfuse::peers
