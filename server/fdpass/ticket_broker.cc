#include "server/fdpass/ticket_broker.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace arfuse {

FdCharge::FdCharge(FdCharge&& other) noexcept
    : broker_(std::exchange(other.broker_, nullptr)),
      uid_(other.uid_),
      count_(std::exchange(other.count_, 0)) {}

FdCharge& FdCharge::operator=(FdCharge&& other) noexcept {
  if (this != &other) {
    Reset();
    broker_ = std::exchange(other.broker_, nullptr);
    uid_ = other.uid_;
    count_ = std::exchange(other.count_, 0);
  }
  return *this;
}

void FdCharge::Reset() {
  if (broker_ != nullptr && count_ != 0) broker_->Release(uid_, count_);
  broker_ = nullptr;
  count_ = 0;
}

void FdCharge::Absorb(FdCharge other) {
  if (other.count_ == 0) return;
  if (count_ == 0) {
    *this = std::move(other);
    return;
  }
  if (other.broker_ != broker_ || other.uid_ != uid_) return;  // `other` releases its own
  count_ += std::exchange(other.count_, 0);
}

FdTicketBroker::FdTicketBroker(FdTicketBrokerOptions options) : options_(options) {}

FdTicketBroker::~FdTicketBroker() = default;

absl::Status FdTicketBroker::FitsLocked(uid_t uid, size_t n) const {
  auto it = charged_.find(uid);
  const size_t mine = it == charged_.end() ? 0 : it->second;
  if (mine + n > options_.max_fds_per_uid) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "uid ", uid, " holds ", mine, " pending descriptors and ", n, " more exceed its budget of ",
        options_.max_fds_per_uid,
        " (--max-pending-fds-per-uid): claim or pick up its fd tickets, or let them expire, "
        "first"));
  }
  if (charged_total_ + n > options_.max_fds) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the sidecar holds ", charged_total_, " pending descriptors and ", n,
                     " more exceed its budget of ", options_.max_fds,
                     " for all users (--max-pending-fds): retry shortly"));
  }
  return absl::OkStatus();
}

void FdTicketBroker::AddChargeLocked(uid_t uid, size_t n) {
  charged_[uid] += n;
  charged_total_ += n;
}

void FdTicketBroker::DropChargeLocked(uid_t uid, size_t n) {
  auto it = charged_.find(uid);
  if (it == charged_.end()) return;
  it->second -= std::min(it->second, n);
  charged_total_ -= std::min(charged_total_, n);
  if (it->second == 0) charged_.erase(it);
}

void FdTicketBroker::Release(uid_t uid, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  DropChargeLocked(uid, n);
}

absl::StatusOr<FdCharge> FdTicketBroker::Charge(uid_t uid, size_t n) {
  FdCharge charge;
  if (n == 0) return charge;
  std::lock_guard<std::mutex> lock(mu_);
  absl::Status fits = FitsLocked(uid, n);
  if (!fits.ok()) return fits;
  AddChargeLocked(uid, n);
  charge.broker_ = this;
  charge.uid_ = uid;
  charge.count_ = n;
  return charge;
}

template <typename Pred>
size_t FdTicketBroker::DropLocked(Pred drop, std::vector<Entry>& dropped) {
  size_t n = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (!drop(it->second)) {
      ++it;
      continue;
    }
    DropChargeLocked(it->second.owner, it->second.fds.size());
    dropped.push_back(std::move(it->second));
    entries_.erase(it++);
    ++n;
  }
  return n;
}

void FdTicketBroker::ExpireLocked(absl::Time now, std::vector<Entry>& dropped) {
  DropLocked([now](const Entry& e) { return e.expires <= now; }, dropped);
}

size_t FdTicketBroker::ExpireNow(absl::Time now) {
  std::vector<Entry> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ExpireLocked(now, dropped);
  }
  return dropped.size();  // their descriptors close here, outside the lock
}

size_t FdTicketBroker::RevokeAttachment(absl::string_view session, absl::string_view attachment) {
  std::vector<Entry> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    DropLocked(
        [&](const Entry& e) {
          return !e.scope.session.empty() && e.scope.session == session &&
                 e.scope.attachment == attachment;
        },
        dropped);
  }
  return dropped.size();
}

size_t FdTicketBroker::RevokeSession(absl::string_view session) {
  std::vector<Entry> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    DropLocked(
        [&](const Entry& e) { return !e.scope.session.empty() && e.scope.session == session; },
        dropped);
  }
  return dropped.size();
}

absl::StatusOr<std::string> FdTicketBroker::Add(Kind kind, uid_t owner, std::vector<UniqueFd> fds,
                                                absl::Duration ttl, FdTicketScope scope,
                                                FdCharge prior) {
  if (fds.empty()) return absl::InvalidArgumentError("an fd ticket needs at least one descriptor");
  if (fds.size() > options_.max_fds_per_ticket) {
    return absl::InvalidArgumentError(absl::StrCat("an fd ticket holds at most ",
                                                   options_.max_fds_per_ticket,
                                                   " descriptors, got ", fds.size()));
  }
  // Only a charge of this broker for this owner counts; any other is released on return.
  const size_t already =
      prior.broker_ == this && prior.uid_ == owner ? std::min(prior.count_, fds.size()) : 0;
  const absl::Time now = absl::Now();
  std::vector<Entry> dropped;
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked(now, dropped);
  absl::Status fits = FitsLocked(owner, fds.size() - already);
  if (!fits.ok()) return fits;
  // The prior charge becomes the ticket's: taken over under the lock, so it is never released
  // twice.
  AddChargeLocked(owner, fds.size() - already);
  if (already != 0) prior.count_ -= already;
  std::string ticket;
  do {
    ticket = NewFdTicket();
  } while (entries_.contains(ticket));
  Entry e{kind, owner, now + std::min(std::max(ttl, absl::ZeroDuration()), options_.max_ttl),
          std::move(fds), std::move(scope)};
  entries_.emplace(ticket, std::move(e));
  return ticket;
}

absl::StatusOr<FdTicketBroker::Entry> FdTicketBroker::Take(Kind kind, absl::string_view ticket,
                                                           uid_t caller) {
  const absl::Time now = absl::Now();
  std::vector<Entry> dropped;
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked(now, dropped);
  auto it = IsWellFormedFdTicket(ticket) ? entries_.find(ticket) : entries_.end();
  // Another user's ticket gets the answer an unknown one gets (and stays pending for its owner):
  // a caller learns nothing about tickets that are not its own.
  if (it == entries_.end() || it->second.kind != kind || it->second.owner != caller) {
    return absl::PermissionDeniedError(
        "fd ticket unknown, expired or not the caller's (a ticket is single use, expires shortly "
        "after it is issued and serves only the user it was issued to): send the descriptor "
        "again");
  }
  // The entry leaves with its charge still counted; the caller decides when it ends.
  Entry e = std::move(it->second);
  entries_.erase(it);
  return e;
}

absl::StatusOr<std::string> FdTicketBroker::Deposit(uid_t owner, std::vector<UniqueFd> fds,
                                                    absl::Duration ttl, FdCharge prior) {
  return Add(Kind::kDeposit, owner, std::move(fds), ttl, {}, std::move(prior));
}

absl::StatusOr<std::vector<UniqueFd>> FdTicketBroker::Claim(absl::string_view ticket,
                                                            uid_t caller) {
  absl::StatusOr<Entry> e = Take(Kind::kDeposit, ticket, caller);
  if (!e.ok()) return e.status();
  Release(e->owner, e->fds.size());
  return std::move(e->fds);
}

absl::StatusOr<std::string> FdTicketBroker::Offer(uid_t owner, std::vector<UniqueFd> fds,
                                                  absl::Duration ttl, FdTicketScope scope) {
  return Add(Kind::kOffer, owner, std::move(fds), ttl, std::move(scope), {});
}

absl::StatusOr<FdPickup> FdTicketBroker::PickupCharged(absl::string_view ticket, uid_t caller) {
  absl::StatusOr<Entry> e = Take(Kind::kOffer, ticket, caller);
  if (!e.ok()) return e.status();
  FdPickup out;
  out.charge.broker_ = this;
  out.charge.uid_ = e->owner;
  out.charge.count_ = e->fds.size();
  out.fds = std::move(e->fds);
  return out;
}

absl::StatusOr<std::vector<UniqueFd>> FdTicketBroker::Pickup(absl::string_view ticket,
                                                             uid_t caller) {
  absl::StatusOr<FdPickup> p = PickupCharged(ticket, caller);
  if (!p.ok()) return p.status();
  return std::move(p->fds);  // p->charge is released as p goes
}

size_t FdTicketBroker::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

size_t FdTicketBroker::pending_for(uid_t uid) const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [ticket, e] : entries_) n += e.owner == uid ? 1 : 0;
  return n;
}

size_t FdTicketBroker::charged() const {
  std::lock_guard<std::mutex> lock(mu_);
  return charged_total_;
}

size_t FdTicketBroker::charged_for(uid_t uid) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = charged_.find(uid);
  return it == charged_.end() ? 0 : it->second;
}

}  // namespace arfuse
