// Bytes and file descriptors over a connected Unix stream socket (SCM_RIGHTS), non-blocking. The
// descriptors of a message ride on its first byte; the receiver takes them with that byte. Shared
// by the peer channel's framing (server/peers/wire.h) and the fd channel (fd_wire.h).
#pragma once

#include <cstddef>
#include <deque>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/fd/unique_fd.h"

namespace arfuse {

// The most descriptors one sendmsg/recvmsg carries here (the control buffers are sized for it).
inline constexpr size_t kMaxScmFds = 64;

// Sends data[*offset..] without blocking; `fds` go with the first byte (only when *offset == 0).
// Advances *offset; OK with *offset < data.size() when the socket is full. INVALID_ARGUMENT for
// more than kMaxScmFds descriptors (before anything is written); UNAVAILABLE "<what> write
// failed: ..." when the connection is broken.
absl::Status SendWithFds(int fd, absl::string_view data, size_t* offset, absl::Span<const int> fds,
                         absl::string_view what);

// Reads what is available without blocking, appending bytes to `buf` and received descriptors
// (close-on-exec) to `fds`; at most `max_bytes` bytes. Sets *eof when the other end closed.
// INVALID_ARGUMENT when the sender attached more descriptors to one message than kMaxScmFds
// (the excess is closed by the kernel), or when `fds` would grow past `max_fds` (the reading
// stops there: a sender spreading descriptors over many small messages cannot make the reader
// hold more); UNAVAILABLE "<what> read failed: ..." for a socket error.
// Takes the first `n` descriptors off `fds` (those that arrived with a message's first byte).
// `fds` holds at least `n`.
std::vector<UniqueFd> TakeFds(std::deque<UniqueFd>& fds, size_t n);

// Waits until `fd` is ready for `events` (POLLIN, POLLOUT) or `deadline` passes: true when
// ready, false on timeout. For the blocking client sides of both protocols.
absl::StatusOr<bool> WaitForSocket(int fd, short events, absl::Time deadline);

absl::Status RecvWithFds(int fd, std::string& buf, std::deque<UniqueFd>& fds, bool* eof,
                         absl::string_view what, size_t max_bytes = static_cast<size_t>(-1),
                         size_t max_fds = static_cast<size_t>(-1));

}  // namespace arfuse
