// The ticket format of the fd channel (fd_wire.h): a ticket names descriptors in transit between
// a client and its sidecar (the broker that holds them is the daemon's, server/fdpass/
// ticket_broker.h). Both sides check a ticket's form; only the daemon issues them.
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace arfuse {

inline constexpr size_t kFdTicketChars = 32;

// 16 random bytes from the kernel (getrandom) as 32 lowercase hex characters.
std::string NewFdTicket();

// 32 lowercase hex characters.
bool IsWellFormedFdTicket(absl::string_view ticket);

}  // namespace arfuse
