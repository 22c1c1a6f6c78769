// FdTicketBroker: unguessable single-use tickets bound to a uid, expiry, caps.
#include "server/fdpass/ticket_broker.h"

#include <set>
#include <thread>

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
  for (const std::string t : {std::string(), std::string("nope"), NewFdTicket()}) {
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

TEST(FdTicketBroker, PendingTicketsAreCappedPerUidAndInAll) {
  FdTicketBrokerOptions o;
  o.max_pending_per_uid = 2;
  o.max_pending = 3;
  FdTicketBroker broker(o);
  std::vector<Pipe> pipes(6);
  ASSERT_TRUE(broker.Deposit(1, One(pipes[0]), absl::Seconds(30)).ok());
  ASSERT_TRUE(broker.Offer(1, One(pipes[1]), absl::Seconds(30)).ok());
  absl::StatusOr<std::string> third = broker.Deposit(1, One(pipes[2]), absl::Seconds(30));
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("uid 1 already has 2 pending fd tickets"));
  EXPECT_TRUE(pipes[2].WriteEndClosedEverywhere());  // refused descriptors are closed
  ASSERT_TRUE(broker.Deposit(2, One(pipes[3]), absl::Seconds(30)).ok());
  absl::StatusOr<std::string> over = broker.Deposit(3, One(pipes[4]), absl::Seconds(30));
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr("holds 3 pending fd tickets, its limit"));
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
