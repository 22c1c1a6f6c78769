// arfuse.v1.Config: Resolve computes a decision with the library rules (config/) for the
// request's flags and topology, or the server's own; Negotiate answers for the group's current
// decision, as the daemon reports it through a snapshot function.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "arfuse/v1/config.grpc.pb.h"
#include "config/fusion_config.h"

namespace arfuse {

// What the daemon knows about its group right now.
struct ConfigSnapshot {
  // The group's decision after resolution and the rank vote (ResolveBackend, then Consensus);
  // Negotiate fills the mode and data plane per request.
  config::Decision decision;
  v1::DeviceKind device = v1::DEVICE_KIND_UNSPECIFIED;
  int rank = 0;
  int world_size = 1;
  bool mps_detected = false;
  // Measured by the doorbell self-test; 0 when not measured.
  double doorbell_hop_us = 0;
  // The workspace's capacity in tokens (--max-tokens); 0: not known. Caps the decision's
  // max_tokens_per_batch.
  uint32_t workspace_max_tokens = 0;
};

struct ConfigServiceOptions {
  // The server's own GPU and group: Resolve uses it when a request has no topology.
  config::Topology topology;
  // The server's own flags: Resolve uses them when a request has no flags, and their rule set
  // when the request's flags leave fusion_rules unset.
  config::FusionFlags flags;
  // Defaults for requests without a capture. Its mnnvl_capture_safe is the ops override
  // (--mnnvl-capture-safe): it fills a Resolve request that leaves the field unset, and Negotiate
  // takes the more conservative of it and the request's value.
  config::CaptureRequest capture;
  // Called once per Negotiate call on a gRPC callback thread: must not block. Returns UNAVAILABLE
  // (or another status, passed to the client) while the group has not decided yet. Empty:
  // Negotiate answers UNAVAILABLE.
  std::function<absl::StatusOr<ConfigSnapshot>()> snapshot;
};

// Logs a decision's notices at INFO, each text once per process (upstream logs its
// mnnvl-to-trtllm fallback once per process, however often the group re-forms). Thread-safe.
void LogNoticesOncePerProcess(const config::Decision& decision);

class ConfigService final : public v1::Config::CallbackService {
 public:
  explicit ConfigService(ConfigServiceOptions options);

  grpc::ServerUnaryReactor* Resolve(grpc::CallbackServerContext* context,
                                    const v1::ResolveRequest* request,
                                    v1::ResolveResponse* response) override;
  grpc::ServerUnaryReactor* Negotiate(grpc::CallbackServerContext* context,
                                      const v1::NegotiateRequest* request,
                                      v1::NegotiateResponse* response) override;

  // The handlers without the transport (API version checked by the RPC methods only).
  absl::StatusOr<v1::ResolveResponse> HandleResolve(const v1::ResolveRequest& request) const;
  absl::StatusOr<v1::NegotiateResponse> HandleNegotiate(const v1::NegotiateRequest& request) const;

 private:
  const ConfigServiceOptions options_;
};

}  // namespace arfuse
