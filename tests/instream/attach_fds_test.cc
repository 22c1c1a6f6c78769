// OfferAttachFds: an attach's descriptors go to the caller's uid only, as duplicates, over the fd
// channel's ticket broker; exports without descriptors offer nothing.
#include "server/instream/attach_fds.h"

#include <sys/mman.h>
#include <unistd.h>

#include <optional>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace arfuse {
namespace {

// An export whose rank 0 memory is a descriptor of a memfd.
InStreamExport ExportWithFd() {
  InStreamExport e;
  InStreamRankMemory m;
  m.kind = instream::MemoryKind::kHostShm;
  m.fd = UniqueFd(::memfd_create("attach-fds-test", MFD_CLOEXEC));
  e.ranks.push_back(std::move(m));
  e.ranks.emplace_back();
  return e;
}

std::optional<SocketCredentials> Me() {
  SocketCredentials c;
  c.pid = ::getpid();
  c.uid = ::getuid();
  c.gid = ::getgid();
  return c;
}

TEST(OfferAttachFds, AnExportWithoutDescriptorsOffersNothing) {
  InStreamExport e;
  e.ranks.resize(2);
  absl::StatusOr<AttachFdOffer> offer =
      OfferAttachFds(e, nullptr, "", std::nullopt, absl::Seconds(30));
  ASSERT_TRUE(offer.ok()) << offer.status();
  EXPECT_EQ(offer->count, 0u);
  EXPECT_TRUE(offer->ticket.empty());
}

TEST(OfferAttachFds, DescriptorsWithoutAnFdChannelAreRefused) {
  FdTicketBroker broker;
  EXPECT_TRUE(absl::IsFailedPrecondition(
      OfferAttachFds(ExportWithFd(), nullptr, "/tmp/x.fd", Me(), absl::Seconds(30)).status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(
      OfferAttachFds(ExportWithFd(), &broker, "", Me(), absl::Seconds(30)).status()));
}

TEST(OfferAttachFds, AnUnknownCallerGetsNoDescriptors) {
  FdTicketBroker broker;
  EXPECT_TRUE(absl::IsPermissionDenied(
      OfferAttachFds(ExportWithFd(), &broker, "/tmp/x.fd", std::nullopt, absl::Seconds(30))
          .status()));
  EXPECT_EQ(broker.pending(), 0u);
}

TEST(OfferAttachFds, TheCallerPicksUpDuplicatesAndTheExportKeepsItsOwn) {
  FdTicketBroker broker;
  InStreamExport e = ExportWithFd();
  ASSERT_TRUE(e.ranks[0].fd.valid());
  absl::StatusOr<AttachFdOffer> offer =
      OfferAttachFds(e, &broker, "/tmp/x.fd", Me(), absl::Seconds(30));
  ASSERT_TRUE(offer.ok()) << offer.status();
  EXPECT_EQ(offer->count, 1u);
  EXPECT_EQ(offer->socket, "/tmp/x.fd");
  absl::StatusOr<std::vector<UniqueFd>> fds = broker.Pickup(offer->ticket, ::getuid());
  ASSERT_TRUE(fds.ok()) << fds.status();
  ASSERT_EQ(fds->size(), 1u);
  EXPECT_NE((*fds)[0].get(), e.ranks[0].fd.get());
  EXPECT_TRUE(e.ranks[0].fd.valid());
}

}  // namespace
}  // namespace arfuse
