// A client of arfused for the security tests, run as another user (fork, setuid, exec): it tries
// one registration and prints "code=<status code> message=<message>" on stdout.
//
//   security_client named <socket> <shm_name> <bytes>   RegisterRegion host_shm by name
//   security_client memfd <socket> <bytes>              a sealed memfd of its own, by descriptor
//   security_client claim <socket> <ticket> <bytes>     RegisterRegion host_fd with a given ticket
#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "client/cpp/client.h"

namespace {

int Report(const absl::Status& s) {
  std::printf("code=%d message=%s\n", static_cast<int>(s.code()), std::string(s.message()).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using arfuse::client::Client;
  if (argc < 4) {
    std::fprintf(stderr, "usage: security_client named|memfd|claim <socket> ...\n");
    return 2;
  }
  const std::string mode = argv[1];
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
