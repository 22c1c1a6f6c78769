#include "server/peers/local_exchange.h"

#include <fcntl.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/peers/coordinator.h"

namespace arfuse {
namespace {

using peers::CollectiveKind;
using peers::CollectiveResult;
using peers::Contribution;
using peers::Coordinator;

class LocalExchange final : public Exchange {
 public:
  LocalExchange(std::shared_ptr<Coordinator> coord, int rank, int nnodes)
      : coord_(std::move(coord)), rank_(rank), nnodes_(nnodes) {}
  ~LocalExchange() override {
    coord_->ParticipantGone(Participant(), absl::StrCat("rank ", rank_, " exchange destroyed"));
  }

  int rank() const override { return rank_; }
  int world_size() const override { return coord_->world_size(); }
  int nnodes() const override { return nnodes_; }

  absl::StatusOr<std::vector<std::string>> Allgather(const std::string& tag,
                                                     const std::string& payload,
                                                     absl::Time deadline) override {
    Contribution c = Make(CollectiveKind::kAllgather, tag, deadline);
    c.payload = payload;
    ARFUSE_ASSIGN_OR_RETURN(CollectiveResult r, Run(std::move(c)));
    return std::move(r.payloads);
  }

  absl::Status Barrier(const std::string& tag, absl::Time deadline) override {
    return Run(Make(CollectiveKind::kBarrier, tag, deadline)).status();
  }

  absl::StatusOr<VoteResult> Vote(const std::string& tag, bool yes, const std::string& reason,
                                  absl::Time deadline) override {
    Contribution c = Make(CollectiveKind::kVote, tag, deadline);
    c.yes = yes;
    c.reason = reason;
    ARFUSE_ASSIGN_OR_RETURN(CollectiveResult r, Run(std::move(c)));
    VoteResult v;
    v.all_yes = r.all_yes;
    v.reasons = std::move(r.reasons);
    return v;
  }

  absl::StatusOr<std::vector<int>> AllgatherFd(const std::string& tag, int fd,
                                               absl::Time deadline) override {
    if (fd < 0) return absl::InvalidArgumentError("AllgatherFd needs an open descriptor");
    Contribution c = Make(CollectiveKind::kAllgatherFd, tag, deadline);
    c.fd.reset(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
    if (!c.fd) return absl::InvalidArgumentError("AllgatherFd: descriptor is not open");
    ARFUSE_ASSIGN_OR_RETURN(CollectiveResult r, Run(std::move(c)));
    std::vector<int> out;
    for (auto& u : r.fds) out.push_back(u.release());
    return out;
  }

 private:
  // Participant ids are the rank + 1 (0 means "unchecked" to the coordinator).
  uint64_t Participant() const { return static_cast<uint64_t>(rank_) + 1; }

  Contribution Make(CollectiveKind kind, const std::string& tag, absl::Time deadline) const {
    Contribution c;
    c.kind = kind;
    c.tag = tag;
    c.epoch = coord_->epoch();
    c.rank = rank_;
    c.deadline = deadline;
    return c;
  }

  absl::StatusOr<CollectiveResult> Run(Contribution c) {
    struct Slot {
      std::mutex mu;
      std::condition_variable cv;
      std::optional<CollectiveResult> result;
    };
    auto slot = std::make_shared<Slot>();
    const absl::Time deadline = c.deadline;
    coord_->Contribute(Participant(), std::move(c), [slot](CollectiveResult r) {
      std::lock_guard<std::mutex> lock(slot->mu);
      slot->result = std::move(r);
      slot->cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(slot->mu);
    while (!slot->result.has_value()) {
      if (absl::Now() >= deadline) {
        // No I/O thread here: the waiter whose deadline passed expires the collective itself,
        // which answers every rank waiting on it (this one included) with the missing ranks.
        lock.unlock();
        coord_->Expire(absl::Now());
        lock.lock();
        continue;
      }
      absl::Duration left = deadline - absl::Now();
      slot->cv.wait_for(lock, absl::ToChronoNanoseconds(std::min(left, absl::Seconds(1))));
    }
    CollectiveResult r = std::move(*slot->result);
    if (!r.status.ok()) return r.status;
    return r;
  }

  std::shared_ptr<Coordinator> coord_;
  const int rank_;
  const int nnodes_;
};

}  // namespace

std::vector<std::unique_ptr<Exchange>> LocalExchangeGroup::Create(int world_size, int nnodes) {
  auto coord = std::make_shared<Coordinator>("local", world_size, nnodes);
  for (int r = 0; r < world_size; ++r) {
    peers::MemberInfo m;
    m.rank = r;
    m.world_size = world_size;
    m.nnodes = nnodes;
    m.group = "local";
    m.node_id = "local";
    coord->Join(static_cast<uint64_t>(r) + 1, m, absl::InfiniteFuture(), [](peers::JoinResult) {});
  }
  std::vector<std::unique_ptr<Exchange>> out;
  for (int r = 0; r < world_size; ++r) {
    out.push_back(std::make_unique<LocalExchange>(coord, r, nnodes));
  }
  return out;
}

}  // namespace arfuse
