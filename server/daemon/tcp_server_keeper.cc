#include "server/daemon/tcp_server_keeper.h"

#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "spdlog/spdlog.h"

namespace arfuse {

std::pair<std::string, int> SplitHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || address.find(']', colon) != std::string::npos ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port)) {
    return {address, -1};
  }
  return {address.substr(0, colon), port};
}

std::vector<UniqueFd> ListeningTcpSockets(int port) {
  std::vector<UniqueFd> out;
  std::vector<int> numbers;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    const int own = ::dirfd(d);
    while (dirent* e = ::readdir(d)) {
      int n = -1;
      if (absl::SimpleAtoi(e->d_name, &n) && n != own) numbers.push_back(n);
    }
    ::closedir(d);
  }
  for (int n : numbers) {
    // A duplicate first: the number may be closed and reused meanwhile, and every check below is
    // then made on whatever it is now, which is kept only if it is such a socket.
    UniqueFd dup(::fcntl(n, F_DUPFD_CLOEXEC, 0));
    if (!dup) continue;
    int listening = 0;
    socklen_t len = sizeof(listening);
    if (::getsockopt(dup.get(), SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening) {
      continue;
    }
    sockaddr_storage ss{};
    socklen_t sl = sizeof(ss);
    if (::getsockname(dup.get(), reinterpret_cast<sockaddr*>(&ss), &sl) != 0) continue;
    int p = -1;
    if (ss.ss_family == AF_INET) p = ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    if (ss.ss_family == AF_INET6) p = ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
    if (p == port) out.push_back(std::move(dup));
  }
  return out;
}

bool DescriptorsFree(int n) {
  std::vector<UniqueFd> probe;
  probe.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    probe.emplace_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!probe.back()) return false;
  }
  return true;
}

absl::StatusOr<std::unique_ptr<TcpServerKeeper>> TcpServerKeeper::Start(
    const std::string& address, Build build, TcpServerKeeperOptions options) {
  auto [host, port] = SplitHostPort(address);
  if (port < 0) {
    return absl::InvalidArgumentError(absl::StrCat("no port in ", address));
  }
  std::unique_ptr<TcpServerKeeper> k(new TcpServerKeeper(host, std::move(build), options));
  int bound = 0;
  std::unique_ptr<grpc::Server> first = k->build_(address, &bound);
  if (first == nullptr || bound == 0) {
    if (first != nullptr) first->Shutdown();
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", address, " (in use or not permitted)"));
  }
  k->port_ = bound;
  k->servers_.push_back(std::move(first));
  k->watched_ = ListeningTcpSockets(bound);
  k->thread_ = std::thread([p = k.get()] { p->Watch(); });
  return k;
}

TcpServerKeeper::TcpServerKeeper(std::string host, Build build, TcpServerKeeperOptions options)
    : host_(std::move(host)), build_(std::move(build)), options_(options) {}

TcpServerKeeper::~TcpServerKeeper() { Shutdown(std::chrono::system_clock::now()); }

void TcpServerKeeper::Shutdown(std::chrono::system_clock::time_point deadline) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::vector<std::unique_ptr<grpc::Server>> servers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    servers.swap(servers_);
  }
  for (auto& s : servers) s->Shutdown(deadline);
}

bool TcpServerKeeper::Stuck(absl::Time now) {
  bool pending = false;
  for (const UniqueFd& fd : watched_) {
    pollfd p{fd.get(), POLLIN, 0};
    if (::poll(&p, 1, 0) > 0 && (p.revents & POLLIN)) pending = true;
  }
  if (!pending) {
    stuck_since_ = absl::InfiniteFuture();
    return false;
  }
  if (stuck_since_ == absl::InfiniteFuture()) stuck_since_ = now;
  return now - stuck_since_ >= options_.stuck_after;
}

bool TcpServerKeeper::Rebuild() {
  // Building a server takes descriptors of its own; gRPC aborts on some failures to get them.
  if (!DescriptorsFree(options_.headroom)) return false;
  // Out of the port's accept path: its backlog is refused, and the port is free for a new
  // listener (both have SO_REUSEADDR, and the old socket no longer listens).
  for (const UniqueFd& fd : watched_) ::shutdown(fd.get(), SHUT_RDWR);
  const std::string address = absl::StrCat(host_, ":", port_);
  int bound = 0;
  std::unique_ptr<grpc::Server> fresh = build_(address, &bound);
  if (fresh == nullptr || bound != port_) {
    if (fresh != nullptr) fresh->Shutdown(std::chrono::system_clock::now());
    return false;
  }
  std::unique_ptr<grpc::Server> oldest;
  {
    std::lock_guard<std::mutex> lock(mu_);
    servers_.push_back(std::move(fresh));
    if (servers_.size() > options_.max_retired + 1) {
      oldest = std::move(servers_.front());
      servers_.erase(servers_.begin());
    }
  }
  if (oldest != nullptr) oldest->Shutdown(std::chrono::system_clock::now());
  watched_ = ListeningTcpSockets(port_);
  stuck_since_ = absl::InfiniteFuture();
  rebuilt_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void TcpServerKeeper::Watch() {
  LogRateLimiter log_limit(absl::Seconds(1));
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, absl::ToChronoNanoseconds(options_.interval), [this] { return stop_; });
      if (stop_) return;
    }
    const absl::Time now = absl::Now();
    if (!stuck_ && Stuck(now)) {
      stuck_ = true;
      spdlog::warn(
          "event=tcp_listener_stuck address={}:{} reason=\"a connection waited {} ms "
          "for accept (gRPC's listener stops after accept fails with EMFILE)\"",
          host_, port_, absl::ToInt64Milliseconds(options_.stuck_after));
    }
    if (!stuck_) continue;
    if (Rebuild()) {
      stuck_ = false;
      spdlog::info("event=tcp_listener_rebuilt address={}:{} servers={}", host_, port_, [this] {
        std::lock_guard<std::mutex> lock(mu_);
        return servers_.size();
      }());
    } else {
      uint64_t held_back = 0;
      if (log_limit.Allow("rebuild", now, &held_back)) {
        spdlog::warn("event=tcp_listener_rebuild_waiting address={}:{} held_back={}", host_, port_,
                     held_back);
      }
    }
  }
}

}  // namespace arfuse
