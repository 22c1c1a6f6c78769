// Mutual TLS on the peer channel's TCP connections (docs/peers.md, docs/security.md): every
// sidecar of a group holds a certificate signed by the group's CA and trusts only that CA, so a
// process without such a certificate cannot join, read or answer a collective. TLS 1.3 only (both
// ends are arfused), a certificate required and verified in both directions; no host name check:
// membership is "has a certificate of the group's CA", so the CA should sign nothing else.
//
// The Unix-socket channel of one node keeps its SO_PEERCRED check and carries no TLS (descriptors
// travel there).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/peers/wire.h"

// OpenSSL's types, without its headers in every includer.
struct ssl_ctx_st;
struct ssl_st;

namespace arfuse::peers {

struct PeerTlsFiles {
  std::string cert;  // PEM certificate chain of this sidecar (used as server and as client)
  std::string key;   // PEM private key of `cert`
  std::string ca;    // PEM CA bundle every peer's certificate must chain to
  bool any() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// The TLS settings of one group formation (loaded when the group forms, so a renewed certificate
// is used from the next re-formation on).
class PeerTls {
 public:
  // INVALID_ARGUMENT naming the file and OpenSSL's reason when one is missing, cannot be read,
  // or the key does not match the certificate.
  static absl::StatusOr<std::shared_ptr<const PeerTls>> Load(const PeerTlsFiles& files);
  ~PeerTls();
  PeerTls(const PeerTls&) = delete;
  PeerTls& operator=(const PeerTls&) = delete;

  ssl_ctx_st* server_ctx() const { return server_; }
  ssl_ctx_st* client_ctx() const { return client_; }

 private:
  PeerTls() = default;
  ssl_ctx_st* server_ = nullptr;
  ssl_ctx_st* client_ = nullptr;
};

// One TLS session over a connected non-blocking TCP socket, which it owns. Frames travel over it
// like over the plain socket (PeerStream); no descriptors.
class TlsStream final : public PeerStream {
 public:
  // The accepting side (rank 0's coordinator) or the joining side.
  static absl::StatusOr<std::unique_ptr<TlsStream>> Accept(const PeerTls& tls, UniqueFd fd);
  static absl::StatusOr<std::unique_ptr<TlsStream>> Connect(const PeerTls& tls, UniqueFd fd);
  ~TlsStream() override;  // closes the socket without waiting for the peer

  // Advances the handshake without blocking; OK with *done false means: call again once the
  // socket is readable (or writable, when WantsWrite()). The accepting side is done once the
  // joiner's certificate verified; the joining side once rank 0 accepted its certificate (rank 0's
  // first session ticket, which it sends only after verifying the joiner's certificate), so a
  // refused joiner hears why before it sends a byte of its own. Errors: UNAUTHENTICATED with the
  // reason (no certificate, one the CA did not sign, a peer that does not speak TLS 1.3),
  // UNAVAILABLE when the connection closed or broke.
  absl::Status Handshake(bool* done);
  bool WantsWrite() const { return want_write_; }
  // Drives Handshake until done or `deadline` (DEADLINE_EXCEEDED), polling the socket.
  absl::Status HandshakeUntil(absl::Time deadline);

  int fd() const override { return fd_.get(); }
  absl::Status ReadAvailable(std::string& buf, std::deque<UniqueFd>& fds, bool* eof) override;
  absl::Status SendSome(const std::string& data, size_t* offset,
                        const std::vector<int>& fds) override;
  short PollEvents(bool sending) const override;

 private:
  friend class PeerTls;  // installs OnNewSession on the joining side's context
  TlsStream(UniqueFd fd, bool accepting);
  // Accept's and Connect's common part: the SSL object of `ctx` over the socket, in the state
  // `accepting` names.
  static absl::StatusOr<std::unique_ptr<TlsStream>> Start(ssl_ctx_st* ctx, UniqueFd fd,
                                                          bool accepting);
  absl::Status Fail(int ret, const char* during);
  static int OnNewSession(ssl_st* ssl, void* session);

  UniqueFd fd_;
  const bool accepting_;
  ssl_st* ssl_ = nullptr;
  bool handshaken_ = false;  // the TLS handshake itself is complete
  bool accepted_ = false;    // joining side: rank 0 sent its session ticket
  bool want_write_ = false;
};

// True when `buf` holds the start of a plain peer frame (this build's magic), i.e. a joiner that
// does not use TLS; false when it cannot be one. nullopt while fewer than 4 bytes decide it.
std::optional<bool> LooksLikePlainFrame(const std::string& buf);

}  // namespace arfuse::peers
