#include "common/fd/fd_channel_client.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/fd/fd_ticket.h"
#include "common/fd/fd_wire.h"
#include "common/status_macros.h"

namespace arfuse {

std::string FdChannelPath(absl::string_view main_socket_path) {
  return absl::StrCat(main_socket_path, ".fd");
}

absl::StatusOr<UniqueFd> ConnectFdChannel(const std::string& path, absl::Time deadline) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("fd channel path too long: ", path));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  for (;;) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) return absl::UnavailableError(absl::StrCat("socket(): ", std::strerror(errno)));
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) return fd;
    // A Unix socket whose backlog is full answers EAGAIN to a non-blocking connect.
    if (errno != EAGAIN || absl::Now() >= deadline) {
      return absl::UnavailableError(
          absl::StrCat("cannot connect to the fd channel at ", path, ": ", std::strerror(errno)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

namespace {

// One request and its reply; ERROR replies become their status.
absl::StatusOr<FdMessage> RoundTrip(const std::string& path, FdOp op, absl::string_view body,
                                    const std::vector<int>& fds, FdOp expected,
                                    absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  ARFUSE_ASSIGN_OR_RETURN(UniqueFd conn, ConnectFdChannel(path, deadline));
  ARFUSE_RETURN_IF_ERROR(SendFdMessage(conn.get(), op, body, fds, deadline));
  ARFUSE_ASSIGN_OR_RETURN(FdMessage reply, RecvFdMessage(conn.get(), deadline));
  if (reply.op == FdOp::kError) return DecodeFdError(reply.body);
  if (reply.op != expected) {
    return absl::InternalError(absl::StrCat("the fd channel answered op ",
                                            static_cast<int>(reply.op), " to op ",
                                            static_cast<int>(op)));
  }
  return reply;
}

}  // namespace

absl::StatusOr<std::string> DepositFds(const std::string& path, const std::vector<int>& fds,
                                       absl::Duration timeout) {
  if (fds.empty()) return absl::InvalidArgumentError("nothing to deposit");
  ARFUSE_ASSIGN_OR_RETURN(FdMessage reply,
                          RoundTrip(path, FdOp::kDeposit, "", fds, FdOp::kDepositOk, timeout));
  if (!IsWellFormedFdTicket(reply.body)) {
    return absl::InternalError("the fd channel answered a malformed ticket");
  }
  return reply.body;
}

absl::StatusOr<std::vector<UniqueFd>> PickupFds(const std::string& path, absl::string_view ticket,
                                                absl::Duration timeout) {
  ARFUSE_ASSIGN_OR_RETURN(FdMessage reply,
                          RoundTrip(path, FdOp::kPickup, ticket, {}, FdOp::kPickupOk, timeout));
  return std::move(reply.fds);
}

}  // namespace arfuse
