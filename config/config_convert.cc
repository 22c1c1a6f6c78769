#include "config/config_convert.h"

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"

namespace arfuse::config {
namespace {

absl::StatusOr<int> ToInt(const char* field, uint32_t value) {
  if (value > static_cast<uint32_t>(std::numeric_limits<int>::max())) {
    return absl::InvalidArgumentError(absl::StrCat(field, " ", value, " is out of range"));
  }
  return static_cast<int>(value);
}

const google::protobuf::FieldDescriptor* FlagField(const FusionFlagSpec& spec) {
  return v1::FusionFlags::descriptor()->FindFieldByName(spec.ident);
}

}  // namespace

// The fusion flags travel field by field through reflection: each flag's v1.FusionFlags field has
// the flag's ident for its name (a bool for a switch, a string otherwise; the config tests check
// every one), so a new flag needs no code here.
v1::FusionFlags FlagsToProto(const FusionFlags& flags) {
  v1::FusionFlags p;
  const google::protobuf::Reflection* reflection = p.GetReflection();
  for (const FusionFlagSpec& spec : FusionFlagTable()) {
    const google::protobuf::FieldDescriptor* field = FlagField(spec);
    std::optional<std::string> text = spec.Get(flags);
    if (field == nullptr || !text) continue;
    if (field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_BOOL) {
      reflection->SetBool(&p, field, *text == "true");
    } else {
      reflection->SetString(&p, field, *text);
    }
  }
  return p;
}

absl::StatusOr<FusionFlags> FlagsFromProto(const v1::FusionFlags& p, RuleSet default_rules) {
  FusionFlags flags;
  flags.rules = default_rules;
  const google::protobuf::Reflection* reflection = p.GetReflection();
  for (const FusionFlagSpec& spec : FusionFlagTable()) {
    const google::protobuf::FieldDescriptor* field = FlagField(spec);
    // Unset (or, without presence, the type's zero value): the flag's default.
    if (field == nullptr || !reflection->HasField(p, field)) continue;
    const std::string text = field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_BOOL
                                 ? (reflection->GetBool(p, field) ? "true" : "false")
                                 : reflection->GetString(p, field);
    if (absl::Status st = spec.Assign(flags, text); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("flags.", spec.ident, ": ", st.message()));
    }
  }
  return flags;
}

v1::Topology TopologyToProto(const Topology& t) {
  v1::Topology p;
  p.set_sm(static_cast<uint32_t>(t.sm));
  p.set_tp_size(static_cast<uint32_t>(t.tp));
  p.set_nnodes(static_cast<uint32_t>(t.nnodes));
  return p;
}

absl::StatusOr<Topology> TopologyFromProto(const v1::Topology& p) {
  Topology t;
  ARFUSE_ASSIGN_OR_RETURN(t.sm, ToInt("topology.sm", p.sm()));
  ARFUSE_ASSIGN_OR_RETURN(t.tp, ToInt("topology.tp_size", p.tp_size()));
  ARFUSE_ASSIGN_OR_RETURN(t.nnodes, ToInt("topology.nnodes", p.nnodes()));
  return t;
}

v1::CudaGraphMode CudaGraphModeToProto(CudaGraphMode mode) {
  switch (mode) {
    case CudaGraphMode::kNone:
      return v1::CUDA_GRAPH_MODE_NONE;
    case CudaGraphMode::kPiecewise:
      return v1::CUDA_GRAPH_MODE_PIECEWISE;
    case CudaGraphMode::kFull:
      return v1::CUDA_GRAPH_MODE_FULL;
  }
  return v1::CUDA_GRAPH_MODE_UNSPECIFIED;
}

absl::StatusOr<CudaGraphMode> CudaGraphModeFromProto(v1::CudaGraphMode mode, const char* field) {
  switch (mode) {
    case v1::CUDA_GRAPH_MODE_UNSPECIFIED:
    case v1::CUDA_GRAPH_MODE_NONE:
      return CudaGraphMode::kNone;
    case v1::CUDA_GRAPH_MODE_PIECEWISE:
      return CudaGraphMode::kPiecewise;
    case v1::CUDA_GRAPH_MODE_FULL:
      return CudaGraphMode::kFull;
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " ", static_cast<int>(mode), " is not a known mode"));
}

v1::DataPlane DataPlaneToProto(DataPlane plane) {
  switch (plane) {
    case DataPlane::kDoorbell:
      return v1::DATA_PLANE_DOORBELL;
    case DataPlane::kInStream:
      return v1::DATA_PLANE_INSTREAM;
    case DataPlane::kEager:
      break;
  }
  return v1::DATA_PLANE_EAGER;
}

absl::StatusOr<DataPlane> DataPlaneFromProto(v1::DataPlane plane, const char* field) {
  switch (plane) {
    case v1::DATA_PLANE_EAGER:
      return DataPlane::kEager;
    case v1::DATA_PLANE_DOORBELL:
      return DataPlane::kDoorbell;
    case v1::DATA_PLANE_INSTREAM:
      return DataPlane::kInStream;
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " ", static_cast<int>(plane), " is not a known data plane"));
}

v1::CaptureRequest CaptureToProto(const CaptureRequest& c) {
  v1::CaptureRequest p;
  p.set_cuda_graph_mode(CudaGraphModeToProto(c.mode));
  p.set_fused_op_in_graph(c.fused_op_in_graph);
  if (c.mnnvl_capture_safe) p.set_mnnvl_capture_safe(*c.mnnvl_capture_safe);
  p.set_client_loads_kernels(c.client_loads_kernels);
  p.set_call_sites(c.call_sites);
  if (c.prefill_mode) p.set_prefill_cuda_graph_mode(CudaGraphModeToProto(*c.prefill_mode));
  if (c.decode_mode) p.set_decode_cuda_graph_mode(CudaGraphModeToProto(*c.decode_mode));
  return p;
}

absl::StatusOr<CaptureRequest> CaptureFromProto(const v1::CaptureRequest& p) {
  CaptureRequest c;
  ARFUSE_ASSIGN_OR_RETURN(c.mode, CudaGraphModeFromProto(p.cuda_graph_mode()));
  c.fused_op_in_graph = p.fused_op_in_graph();
  if (p.has_mnnvl_capture_safe()) c.mnnvl_capture_safe = p.mnnvl_capture_safe();
  c.client_loads_kernels = p.client_loads_kernels();
  c.call_sites = p.call_sites();
  if (p.has_prefill_cuda_graph_mode()) {
    ARFUSE_ASSIGN_OR_RETURN(
        c.prefill_mode,
        CudaGraphModeFromProto(p.prefill_cuda_graph_mode(), "capture.prefill_cuda_graph_mode"));
  }
  if (p.has_decode_cuda_graph_mode()) {
    ARFUSE_ASSIGN_OR_RETURN(
        c.decode_mode,
        CudaGraphModeFromProto(p.decode_cuda_graph_mode(), "capture.decode_cuda_graph_mode"));
  }
  return c;
}

v1::Decision DecisionToProto(const Decision& d) {
  v1::Decision p;
  p.set_backend(d.backend);
  p.set_fusion_enabled(d.fusion_enabled);
  p.set_cuda_graph_mode(CudaGraphModeToProto(d.cuda_graph_mode));
  p.set_data_plane(DataPlaneToProto(d.data_plane));
  for (const std::string& w : d.warnings) p.add_warnings(w);
  for (const std::string& r : d.reasons) p.add_reasons(r);
  p.set_prefill_cuda_graph_mode(CudaGraphModeToProto(d.prefill.mode));
  p.set_prefill_data_plane(DataPlaneToProto(d.prefill.data_plane));
  p.set_decode_cuda_graph_mode(CudaGraphModeToProto(d.decode.mode));
  p.set_decode_data_plane(DataPlaneToProto(d.decode.data_plane));
  p.set_max_tokens_per_batch(d.max_tokens_per_batch);
  p.set_fusion_rules(RuleSetName(d.rules));
  for (const std::string& n : d.notices) p.add_notices(n);
  return p;
}

absl::StatusOr<Decision> DecisionFromProto(const v1::Decision& p) {
  Decision d;
  if (p.backend() != kBackendNone && p.backend() != kBackendTrtllm &&
      p.backend() != kBackendMnnvl) {
    return absl::InvalidArgumentError(absl::StrCat("decision.backend \"", p.backend().substr(0, 32),
                                                   "\" is not trtllm, mnnvl or none"));
  }
  d.backend = p.backend();
  d.fusion_enabled = p.fusion_enabled();
  ARFUSE_ASSIGN_OR_RETURN(d.cuda_graph_mode,
                          CudaGraphModeFromProto(p.cuda_graph_mode(), "decision.cuda_graph_mode"));
  ARFUSE_ASSIGN_OR_RETURN(d.data_plane, DataPlaneFromProto(p.data_plane()));
  d.warnings.assign(p.warnings().begin(), p.warnings().end());
  d.reasons.assign(p.reasons().begin(), p.reasons().end());
  d.notices.assign(p.notices().begin(), p.notices().end());
  d.max_tokens_per_batch = p.max_tokens_per_batch();
  if (!p.fusion_rules().empty()) {
    absl::StatusOr<RuleSet> rules = ParseRuleSet(p.fusion_rules());
    if (!rules.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("decision.fusion_rules: ", rules.status().message()));
    }
    d.rules = *rules;
  }
  // A server that predates the per-phase fields answered for every phase at once.
  d.prefill = {d.cuda_graph_mode, d.data_plane};
  d.decode = {d.cuda_graph_mode, d.data_plane};
  if (p.prefill_cuda_graph_mode() != v1::CUDA_GRAPH_MODE_UNSPECIFIED) {
    ARFUSE_ASSIGN_OR_RETURN(
        d.prefill.mode,
        CudaGraphModeFromProto(p.prefill_cuda_graph_mode(), "decision.prefill_cuda_graph_mode"));
  }
  if (p.prefill_data_plane() != v1::DATA_PLANE_UNSPECIFIED) {
    ARFUSE_ASSIGN_OR_RETURN(
        d.prefill.data_plane,
        DataPlaneFromProto(p.prefill_data_plane(), "decision.prefill_data_plane"));
  }
  if (p.decode_cuda_graph_mode() != v1::CUDA_GRAPH_MODE_UNSPECIFIED) {
    ARFUSE_ASSIGN_OR_RETURN(
        d.decode.mode,
        CudaGraphModeFromProto(p.decode_cuda_graph_mode(), "decision.decode_cuda_graph_mode"));
  }
  if (p.decode_data_plane() != v1::DATA_PLANE_UNSPECIFIED) {
    ARFUSE_ASSIGN_OR_RETURN(d.decode.data_plane, DataPlaneFromProto(p.decode_data_plane(),
                                                                    "decision.decode_data_plane"));
  }
  return d;
}

}  // namespace arfuse::config
