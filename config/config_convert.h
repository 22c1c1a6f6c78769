// Conversions between the arfuse.v1 Config messages and the plain structs of config/.
// Shared by the Config service and by clients (arfusectl) so both read the API the same way.
// Proto-to-struct conversions validate enum values and integer ranges (INVALID_ARGUMENT naming the
// field); the rules themselves validate the rest.
#pragma once

#include "absl/status/statusor.h"
#include "arfuse/v1/config.pb.h"
#include "config/fusion_config.h"

namespace arfuse::config {

v1::FusionFlags FlagsToProto(const FusionFlags& flags);
// An unset fusion_rules takes `default_rules` (a server passes its own). INVALID_ARGUMENT naming
// the field for an unknown rule set; the rules validate the other values.
absl::StatusOr<FusionFlags> FlagsFromProto(const v1::FusionFlags& flags,
                                           RuleSet default_rules = kDefaultRuleSet);

v1::Topology TopologyToProto(const Topology& topology);
// Zero fields are not defaulted: they fail validation in the rules ("tp must be >= 1").
absl::StatusOr<Topology> TopologyFromProto(const v1::Topology& topology);

v1::CudaGraphMode CudaGraphModeToProto(CudaGraphMode mode);
// UNSPECIFIED means "none" (the API's default). `field` names the field in the message.
absl::StatusOr<CudaGraphMode> CudaGraphModeFromProto(v1::CudaGraphMode mode,
                                                     const char* field = "capture.cuda_graph_mode");

v1::DataPlane DataPlaneToProto(DataPlane plane);
absl::StatusOr<DataPlane> DataPlaneFromProto(v1::DataPlane plane,
                                             const char* field = "decision.data_plane");

v1::CaptureRequest CaptureToProto(const CaptureRequest& capture);
absl::StatusOr<CaptureRequest> CaptureFromProto(const v1::CaptureRequest& capture);

v1::Decision DecisionToProto(const Decision& decision);
// Per-phase fields left UNSPECIFIED (a server that predates them) take the one-mode fields; an
// empty fusion_rules is the default rule set.
absl::StatusOr<Decision> DecisionFromProto(const v1::Decision& decision);

}  // namespace arfuse::config
