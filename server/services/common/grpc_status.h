// The one place where absl::Status becomes grpc::Status, and where a client's API version is
// checked. Codes keep their meaning (the gRPC litmus test): UNAVAILABLE retry the call, ABORTED
// retry higher up, FAILED_PRECONDITION fix state first, INVALID_ARGUMENT fix the request.
#pragma once

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"

namespace arfuse {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// OK when the client sent no `arfuse-api-version` metadata (an older client) or one with our
// major version; FAILED_PRECONDITION naming both versions otherwise.
absl::Status CheckClientApiVersion(const grpc::ServerContextBase& context);

}  // namespace arfuse
