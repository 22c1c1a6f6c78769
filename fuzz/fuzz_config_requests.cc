// libFuzzer: arfuse.v1 Config requests (ResolveRequest, NegotiateRequest, Decision,
// CaptureRequest) as raw bytes -> ParseFromArray -> config/config_convert.h ->
// the config rules. First byte picks the message. Oracles besides ASan/UBSan:
//  - flag migration is idempotent (design §4 rule 1: migrating migrated flags changes nothing);
//  - Decision and CaptureRequest survive struct -> proto -> struct unchanged;
//  - identical reports from every rank reach rank 0's decision (design §4 rule 6).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "arfuse/v1/config.pb.h"
#include "config/config_convert.h"
#include "config/fusion_config.h"

namespace {

using namespace arfuse;
using namespace arfuse::config;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

void RoundTrip(const Decision& d) {
  absl::StatusOr<Decision> back = DecisionFromProto(DecisionToProto(d));
  Check(back.ok() && *back == d);
  (void)DecisionToJson(d);
}

const std::vector<NegotiationEnvironment>& Environments() {
  static const std::vector<NegotiationEnvironment> envs = [] {
    std::vector<NegotiationEnvironment> v(3);
    v[1].doorbell_available = false;
    v[1].doorbell_unavailable_reason = "host mode";
    v[2].mps_detected = false;
    v[2].doorbell_hop_us = 5.5;
    return v;
  }();
  return envs;
}

void Rules(const FusionFlags& flags, const Topology& topology, const CaptureRequest& capture) {
  (void)ValidateFlags(flags);
  (void)ValidateTopology(topology);
  MigratedFlags once = MigrateFlags(flags);
  MigratedFlags twice = MigrateFlags(once.flags);
  Check(twice.flags == once.flags && twice.warnings.empty());
  for (const auto& env : Environments()) {
    absl::StatusOr<Decision> d = Resolve(flags, topology, capture, env);
    if (d.ok()) RoundTrip(*d);
  }
  absl::StatusOr<Decision> resolved = ResolveBackend(flags, topology);
  if (!resolved.ok()) return;
  RankReport r0;
  r0.rank = 0;
  r0.flags = once.flags;
  r0.topology = topology;
  r0.decision = *resolved;
  RankReport r1 = r0;
  r1.rank = 1;
  absl::StatusOr<Decision> group = Consensus({r0, r1});
  Check(group.ok());
  Check(group->backend == resolved->backend && group->fusion_enabled == resolved->fusion_enabled);
  // And a dissenting rank turns the whole group off.
  r1.failure = "workspace allocation failed";
  absl::StatusOr<Decision> split = Consensus({r0, r1});
  Check(split.ok() && !split->fusion_enabled);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t which = data[0] % 4;
  const void* body = data + 1;
  const int len = static_cast<int>(size - 1);
  switch (which) {
    case 0: {
      v1::ResolveRequest req;
      if (!req.ParseFromArray(body, len)) return 0;
      absl::StatusOr<FusionFlags> parsed = FlagsFromProto(req.flags());
      if (!parsed.ok()) return 0;
      const FusionFlags flags = *parsed;
      Topology topology{90, 2, 1};
      if (req.has_topology()) {
        absl::StatusOr<Topology> t = TopologyFromProto(req.topology());
        if (!t.ok()) return 0;
        topology = *t;
      }
      absl::StatusOr<CaptureRequest> capture = CaptureFromProto(req.capture());
      if (!capture.ok()) return 0;
      Check(*FlagsFromProto(FlagsToProto(flags)) == flags);
      Rules(flags, topology, *capture);
      break;
    }
    case 1: {
      v1::NegotiateRequest req;
      if (!req.ParseFromArray(body, len)) return 0;
      absl::StatusOr<CaptureRequest> capture = CaptureFromProto(req.capture());
      if (!capture.ok()) return 0;
      for (const char* backend : {kBackendTrtllm, kBackendMnnvl, kBackendNone}) {
        Decision d;
        d.backend = backend;
        d.fusion_enabled = std::string(backend) != kBackendNone;
        for (const auto& env : Environments()) RoundTrip(Negotiate(d, *capture, env));
      }
      break;
    }
    case 2: {
      v1::Decision req;
      if (!req.ParseFromArray(body, len)) return 0;
      absl::StatusOr<Decision> d = DecisionFromProto(req);
      if (!d.ok()) return 0;
      RoundTrip(*d);
      RoundTrip(Negotiate(*d, CaptureRequest{}));
      break;
    }
    case 3: {
      v1::CaptureRequest req;
      if (!req.ParseFromArray(body, len)) return 0;
      absl::StatusOr<CaptureRequest> c = CaptureFromProto(req);
      if (!c.ok()) return 0;
      absl::StatusOr<CaptureRequest> back = CaptureFromProto(CaptureToProto(*c));
      Check(back.ok() && *back == *c);
      break;
    }
  }
  return 0;
}
