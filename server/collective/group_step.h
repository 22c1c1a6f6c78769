// A collective step whose local part may fail: every rank contributes either its payload or its
// error, and every rank learns the outcome. A rank that failed locally still takes part, so its
// peers fail at once with its reason instead of waiting out the deadline in the next exchange.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/peers/exchange.h"

namespace arfuse {

// Allgathers `local` (payload or error) under `tag`. Returns every rank's payload when all ranks
// succeeded; this rank's own error when it failed; otherwise the first failed peer's code with
// "rank N: <message>" prefixed by `what`. Exchange failures (a missing rank) pass through.
absl::StatusOr<std::vector<std::string>> AllgatherStep(Exchange& exchange, const std::string& tag,
                                                       const absl::StatusOr<std::string>& local,
                                                       const std::string& what,
                                                       absl::Time deadline);

// The same for a step with no payload: OK when every rank's `local` was OK.
absl::Status StatusStep(Exchange& exchange, const std::string& tag, const absl::Status& local,
                        const std::string& what, absl::Time deadline);

// Forwards to another Exchange with every tag prefixed, so the steps of successive
// initializations (generations) can never be confused with each other.
class PrefixedExchange final : public Exchange {
 public:
  PrefixedExchange(Exchange& inner, std::string prefix)
      : inner_(inner), prefix_(std::move(prefix)) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  int nnodes() const override { return inner_.nnodes(); }
  absl::StatusOr<std::vector<std::string>> Allgather(const std::string& tag,
                                                     const std::string& payload,
                                                     absl::Time deadline) override {
    return inner_.Allgather(prefix_ + tag, payload, deadline);
  }
  absl::Status Barrier(const std::string& tag, absl::Time deadline) override {
    return inner_.Barrier(prefix_ + tag, deadline);
  }
  absl::StatusOr<VoteResult> Vote(const std::string& tag, bool yes, const std::string& reason,
                                  absl::Time deadline) override {
    return inner_.Vote(prefix_ + tag, yes, reason, deadline);
  }
  absl::StatusOr<std::vector<int>> AllgatherFd(const std::string& tag, int fd,
                                               absl::Time deadline) override {
    return inner_.AllgatherFd(prefix_ + tag, fd, deadline);
  }

 private:
  Exchange& inner_;
  std::string prefix_;
};

}  // namespace arfuse
