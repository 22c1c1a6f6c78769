// FdTicketBroker: unguessable single-use tickets bound to a uid, expiry, caps.
#include "server/fdpass/ticket_broker.h"

#include <set>
#include <thread>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/fdpass/fd_test_util.h"

namespace arfuse {
namespace {

using ::arfuse::testing::Pipe;
using ::testing::HasSubstr;
using ::testing::Not;

std::vector<UniqueFd> One(Pipe& p) {
  std::vector<UniqueFd> v;
  v.push_back(std::move(p.write_end));
  return v;
}

TEST(FdTicketBroker, TicketsAre32HexCharactersAndDistinct) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    std::string t = NewFdTicket();
    ASSERT_TRUE(IsWellFormedFdTicket(t)) << t;
    EXPECT_EQ(t.size(), 32u);
    EXPECT_TRUE(seen.insert(t).second);
  }
  EXPECT_FALSE(IsWellFormedFdTicket("0123456789ABCDEF0123456789abcdef"));  // upper case
  EXPECT_FALSE(IsWellFormedFdTicket("0123"));
}

TEST(FdTicketBroker, DepositIsClaimedOnceByItsOwner) {
  FdTicketBroker broker;
  Pipe p;
  absl::StatusOr<std::string> ticket = broker.Deposit(1000, One(p), absl::Seconds(30));
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_EQ(broker.pending_for(1000), 1u);
  absl::StatusOr<std::vector<UniqueFd>> fds = broker.Claim(*ticket, 1000);
  ASSERT_TRUE(fds.ok()) << fds.status();
  ASSERT_EQ(fds->size(), 1u);
  EXPECT_EQ(::write((*fds)[0].get(), "x", 1), 1);  // the pipe's write end, handed over
  EXPECT_EQ(broker.pending(), 0u);
  absl::StatusOr<std::vector<UniqueFd>> again = broker.Claim(*ticket, 1000);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(again.status().message(),
              HasSubstr("fd ticket unknown, expired or not the caller's"));
  EXPECT_THAT(again.status().message(), Not(HasSubstr(*ticket)));
}

// Another user's ticket is answered exactly as one that does not exist: the answer tells a caller
// nothing about tickets that are not its own.
TEST(FdTicketBroker, AnotherUserIsDeniedAsForAnUnknownTicketAndTheTicketStaysForItsOwner) {
  FdTicketBroker broker;
  Pipe p;
  std::string ticket = *broker.Deposit(1000, One(p), absl::Seconds(30));
  absl::StatusOr<std::vector<UniqueFd>> stolen = broker.Claim(ticket, 1001);
  absl::StatusOr<std::vector<UniqueFd>> unknown = broker.Claim(NewFdTicket(), 1001);
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(stolen.status(), unknown.status());
  EXPECT_THAT(stolen.status().message(), Not(HasSubstr(ticket)));
  EXPECT_THAT(stolen.status().message(), Not(HasSubstr("1000")));
  EXPECT_TRUE(broker.Claim(ticket, 1000).ok());
}

TEST(FdTicketBroker, UnknownAndMalformedTicketsAreDenied) {
  FdTicketBroker broker;
  for (const std::string& t : {std::string(), std::string("nope"), NewFdTicket()}) {
    EXPECT_EQ(broker.Claim(t, 0).status().code(), absl::StatusCode::kPermissionDenied) << t;
    EXPECT_EQ(broker.Pickup(t, 0).status().code(), absl::StatusCode::kPermissionDenied) << t;
  }
}

// A deposit is claimed by a gRPC call, an offer picked up over the fd channel: neither path takes
// the other's tickets.
TEST(FdTicketBroker, DepositsAndOffersDoNotMix) {
  FdTicketBroker broker;
  Pipe a, b;
  std::string deposit = *broker.Deposit(7, One(a), absl::Seconds(30));
  std::string offer = *broker.Offer(7, One(b), absl::Seconds(30));
  EXPECT_EQ(broker.Pickup(deposit, 7).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(broker.Claim(offer, 7).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(broker.Claim(deposit, 7).ok());
  EXPECT_TRUE(broker.Pickup(offer, 7).ok());
}

TEST(FdTicketBroker, ExpiredTicketsAreDeniedAndTheirDescriptorsClose) {
  FdTicketBroker broker;
  Pipe p;
  std::string ticket = *broker.Deposit(5, One(p), absl::Milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(p.WriteEndClosedEverywhere());  // held until something looks
  EXPECT_EQ(broker.ExpireNow(), 1u);
  EXPECT_TRUE(p.WriteEndClosedEverywhere());
  EXPECT_EQ(broker.Claim(ticket, 5).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(broker.pending_for(5), 0u);
}

TEST(FdTicketBroker, DestroyingTheBrokerClosesPendingDescriptors) {
  Pipe p;
  {
    FdTicketBroker broker;
    ASSERT_TRUE(broker.Deposit(5, One(p), absl::Seconds(30)).ok());
  }
  EXPECT_TRUE(p.WriteEndClosedEverywhere());
}

std::vector<UniqueFd> Several(std::vector<Pipe>& pipes, size_t from, size_t n) {
  std::vector<UniqueFd> v;
  for (size_t i = from; i < from + n; ++i) v.push_back(std::move(pipes[i].write_end));
  return v;
}

// Descriptors, not tickets, count: a ticket of three costs three of the budget.
TEST(FdTicketBroker, PendingDescriptorsAreBudgetedPerUidAndInAll) {
  FdTicketBrokerOptions o;
  o.max_fds_per_uid = 4;
  o.max_fds = 6;
  FdTicketBroker broker(o);
  std::vector<Pipe> pipes(12);
  absl::StatusOr<std::string> three = broker.Deposit(1, Several(pipes, 0, 3), absl::Seconds(30));
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_EQ(broker.charged_for(1), 3u);
  absl::StatusOr<std::string> two = broker.Deposit(1, Several(pipes, 3, 2), absl::Seconds(30));
  EXPECT_EQ(two.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(two.status().message(),
              HasSubstr("uid 1 holds 3 pending descriptors and 2 more exceed its budget of 4 "
                        "(--max-pending-fds-per-uid)"));
  EXPECT_TRUE(pipes[3].WriteEndClosedEverywhere());  // refused descriptors are closed
  EXPECT_TRUE(pipes[4].WriteEndClosedEverywhere());
  // An offer counts against the same budget.
  ASSERT_TRUE(broker.Offer(1, Several(pipes, 5, 1), absl::Seconds(30)).ok());
  absl::StatusOr<std::string> offer = broker.Offer(1, Several(pipes, 6, 1), absl::Seconds(30));
  EXPECT_EQ(offer.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(offer.status().message(), HasSubstr("--max-pending-fds-per-uid"));
  // Another uid has a budget of its own, until all uids together reach theirs.
  ASSERT_TRUE(broker.Deposit(2, Several(pipes, 7, 2), absl::Seconds(30)).ok());
  absl::StatusOr<std::string> over = broker.Deposit(3, Several(pipes, 9, 1), absl::Seconds(30));
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(),
              HasSubstr("holds 6 pending descriptors and 1 more exceed its budget of 6 for all "
                        "users (--max-pending-fds)"));
  EXPECT_EQ(broker.charged(), 6u);
  // A claim gives its descriptors' share back.
  ASSERT_TRUE(broker.Claim(*three, 1).ok());
  EXPECT_EQ(broker.charged_for(1), 1u);
  EXPECT_TRUE(broker.Deposit(3, Several(pipes, 10, 1), absl::Seconds(30)).ok());
  EXPECT_EQ(broker.charged(), 4u);
}

TEST(FdTicketBroker, ExpiryGivesTheBudgetBack) {
  FdTicketBrokerOptions o;
  o.max_fds_per_uid = 2;
  o.max_fds = 2;
  FdTicketBroker broker(o);
  std::vector<Pipe> pipes(4);
  ASSERT_TRUE(broker.Deposit(5, Several(pipes, 0, 2), absl::Milliseconds(1)).ok());
  absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(broker.ExpireNow(), 1u);
  EXPECT_EQ(broker.charged(), 0u);
  EXPECT_TRUE(broker.Deposit(5, Several(pipes, 2, 2), absl::Seconds(30)).ok());
}

// A charge outside any ticket (the fd channel's descriptors on their way in or out) counts too,
// and a deposit takes over what was charged for its descriptors instead of counting them twice.
TEST(FdTicketBroker, ChargesCountAndMoveIntoADeposit) {
  FdTicketBrokerOptions o;
  o.max_fds_per_uid = 4;
  o.max_fds = 8;
  FdTicketBroker broker(o);
  absl::StatusOr<FdCharge> arriving = broker.Charge(7, 3);
  ASSERT_TRUE(arriving.ok()) << arriving.status();
  EXPECT_EQ(broker.charged_for(7), 3u);
  absl::StatusOr<FdCharge> more = broker.Charge(7, 2);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(more.status().message(), HasSubstr("--max-pending-fds-per-uid"));
  std::vector<Pipe> pipes(3);
  absl::StatusOr<std::string> ticket =
      broker.Deposit(7, Several(pipes, 0, 3), absl::Seconds(30), *std::move(arriving));
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_EQ(broker.charged_for(7), 3u);
  ASSERT_TRUE(broker.Claim(*ticket, 7).ok());
  EXPECT_EQ(broker.charged_for(7), 0u);
  {
    absl::StatusOr<FdCharge> held = broker.Charge(7, 4);
    ASSERT_TRUE(held.ok());
    EXPECT_EQ(broker.charged(), 4u);
  }
  EXPECT_EQ(broker.charged(), 0u);  // released with the charge
}

// A pickup's descriptors stay charged until the fd channel knows the client has them.
TEST(FdTicketBroker, APickupStaysChargedUntilItsChargeEnds) {
  FdTicketBroker broker;
  std::vector<Pipe> pipes(2);
  std::string ticket = *broker.Offer(9, Several(pipes, 0, 2), absl::Seconds(30));
  absl::StatusOr<FdPickup> picked = broker.PickupCharged(ticket, 9);
  ASSERT_TRUE(picked.ok()) << picked.status();
  EXPECT_EQ(picked->fds.size(), 2u);
  EXPECT_EQ(broker.pending(), 0u);
  EXPECT_EQ(broker.charged_for(9), 2u);
  picked->charge.Reset();
  EXPECT_EQ(broker.charged_for(9), 0u);
}

// An attach's offer dies with its attachment's Detach and with its session's end: its
// descriptors close and its ticket is unknown from then on, even to its owner.
TEST(FdTicketBroker, OffersDieWithTheirAttachmentAndTheirSession) {
  FdTicketBroker broker;
  std::vector<Pipe> pipes(4);
  std::string a = *broker.Offer(1, Several(pipes, 0, 1), absl::Seconds(30), {"s1", "a1"});
  std::string b = *broker.Offer(1, Several(pipes, 1, 1), absl::Seconds(30), {"s1", "a2"});
  std::string c = *broker.Offer(1, Several(pipes, 2, 1), absl::Seconds(30), {"s2", "a3"});
  std::string d = *broker.Offer(1, Several(pipes, 3, 1), absl::Seconds(30));
  EXPECT_EQ(broker.RevokeAttachment("s1", "a1"), 1u);
  EXPECT_TRUE(pipes[0].WriteEndClosedEverywhere());
  EXPECT_FALSE(pipes[1].WriteEndClosedEverywhere());
  EXPECT_EQ(broker.Pickup(a, 1).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(broker.RevokeAttachment("s2", "a1"), 0u);  // another session's attachment id
  EXPECT_EQ(broker.RevokeSession("s1"), 1u);
  EXPECT_TRUE(pipes[1].WriteEndClosedEverywhere());
  EXPECT_EQ(broker.Pickup(b, 1).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(broker.RevokeSession(""), 0u);  // an offer without a scope belongs to no session
  EXPECT_EQ(broker.charged_for(1), 2u);
  EXPECT_TRUE(broker.Pickup(c, 1).ok());
  EXPECT_TRUE(broker.Pickup(d, 1).ok());
}

TEST(FdTicketBroker, EmptyAndOversizedDepositsAreRefused) {
  FdTicketBrokerOptions o;
  o.max_fds_per_ticket = 2;
  FdTicketBroker broker(o);
  absl::StatusOr<std::string> none = broker.Deposit(1, {}, absl::Seconds(1));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.status().message(), HasSubstr("at least one descriptor"));
  std::vector<Pipe> pipes(3);
  std::vector<UniqueFd> three;
  for (Pipe& p : pipes) three.push_back(std::move(p.write_end));
  absl::StatusOr<std::string> many = broker.Deposit(1, std::move(three), absl::Seconds(1));
  EXPECT_EQ(many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(many.status().message(), HasSubstr("at most 2 descriptors, got 3"));
}

TEST(FdTicketBroker, ConcurrentDepositsAndClaimsLoseNothing) {
  FdTicketBroker broker;
  std::vector<std::thread> threads;
  std::atomic<int> claimed{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        std::vector<UniqueFd> fds;
        fds.emplace_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
        absl::StatusOr<std::string> ticket = broker.Deposit(t, std::move(fds), absl::Seconds(30));
        ASSERT_TRUE(ticket.ok()) << ticket.status();
        if (broker.Claim(*ticket, t).ok()) claimed.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(claimed.load(), 800);
  EXPECT_EQ(broker.pending(), 0u);
}

}  // namespace
}  // namespace arfuse
