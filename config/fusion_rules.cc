// The decision: names and parsing of the topology and capture values, migration, auto-enable,
// backend resolution under a rule set, the runtime gate and feasibility (docs/config.md), and the
// decision as JSON.
#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/json.h"
#include "common/status_macros.h"
#include "config/fusion_config.h"
#include "config/internal.h"
#include "kernels/common/op_types.h"

namespace arfuse::config {
namespace {

using internal::Contains;
using internal::Quoted;

// Far above any NVLink domain; rejects garbage without limiting real deployments.
constexpr int kMaxRanks = 1 << 16;
// Upstream's texts, verbatim: scripts grep the frameworks' logs for them.
// ServerArgs._handle_deprecated_args (#23402 and later).
constexpr char kDeprecationWarning[] =
    "--enable-flashinfer-allreduce-fusion is deprecated. Please use "
    "--flashinfer-allreduce-fusion-backend=auto instead.";
// The model-specific auto-enable's INFO line (stored copies after #28789).
constexpr char kAutoEnablingPrefix[] =
    "Auto-enabling FlashInfer AllReduce Fusion on SM90/SM10X for ";
// flashinfer_comm_fusion.py's once-per-process INFO line of the mnnvl-to-trtllm fallback (the
// #23402 review; the condition there became _mnnvl_supported).
constexpr char kForcingTrtllmPrefix[] = "FlashInfer allreduce fusion: forcing trtllm backend (";
// flashinfer_comm_fusion.py's _resolve_backend ValueErrors (#28789 / #29063).
constexpr char kValueErrorArch[] =
    "FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs.";
constexpr char kValueErrorAutoMultiNode[] =
    "FlashInfer allreduce fusion does not support multi-node on non-Blackwell systems.";
constexpr char kValueErrorTrtllmMultiNode[] =
    "FlashInfer allreduce fusion trtllm backend supports single-node only.";
constexpr char kValueErrorMnnvl[] =
    "FlashInfer allreduce fusion mnnvl backend requires a Blackwell system, or SM90 single-node.";

std::string TopologyText(const Topology& t) {
  return absl::StrCat("sm=", t.sm, " tp=", t.tp, " nnodes=", t.nnodes);
}

std::string NodesText(int nnodes) {
  return nnodes == 1 ? "one node" : absl::StrCat(nnodes, " nodes");
}

}  // namespace

// ---- Names and parsing. ----

const std::vector<std::string>& AutoEnableArchitectures(RuleSet rules) {
  // The allowlist of the auto-enable block in ServerArgs._handle_model_specific_adjustments:
  // DeepseekV3/V32, GptOss, the GLM MoE family, MistralLarge3, Qwen3Moe/Next, Qwen3.5,
  // Kimi K2.5, InternS2 Preview. Both rule sets use the same list: the entries later copies add
  // (Qwen3VLMoe, NemotronH, DeepseekV4) cannot be dated against #29063 (docs/config.md).
  static const std::vector<std::string> archs = {
      "DeepseekV3ForCausalLM",
      "DeepseekV32ForCausalLM",
      "GptOssForCausalLM",
      "GlmMoeDsaForCausalLM",
      "Glm4MoeForCausalLM",
      "Glm4MoeLiteForCausalLM",
      "MistralLarge3ForCausalLM",
      "Qwen3MoeForCausalLM",
      "Qwen3NextForCausalLM",
      "KimiK25ForConditionalGeneration",
      "Qwen3_5MoeForConditionalGeneration",
      "InternS2PreviewForConditionalGeneration",
      "Qwen3_5ForConditionalGeneration",
  };
  static_cast<void>(rules);
  return archs;
}

const char* PhaseName(Phase phase) { return phase == Phase::kPrefill ? "prefill" : "decode"; }

const char* CudaGraphModeName(CudaGraphMode mode) {
  switch (mode) {
    case CudaGraphMode::kNone:
      return "none";
    case CudaGraphMode::kPiecewise:
      return "piecewise";
    case CudaGraphMode::kFull:
      return "full";
  }
  return "unknown";
}

const char* DataPlaneName(DataPlane plane) {
  switch (plane) {
    case DataPlane::kEager:
      return "eager";
    case DataPlane::kDoorbell:
      return "doorbell";
    case DataPlane::kInStream:
      return "instream";
  }
  return "unknown";
}

absl::StatusOr<CudaGraphMode> ParseCudaGraphMode(const std::string& text, const std::string& flag) {
  if (text == "none") return CudaGraphMode::kNone;
  if (text == "piecewise") return CudaGraphMode::kPiecewise;
  if (text == "full") return CudaGraphMode::kFull;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown ", flag, " ", Quoted(text), ": expected none, piecewise or full"));
}

absl::StatusOr<int> ParseSm(const std::string& text) {
  int sm = 0;
  const bool digits =
      !text.empty() && text.size() <= 4 &&
      std::all_of(text.begin(), text.end(), [](char c) { return absl::ascii_isdigit(c); });
  if (!digits || !absl::SimpleAtoi(text, &sm)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sm ", Quoted(text),
                     " is not a number: give the compute capability as <major><minor>, e.g. 90 "
                     "or 100"));
  }
  Topology probe{sm, 1, 1};
  ARFUSE_RETURN_IF_ERROR(ValidateTopology(probe));
  return sm;
}

absl::StatusOr<int> ParsePositiveInt(const std::string& flag, const std::string& text) {
  int value = 0;
  const bool digits = !text.empty() && std::all_of(text.begin(), text.end(),
                                                   [](char c) { return absl::ascii_isdigit(c); });
  if (!digits || !absl::SimpleAtoi(text, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", Quoted(text), " is not a positive integer"));
  }
  if (value < 1) return absl::InvalidArgumentError(absl::StrCat(flag, " must be >= 1, got 0"));
  if (value > kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", value, " is too large (max ", kMaxRanks, ")"));
  }
  return value;
}

absl::Status ValidateTopology(const Topology& t) {
  if (t.sm < kMinSm || t.sm > kMaxSm) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sm ", t.sm, " is not a compute capability: give <major><minor>, e.g. 90 or 100"));
  }
  if (t.tp < 1) return absl::InvalidArgumentError(absl::StrCat("tp must be >= 1, got ", t.tp));
  if (t.nnodes < 1) {
    return absl::InvalidArgumentError(absl::StrCat("nnodes must be >= 1, got ", t.nnodes));
  }
  if (t.tp > kMaxRanks || t.nnodes > kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("topology ", TopologyText(t), " is too large (max ", kMaxRanks, ")"));
  }
  // Every node holds at least one rank of the group; more nodes than ranks is a typo (--tp and
  // --nnodes swapped), not a topology.
  if (t.nnodes > t.tp) {
    return absl::InvalidArgumentError(absl::StrCat("nnodes ", t.nnodes, " is more than tp ", t.tp,
                                                   ": every node holds at least one rank"));
  }
  return absl::OkStatus();
}

// ---- The rules. ----

bool IsSm100Family(int sm) { return sm / 10 == 10; }

bool MnnvlSupported(int sm, int nnodes) {
  // Our mnnvl is unicast VMM (no multicast): the SM100 family reaches across an NVLink domain;
  // on SM90 it is only validated within one node.
  return IsSm100Family(sm) || (sm == 90 && nnodes == 1);
}

MigratedFlags MigrateFlags(const FusionFlags& flags) {
  MigratedFlags out{flags, {}};
  if (flags.enable_deprecated) {
    // Upstream warns only in the branch that applies the old flag; with an explicit backend the
    // old flag is dropped without a word.
    if (!flags.backend) {
      out.flags.backend = kBackendAuto;
      out.warnings.push_back(kDeprecationWarning);
    }
    // The old setting never survives: a second migration must not warn again.
    out.flags.enable_deprecated = false;
  }
  if (out.flags.enforce_disable && out.flags.backend) {
    out.warnings.push_back(absl::StrCat(kFlagEnforceDisable, " overrides ", kFlagBackend, "=",
                                        *out.flags.backend, ": fusion is off"));
    out.flags.backend.reset();
  }
  return out;
}

namespace {

// Upstream's auto-enable block (ServerArgs._handle_model_specific_adjustments): with no backend
// flag, "auto" for an allowlisted architecture on the rule set's GPUs, tp > 1, no DP attention,
// one node or the SM100 family, and no MoE all-to-all backend. Returns the conditions that fail.
std::vector<std::string> AutoEnableBlockers(const FusionFlags& f, const Topology& t) {
  std::vector<std::string> blockers;
  if (f.model_architecture.empty()) {
    blockers.push_back(absl::StrCat("no ", kFlagModelArchitecture,
                                    " (only allowlisted architectures are auto-enabled)"));
  } else if (!Contains(AutoEnableArchitectures(f.rules), f.model_architecture)) {
    blockers.push_back(
        absl::StrCat("architecture ", f.model_architecture, " is not on the allowlist"));
  }
  const bool gpu_ok =
      f.rules == RuleSet::kSglang23402 ? IsSm100Family(t.sm) : (t.sm == 90 || IsSm100Family(t.sm));
  if (!gpu_ok) {
    blockers.push_back(f.rules == RuleSet::kSglang23402
                           ? absl::StrCat("sm ", t.sm,
                                          " is not the SM100 family (sglang-23402 auto-enables "
                                          "only there)")
                           : absl::StrCat("sm ", t.sm, " is neither SM90 nor the SM100 family"));
  } else if (t.nnodes > 1 && !IsSm100Family(t.sm)) {
    blockers.push_back(absl::StrCat("sm ", t.sm, " on ", t.nnodes,
                                    " nodes (several nodes need the SM100 family)"));
  }
  if (f.dp_attention) blockers.push_back(absl::StrCat(kFlagDpAttention, " is set"));
  if (f.moe_a2a_backend != "none") {
    blockers.push_back(absl::StrCat(kFlagMoeA2aBackend, "=", f.moe_a2a_backend, " (not none)"));
  }
  return blockers;
}

// The backend name under sglang-23402: auto is mnnvl wherever _mnnvl_supported holds, else
// trtllm; an explicit mnnvl that is not supported becomes trtllm with an INFO notice. Other
// architectures resolve to trtllm too (upstream's unit test expects the name); the runtime gate
// keeps them unfused.
std::string ResolveName23402(const std::string& requested, const Topology& t, Decision& d) {
  const bool mnnvl_ok = MnnvlSupported(t.sm, t.nnodes);
  if (requested == kBackendAuto) {
    const char* name = mnnvl_ok ? kBackendMnnvl : kBackendTrtllm;
    d.reasons.push_back(absl::StrCat("auto resolved to ", name, " for sm ", t.sm, " on ",
                                     NodesText(t.nnodes),
                                     " (sglang-23402: mnnvl where it is supported, else trtllm)"));
    return name;
  }
  if (requested == kBackendMnnvl) {
    if (mnnvl_ok) {
      d.reasons.push_back(absl::StrCat(kFlagBackend, "=mnnvl, supported on sm ", t.sm, " on ",
                                       NodesText(t.nnodes)));
      return kBackendMnnvl;
    }
    d.notices.push_back(absl::StrCat(kForcingTrtllmPrefix,
                                     "mnnvl is supported on the SM100 family, or SM90 within one "
                                     "node; this is sm ",
                                     t.sm, " on ", NodesText(t.nnodes), ")."));
    d.reasons.push_back(absl::StrCat(kFlagBackend, "=mnnvl is not supported on sm ", t.sm, " on ",
                                     NodesText(t.nnodes), ": falling back to trtllm"));
    return kBackendTrtllm;
  }
  d.reasons.push_back(absl::StrCat(kFlagBackend, "=trtllm on sm ", t.sm));
  return kBackendTrtllm;
}

absl::Status UpstreamValueError(const char* text, const std::string& requested, const Topology& t) {
  return absl::InvalidArgumentError(absl::StrCat(
      text, " (", kFlagFusionRules, "=sglang-29063, sm ", t.sm, " on ", NodesText(t.nnodes), ", ",
      kFlagBackend, "=", requested, ": SGLang stops the server with this ValueError)"));
}

// The backend name under sglang-29063 (_resolve_backend of #28789 / #29063): auto is mnnvl on
// the SM100 family, trtllm on SM90 within one node; the five configurations below are errors.
absl::StatusOr<std::string> ResolveName29063(const std::string& requested, const Topology& t,
                                             Decision& d) {
  const bool sm100 = IsSm100Family(t.sm);
  const bool multi_node = t.nnodes > 1;
  if (!sm100 && t.sm != 90) return UpstreamValueError(kValueErrorArch, requested, t);
  if (requested == kBackendAuto) {
    if (multi_node && !sm100) return UpstreamValueError(kValueErrorAutoMultiNode, requested, t);
    const char* name = sm100 ? kBackendMnnvl : kBackendTrtllm;
    d.reasons.push_back(absl::StrCat("auto resolved to ", name, " for sm ", t.sm, " on ",
                                     NodesText(t.nnodes),
                                     " (sglang-29063: mnnvl on the SM100 family, trtllm on "
                                     "SM90)"));
    return name;
  }
  if (requested == kBackendTrtllm && multi_node) {
    return UpstreamValueError(kValueErrorTrtllmMultiNode, requested, t);
  }
  if (requested == kBackendMnnvl && !MnnvlSupported(t.sm, t.nnodes)) {
    return UpstreamValueError(kValueErrorMnnvl, requested, t);
  }
  d.reasons.push_back(
      absl::StrCat(kFlagBackend, "=", requested, " on sm ", t.sm, " on ", NodesText(t.nnodes)));
  return requested;
}

// Why a world size cannot fuse, or "" when the fused kernels serve it.
std::string WorldSizeBlocker(int tp) {
  if (IsSupportedWorldSize(tp)) return "";
  if (tp > kMaxWorldSize) {
    return absl::StrCat(
        "tp=", tp, " is more ranks than arfuse's fused kernels serve (2, 4, 8 or 16: FusionParams ",
        "holds kMaxWorldSize=", kMaxWorldSize,
        " peer workspaces, and arfused joins groups of at most 16 ranks; FlashInfer's mnnvl runs "
        "2-64): fusion disabled, the framework's own path runs (docs/config.md, world sizes 32 "
        "and 64)");
  }
  return absl::StrCat("tp=", tp,
                      " is not a world size the fused kernels support (2, 4, 8, 16): fusion "
                      "disabled, the unfused path runs");
}

}  // namespace

absl::StatusOr<Decision> ResolveBackend(const FusionFlags& flags, const Topology& topology) {
  ARFUSE_RETURN_IF_ERROR(ValidateTopology(topology));
  ARFUSE_RETURN_IF_ERROR(ValidateFlags(flags));
  const Topology& t = topology;

  MigratedFlags migrated = MigrateFlags(flags);
  Decision d;
  d.rules = flags.rules;
  d.warnings = std::move(migrated.warnings);
  const FusionFlags& f = migrated.flags;

  // Upstream's order: deprecated flags, then the model-specific auto-enable, then the
  // enforce-disable switch and deterministic inference, each of which clears the backend.
  std::optional<std::string> requested = f.backend;
  std::string not_enabled;
  if (!requested && !f.enforce_disable && !f.deterministic && t.tp > 1) {
    const std::vector<std::string> blockers = AutoEnableBlockers(f, t);
    if (blockers.empty()) {
      requested = kBackendAuto;
      d.reasons.push_back(absl::StrCat(kAutoEnablingPrefix, f.model_architecture, " (",
                                       RuleSetName(f.rules), ": no ", kFlagBackend, ", auto on sm ",
                                       t.sm, " with tp=", t.tp, ")"));
    } else {
      not_enabled = absl::StrCat("no ", kFlagBackend, ": fusion off, not auto-enabled (",
                                 absl::StrJoin(blockers, "; "), ")");
    }
  }

  // Overrides: each one alone forces the unfused path, so report every one given.
  if (f.enforce_disable) {
    d.reasons.push_back(absl::StrCat("fusion disabled by ", kFlagEnforceDisable));
  }
  if (f.deterministic) {
    d.reasons.push_back(
        absl::StrCat(kFlagDeterministic, " clears the backend: the unfused path runs"));
  }
  if (f.enforce_disable || f.deterministic) return d;

  // Upstream's workspace set-up returns before resolving anything for a single rank.
  if (t.tp == 1) {
    d.reasons.push_back(
        absl::StrCat("tp=1: nothing to reduce, fusion off",
                     requested ? absl::StrCat(" (", kFlagBackend, "=", *requested, ")") : ""));
    return d;
  }
  if (!requested) {
    d.reasons.push_back(not_enabled);
    return d;
  }

  if (f.rules == RuleSet::kSglang29063) {
    ARFUSE_ASSIGN_OR_RETURN(d.backend, ResolveName29063(*requested, t, d));
  } else {
    d.backend = ResolveName23402(*requested, t, d);
  }

  // The communicator's runtime gate (apply_flashinfer_allreduce_fusion): SM90 or the SM100
  // family, no DP attention, 1..FUSE_ALLREDUCE_MAX_BATCH_SIZE tokens per batch. It keeps the
  // resolved name.
  d.fusion_enabled = true;
  if (t.sm != 90 && !IsSm100Family(t.sm)) {
    d.fusion_enabled = false;
    d.reasons.push_back(absl::StrCat("sm ", t.sm,
                                     ": the runtime gate (apply_flashinfer_allreduce_fusion) "
                                     "fuses only on SM90 and the SM100 family (compute "
                                     "capability 10.x): fusion off, the unfused path runs"));
  }
  if (f.dp_attention) {
    d.fusion_enabled = false;
    d.reasons.push_back(absl::StrCat(kFlagDpAttention,
                                     ": the runtime gate (apply_flashinfer_allreduce_fusion) "
                                     "refuses fusion under DP attention: fusion off, the unfused "
                                     "path runs"));
  }
  // Feasibility: workspace creation and the rank vote can turn fusion off later as well.
  if (d.backend == kBackendTrtllm && t.nnodes > 1) {
    d.fusion_enabled = false;
    d.reasons.push_back(absl::StrCat("trtllm needs every rank on one node (nnodes=", t.nnodes,
                                     "): fusion disabled, the unfused path runs"));
  }
  if (const std::string blocker = WorldSizeBlocker(t.tp); !blocker.empty()) {
    d.fusion_enabled = false;
    d.reasons.push_back(blocker);
  }
  if (d.fusion_enabled) {
    d.max_tokens_per_batch = kFuseAllreduceMaxBatchSize;
    d.reasons.push_back(absl::StrCat("fused ops take 1..", kFuseAllreduceMaxBatchSize,
                                     " tokens per batch (the runtime gate's "
                                     "FUSE_ALLREDUCE_MAX_BATCH_SIZE); larger batches run the "
                                     "framework's own path"));
  }
  return d;
}

// ---- JSON. ----

namespace {

std::string JsonList(const std::vector<std::string>& items) {
  std::vector<std::string> quoted;
  quoted.reserve(items.size());
  for (const std::string& s : items) quoted.push_back(JsonQuote(s));
  return absl::StrCat("[", absl::StrJoin(quoted, ","), "]");
}

std::string JsonPhase(const PhaseCapture& p) {
  return absl::StrCat("{\"cuda_graph_mode\":", JsonQuote(CudaGraphModeName(p.mode)),
                      ",\"data_plane\":", JsonQuote(DataPlaneName(p.data_plane)), "}");
}

}  // namespace

std::string DecisionToJson(const Decision& d) {
  return absl::StrCat(
      "{\"backend\":", JsonQuote(d.backend), ",\"fusion_enabled\":", JsonBool(d.fusion_enabled),
      ",\"cuda_graph_mode\":", JsonQuote(CudaGraphModeName(d.cuda_graph_mode)),
      ",\"data_plane\":", JsonQuote(DataPlaneName(d.data_plane)),
      ",\"prefill\":", JsonPhase(d.prefill), ",\"decode\":", JsonPhase(d.decode),
      ",\"max_tokens_per_batch\":", d.max_tokens_per_batch,
      ",\"fusion_rules\":", JsonQuote(RuleSetName(d.rules)), ",\"warnings\":", JsonList(d.warnings),
      ",\"notices\":", JsonList(d.notices), ",\"reasons\":", JsonList(d.reasons), "}");
}

}  // namespace arfuse::config
