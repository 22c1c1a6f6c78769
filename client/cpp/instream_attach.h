// Attaching a process to its sidecar's in-stream plane from C++ (docs/instream.md): Fusion.Attach
// with libarfuse_client's versions, the response's descriptors picked up on the sidecar's fd
// socket, then arfuse_attach. A separate library from the gRPC client (arfuse_client_instream):
// only callers that launch in-stream load libarfuse_client.so.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "client/cpp/client.h"
#include "client/instream/arfuse_client.hpp"

namespace arfuse::client {

// The Attach request for `hiddens` (empty: the workspace's) with the versions of the
// libarfuse_client this process loaded.
v1::AttachRequest InStreamAttachRequest(const std::vector<uint32_t>& hiddens);

// Attaches for `hiddens`: Fusion.Attach, the descriptors the response names (host mode, VMM
// POSIX-FD memory) picked up on the sidecar's fd channel, then arfuse_attach. The sidecar's
// refusal comes back as it sent it. When the attach cannot complete here, the sidecar's
// attachment is detached again before returning.
absl::StatusOr<instream::InStreamContext> AttachInStream(Client& client,
                                                         const std::vector<uint32_t>& hiddens = {});

}  // namespace arfuse::client
