// ConnectionTable: the credentials of "fd:N" while the connection is open, and none once its
// number holds something else.
#include "server/fdpass/connection_table.h"

#include "gtest/gtest.h"
#include "tests/fdpass/fd_test_util.h"

namespace arfuse {
namespace {

using ::arfuse::testing::SocketPair;

SocketCredentials Creds(uid_t uid) {
  SocketCredentials c;
  c.pid = 1;
  c.uid = uid;
  c.gid = uid;
  return c;
}

std::string PeerOf(int fd) { return "fd:" + std::to_string(fd); }

TEST(ConnectionTable, NamesTheConnectionGrpcReportsByDescriptor) {
  EXPECT_EQ(ConnectionTable::FdOfPeer("fd:17"), 17);
  EXPECT_EQ(ConnectionTable::FdOfPeer("fd:-1"), std::nullopt);
  EXPECT_EQ(ConnectionTable::FdOfPeer("fd:"), std::nullopt);
  EXPECT_EQ(ConnectionTable::FdOfPeer("unix:/run/a.sock"), std::nullopt);
  EXPECT_EQ(ConnectionTable::FdOfPeer("ipv4:127.0.0.1:5"), std::nullopt);
}

TEST(ConnectionTable, KnowsAnOpenConnectionAndForgetsAClosedOne) {
  ConnectionTable table;
  SocketPair sp;
  table.Record(sp.b.get(), ConnectionTable::Channel::kMain, Creds(1000));
  std::optional<SocketCredentials> got = table.ForPeer(PeerOf(sp.b.get()));
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->uid, 1000u);
  EXPECT_EQ(table.Live(), 1u);
  EXPECT_EQ(table.LiveFor(1000, ConnectionTable::Channel::kMain), 1u);
  EXPECT_EQ(table.LiveFor(1001, ConnectionTable::Channel::kMain), 0u);
  const int number = sp.b.get();
  sp.b.reset();
  EXPECT_FALSE(table.ForPeer(PeerOf(number)).has_value());
  EXPECT_EQ(table.Live(), 0u);
}

// The number of a closed connection is taken by the next open: a pipe is no connection, and a
// connection accepted later at the same number is that connection's, never the old one's.
TEST(ConnectionTable, AReusedDescriptorNumberNeverCarriesTheOldCredentials) {
  ConnectionTable table;
  SocketPair first;
  const int number = first.b.get();
  table.Record(number, ConnectionTable::Channel::kMain, Creds(1000));
  first.b.reset();
  int p[2];
  ASSERT_EQ(::pipe(p), 0);  // takes the lowest free number
  ASSERT_EQ(p[0], number);
  EXPECT_FALSE(table.ForPeer(PeerOf(number)).has_value());
  ::close(p[0]);
  ::close(p[1]);
  SocketPair second;
  ASSERT_EQ(second.a.get(), number);
  EXPECT_FALSE(table.ForPeer(PeerOf(number)).has_value());  // not recorded yet
  table.Record(number, ConnectionTable::Channel::kMain, Creds(2000));
  ASSERT_TRUE(table.ForPeer(PeerOf(number)).has_value());
  EXPECT_EQ(table.ForPeer(PeerOf(number))->uid, 2000u);
}

TEST(ConnectionTable, FdChannelConnectionsCountButAreNoGrpcCaller) {
  ConnectionTable table;
  SocketPair sp;
  table.Record(sp.b.get(), ConnectionTable::Channel::kFd, Creds(5));
  EXPECT_EQ(table.LiveFor(5, ConnectionTable::Channel::kFd), 1u);
  EXPECT_EQ(table.Live(), 1u);
  EXPECT_FALSE(table.ForPeer(PeerOf(sp.b.get())).has_value());
}

// Each channel's per-uid count is its own: fd-channel connections never count against the main
// socket's cap (nor the other way round); the total counts both.
TEST(ConnectionTable, PerUidCountsAreKeptPerChannel) {
  ConnectionTable table;
  SocketPair a, b, c;
  table.Record(a.b.get(), ConnectionTable::Channel::kFd, Creds(5));
  table.Record(b.b.get(), ConnectionTable::Channel::kFd, Creds(5));
  table.Record(c.b.get(), ConnectionTable::Channel::kMain, Creds(5));
  EXPECT_EQ(table.LiveFor(5, ConnectionTable::Channel::kFd), 2u);
  EXPECT_EQ(table.LiveFor(5, ConnectionTable::Channel::kMain), 1u);
  EXPECT_EQ(table.Live(), 3u);
}

TEST(ConnectionTable, OwnProcessCredentialsAnswerForAnyPeer) {
  OwnProcessCredentials own;
  std::optional<SocketCredentials> c = own.ForPeer("unix:/x");
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->uid, ::geteuid());
  EXPECT_EQ(c->pid, ::getpid());
}

}  // namespace
}  // namespace arfuse
