// Tickets for file descriptors in transit between a client and its sidecar. A descriptor cannot
// travel inside a gRPC message, so it goes over the fd channel (fd_channel_server.h) and the gRPC
// call names it by ticket:
//   Deposit: a client sent descriptors in (DEPOSIT); a later call (RegisterRegion's
//            HostFdMemory) Claims them by ticket.
//   Offer:   the daemon has descriptors for a client (the in-stream plane's attach); the client
//            picks them up by ticket over the fd channel (PICKUP).
// A ticket is 16 random bytes as 32 lowercase hex characters, single use, bound to the uid the
// kernel reported for the depositing (or receiving) client, and expires. Pending tickets are
// capped per uid and in total, so no client can make the daemon hold descriptors without bound.
// Thread-safe; no call blocks.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/fdpass/unique_fd.h"

namespace arfuse {

struct FdTicketBrokerOptions {
  size_t max_pending_per_uid = 64;
  size_t max_pending = 1024;
  size_t max_fds_per_ticket = 16;
  // Longer ttls are cut to this.
  absl::Duration max_ttl = absl::Minutes(5);
};

inline constexpr size_t kFdTicketChars = 32;

class FdTicketBroker {
 public:
  explicit FdTicketBroker(FdTicketBrokerOptions options = {});
  ~FdTicketBroker();  // closes every pending descriptor
  FdTicketBroker(const FdTicketBroker&) = delete;
  FdTicketBroker& operator=(const FdTicketBroker&) = delete;

  // Descriptors `owner` sent in, held until claimed or `ttl` passes. INVALID_ARGUMENT for no
  // descriptors or more than max_fds_per_ticket; RESOURCE_EXHAUSTED over the pending caps. The
  // descriptors are closed on any error.
  absl::StatusOr<std::string> Deposit(uid_t owner, std::vector<UniqueFd> fds, absl::Duration ttl);
  // The descriptors of a deposit, once. PERMISSION_DENIED for a ticket that is unknown, expired,
  // already claimed, an Offer's, or another user's: one answer, so that it says nothing about
  // other users' tickets (another user's stays pending for its owner). Messages never echo the
  // ticket.
  absl::StatusOr<std::vector<UniqueFd>> Claim(absl::string_view ticket, uid_t caller);

  // Descriptors the daemon gives `owner`, held until picked up or `ttl` passes. Errors as
  // Deposit's.
  absl::StatusOr<std::string> Offer(uid_t owner, std::vector<UniqueFd> fds, absl::Duration ttl);
  // The descriptors of an offer, once (the fd channel's PICKUP). Errors as Claim's.
  absl::StatusOr<std::vector<UniqueFd>> Pickup(absl::string_view ticket, uid_t caller);

  // Drops the tickets expired by `now` (closing their descriptors); returns how many. Every call
  // above expires lazily too; the fd channel calls this periodically so an idle broker lets go.
  size_t ExpireNow(absl::Time now = absl::Now());

  size_t pending() const;
  size_t pending_for(uid_t uid) const;

 private:
  enum class Kind { kDeposit, kOffer };
  struct Entry {
    Kind kind;
    uid_t owner;
    absl::Time expires;
    std::vector<UniqueFd> fds;
  };
  absl::StatusOr<std::string> Add(Kind kind, uid_t owner, std::vector<UniqueFd> fds,
                                  absl::Duration ttl);
  absl::StatusOr<std::vector<UniqueFd>> Take(Kind kind, absl::string_view ticket, uid_t caller);
  // Moves expired entries into `dropped` (closed by the caller, outside the lock).
  void ExpireLocked(absl::Time now, std::vector<Entry>& dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const FdTicketBrokerOptions options_;
  // std::mutex rather than absl::Mutex: ThreadSanitizer sees its synchronization.
  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, Entry> entries_;  // guarded by mu_
  absl::flat_hash_map<uid_t, size_t> per_uid_;       // guarded by mu_
};

// 16 random bytes from the kernel (getrandom) as 32 lowercase hex characters.
std::string NewFdTicket();

// 32 lowercase hex characters.
bool IsWellFormedFdTicket(absl::string_view ticket);

}  // namespace arfuse
