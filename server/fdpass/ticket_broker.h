// Tickets for file descriptors in transit between a client and its sidecar. A descriptor cannot
// travel inside a gRPC message, so it goes over the fd channel (fd_channel_server.h) and the gRPC
// call names it by ticket:
//   Deposit: a client sent descriptors in (DEPOSIT); a later call (RegisterRegion's
//            HostFdMemory) Claims them by ticket.
//   Offer:   the daemon has descriptors for a client (the in-stream plane's attach); the client
//            picks them up by ticket over the fd channel (PICKUP).
// A ticket is 16 random bytes as 32 lowercase hex characters, single use, bound to the uid the
// kernel reported for the depositing (or receiving) client, and expires. An offer may also belong
// to an attachment of a session: it dies with that attachment's Detach or the session's end.
//
// Descriptors, not tickets, are budgeted: every descriptor the broker holds for a uid (in its
// pending tickets), and every descriptor charged to it outside a ticket (FdCharge: a DEPOSIT still
// being read, a PICKUP's reply the client has not read yet), counts against a budget per uid and
// one for all uids together. A ticket of 16 descriptors costs 16 times one of one. The budgets
// are what keeps one client from filling the daemon's descriptor table: they sit inside the
// reserve the connection caps leave below RLIMIT_NOFILE (docs/security.md).
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
#include "common/fd/fd_ticket.h"
#include "common/fd/unique_fd.h"

namespace arfuse {

struct FdTicketBrokerOptions {
  // Descriptors charged to one uid, and to all uids together (pending tickets plus FdCharges).
  // The daemon derives both from RLIMIT_NOFILE (PendingFdBudget(), server/daemon/unix_listener.h).
  size_t max_fds_per_uid = 32;
  size_t max_fds = 128;
  size_t max_fds_per_ticket = 16;
  // Longer ttls are cut to this.
  absl::Duration max_ttl = absl::Minutes(5);
};

// What an offer belongs to beyond its uid, as the caller names them (opaque to the broker): the
// session and the attachment the descriptors were offered for. Empty: nothing (only expiry and
// pickup end the ticket).
struct FdTicketScope {
  std::string session;
  std::string attachment;
};

class FdTicketBroker;

// Descriptors charged to a uid's budget outside any ticket, released when the charge is
// destroyed (or Reset). Movable; must not outlive its broker.
class FdCharge {
 public:
  FdCharge() = default;
  ~FdCharge() { Reset(); }
  FdCharge(FdCharge&& other) noexcept;
  FdCharge& operator=(FdCharge&& other) noexcept;
  FdCharge(const FdCharge&) = delete;
  FdCharge& operator=(const FdCharge&) = delete;

  size_t count() const { return count_; }
  uid_t uid() const { return uid_; }
  void Reset();
  // Takes over `other` (a charge of the same broker and uid; any other is released).
  void Absorb(FdCharge other);

 private:
  friend class FdTicketBroker;
  FdTicketBroker* broker_ = nullptr;
  uid_t uid_ = 0;
  size_t count_ = 0;
};

// A PICKUP's descriptors, and their charge, which the fd channel keeps until the client has read
// them (descriptors in a socket's queue are still open files of the daemon's user).
struct FdPickup {
  std::vector<UniqueFd> fds;
  FdCharge charge;
};

class FdTicketBroker {
 public:
  explicit FdTicketBroker(FdTicketBrokerOptions options = {});
  ~FdTicketBroker();  // closes every pending descriptor; every FdCharge must be gone
  FdTicketBroker(const FdTicketBroker&) = delete;
  FdTicketBroker& operator=(const FdTicketBroker&) = delete;

  // Charges `n` descriptors to `uid`. RESOURCE_EXHAUSTED naming the budget (per uid or in all)
  // the charge would exceed; nothing is charged then.
  absl::StatusOr<FdCharge> Charge(uid_t uid, size_t n);

  // Descriptors `owner` sent in, held until claimed or `ttl` passes. `prior` is what the caller
  // already charged to `owner` for them (the fd channel charges a DEPOSIT's descriptors as they
  // arrive); it moves to the ticket, and the rest is charged here. INVALID_ARGUMENT for no
  // descriptors or more than max_fds_per_ticket; RESOURCE_EXHAUSTED over a budget. The
  // descriptors are closed (and `prior` released) on any error.
  absl::StatusOr<std::string> Deposit(uid_t owner, std::vector<UniqueFd> fds, absl::Duration ttl,
                                      FdCharge prior = {});
  // The descriptors of a deposit, once. PERMISSION_DENIED for a ticket that is unknown, expired,
  // already claimed, an Offer's, or another user's: one answer, so that it says nothing about
  // other users' tickets (another user's stays pending for its owner). Messages never echo the
  // ticket.
  absl::StatusOr<std::vector<UniqueFd>> Claim(absl::string_view ticket, uid_t caller);

  // Descriptors the daemon gives `owner`, held until picked up, `ttl` passes or `scope` ends
  // (Revoke*). Errors as Deposit's.
  absl::StatusOr<std::string> Offer(uid_t owner, std::vector<UniqueFd> fds, absl::Duration ttl,
                                    FdTicketScope scope = {});
  // The descriptors of an offer, once (the fd channel's PICKUP), with their charge still held.
  // Errors as Claim's.
  absl::StatusOr<FdPickup> PickupCharged(absl::string_view ticket, uid_t caller);
  // The same, the charge released: the caller holds the descriptors now.
  absl::StatusOr<std::vector<UniqueFd>> Pickup(absl::string_view ticket, uid_t caller);

  // Drops (closing their descriptors) the offers made for `attachment` of `session`, or for any
  // attachment of `session`: that Detach or that session's end. Returns how many.
  size_t RevokeAttachment(absl::string_view session, absl::string_view attachment);
  size_t RevokeSession(absl::string_view session);

  // Drops the tickets expired by `now` (closing their descriptors); returns how many. Every call
  // above expires lazily too; the fd channel calls this periodically so an idle broker lets go.
  size_t ExpireNow(absl::Time now = absl::Now());

  // Pending tickets, in all and of `uid`.
  size_t pending() const;
  size_t pending_for(uid_t uid) const;
  // Descriptors charged (tickets and FdCharges), in all and to `uid`.
  size_t charged() const;
  size_t charged_for(uid_t uid) const;
  const FdTicketBrokerOptions& options() const { return options_; }

 private:
  friend class FdCharge;
  enum class Kind { kDeposit, kOffer };
  struct Entry {
    Kind kind;
    uid_t owner;
    absl::Time expires;
    std::vector<UniqueFd> fds;
    FdTicketScope scope;
  };
  absl::StatusOr<std::string> Add(Kind kind, uid_t owner, std::vector<UniqueFd> fds,
                                  absl::Duration ttl, FdTicketScope scope, FdCharge prior);
  absl::StatusOr<Entry> Take(Kind kind, absl::string_view ticket, uid_t caller);
  // Why `n` more descriptors for `uid` exceed a budget; OK when they fit.
  absl::Status FitsLocked(uid_t uid, size_t n) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddChargeLocked(uid_t uid, size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropChargeLocked(uid_t uid, size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Release(uid_t uid, size_t n);
  // Moves the entries `drop` selects into `dropped` (closed by the caller, outside the lock).
  template <typename Pred>
  size_t DropLocked(Pred drop, std::vector<Entry>& dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireLocked(absl::Time now, std::vector<Entry>& dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const FdTicketBrokerOptions options_;
  // std::mutex rather than absl::Mutex: ThreadSanitizer sees its synchronization.
  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, Entry> entries_;  // guarded by mu_
  absl::flat_hash_map<uid_t, size_t> charged_;       // descriptors by uid; guarded by mu_
  size_t charged_total_ = 0;                         // guarded by mu_
};

}  // namespace arfuse
