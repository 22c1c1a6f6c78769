// Connects to the sidecar at argv[1] with the installed C++ client and prints what its session
// says. Exit 0 when connected, 1 when not (the message names why).
#include <cstdio>
#include <string>

#include "client/cpp/client.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: arfuse-downstream unix:/path/to/arfused.sock\n");
    return 2;
  }
  arfuse::client::ClientOptions options;
  options.target = argv[1];
  options.client_name = "arfuse-downstream";
  options.connect_timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<arfuse::client::Client>> client =
      arfuse::client::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "arfuse-downstream: %s\n",
                 std::string(client.status().ToString()).c_str());
    return 1;
  }
  const arfuse::client::SessionInfo& s = (*client)->session();
  std::printf("connected: rank %u of %u, device %s, server API %u.%u, dtype size %zu\n", s.rank,
              s.world_size, arfuse::v1::DeviceKind_Name(s.device).c_str(), s.server_api_major,
              s.server_api_minor, arfuse::DTypeSize(arfuse::DType::kBF16));
  return 0;
}
