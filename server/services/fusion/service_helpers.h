// Small helpers shared by the Fusion service's source files (fusion_service.cc, instream_rpc.cc).
#pragma once

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "server/services/common/grpc_status.h"

namespace arfuse {

inline grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* ctx,
                                           const absl::Status& s) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

inline absl::Status EngineUnavailable() {
  return absl::UnavailableError("the sidecar's engine is still initializing; retry shortly");
}

}  // namespace arfuse
