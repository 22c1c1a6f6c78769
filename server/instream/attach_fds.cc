#include "server/instream/attach_fds.h"

#include <fcntl.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/fd/unique_fd.h"
#include "server/instream/attach_blob.h"

namespace arfuse {

absl::StatusOr<AttachFdOffer> OfferAttachFds(const InStreamExport& exported,
                                             FdTicketBroker* tickets, const std::string& fd_socket,
                                             const std::optional<SocketCredentials>& caller,
                                             absl::Duration ttl, FdTicketScope scope,
                                             int counters_fd) {
  AttachFdOffer offer;
  std::vector<int> fd_refs = AttachBlobFds(exported);
  if (counters_fd >= 0) fd_refs.push_back(counters_fd);
  if (fd_refs.empty()) return offer;
  if (tickets == nullptr || fd_socket.empty()) {
    return absl::FailedPreconditionError(
        "this workspace's memory reaches clients as file descriptors, and this sidecar serves no "
        "fd channel");
  }
  if (!caller.has_value()) {
    // The descriptors go to the caller's uid only: a call whose credentials are not known (not
    // accepted on the Unix socket) gets none.
    return absl::PermissionDeniedError(
        "the caller's credentials are not known (not a Unix-socket client of this sidecar): the "
        "workspace's descriptors are handed only to a known uid");
  }
  // The export keeps its descriptors; the fd channel hands out duplicates.
  std::vector<UniqueFd> fds;
  for (int fd : fd_refs) {
    fds.emplace_back(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
    if (!fds.back()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot duplicate a workspace descriptor: ", std::strerror(errno)));
    }
  }
  absl::StatusOr<std::string> ticket =
      tickets->Offer(caller->uid, std::move(fds), ttl, std::move(scope));
  if (!ticket.ok()) return ticket.status();
  offer.ticket = *std::move(ticket);
  offer.count = static_cast<uint32_t>(fd_refs.size());
  offer.socket = fd_socket;
  return offer;
}

}  // namespace arfuse
