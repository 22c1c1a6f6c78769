// Small helpers shared by the Fusion service's source files (fusion_service.cc, eager_rpc.cc,
// doorbell_rpc.cc, instream_rpc.cc).
#pragma once

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "arfuse/v1/fusion.pb.h"
#include "server/engine_api/engine.h"
#include "server/services/common/grpc_status.h"

namespace arfuse {

inline grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* ctx,
                                           const absl::Status& s) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

inline v1::ExecPath ToProtoPath(ExecPath p) { return static_cast<v1::ExecPath>(p); }

inline absl::Status EngineUnavailable() {
  return absl::UnavailableError("the sidecar's engine is still initializing; retry shortly");
}

}  // namespace arfuse
