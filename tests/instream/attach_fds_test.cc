// OfferAttachFds: an attach's descriptors go to the caller's uid only, as duplicates, over the fd
// channel's ticket broker; exports without descriptors offer nothing.
#include "server/instream/attach_fds.h"

#include <sys/mman.h>
#include <sys/stat.h>
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

// The op counter page follows the export's descriptors (the blob's counters_fd_index), also when
// the export has none (CUDA IPC, FABRIC): the offer then holds the page alone.
TEST(OfferAttachFds, TheCounterPageIsOfferedAfterTheExportsDescriptors) {
  FdTicketBroker broker;
  InStreamExport e = ExportWithFd();
  UniqueFd page(::memfd_create("attach-fds-test-page", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(page.get(), 4096), 0);
  absl::StatusOr<AttachFdOffer> offer =
      OfferAttachFds(e, &broker, "/tmp/x.fd", Me(), absl::Seconds(30), {}, page.get());
  ASSERT_TRUE(offer.ok()) << offer.status();
  EXPECT_EQ(offer->count, 2u);
  absl::StatusOr<std::vector<UniqueFd>> fds = broker.Pickup(offer->ticket, ::getuid());
  ASSERT_TRUE(fds.ok()) << fds.status();
  ASSERT_EQ(fds->size(), 2u);
  struct stat st;
  ASSERT_EQ(::fstat((*fds)[1].get(), &st), 0);
  EXPECT_EQ(st.st_size, 4096);  // the page, not the workspace (an empty memfd)

  InStreamExport none;
  none.ranks.resize(2);
  absl::StatusOr<AttachFdOffer> alone =
      OfferAttachFds(none, &broker, "/tmp/x.fd", Me(), absl::Seconds(30), {}, page.get());
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(alone->count, 1u);
}

}  // namespace
}  // namespace arfuse
