#include "server/fdpass/ticket_broker.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"

namespace arfuse {

std::string NewFdTicket() {
  uint8_t raw[kFdTicketChars / 2];
  size_t got = 0;
  while (got < sizeof(raw)) {
    ssize_t n = ::getrandom(raw + got, sizeof(raw) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      // getrandom only fails this way before the kernel's pool is initialized, which a running
      // daemon is long past; never fall back to a guessable ticket.
      std::abort();
    }
    got += static_cast<size_t>(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(kFdTicketChars, '0');
  for (size_t i = 0; i < sizeof(raw); ++i) {
    out[2 * i] = kHex[raw[i] >> 4];
    out[2 * i + 1] = kHex[raw[i] & 0xf];
  }
  return out;
}

bool IsWellFormedFdTicket(absl::string_view ticket) {
  if (ticket.size() != kFdTicketChars) return false;
  for (char c : ticket) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

FdTicketBroker::FdTicketBroker(FdTicketBrokerOptions options) : options_(options) {}

FdTicketBroker::~FdTicketBroker() = default;

void FdTicketBroker::ExpireLocked(absl::Time now, std::vector<Entry>& dropped) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.expires > now) {
      ++it;
      continue;
    }
    if (--per_uid_[it->second.owner] == 0) per_uid_.erase(it->second.owner);
    dropped.push_back(std::move(it->second));
    entries_.erase(it++);
  }
}

size_t FdTicketBroker::ExpireNow(absl::Time now) {
  std::vector<Entry> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ExpireLocked(now, dropped);
  }
  return dropped.size();  // their descriptors close here, outside the lock
}

absl::StatusOr<std::string> FdTicketBroker::Add(Kind kind, uid_t owner, std::vector<UniqueFd> fds,
                                                absl::Duration ttl) {
  if (fds.empty()) return absl::InvalidArgumentError("an fd ticket needs at least one descriptor");
  if (fds.size() > options_.max_fds_per_ticket) {
    return absl::InvalidArgumentError(absl::StrCat("an fd ticket holds at most ",
                                                   options_.max_fds_per_ticket,
                                                   " descriptors, got ", fds.size()));
  }
  const absl::Time now = absl::Now();
  std::vector<Entry> dropped;
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked(now, dropped);
  auto per = per_uid_.find(owner);
  if (per != per_uid_.end() && per->second >= options_.max_pending_per_uid) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "uid ", owner, " already has ", per->second, " pending fd tickets (the limit is ",
        options_.max_pending_per_uid, "): claim or let them expire first"));
  }
  if (entries_.size() >= options_.max_pending) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the sidecar holds ", entries_.size(), " pending fd tickets, its limit; retry shortly"));
  }
  std::string ticket;
  do {
    ticket = NewFdTicket();
  } while (entries_.contains(ticket));
  Entry e{kind, owner, now + std::min(std::max(ttl, absl::ZeroDuration()), options_.max_ttl),
          std::move(fds)};
  entries_.emplace(ticket, std::move(e));
  ++per_uid_[owner];
  return ticket;
}

absl::StatusOr<std::vector<UniqueFd>> FdTicketBroker::Take(Kind kind, absl::string_view ticket,
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
  std::vector<UniqueFd> fds = std::move(it->second.fds);
  if (--per_uid_[it->second.owner] == 0) per_uid_.erase(it->second.owner);
  entries_.erase(it);
  return fds;
}

absl::StatusOr<std::string> FdTicketBroker::Deposit(uid_t owner, std::vector<UniqueFd> fds,
                                                    absl::Duration ttl) {
  return Add(Kind::kDeposit, owner, std::move(fds), ttl);
}

absl::StatusOr<std::vector<UniqueFd>> FdTicketBroker::Claim(absl::string_view ticket,
                                                            uid_t caller) {
  return Take(Kind::kDeposit, ticket, caller);
}

absl::StatusOr<std::string> FdTicketBroker::Offer(uid_t owner, std::vector<UniqueFd> fds,
                                                  absl::Duration ttl) {
  return Add(Kind::kOffer, owner, std::move(fds), ttl);
}

absl::StatusOr<std::vector<UniqueFd>> FdTicketBroker::Pickup(absl::string_view ticket,
                                                             uid_t caller) {
  return Take(Kind::kOffer, ticket, caller);
}

size_t FdTicketBroker::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

size_t FdTicketBroker::pending_for(uid_t uid) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = per_uid_.find(uid);
  return it == per_uid_.end() ? 0 : it->second;
}

}  // namespace arfuse
