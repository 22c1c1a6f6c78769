// The fd channel's wire protocol: arfused serves it on a second Unix socket beside the main one
// (<main socket>.fd). A client hands descriptors in (DEPOSIT: it gets a ticket that a gRPC call
// then names) and takes descriptors out (PICKUP: the ticket came in a gRPC answer).
//
//   message = FdMessageHeader (16 bytes, little-endian) + body (body_len bytes)
//   DEPOSIT    client -> arfused  nfds 1..kMaxFdChannelFds descriptors, empty body
//   DEPOSIT_OK arfused -> client  body: the ticket (32 hex characters)
//   PICKUP     client -> arfused  body: the ticket, no descriptors
//   PICKUP_OK  arfused -> client  nfds descriptors, empty body
//   ERROR      arfused -> client  body: u32 status code, then the message
//
// Descriptors ride on the header's first byte (SCM_RIGHTS). One request at a time per
// connection: a client sends one message and reads the reply before sending another. Shared
// between clients and daemons of different builds, so the layout is pinned by static_asserts and
// the version is checked on every message.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/fd/scm_rights.h"
#include "common/fd/unique_fd.h"

namespace arfuse {

inline constexpr uint32_t kFdWireMagic = 0x44465241;  // "ARFD" little-endian
inline constexpr uint8_t kFdWireVersion = 1;
// Bodies are tickets and error messages.
inline constexpr uint32_t kMaxFdBody = 1024;
inline constexpr uint16_t kMaxFdChannelFds = 16;
static_assert(kMaxFdChannelFds <= kMaxScmFds);

enum class FdOp : uint8_t {
  kDeposit = 1,
  kDepositOk = 2,
  kPickup = 3,
  kPickupOk = 4,
  kError = 5,
};
inline constexpr uint8_t kMaxFdOp = static_cast<uint8_t>(FdOp::kError);

struct FdMessageHeader {
  uint32_t magic;
  uint8_t version;
  uint8_t op;
  uint16_t nfds;
  uint32_t body_len;
  uint32_t reserved;  // 0
};
static_assert(std::is_trivially_copyable_v<FdMessageHeader>);
static_assert(sizeof(FdMessageHeader) == 16);
static_assert(offsetof(FdMessageHeader, version) == 4);
static_assert(offsetof(FdMessageHeader, op) == 5);
static_assert(offsetof(FdMessageHeader, nfds) == 6);
static_assert(offsetof(FdMessageHeader, body_len) == 8);
static_assert(offsetof(FdMessageHeader, reserved) == 12);
static_assert(std::endian::native == std::endian::little);

struct FdMessage {
  FdOp op = FdOp::kError;
  std::string body;
  std::vector<UniqueFd> fds;
};

// Header + body; `nfds` descriptors are to be sent with the first byte.
std::string EncodeFdMessage(FdOp op, absl::string_view body, uint16_t nfds = 0);
std::string EncodeFdError(const absl::Status& status);
// The status an ERROR body carries (an unknown code reads as UNKNOWN).
absl::Status DecodeFdError(absl::string_view body);

// Bytes still needed before `buf` holds one complete message (a header first, then its body);
// 0 when it does. Lets a reader take exactly one message's bytes, so that descriptors of the next
// message are never read with this one.
size_t FdMessageBytesMissing(const std::string& buf);

// Takes one complete message off the front of `buf` (and its descriptors off `fds`); nullopt
// when more bytes are needed. INVALID_ARGUMENT naming the problem for anything else: bad magic or
// version, unknown op, a nonzero reserved field, a body or descriptor count over the limits, or
// fewer descriptors than announced once the message is complete.
absl::StatusOr<std::optional<FdMessage>> TakeFdMessage(std::string& buf, std::deque<UniqueFd>& fds);

// Blocking client side, bounded by `deadline` (DEADLINE_EXCEEDED past it; UNAVAILABLE when the
// other end closed): send one message, read one reply.
absl::Status SendFdMessage(int fd, FdOp op, absl::string_view body, const std::vector<int>& fds,
                           absl::Time deadline);
absl::StatusOr<FdMessage> RecvFdMessage(int fd, absl::Time deadline);

}  // namespace arfuse
