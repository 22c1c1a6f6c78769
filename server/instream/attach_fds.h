// An attach's descriptors on their way to the client (docs/instream.md): workspace memory that
// reaches clients as file descriptors (VMM POSIX handles, host shared memory) travels over the
// sidecar's fd channel, offered by ticket to the caller's uid only; the attach blob names them by
// index. No gRPC, no CUDA.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/engine_api/instream_host.h"
#include "server/fdpass/socket_credentials.h"
#include "server/fdpass/ticket_broker.h"

namespace arfuse {

// Where the client picks the descriptors up (AttachResponse's fd_ticket, fd_count, fd_socket).
struct AttachFdOffer {
  std::string ticket;
  uint32_t count = 0;  // 0: the export has no descriptors, and nothing was offered
  std::string socket;
};

// Offers duplicates of the export's descriptors (AttachBlobFds) to `caller`'s uid on the fd
// channel (`tickets`, reached at `fd_socket`) for `ttl`; the export keeps its own. An export
// without descriptors gets an empty offer. FAILED_PRECONDITION without an fd channel,
// PERMISSION_DENIED when the caller's credentials are not known, RESOURCE_EXHAUSTED when a
// descriptor cannot be duplicated.
// `scope` names the attachment the offer is for: the ticket dies with it
// (FdTicketBroker::RevokeAttachment, RevokeSession). `counters_fd` (>= 0) is the attachment's op
// counter page, offered after the export's descriptors (the blob's counters_fd_index).
absl::StatusOr<AttachFdOffer> OfferAttachFds(const InStreamExport& exported,
                                             FdTicketBroker* tickets, const std::string& fd_socket,
                                             const std::optional<SocketCredentials>& caller,
                                             absl::Duration ttl, FdTicketScope scope = {},
                                             int counters_fd = -1);

}  // namespace arfuse
