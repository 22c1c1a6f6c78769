#include "common/fd/fd_ticket.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>

namespace arfuse {

std::string NewFdTicket() {
  uint8_t raw[kFdTicketChars / 2];
  size_t got = 0;
  while (got < sizeof(raw)) {
    ssize_t n = ::getrandom(raw + got, sizeof(raw) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      // getrandom only fails this way before the kernel's pool is initialized, which a running
      // daemon is long past; never fall back to a guessable ticket.
      std::abort();
    }
    got += static_cast<size_t>(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(kFdTicketChars, '0');
  for (size_t i = 0; i < sizeof(raw); ++i) {
    out[2 * i] = kHex[raw[i] >> 4];
    out[2 * i + 1] = kHex[raw[i] & 0xf];
  }
  return out;
}

bool IsWellFormedFdTicket(absl::string_view ticket) {
  if (ticket.size() != kFdTicketChars) return false;
  for (char c : ticket) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace arfuse
