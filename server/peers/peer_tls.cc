#include "server/peers/peer_tls.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/fd/scm_rights.h"
#include "common/status_macros.h"

namespace arfuse::peers {
namespace {

// OpenSSL's queued errors, reasons only ("certificate verify failed"), and clears the queue.
std::string TakeOpenSslErrors() {
  std::vector<std::string> reasons;
  while (unsigned long e = ERR_get_error()) {
    const char* r = ERR_reason_error_string(e);
    if (r != nullptr) {
      reasons.emplace_back(r);
    } else {
      char buf[256];
      ERR_error_string_n(e, buf, sizeof(buf));
      reasons.emplace_back(buf);
    }
  }
  return absl::StrJoin(reasons, "; ");
}

absl::Status CheckReadable(const char* what, const std::string& path) {
  if (path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the peer channel's mutual TLS needs a certificate, its key and a CA bundle; the ", what,
        " is missing"));
  }
  std::ifstream in(path);
  if (!in.good()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read the peer TLS ", what, " ", path, ": ", strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status Configure(SSL_CTX* ctx, const PeerTlsFiles& f) {
  if (ctx == nullptr) {
    return absl::InternalError(absl::StrCat("cannot create a TLS context: ", TakeOpenSslErrors()));
  }
  SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION);
  SSL_CTX_set_max_proto_version(ctx, TLS1_3_VERSION);
  if (SSL_CTX_use_certificate_chain_file(ctx, f.cert.c_str()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("the peer TLS certificate ", f.cert,
                                                   " is not a PEM certificate chain (",
                                                   TakeOpenSslErrors(), ")"));
  }
  if (SSL_CTX_use_PrivateKey_file(ctx, f.key.c_str(), SSL_FILETYPE_PEM) != 1) {
    const std::string reason = TakeOpenSslErrors();
    if (absl::StrContains(reason, "mismatch")) {
      return absl::InvalidArgumentError(
          absl::StrCat("the peer TLS key ", f.key, " does not belong to the certificate ", f.cert));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("the peer TLS key ", f.key, " is not a PEM private key (", reason, ")"));
  }
  if (SSL_CTX_check_private_key(ctx) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("the peer TLS key ", f.key,
                                                   " does not belong to the certificate ", f.cert,
                                                   " (", TakeOpenSslErrors(), ")"));
  }
  if (SSL_CTX_load_verify_locations(ctx, f.ca.c_str(), nullptr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the peer TLS CA bundle ", f.ca, " holds no PEM certificate (", TakeOpenSslErrors(), ")"));
  }
  return absl::OkStatus();
}

// A socket BIO that writes with MSG_NOSIGNAL: a peer that went away must not raise SIGPIPE in a
// process that did not ignore it (the library is usable outside arfused).
int BioWrite(BIO* b, const char* data, int n) {
  BIO_clear_retry_flags(b);
  const int fd = static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(b)));
  ssize_t r = ::send(fd, data, static_cast<size_t>(n), MSG_NOSIGNAL);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) BIO_set_retry_write(b);
  return static_cast<int>(r);
}

int BioRead(BIO* b, char* data, int n) {
  BIO_clear_retry_flags(b);
  const int fd = static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(b)));
  ssize_t r = ::recv(fd, data, static_cast<size_t>(n), 0);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) BIO_set_retry_read(b);
  return static_cast<int>(r);
}

// Whether the failed call saw the peer close the connection (with or without close_notify);
// leaves OpenSSL's error queue as it is.
bool ClosedByPeer(int err) {
  if (err == SSL_ERROR_ZERO_RETURN) return true;
  const unsigned long e = ERR_peek_error();
  if (err == SSL_ERROR_SYSCALL && e == 0) return true;
  return ERR_GET_REASON(e) == SSL_R_UNEXPECTED_EOF_WHILE_READING;
}

long BioCtrl(BIO*, int cmd, long, void*) { return cmd == BIO_CTRL_FLUSH ? 1 : 0; }

int BioCreate(BIO* b) {
  BIO_set_init(b, 1);
  return 1;
}

const BIO_METHOD* SocketBio() {
  static BIO_METHOD* const method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "arfuse peer socket");
    BIO_meth_set_write(m, BioWrite);
    BIO_meth_set_read(m, BioRead);
    BIO_meth_set_ctrl(m, BioCtrl);
    BIO_meth_set_create(m, BioCreate);
    return m;
  }();
  return method;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const PeerTls>> PeerTls::Load(const PeerTlsFiles& files) {
  ARFUSE_RETURN_IF_ERROR(CheckReadable("certificate", files.cert));
  ARFUSE_RETURN_IF_ERROR(CheckReadable("key", files.key));
  ARFUSE_RETURN_IF_ERROR(CheckReadable("CA bundle", files.ca));
  ERR_clear_error();
  std::shared_ptr<PeerTls> t(new PeerTls());
  t->server_ = SSL_CTX_new(TLS_server_method());
  ARFUSE_RETURN_IF_ERROR(Configure(t->server_, files));
  t->client_ = SSL_CTX_new(TLS_client_method());
  ARFUSE_RETURN_IF_ERROR(Configure(t->client_, files));
  // Rank 0 asks every joiner for a certificate of the CA and refuses one without.
  SSL_CTX_set_verify(t->server_, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  if (STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(files.ca.c_str())) {
    SSL_CTX_set_client_CA_list(t->server_, names);
  }
  static const unsigned char kContext[] = "arfuse-peer";
  SSL_CTX_set_session_id_context(t->server_, kContext, sizeof(kContext) - 1);
  // One ticket per connection: it is the joiner's sign that rank 0 verified its certificate.
  SSL_CTX_set_num_tickets(t->server_, 1);
  // A joiner checks rank 0's certificate against the same CA; it never resumes a session, it
  // only watches for the ticket.
  SSL_CTX_set_verify(t->client_, SSL_VERIFY_PEER, nullptr);
  SSL_CTX_set_session_cache_mode(t->client_,
                                 SSL_SESS_CACHE_CLIENT | SSL_SESS_CACHE_NO_INTERNAL_STORE);
  SSL_CTX_sess_set_new_cb(t->client_, [](SSL* ssl, SSL_SESSION* session) {
    return TlsStream::OnNewSession(ssl, session);
  });
  return std::shared_ptr<const PeerTls>(std::move(t));
}

PeerTls::~PeerTls() {
  SSL_CTX_free(server_);
  SSL_CTX_free(client_);
}

TlsStream::TlsStream(UniqueFd fd, bool accepting) : fd_(std::move(fd)), accepting_(accepting) {}

TlsStream::~TlsStream() { SSL_free(ssl_); }

absl::StatusOr<std::unique_ptr<TlsStream>> TlsStream::Start(SSL_CTX* ctx, UniqueFd fd,
                                                            bool accepting) {
  std::unique_ptr<TlsStream> s(new TlsStream(std::move(fd), accepting));
  s->ssl_ = SSL_new(ctx);
  if (s->ssl_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("SSL_new: ", TakeOpenSslErrors()));
  }
  BIO* bio = BIO_new(SocketBio());
  if (bio == nullptr) return absl::ResourceExhaustedError("cannot allocate a socket BIO");
  BIO_set_data(bio, reinterpret_cast<void*>(static_cast<intptr_t>(s->fd_.get())));
  SSL_set_bio(s->ssl_, bio, bio);
  SSL_set_mode(s->ssl_, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  SSL_set_app_data(s->ssl_, s.get());
  if (accepting) {
    SSL_set_accept_state(s->ssl_);
  } else {
    SSL_set_connect_state(s->ssl_);
  }
  return s;
}

absl::StatusOr<std::unique_ptr<TlsStream>> TlsStream::Accept(const PeerTls& tls, UniqueFd fd) {
  return Start(tls.server_ctx(), std::move(fd), true);
}

absl::StatusOr<std::unique_ptr<TlsStream>> TlsStream::Connect(const PeerTls& tls, UniqueFd fd) {
  return Start(tls.client_ctx(), std::move(fd), false);
}

int TlsStream::OnNewSession(ssl_st* ssl, void* /*session*/) {
  if (auto* self = static_cast<TlsStream*>(SSL_get_app_data(ssl))) self->accepted_ = true;
  return 0;  // not kept: OpenSSL frees the session
}

absl::Status TlsStream::Fail(int ret, const char* during) {
  const int saved_errno = errno;
  const int err = SSL_get_error(ssl_, ret);
  const bool closed = ClosedByPeer(err);
  const std::string reason = TakeOpenSslErrors();
  if (closed) {
    return absl::UnavailableError(
        absl::StrCat("the connection closed during the TLS ", during,
                     err == SSL_ERROR_SYSCALL && ret < 0 && saved_errno != 0
                         ? absl::StrCat(" (", strerror(saved_errno), ")")
                         : std::string()));
  }
  if (err == SSL_ERROR_SYSCALL) {
    return absl::UnavailableError(absl::StrCat("the TLS ", during, " failed: ", reason));
  }
  const long verify = SSL_get_verify_result(ssl_);
  if (verify != X509_V_OK && absl::StrContains(reason, "certificate verify failed")) {
    return absl::UnauthenticatedError(
        absl::StrCat(accepting_ ? "the joining peer's certificate" : "rank 0's certificate",
                     " did not verify against the peer CA bundle (",
                     X509_verify_cert_error_string(verify), ")"));
  }
  if (accepting_ && absl::StrContains(reason, "did not return a certificate")) {
    return absl::UnauthenticatedError(
        "the joining peer presented no certificate (the peer channel's TCP port takes only "
        "mutual TLS)");
  }
  if (!accepting_ && absl::StrContains(reason, "alert")) {
    return absl::UnauthenticatedError(
        absl::StrCat("rank 0 refused this sidecar's certificate (", reason,
                     "): it must be signed by the CA that rank 0 trusts (its peer CA bundle)"));
  }
  return absl::UnauthenticatedError(absl::StrCat(
      "the TLS ", during, " failed (", reason.empty() ? std::string("no reason given") : reason,
      "): every rank must use mutual TLS 1.3 with certificates of the group's CA"));
}

absl::Status TlsStream::Handshake(bool* done) {
  *done = false;
  if (!handshaken_) {
    ERR_clear_error();
    const int r = SSL_do_handshake(ssl_);
    if (r != 1) {
      const int err = SSL_get_error(ssl_, r);
      if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
        want_write_ = err == SSL_ERROR_WANT_WRITE;
        return absl::OkStatus();
      }
      return Fail(r, "handshake");
    }
    handshaken_ = true;
    want_write_ = false;
  }
  if (accepting_ || accepted_) {
    *done = true;
    return absl::OkStatus();
  }
  // TLS 1.3 ends the joiner's handshake before rank 0 has looked at the joiner's certificate:
  // wait for rank 0's verdict, its session ticket or an alert. Peeking leaves any application
  // bytes for ReadAvailable.
  for (;;) {
    char byte = 0;
    ERR_clear_error();
    const int r = SSL_peek(ssl_, &byte, 1);
    if (accepted_ || r > 0) {
      accepted_ = true;
      *done = true;
      return absl::OkStatus();
    }
    const int err = SSL_get_error(ssl_, r);
    if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
      want_write_ = err == SSL_ERROR_WANT_WRITE;
      return absl::OkStatus();
    }
    absl::Status failed = Fail(r, "handshake");
    if (absl::IsUnavailable(failed)) {
      // Closed before the ticket: rank 0 refused the certificate without an alert we could read,
      // or went away. Both are worth naming.
      return absl::UnavailableError(absl::StrCat(
          failed.message(),
          " before rank 0 accepted this sidecar's certificate (is it signed by the CA rank 0 "
          "trusts?)"));
    }
    return failed;
  }
}

absl::Status TlsStream::HandshakeUntil(absl::Time deadline) {
  for (;;) {
    bool done = false;
    ARFUSE_RETURN_IF_ERROR(Handshake(&done));
    if (done) return absl::OkStatus();
    const short events = static_cast<short>(POLLIN | (want_write_ ? POLLOUT : 0));
    ARFUSE_ASSIGN_OR_RETURN(const bool ready, WaitForSocket(fd_.get(), events, deadline));
    if (!ready) return absl::DeadlineExceededError("the TLS handshake did not complete in time");
  }
}

absl::Status TlsStream::ReadAvailable(std::string& buf, std::deque<UniqueFd>& /*fds*/, bool* eof) {
  *eof = false;
  char chunk[16384];
  for (;;) {
    ERR_clear_error();
    const int r = SSL_read(ssl_, chunk, sizeof(chunk));
    if (r > 0) {
      buf.append(chunk, static_cast<size_t>(r));
      continue;
    }
    const int err = SSL_get_error(ssl_, r);
    if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
      // Everything OpenSSL had buffered is in buf now, so polling the socket is enough.
      want_write_ = err == SSL_ERROR_WANT_WRITE;
      return absl::OkStatus();
    }
    if (ClosedByPeer(err)) {
      ERR_clear_error();
      *eof = true;  // closed, with or without close_notify
      return absl::OkStatus();
    }
    absl::Status failed = Fail(r, "read");
    return absl::UnavailableError(absl::StrCat("peer connection: ", failed.message()));
  }
}

absl::Status TlsStream::SendSome(const std::string& data, size_t* offset,
                                 const std::vector<int>& fds) {
  if (!fds.empty()) {
    return absl::InvalidArgumentError("descriptors cannot travel over the TCP peer channel");
  }
  while (*offset < data.size()) {
    ERR_clear_error();
    const size_t left = data.size() - *offset;
    const int r =
        SSL_write(ssl_, data.data() + *offset, static_cast<int>(std::min<size_t>(left, INT_MAX)));
    if (r > 0) {
      *offset += static_cast<size_t>(r);
      continue;
    }
    const int err = SSL_get_error(ssl_, r);
    if (err == SSL_ERROR_WANT_WRITE || err == SSL_ERROR_WANT_READ) {
      want_write_ = err == SSL_ERROR_WANT_WRITE;
      return absl::OkStatus();
    }
    absl::Status failed = Fail(r, "write");
    return absl::UnavailableError(absl::StrCat("peer connection: ", failed.message()));
  }
  want_write_ = false;
  return absl::OkStatus();
}

short TlsStream::PollEvents(bool sending) const {
  return static_cast<short>(POLLIN | (sending || want_write_ ? POLLOUT : 0));
}

std::optional<bool> LooksLikePlainFrame(const std::string& buf) {
  uint8_t magic[4];
  std::memcpy(magic, &kFrameMagic, sizeof(magic));
  const size_t n = std::min<size_t>(buf.size(), sizeof(magic));
  if (std::memcmp(buf.data(), magic, n) != 0) return false;
  if (n < sizeof(magic)) return std::nullopt;
  return true;
}

}  // namespace arfuse::peers
