#include "server/daemon/tcp_listener.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

int PortOf(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return 0;
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpListener>> TcpListener::Bind(const std::string& host, int port,
                                                               TcpListenerOptions options) {
  absl::string_view name = host;
  if (absl::ConsumePrefix(&name, "[")) absl::ConsumeSuffix(&name, "]");
  const std::string where = absl::StrCat(host, ":", port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string node(name);
  if (int rc = ::getaddrinfo(node.empty() ? nullptr : node.c_str(), "0", &hints, &found); rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", where, ": ", ::gai_strerror(rc)));
  }
  std::vector<UniqueFd> fds;
  int bound_port = port;
  absl::Status last = absl::OkStatus();
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    sockaddr_storage addr{};
    std::memcpy(&addr, ai->ai_addr, ai->ai_addrlen);
    if (ai->ai_family == AF_INET) {
      reinterpret_cast<sockaddr_in*>(&addr)->sin_port = htons(static_cast<uint16_t>(bound_port));
    } else if (ai->ai_family == AF_INET6) {
      reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = htons(static_cast<uint16_t>(bound_port));
    } else {
      continue;
    }
    UniqueFd fd(::socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) {
      last = absl::UnavailableError(absl::StrCat("socket(): ", std::strerror(errno)));
      continue;
    }
    // SO_REUSEADDR: a restarted sidecar binds at once despite connections in TIME_WAIT. No
    // SO_REUSEPORT: no second process may share the port.
    const int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    // "::" listens on IPv4 too unless the system says otherwise; "0.0.0.0" then also resolves,
    // and its bind fails with EADDRINUSE, which is the dual-stack socket serving it.
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), ai->ai_addrlen) != 0 ||
        ::listen(fd.get(), 128) != 0) {
      last = absl::UnavailableError(
          absl::StrCat("cannot listen on ", where, ": ", std::strerror(errno)));
      continue;
    }
    bound_port = PortOf(fd.get());
    fds.push_back(std::move(fd));
  }
  ::freeaddrinfo(found);
  if (fds.empty()) {
    return last.ok() ? absl::UnavailableError(absl::StrCat("no address to listen on for ", where))
                     : last;
  }
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::UnavailableError(absl::StrCat("pipe(): ", std::strerror(errno)));
  }
  return std::unique_ptr<TcpListener>(new TcpListener(std::move(fds), bound_port, UniqueFd(wake[0]),
                                                      UniqueFd(wake[1]), std::move(options)));
}

TcpListener::TcpListener(std::vector<UniqueFd> fds, int port, UniqueFd wake_read,
                         UniqueFd wake_write, TcpListenerOptions options)
    : fds_(std::move(fds)),
      port_(port),
      wake_read_(std::move(wake_read)),
      wake_write_(std::move(wake_write)),
      options_(std::move(options)) {}

TcpListener::~TcpListener() { Stop(); }

void TcpListener::Serve(Handler handler) {
  handler_ = std::move(handler);
  thread_ = std::thread([this] { AcceptLoop(); });
}

void TcpListener::Stop() {
  if (thread_.joinable()) {
    char byte = 1;
    (void)!::write(wake_write_.get(), &byte, 1);
    thread_.join();
  }
  fds_.clear();  // connections still in the backlog are refused at once
}

bool TcpListener::Admit(UniqueFd conn) {
  if (options_.max_connections > 0 && open_.Live() >= options_.max_connections) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    return false;  // conn closes
  }
  const int one = 1;
  ::setsockopt(conn.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  open_.Record(conn.get(), ConnectionTable::Channel::kMain, SocketCredentials{});
  accepted_.fetch_add(1, std::memory_order_relaxed);
  handler_(std::move(conn));
  return true;
}

void TcpListener::AcceptLoop() {
  LogRateLimiter log_limit(absl::Seconds(1));
  absl::Duration pause = absl::ZeroDuration();
  std::vector<pollfd> polled(fds_.size() + 1);
  while (true) {
    // Out of descriptors, poll is not trusted to wait (a listening socket stays readable): the
    // loop leaves the sockets alone this long, watching only for Stop().
    if (pause > absl::ZeroDuration()) {
      pollfd w{wake_read_.get(), POLLIN, 0};
      if (::poll(&w, 1, static_cast<int>(absl::ToInt64Milliseconds(pause))) > 0) return;
    }
    pause = absl::ZeroDuration();
    // The spare goes back into reserve as soon as a descriptor is free again.
    const bool have_spare = reserve_.Replenish();
    polled[0] = {wake_read_.get(), POLLIN, 0};
    for (size_t i = 0; i < fds_.size(); ++i) polled[i + 1] = {fds_[i].get(), POLLIN, 0};
    if (::poll(polled.data(), polled.size(), have_spare ? -1 : 100) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("event=accept_poll_failed socket={} error=\"{}\"", options_.label,
                    std::strerror(errno));
      return;
    }
    if (polled[0].revents != 0) return;
    for (size_t i = 0; i < fds_.size(); ++i) {
      if (polled[i + 1].revents == 0) continue;
      const int listen_fd = fds_[i].get();
      accept_calls_.fetch_add(1, std::memory_order_relaxed);
      int raw = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (raw >= 0) {
        Admit(UniqueFd(raw));
        continue;
      }
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || err == ECONNABORTED) continue;
      bool served = false;
      if (err == EMFILE || err == ENFILE) {
        accept_calls_.fetch_add(1, std::memory_order_relaxed);
        // A probe is one short connection: the spare's place serves it, and comes back as soon as
        // the probe (or anything else) closes a descriptor.
        UniqueFd conn = reserve_.AcceptWithSpare(listen_fd);
        if (conn.valid()) {
          served = Admit(std::move(conn));
          if (served) served_with_spare_.fetch_add(1, std::memory_order_relaxed);
        }
      }
      pause = AcceptReserve::ShedPause(served);
      uint64_t held_back = 0;
      if (log_limit.Allow(absl::StrCat("accept_failed/", err), absl::Now(), &held_back)) {
        spdlog::warn(
            "event=accept_failed socket={} error=\"{}\" served_with_spare={} held_back={} "
            "pause_ms={}",
            options_.label, std::strerror(err), served ? "yes" : "no", held_back,
            absl::ToInt64Milliseconds(pause));
      }
    }
  }
}

}  // namespace arfuse
