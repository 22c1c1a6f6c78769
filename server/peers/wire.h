// The peer channel's framing: a fixed 24-byte header, then a protobuf body (arfuse.v1 peer
// messages) or a small error record. File descriptors (SCM_RIGHTS) ride on the first byte of
// the frame that announces them in `nfds`. Shared between processes on different builds, so the
// layout is pinned with static_asserts and the version byte is checked on every frame.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/fd/scm_rights.h"
#include "common/fd/unique_fd.h"

namespace arfuse::peers {

inline constexpr uint32_t kFrameMagic = 0x50465241;  // "ARFP" little-endian
// 2: adds kHeartbeat. A peer on another version is answered with an Error frame in its own
// version's framing (the header layout and kError are the same in every version), so its join
// fails at once naming both versions instead of retrying until its timeout.
inline constexpr uint8_t kWireVersion = 2;
// Bodies carry small handshake payloads (IPC handles, the NCCL id, votes); anything bigger is a
// protocol error, not a reason to allocate.
inline constexpr uint32_t kMaxFrameBody = 16u << 20;
inline constexpr uint16_t kMaxFrameFds = kMaxScmFds;

enum class FrameType : uint8_t {
  kJoin = 1,          // body: EncodeJoinBody()
  kJoinOk = 2,        // body: arfuse.v1.JoinResponse
  kCollective = 3,    // body: arfuse.v1.CollectiveRequest
  kCollectiveFd = 4,  // body: arfuse.v1.CollectiveRequest (kind ALLGATHER), one fd attached
  kCollectiveOk = 5,  // body: arfuse.v1.CollectiveResponse (+ one fd per rank for kCollectiveFd)
  kError = 6,         // body: EncodeError()
  kLeave = 7,         // body: arfuse.v1.LeaveRequest
  // Liveness on an idle (or busy) link, never part of a collective: a rank sends one every
  // heartbeat interval with timeout_ms = how long the coordinator may go without hearing from it
  // before it declares the rank lost (0: do not watch me); the coordinator echoes it at once
  // (same seq, timeout_ms 0). Body: the rank's gossip (at most kMaxGossipBytes, empty for
  // none); the echo's body is EncodeGossipTable of every rank's latest, or empty when the
  // heartbeat's was. Since version 2 (the body since gossip; an older side ignores it).
  kHeartbeat = 8,
};
inline constexpr uint8_t kMaxFrameType = static_cast<uint8_t>(FrameType::kHeartbeat);

struct FrameHeader {
  uint32_t magic;
  uint8_t version;
  uint8_t type;
  uint16_t nfds;
  uint32_t body_len;
  // Join and collectives: how long the sender will wait, so the coordinator can answer (naming
  // the missing ranks) before the sender gives up. Relative, because clocks of different nodes
  // disagree.
  uint32_t timeout_ms;
  // Echoed in the reply so a sender can drop a late answer to a call it already gave up on.
  uint64_t seq;
};
static_assert(std::is_trivially_copyable_v<FrameHeader>);
static_assert(sizeof(FrameHeader) == 24);
static_assert(offsetof(FrameHeader, version) == 4);
static_assert(offsetof(FrameHeader, type) == 5);
static_assert(offsetof(FrameHeader, nfds) == 6);
static_assert(offsetof(FrameHeader, body_len) == 8);
static_assert(offsetof(FrameHeader, timeout_ms) == 12);
static_assert(offsetof(FrameHeader, seq) == 16);
// The header is copied as bytes; every host we run on (x86-64, aarch64) is little-endian.
static_assert(std::endian::native == std::endian::little);

struct Frame {
  FrameType type = FrameType::kError;
  uint32_t timeout_ms = 0;
  uint64_t seq = 0;
  std::string body;
  std::vector<UniqueFd> fds;
};

std::string EncodeFrame(FrameType type, uint64_t seq, uint32_t timeout_ms, const std::string& body,
                        uint16_t nfds = 0);

// A frame queued for sending; `fds` travel with its first byte. `seq` lets a sender tell whether
// its frame is still (partly) unsent.
struct OutFrame {
  std::string data;
  std::vector<UniqueFd> fds;
  size_t offset = 0;
  uint64_t seq = 0;
};

// Writes queued frames in order, without blocking, until the socket is full or the queue is
// empty; frames written completely are popped. An error means the connection is broken.
absl::Status FlushFrames(int fd, std::deque<OutFrame>& queue);

// Takes one complete frame off the front of `buf` (and its fds off the front of `fds`); nullopt
// when more bytes are needed. INVALID_ARGUMENT for a frame that is not ours (bad magic, version,
// size, or fewer fds than announced once the frame is complete).
absl::StatusOr<std::optional<Frame>> TakeFrame(std::string& buf, std::deque<UniqueFd>& fds);

std::string EncodeError(const absl::Status& status);

// When `buf` starts with a frame header of another wire version: the reply to send before closing,
// an Error frame (FAILED_PRECONDITION naming both versions) framed in *that* version and echoing
// the frame's seq, which an arfused of either version decodes. nullopt otherwise.
std::optional<std::string> WrongVersionReply(const std::string& buf);

// kJoin body: u16 group length, the group name, then a serialized arfuse.v1.JoinRequest (which
// has no group field of its own).
std::string EncodeJoinBody(const std::string& group, const std::string& join_request);
absl::Status DecodeJoinBody(const std::string& body, std::string* group, std::string* join_request);
absl::Status DecodeError(const std::string& body);

// A heartbeat echo's body: u32 count, then per rank u32 length and the payload; no table (an
// empty vector) is an empty body. Decode refuses (nullopt) a body that does not parse exactly,
// the empty one included.
std::string EncodeGossipTable(const std::vector<std::string>& payloads);
std::optional<std::vector<std::string>> DecodeGossipTable(const std::string& body);

// Non-blocking read of whatever is available into buf/fds. Sets *eof when the peer closed.
// Returns an error for a socket error (ECONNRESET...).
absl::Status ReadAvailable(int fd, std::string& buf, std::deque<UniqueFd>& fds, bool* eof);

// Non-blocking send of data[*offset..]; `fds` go with the first byte (only when *offset == 0).
// Advances *offset; returns OK with *offset < size when the socket is full.
absl::Status SendSome(int fd, const std::string& data, size_t* offset, const std::vector<int>& fds);

// The bytes of one peer connection, non-blocking: the socket itself (PlainStream), or TLS over a
// TCP socket (peer_tls.h). The fd functions above are the plain stream's.
class PeerStream {
 public:
  virtual ~PeerStream() = default;
  virtual int fd() const = 0;
  // As ReadAvailable / SendSome above; descriptors travel on plain Unix sockets only.
  virtual absl::Status ReadAvailable(std::string& buf, std::deque<UniqueFd>& fds, bool* eof) = 0;
  virtual absl::Status SendSome(const std::string& data, size_t* offset,
                                const std::vector<int>& fds) = 0;
  // The poll events to wait for: POLLIN, and POLLOUT while `sending` (TLS may want more).
  virtual short PollEvents(bool sending) const;
};

class PlainStream final : public PeerStream {
 public:
  explicit PlainStream(UniqueFd fd) : fd_(std::move(fd)) {}
  int fd() const override { return fd_.get(); }
  absl::Status ReadAvailable(std::string& buf, std::deque<UniqueFd>& fds, bool* eof) override;
  absl::Status SendSome(const std::string& data, size_t* offset,
                        const std::vector<int>& fds) override;

 private:
  UniqueFd fd_;
};

absl::Status FlushFrames(PeerStream& stream, std::deque<OutFrame>& queue);

// Blocking (poll-based) helpers bounded by `deadline`, for the client side.
absl::Status SendAll(PeerStream& stream, const std::string& data, const std::vector<int>& fds,
                     absl::Time deadline);
absl::StatusOr<Frame> RecvFrame(PeerStream& stream, std::string& buf, std::deque<UniqueFd>& fds,
                                absl::Time deadline);
// The same on a plain socket.
absl::Status SendAll(int fd, const std::string& data, const std::vector<int>& fds,
                     absl::Time deadline);
// DEADLINE_EXCEEDED when no complete frame arrived in time; UNAVAILABLE when the peer closed.
absl::StatusOr<Frame> RecvFrame(int fd, std::string& buf, std::deque<UniqueFd>& fds,
                                absl::Time deadline);

// TCP keepalive on a peer connection, so that a peer whose host died (no FIN, no RST) is noticed
// as a socket error within about 11 s even while the group is idle. Best effort: a socket that
// does not take the options keeps the plain behaviour. Unix sockets need none (the kernel closes
// them when the process dies).
void EnableKeepalive(int fd);

// Milliseconds left until `deadline`, clamped to [0, 2^31).
uint32_t RemainingMs(absl::Time deadline);

}  // namespace arfuse::peers
