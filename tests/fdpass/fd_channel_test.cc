// FdChannelServer: deposits and pickups over real sockets, refusals, and a server that no client
// can stall.
#include <sys/stat.h>
#include <sys/un.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/fd/fd_channel_client.h"
#include "common/fd/fd_wire.h"
#include "common/fd/scm_rights.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/fdpass/fd_channel_server.h"
#include "tests/fdpass/fd_test_util.h"

namespace arfuse {
namespace {

using ::arfuse::testing::OpenFdCount;
using ::arfuse::testing::Pipe;
using ::arfuse::testing::SocketPair;
using ::testing::HasSubstr;

class FdChannelTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(FdChannelServerOptions{}); }

  void Start(FdChannelServerOptions options) {
    server_.reset();
    auto s = FdChannelServer::Start(&broker_, options);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }

  // A client connection served as uid `uid`; returns the client's end (blocking).
  UniqueFd Connect(uid_t uid) {
    SocketPair sp;
    SocketCredentials creds = OwnCredentials();
    creds.uid = uid;
    server_->Adopt(std::move(sp.b), creds);
    int flags = ::fcntl(sp.a.get(), F_GETFL);
    ::fcntl(sp.a.get(), F_SETFL, flags & ~O_NONBLOCK);
    return std::move(sp.a);
  }

  absl::StatusOr<FdMessage> Ask(int fd, FdOp op, const std::string& body,
                                const std::vector<int>& fds = {}) {
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    absl::Status sent = SendFdMessage(fd, op, body, fds, deadline);
    if (!sent.ok()) return sent;
    return RecvFdMessage(fd, deadline);
  }

  FdTicketBroker broker_;
  std::unique_ptr<FdChannelServer> server_;
};

TEST_F(FdChannelTest, DepositAnswersATicketThatItsOwnerClaims) {
  UniqueFd c = Connect(4242);
  Pipe p;
  absl::StatusOr<FdMessage> reply = Ask(c.get(), FdOp::kDeposit, "", {p.write_end.get()});
  ASSERT_TRUE(reply.ok()) << reply.status();
  ASSERT_EQ(reply->op, FdOp::kDepositOk);
  ASSERT_TRUE(IsWellFormedFdTicket(reply->body)) << reply->body;
  p.write_end.reset();
  EXPECT_EQ(broker_.Claim(reply->body, 4243).status().code(), absl::StatusCode::kPermissionDenied);
  absl::StatusOr<std::vector<UniqueFd>> fds = broker_.Claim(reply->body, 4242);
  ASSERT_TRUE(fds.ok()) << fds.status();
  ASSERT_EQ(fds->size(), 1u);
  EXPECT_EQ(::write((*fds)[0].get(), "z", 1), 1);
  char ch = 0;
  EXPECT_EQ(::read(p.read_end.get(), &ch, 1), 1);
}

TEST_F(FdChannelTest, PickupHandsAnOfferToItsOwnerOnly) {
  Pipe p;
  std::vector<UniqueFd> fds;
  fds.push_back(std::move(p.write_end));
  std::string ticket = *broker_.Offer(77, std::move(fds), absl::Seconds(30));
  UniqueFd thief = Connect(78);
  absl::StatusOr<FdMessage> denied = Ask(thief.get(), FdOp::kPickup, ticket);
  ASSERT_TRUE(denied.ok()) << denied.status();
  ASSERT_EQ(denied->op, FdOp::kError);
  EXPECT_EQ(DecodeFdError(denied->body).code(), absl::StatusCode::kPermissionDenied);
  UniqueFd owner = Connect(77);
  absl::StatusOr<FdMessage> got = Ask(owner.get(), FdOp::kPickup, ticket);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->op, FdOp::kPickupOk);
  ASSERT_EQ(got->fds.size(), 1u);
  EXPECT_EQ(::write(got->fds[0].get(), "q", 1), 1);
  // Single use, and the same connection keeps serving requests.
  absl::StatusOr<FdMessage> again = Ask(owner.get(), FdOp::kPickup, ticket);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(DecodeFdError(again->body).code(), absl::StatusCode::kPermissionDenied);
}

// Polls `done` for up to 5 s.
template <typename F>
bool Eventually(F done) {
  for (absl::Time until = absl::Now() + absl::Seconds(5); absl::Now() < until;) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return done();
}

// A DEPOSIT's descriptors count against their uid's budget from the moment they arrive: a client
// that sends a header's first byte with 16 descriptors and stalls holds its budget, not the
// daemon's descriptor table. Other uids keep theirs until all uids together reach the total.
TEST(FdChannelBudget, DescriptorsOfAHalfSentDepositAreChargedAtOnce) {
  FdTicketBrokerOptions o;
  o.max_fds_per_uid = 16;
  o.max_fds = 20;
  FdTicketBroker broker(o);
  auto server = FdChannelServer::Start(&broker, FdChannelServerOptions{});
  ASSERT_TRUE(server.ok()) << server.status();
  auto connect = [&](uid_t uid) {
    SocketPair sp;
    SocketCredentials creds = OwnCredentials();
    creds.uid = uid;
    (*server)->Adopt(std::move(sp.b), creds);
    int flags = ::fcntl(sp.a.get(), F_GETFL);
    ::fcntl(sp.a.get(), F_SETFL, flags & ~O_NONBLOCK);
    return std::move(sp.a);
  };
  UniqueFd stalled = connect(10);
  const std::string header = EncodeFdMessage(FdOp::kDeposit, "", 16);
  std::vector<Pipe> pipes(16);
  std::vector<int> raw;
  for (Pipe& p : pipes) raw.push_back(p.write_end.get());
  size_t offset = 0;
  ASSERT_TRUE(SendWithFds(stalled.get(), header.substr(0, 1), &offset, raw, "test").ok());
  ASSERT_TRUE(Eventually([&] { return broker.charged_for(10) == 16; })) << broker.charged_for(10);
  for (Pipe& p : pipes) p.write_end.reset();
  // The same uid's next DEPOSIT is over its budget.
  Pipe one;
  UniqueFd again = connect(10);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  ASSERT_TRUE(SendFdMessage(again.get(), FdOp::kDeposit, "", {one.write_end.get()}, deadline).ok());
  absl::StatusOr<FdMessage> refused = RecvFdMessage(again.get(), deadline);
  ASSERT_TRUE(refused.ok()) << refused.status();
  ASSERT_EQ(refused->op, FdOp::kError);
  absl::Status why = DecodeFdError(refused->body);
  EXPECT_EQ(why.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(why.message(), HasSubstr("--max-pending-fds-per-uid"));
  // Another uid deposits within what is left of the total, and then the total is reached.
  UniqueFd other = connect(11);
  std::vector<Pipe> four(4);
  std::vector<int> four_raw;
  for (Pipe& p : four) four_raw.push_back(p.write_end.get());
  ASSERT_TRUE(SendFdMessage(other.get(), FdOp::kDeposit, "", four_raw, deadline).ok());
  absl::StatusOr<FdMessage> ok = RecvFdMessage(other.get(), deadline);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->op, FdOp::kDepositOk);
  UniqueFd third = connect(12);
  ASSERT_TRUE(SendFdMessage(third.get(), FdOp::kDeposit, "", {one.write_end.get()}, deadline).ok());
  absl::StatusOr<FdMessage> full = RecvFdMessage(third.get(), deadline);
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_EQ(full->op, FdOp::kError);
  EXPECT_THAT(DecodeFdError(full->body).message(), HasSubstr("--max-pending-fds)"));
  // The stalled client goes: its descriptors close and its share comes back.
  stalled.reset();
  EXPECT_TRUE(Eventually([&] { return broker.charged_for(10) == 0; }));
  EXPECT_TRUE(Eventually([&] { return pipes[0].WriteEndClosedEverywhere(); }));
  server->reset();
}

// A PICKUP's descriptors stay charged while they sit unread in the client's socket (they are
// still open files of the daemon's user there), and the connection is not closed for idleness
// meanwhile; once the client reads the reply, the charge ends and the idle timeout applies.
TEST(FdChannelBudget, AnUnreadPickupStaysChargedUntilTheClientReadsIt) {
  FdTicketBroker broker;
  FdChannelServerOptions so;
  so.idle_timeout = absl::Milliseconds(200);
  auto server = FdChannelServer::Start(&broker, so);
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<Pipe> pipes(2);
  std::vector<UniqueFd> fds;
  for (Pipe& p : pipes) fds.push_back(std::move(p.write_end));
  const std::string ticket = *broker.Offer(9, std::move(fds), absl::Seconds(30));
  SocketPair sp;
  SocketCredentials creds = OwnCredentials();
  creds.uid = 9;
  (*server)->Adopt(std::move(sp.b), creds);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  ASSERT_TRUE(SendFdMessage(sp.a.get(), FdOp::kPickup, ticket, {}, deadline).ok());
  ASSERT_TRUE(Eventually([&] { return (*server)->unread_fds() == 2; }));
  EXPECT_EQ(broker.pending(), 0u);
  EXPECT_EQ(broker.charged_for(9), 2u);
  absl::SleepFor(absl::Milliseconds(500));  // past the idle timeout
  EXPECT_EQ((*server)->connections(), 1u);
  EXPECT_EQ(broker.charged_for(9), 2u);
  int flags = ::fcntl(sp.a.get(), F_GETFL);
  ::fcntl(sp.a.get(), F_SETFL, flags & ~O_NONBLOCK);
  absl::StatusOr<FdMessage> got = RecvFdMessage(sp.a.get(), deadline);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->op, FdOp::kPickupOk);
  EXPECT_EQ(got->fds.size(), 2u);
  EXPECT_TRUE(Eventually([&] { return broker.charged_for(9) == 0; }));
  EXPECT_TRUE(Eventually([&] { return (*server)->connections() == 0; }));
  server->reset();
}

TEST_F(FdChannelTest, MalformedRequestsAreAnsweredAndTheConnectionCloses) {
  struct Case {
    FdOp op;
    std::string body;
    int nfds;
    absl::StatusCode code;
    const char* text;
    bool closes;
  };
  const std::vector<Case> cases = {
      {FdOp::kDeposit, "", 0, absl::StatusCode::kInvalidArgument, "DEPOSIT carries no descriptor",
       false},
      {FdOp::kDeposit, "body", 1, absl::StatusCode::kInvalidArgument, "DEPOSIT has no body", false},
      {FdOp::kPickup, NewFdTicket(), 1, absl::StatusCode::kInvalidArgument,
       "PICKUP carries no descriptors", false},
      {FdOp::kDepositOk, "", 0, absl::StatusCode::kInvalidArgument, "is an answer, not a request",
       true},
  };
  for (const Case& k : cases) {
    UniqueFd c = Connect(1);
    Pipe p;
    std::vector<int> fds(k.nfds, p.write_end.get());
    absl::StatusOr<FdMessage> reply = Ask(c.get(), k.op, k.body, fds);
    ASSERT_TRUE(reply.ok()) << reply.status();
    ASSERT_EQ(reply->op, FdOp::kError) << k.text;
    absl::Status s = DecodeFdError(reply->body);
    EXPECT_EQ(s.code(), k.code) << k.text;
    EXPECT_THAT(s.message(), HasSubstr(k.text));
    auto next = RecvFdMessage(c.get(), absl::Now() + absl::Milliseconds(k.closes ? 5000 : 50));
    EXPECT_EQ(next.status().code(),
              k.closes ? absl::StatusCode::kUnavailable : absl::StatusCode::kDeadlineExceeded)
        << k.text;
  }
  EXPECT_EQ(broker_.pending(), 0u);
}

TEST_F(FdChannelTest, GarbageGetsAnErrorAndTheConnectionCloses) {
  UniqueFd c = Connect(1);
  const std::string junk = "GET / HTTP/1.1\r\n\r\n";
  ASSERT_EQ(::write(c.get(), junk.data(), junk.size()), static_cast<ssize_t>(junk.size()));
  absl::StatusOr<FdMessage> reply = RecvFdMessage(c.get(), absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_THAT(DecodeFdError(reply->body).message(), HasSubstr("bad magic"));
  EXPECT_EQ(RecvFdMessage(c.get(), absl::Now() + absl::Seconds(5)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_GE(server_->protocol_errors(), 1u);
}

// Descriptors that arrive with the body bytes but are not announced are refused, not kept.
TEST_F(FdChannelTest, UnannouncedDescriptorsAreRefused) {
  UniqueFd c = Connect(1);
  Pipe p;
  std::string m = EncodeFdMessage(FdOp::kPickup, NewFdTicket());
  ASSERT_EQ(::write(c.get(), m.data(), 16), 16);
  size_t offset = 0;
  ASSERT_TRUE(
      SendWithFds(c.get(), absl::string_view(m).substr(16), &offset, {p.write_end.get()}, "test")
          .ok());
  p.write_end.reset();
  absl::StatusOr<FdMessage> reply = RecvFdMessage(c.get(), absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_THAT(DecodeFdError(reply->body).message(),
              HasSubstr("more descriptors than it announced"));
  bool closed = p.WriteEndClosedEverywhere();
  for (int i = 0; i < 500 && !closed; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    closed = p.WriteEndClosedEverywhere();
  }
  EXPECT_TRUE(closed);
}

TEST_F(FdChannelTest, AnIdleOrStalledClientIsClosedAndNeverHoldsUpAnother) {
  FdChannelServerOptions o;
  o.idle_timeout = absl::Milliseconds(200);
  Start(o);
  UniqueFd stalled = Connect(1);
  std::string partial = EncodeFdMessage(FdOp::kPickup, NewFdTicket()).substr(0, 5);
  ASSERT_EQ(::write(stalled.get(), partial.data(), partial.size()), 5);
  // Another client is served at once meanwhile.
  UniqueFd other = Connect(2);
  Pipe p;
  absl::StatusOr<FdMessage> reply = Ask(other.get(), FdOp::kDeposit, "", {p.write_end.get()});
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->op, FdOp::kDepositOk);
  // The stalled one is closed after the idle timeout.
  auto closed = RecvFdMessage(stalled.get(), absl::Now() + absl::Seconds(5));
  EXPECT_EQ(closed.status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(FdChannelTest, ConnectionsOverTheCapAreClosedAtOnce) {
  FdChannelServerOptions o;
  o.max_connections = 1;
  Start(o);
  UniqueFd first = Connect(1);
  for (int i = 0; i < 200 && server_->connections() < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  UniqueFd second = Connect(1);
  EXPECT_EQ(RecvFdMessage(second.get(), absl::Now() + absl::Seconds(5)).status().code(),
            absl::StatusCode::kUnavailable);
  Pipe p;
  EXPECT_TRUE(Ask(first.get(), FdOp::kDeposit, "", {p.write_end.get()}).ok());
}

TEST_F(FdChannelTest, StoppingTheServerClosesItsConnectionsAndLeaksNothing) {
  const int before = OpenFdCount();
  {
    UniqueFd c = Connect(1);
    Pipe p;
    ASSERT_TRUE(Ask(c.get(), FdOp::kDeposit, "", {p.write_end.get()}).ok());
    server_.reset();
    EXPECT_EQ(RecvFdMessage(c.get(), absl::Now() + absl::Seconds(5)).status().code(),
              absl::StatusCode::kUnavailable);
  }
  EXPECT_EQ(broker_.ExpireNow(absl::InfiniteFuture()), 1u);
  EXPECT_EQ(OpenFdCount(), before - 1);  // the server's own wake descriptor went too
}

// The client helpers against a listening socket whose accept loop adopts each connection with
// its kernel-reported credentials, as arfused's listener does.
TEST_F(FdChannelTest, ClientHelpersDepositAndPickUpOverAPath) {
  const std::string dir = absl::StrCat("/tmp/arfuse-fdchan-", ::getpid());
  std::filesystem::create_directories(dir);
  const std::string path = FdChannelPath(dir + "/a.sock");
  EXPECT_EQ(path, dir + "/a.sock.fd");
  UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ::unlink(path.c_str());
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener.get(), 8), 0);
  std::thread acceptor([&] {
    for (int i = 0; i < 2; ++i) {
      UniqueFd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!conn) return;
      absl::StatusOr<SocketCredentials> creds = PeerSocketCredentials(conn.get());
      ASSERT_TRUE(creds.ok());
      server_->Adopt(std::move(conn), *creds);
    }
  });
  Pipe p;
  absl::StatusOr<std::string> ticket = DepositFds(path, {p.write_end.get()});
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  absl::StatusOr<std::vector<UniqueFd>> mine = broker_.Claim(*ticket, ::geteuid());
  ASSERT_TRUE(mine.ok()) << mine.status();
  std::string offer = *broker_.Offer(::geteuid(), *std::move(mine), absl::Seconds(30));
  absl::StatusOr<std::vector<UniqueFd>> back = PickupFds(path, offer);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->size(), 1u);
  EXPECT_EQ(::write((*back)[0].get(), "r", 1), 1);
  acceptor.join();
  auto nobody = DepositFds(dir + "/missing.fd", {p.write_end.get()}, absl::Milliseconds(50));
  EXPECT_EQ(nobody.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(nobody.status().message(), HasSubstr("cannot connect to the fd channel at"));
  std::filesystem::remove_all(dir);
}

TEST(SocketCredentials, ThePeerOfASocketPairIsThisProcess) {
  SocketPair sp;
  absl::StatusOr<SocketCredentials> c = PeerSocketCredentials(sp.a.get());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->pid, ::getpid());
  EXPECT_EQ(c->uid, ::geteuid());
  EXPECT_EQ(c->gid, ::getegid());
  EXPECT_TRUE(c->InGroup(::getegid()));
  EXPECT_EQ(PeerSocketCredentials(-1).status().code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace arfuse
