// A client of arfused for the security tests, run as another user (fork, setuid, exec): it tries
// one registration and prints "code=<status code> message=<message>" on stdout.
//
//   security_client named <socket> <shm_name> <bytes>   RegisterRegion host_shm by name
//   security_client memfd <socket> <bytes>              a sealed memfd of its own, by descriptor
//   security_client claim <socket> <ticket> <bytes>     RegisterRegion host_fd with a given ticket
//   security_client flood <socket> <deposits> <fds> <idle>
//       <deposits> DEPOSITs of <fds> descriptors each on the fd channel (never claimed), then
//       <idle> idle fd-channel connections held open while it connects to the main socket;
//       prints "deposits_ok=N refused=N idle_open=N main=<code> message=<first refusal>"
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/cpp/client.h"
#include "common/fd/fd_channel_client.h"

namespace {

int Report(const absl::Status& s) {
  std::printf("code=%d message=%s\n", static_cast<int>(s.code()), std::string(s.message()).c_str());
  return 0;
}

int Flood(const std::string& socket, int deposits, int per, int idle) {
  const std::string fd_path = arfuse::FdChannelPath(socket);
  int ok = 0, refused = 0;
  std::string first_refusal;
  for (int i = 0; i < deposits; ++i) {
    std::vector<arfuse::UniqueFd> fds;
    std::vector<int> raw;
    for (int k = 0; k < per; ++k) {
      fds.emplace_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
      raw.push_back(fds.back().get());
    }
    absl::StatusOr<std::string> ticket = arfuse::DepositFds(fd_path, raw);
    if (ticket.ok()) {
      ++ok;
    } else {
      ++refused;
      if (first_refusal.empty()) {
        first_refusal = absl::StrCat("code=", static_cast<int>(ticket.status().code()), " ",
                                     ticket.status().message());
      }
    }
  }
  std::vector<arfuse::UniqueFd> held;
  for (int i = 0; i < idle; ++i) {
    arfuse::UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, fd_path.c_str(), sizeof(addr.sun_path) - 1);
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      held.push_back(std::move(fd));
    }
  }
  // Those over the cap are closed by the sidecar at once.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  int open = 0;
  for (const auto& fd : held) {
    pollfd p{fd.get(), POLLIN, 0};
    char c;
    const bool closed = ::poll(&p, 1, 0) > 0 && ::recv(fd.get(), &c, 1, MSG_DONTWAIT) == 0;
    open += closed ? 0 : 1;
  }
  arfuse::client::ClientOptions o;
  o.target = socket;
  o.client_name = "security-client";
  auto c = arfuse::client::Client::Connect(o);
  std::printf("deposits_ok=%d refused=%d idle_open=%d main=%d message=%s\n", ok, refused, open,
              static_cast<int>(c.status().code()), first_refusal.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using arfuse::client::Client;
  if (argc < 4) {
    std::fprintf(stderr, "usage: security_client named|memfd|claim|flood <socket> ...\n");
    return 2;
  }
  const std::string mode = argv[1];
  int deposits = 0, per = 0, idle = 0;
  if (mode == "flood" && argc == 6 && absl::SimpleAtoi(argv[3], &deposits) &&
      absl::SimpleAtoi(argv[4], &per) && absl::SimpleAtoi(argv[5], &idle)) {
    return Flood(argv[2], deposits, per, idle);
  }
  arfuse::client::ClientOptions o;
  o.target = argv[2];
  o.client_name = "security-client";
  auto c = Client::Connect(o);
  if (!c.ok()) return Report(c.status());
  uint64_t bytes = 0;
  if (mode == "named" && argc == 5 && absl::SimpleAtoi(argv[4], &bytes)) {
    return Report((*c)->RegisterHostShm("r", argv[3], bytes).status());
  }
  if (mode == "memfd" && argc == 4 && absl::SimpleAtoi(argv[3], &bytes)) {
    auto buf = arfuse::client::HostShmBuffer::Create(bytes, "mine");
    if (!buf.ok()) return Report(buf.status());
    return Report((*c)->RegisterHostBuffer("r", *buf).status());
  }
  if (mode == "claim" && argc == 5 && absl::SimpleAtoi(argv[4], &bytes)) {
    arfuse::v1::RegisterRegionRequest req;
    req.set_name("r");
    req.set_byte_size(bytes);
    req.mutable_host_fd()->set_fd_ticket(argv[3]);
    arfuse::v1::RegisterRegionResponse resp;
    grpc::ClientContext ctx;
    (*c)->PrepareContext(&ctx, absl::Seconds(10));
    grpc::Status s = (*c)->stub().RegisterRegion(&ctx, req, &resp);
    return Report(absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message()));
  }
  std::fprintf(stderr, "security_client: bad arguments\n");
  return 2;
}
