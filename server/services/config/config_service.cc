#include "server/services/config/config_service.h"

#include <spdlog/spdlog.h>

#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "config/config_convert.h"
#include "server/engine_api/doorbell_host.h"
#include "server/services/common/grpc_status.h"

namespace arfuse {
namespace {

// Finishes a unary call with either the handler's response or its status.
template <typename Response, typename Handler>
grpc::ServerUnaryReactor* Serve(grpc::CallbackServerContext* context, Response* response,
                                const char* method, Handler&& handler) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = CheckClientApiVersion(*context);
  if (status.ok()) {
    absl::StatusOr<Response> result = handler();
    if (result.ok()) {
      *response = std::move(*result);
    } else {
      status = result.status();
    }
  }
  if (!status.ok()) {
    spdlog::debug("event=config_rpc_failed method={} code={} message=\"{}\"", method,
                  absl::StatusCodeToString(status.code()), std::string(status.message()));
  }
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

void LogNoticesOncePerProcess(const config::Decision& decision) {
  static std::mutex mu;
  static std::set<std::string>* logged = new std::set<std::string>();  // never destroyed
  std::lock_guard<std::mutex> lock(mu);
  for (const std::string& notice : decision.notices) {
    if (logged->insert(notice).second) spdlog::info("event=config_notice notice=\"{}\"", notice);
  }
}

ConfigService::ConfigService(ConfigServiceOptions options) : options_(std::move(options)) {}

absl::StatusOr<v1::ResolveResponse> ConfigService::HandleResolve(
    const v1::ResolveRequest& request) const {
  config::Topology topology = options_.topology;
  if (request.has_topology()) {
    ARFUSE_ASSIGN_OR_RETURN(topology, config::TopologyFromProto(request.topology()));
  }
  config::FusionFlags flags = options_.flags;
  if (request.has_flags()) {
    ARFUSE_ASSIGN_OR_RETURN(flags, config::FlagsFromProto(request.flags(), options_.flags.rules));
  }
  config::CaptureRequest capture = options_.capture;
  if (request.has_capture()) {
    ARFUSE_ASSIGN_OR_RETURN(capture, config::CaptureFromProto(request.capture()));
    if (!capture.mnnvl_capture_safe)
      capture.mnnvl_capture_safe = options_.capture.mnnvl_capture_safe;
  }
  // The default environment, like the library and the CLI: Resolve is a what-if that may name
  // another topology than this server's, so this server's data planes do not enter it.
  ARFUSE_ASSIGN_OR_RETURN(config::Decision decision, config::Resolve(flags, topology, capture));
  v1::ResolveResponse response;
  *response.mutable_decision() = config::DecisionToProto(decision);
  *response.mutable_topology() = config::TopologyToProto(topology);
  return response;
}

absl::StatusOr<v1::NegotiateResponse> ConfigService::HandleNegotiate(
    const v1::NegotiateRequest& request) const {
  if (!options_.snapshot) {
    return absl::UnavailableError("the sidecar has no group decision yet; retry");
  }
  ARFUSE_ASSIGN_OR_RETURN(ConfigSnapshot snapshot, options_.snapshot());

  config::CaptureRequest capture = options_.capture;
  if (request.has_capture()) {
    ARFUSE_ASSIGN_OR_RETURN(capture, config::CaptureFromProto(request.capture()));
    // The sidecar declares its own kernels' capture safety; a client may only be more careful.
    capture.mnnvl_capture_safe = options_.capture.mnnvl_capture_safe;
    if (request.capture().has_mnnvl_capture_safe()) {
      capture.mnnvl_capture_safe = options_.capture.mnnvl_capture_safe.value_or(true) &&
                                   request.capture().mnnvl_capture_safe();
    }
  }

  config::NegotiationEnvironment env;
  env.workspace_max_tokens = snapshot.workspace_max_tokens;
  if (snapshot.device == v1::DEVICE_KIND_CUDA) {
    env.mps_detected = snapshot.mps_detected;
    env.doorbell_hop_us = snapshot.doorbell_hop_us;
    env.doorbell_slots = kDoorbellPlaneSlots;
  } else {
    env.doorbell_available = false;
    env.doorbell_unavailable_reason = snapshot.device == v1::DEVICE_KIND_HOST
                                          ? "host device mode has no CUDA doorbell"
                                          : "device kind unknown";
  }

  const config::Decision decision = config::Negotiate(snapshot.decision, capture, env);
  v1::NegotiateResponse response;
  *response.mutable_decision() = config::DecisionToProto(decision);
  response.set_device(snapshot.device);
  response.set_rank(static_cast<uint32_t>(snapshot.rank));
  response.set_world_size(static_cast<uint32_t>(snapshot.world_size));
  response.set_mps_detected(snapshot.mps_detected);
  response.set_doorbell_hop_us(snapshot.doorbell_hop_us);
  response.mutable_server_api()->set_major(kApiMajor);
  response.mutable_server_api()->set_minor(kApiMinor);
  return response;
}

grpc::ServerUnaryReactor* ConfigService::Resolve(grpc::CallbackServerContext* context,
                                                 const v1::ResolveRequest* request,
                                                 v1::ResolveResponse* response) {
  return Serve(context, response, "Resolve", [&] { return HandleResolve(*request); });
}

grpc::ServerUnaryReactor* ConfigService::Negotiate(grpc::CallbackServerContext* context,
                                                   const v1::NegotiateRequest* request,
                                                   v1::NegotiateResponse* response) {
  return Serve(context, response, "Negotiate", [&] { return HandleNegotiate(*request); });
}

}  // namespace arfuse
