#include "server/daemon/unix_listener.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/fd/fd_wire.h"
#include "common/log.h"
#include "spdlog/spdlog.h"

namespace arfuse {

bool PeerCredentialPolicy::Allows(const SocketCredentials& creds) const {
  if (creds.uid == 0 || creds.uid == ::geteuid() || uids.count(creds.uid) > 0) return true;
  for (gid_t g : gids) {
    if (creds.InGroup(g)) return true;
  }
  return false;
}

uint64_t DescriptorReserve(uint64_t nofile_soft_limit) {
  return std::max<uint64_t>(64, nofile_soft_limit / 4);
}

size_t ConnectionBudget(uint64_t nofile_soft_limit) {
  const uint64_t reserve = DescriptorReserve(nofile_soft_limit);
  return nofile_soft_limit > reserve ? static_cast<size_t>(nofile_soft_limit - reserve) : 1;
}

uint64_t NofileSoftLimit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) {
    return uint64_t{1} << 20;
  }
  return static_cast<uint64_t>(lim.rlim_cur);
}

size_t ConnectionBudget() { return ConnectionBudget(NofileSoftLimit()); }

FdTicketBrokerOptions PendingFdBudget(uint64_t nofile_soft_limit, size_t flag_total,
                                      size_t flag_per_uid) {
  FdTicketBrokerOptions o;
  o.max_fds_per_ticket = kMaxFdChannelFds;
  o.max_fds =
      flag_total != 0 ? flag_total : static_cast<size_t>(DescriptorReserve(nofile_soft_limit) / 2);
  o.max_fds_per_uid =
      flag_per_uid != 0 ? flag_per_uid : std::max<size_t>(kMaxFdChannelFds, o.max_fds / 4);
  return o;
}

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Bind(const std::string& path,
                                                                 UnixListenerOptions options) {
  if (options.table == nullptr) return absl::InvalidArgumentError("UnixListener needs a table");
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path too long: ", path));
  }
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return absl::UnavailableError(absl::StrCat("socket(): ", std::strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  // Created 0660 from the start: no window in which others could connect.
  mode_t old_mask = ::umask(0117);
  int bound = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int bind_errno = errno;
  ::umask(old_mask);
  if (bound != 0 || ::listen(fd.get(), 128) != 0) {
    int err = bound != 0 ? bind_errno : errno;
    return absl::UnavailableError(
        absl::StrCat("cannot listen on unix:", path, ": ", std::strerror(err)));
  }
  ::chmod(path.c_str(), 0660);
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::UnavailableError(absl::StrCat("pipe(): ", std::strerror(errno)));
  }
  return std::unique_ptr<UnixListener>(new UnixListener(
      std::move(fd), UniqueFd(wake[0]), UniqueFd(wake[1]), path, std::move(options)));
}

UnixListener::UnixListener(UniqueFd fd, UniqueFd wake_read, UniqueFd wake_write, std::string path,
                           UnixListenerOptions options)
    : fd_(std::move(fd)),
      wake_read_(std::move(wake_read)),
      wake_write_(std::move(wake_write)),
      path_(std::move(path)),
      options_(std::move(options)) {}

UnixListener::~UnixListener() {
  Stop();
  ::unlink(path_.c_str());
}

void UnixListener::Serve(Handler handler) {
  handler_ = std::move(handler);
  thread_ = std::thread([this] { AcceptLoop(); });
}

void UnixListener::Stop() {
  if (thread_.joinable()) {
    char byte = 1;
    (void)!::write(wake_write_.get(), &byte, 1);
    thread_.join();
  }
  // Close the listening socket too: connections still queued in the backlog are refused at
  // once, instead of waiting out the shutdown grace period for an accept that never comes.
  fd_.reset();
}

bool UnixListener::Pause(absl::Duration d) {
  pollfd p{wake_read_.get(), POLLIN, 0};
  int r = ::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(d)));
  return r > 0 && p.revents != 0;
}

void UnixListener::AcceptLoop() {
  LogRateLimiter log_limit(absl::Seconds(1));
  auto log_allowed = [&](absl::string_view key, uint64_t* held_back) {
    return log_limit.Allow(key, absl::Now(), held_back);
  };
  // After a failed accept, poll is not trusted to wait (the listening socket stays readable):
  // the loop leaves the socket alone this long before it polls it again.
  absl::Duration pause = absl::ZeroDuration();
  while (true) {
    if (pause > absl::ZeroDuration() && Pause(pause)) return;
    pollfd fds[2] = {{fd_.get(), POLLIN, 0}, {wake_read_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("event=accept_poll_failed socket={} error=\"{}\"", options_.label,
                    std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    accept_calls_.fetch_add(1, std::memory_order_relaxed);
    int raw = ::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (raw < 0) {
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || err == ECONNABORTED) continue;
      const bool out_of_fds = err == EMFILE || err == ENFILE;
      bool shed = false;
      if (out_of_fds) {
        accept_calls_.fetch_add(1, std::memory_order_relaxed);
        shed = reserve_.Shed(fd_.get());
        if (shed) shed_.fetch_add(1, std::memory_order_relaxed);
      }
      pause = AcceptReserve::ShedPause(shed);
      uint64_t held_back = 0;
      if (log_allowed(absl::StrCat("accept_failed/", err), &held_back)) {
        spdlog::warn("event=accept_failed socket={} error=\"{}\" shed={} held_back={} pause_ms={}",
                     options_.label, std::strerror(err), shed ? "yes" : "no", held_back,
                     absl::ToInt64Milliseconds(pause));
      }
      continue;
    }
    pause = absl::ZeroDuration();
    UniqueFd conn(raw);
    absl::StatusOr<SocketCredentials> creds = PeerSocketCredentials(conn.get());
    std::string refusal;
    if (!creds.ok()) {
      refusal = "credentials unknown";
    } else if (!options_.policy.Allows(*creds)) {
      refusal = "not an allowed user";
    } else if (options_.max_connections > 0 && options_.table->Live() >= options_.max_connections) {
      refusal = absl::StrCat("the sidecar holds ", options_.max_connections,
                             " connections, its limit (RLIMIT_NOFILE less a reserve)");
    } else if (options_.max_connections_per_uid > 0 &&
               options_.table->LiveFor(creds->uid, options_.channel) >=
                   options_.max_connections_per_uid) {
      refusal = absl::StrCat("this uid holds ", options_.max_connections_per_uid,
                             " connections on ", options_.label, " (", options_.per_uid_flag, ")");
    }
    if (!refusal.empty()) {
      refused_.fetch_add(1, std::memory_order_relaxed);
      const int64_t uid = creds.ok() ? static_cast<int64_t>(creds->uid) : -1;
      const int64_t gid = creds.ok() ? static_cast<int64_t>(creds->gid) : -1;
      uint64_t held_back = 0;
      if (log_allowed(absl::StrCat("refused/", uid, "/", refusal), &held_back)) {
        spdlog::warn("event=connection_refused uid={} gid={} socket={} reason=\"{}\" held_back={}",
                     uid, gid, options_.label, refusal, held_back);
      }
      continue;  // conn closes
    }
    options_.table->Record(conn.get(), options_.channel, *creds);
    handler_(std::move(conn), *creds);
  }
}

}  // namespace arfuse
