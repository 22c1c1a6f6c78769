#include "server/fdpass/accept_reserve.h"

#include <fcntl.h>
#include <sys/socket.h>

namespace arfuse {
namespace {

UniqueFd OpenSpare() { return UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC)); }

}  // namespace

AcceptReserve::AcceptReserve() : spare_(OpenSpare()) {}

bool AcceptReserve::Shed(int listen_fd) {
  spare_.reset();
  UniqueFd conn(::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  const bool shed = conn.valid();
  conn.reset();
  spare_ = OpenSpare();
  return shed;
}

UniqueFd AcceptReserve::AcceptWithSpare(int listen_fd) {
  if (!spare_.valid()) return UniqueFd();
  spare_.reset();
  UniqueFd conn(::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  spare_ = OpenSpare();
  return conn;
}

bool AcceptReserve::Replenish() {
  if (!spare_.valid()) spare_ = OpenSpare();
  return spare_.valid();
}

}  // namespace arfuse
