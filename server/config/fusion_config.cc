#include "server/config/fusion_config.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/common/op_types.h"
#include "server/core/status_macros.h"

namespace arfuse::config {
namespace {

// Far above any NVLink domain; rejects garbage without limiting real deployments.
constexpr int kMaxRanks = 1 << 16;
constexpr size_t kMaxArchitectureLength = 128;

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

std::string Quoted(const std::string& text) {
  // Bound what an error message echoes back, and keep it on one line.
  return absl::StrCat("\"", absl::CHexEscape(text.substr(0, 64)), text.size() > 64 ? "..." : "",
                      "\"");
}

std::string TopologyText(const Topology& t) {
  return absl::StrCat("sm=", t.sm, " tp=", t.tp, " nnodes=", t.nnodes);
}

std::string FlagsText(const FusionFlags& f) {
  return absl::StrCat(
      "backend=", f.backend ? *f.backend : "unset",
      " enable_deprecated=", f.enable_deprecated ? "true" : "false",
      " enforce_disable=", f.enforce_disable ? "true" : "false",
      " deterministic=", f.deterministic ? "true" : "false", " rules=", RuleSetName(f.rules),
      " model_architecture=", f.model_architecture.empty() ? "unset" : f.model_architecture,
      " dp_attention=", f.dp_attention ? "true" : "false", " moe_a2a_backend=", f.moe_a2a_backend);
}

std::string FusedText(const Decision& d) {
  return absl::StrCat(d.backend, d.fusion_enabled ? " (fused)" : " (unfused)");
}

std::string NodesText(int nnodes) {
  return nnodes == 1 ? "one node" : absl::StrCat(nnodes, " nodes");
}

bool IsArchitectureChar(char c) { return absl::ascii_isalnum(c) || c == '_'; }

bool Contains(const std::vector<std::string>& list, const std::string& item) {
  return std::find(list.begin(), list.end(), item) != list.end();
}

void AppendUnique(std::vector<std::string>& to, const std::vector<std::string>& from) {
  for (const std::string& s : from) {
    if (!Contains(to, s)) to.push_back(s);
  }
}

}  // namespace

// ---- Names and parsing. ----

const char* RuleSetName(RuleSet rules) {
  switch (rules) {
    case RuleSet::kSglang23402:
      return "sglang-23402";
    case RuleSet::kSglang29063:
      return "sglang-29063";
  }
  return "unknown";
}

absl::StatusOr<RuleSet> ParseRuleSet(const std::string& text) {
  if (text == "sglang-23402") return RuleSet::kSglang23402;
  if (text == "sglang-29063") return RuleSet::kSglang29063;
  return absl::InvalidArgumentError(absl::StrCat("unknown ", kFlagFusionRules, " value ",
                                                 Quoted(text),
                                                 ": expected sglang-23402 or sglang-29063"));
}

const std::vector<std::string>& MoeA2aBackendChoices() {
  // SGLang's MOE_A2A_BACKEND_CHOICES (server_args.py; the newest stored copy).
  static const std::vector<std::string> choices = {
      "none",       "deepep",  "mooncake",  "nixl", "mori",     "ascend_fuseep",
      "flashinfer", "megamoe", "deepep_v2", "pplx", "ascend_tp"};
  return choices;
}

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

CudaGraphMode CaptureRequest::ModeOf(Phase phase) const {
  const std::optional<CudaGraphMode>& per_phase =
      phase == Phase::kPrefill ? prefill_mode : decode_mode;
  return per_phase.value_or(mode);
}

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

absl::StatusOr<std::string> ParseBackendFlag(const std::string& text) {
  if (text == kBackendAuto || text == kBackendTrtllm || text == kBackendMnnvl) return text;
  return absl::InvalidArgumentError(absl::StrCat("unknown ", kFlagBackend, " value ", Quoted(text),
                                                 ": expected auto, trtllm or mnnvl"));
}

absl::StatusOr<std::string> ParseMoeA2aBackend(const std::string& text) {
  if (Contains(MoeA2aBackendChoices(), text)) return text;
  return absl::InvalidArgumentError(absl::StrCat("unknown ", kFlagMoeA2aBackend, " value ",
                                                 Quoted(text), ": expected one of ",
                                                 absl::StrJoin(MoeA2aBackendChoices(), ", ")));
}

absl::StatusOr<std::string> ParseModelArchitecture(const std::string& text) {
  const bool name = !text.empty() && text.size() <= kMaxArchitectureLength &&
                    !absl::ascii_isdigit(text[0]) &&
                    std::all_of(text.begin(), text.end(), IsArchitectureChar);
  if (name) return text;
  return absl::InvalidArgumentError(absl::StrCat(
      kFlagModelArchitecture, " ", Quoted(text),
      " is not an architecture name: give the model's config.json \"architectures\" entry, a "
      "class name such as DeepseekV3ForCausalLM (letters, digits, '_'; at most ",
      kMaxArchitectureLength, " characters)"));
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

absl::StatusOr<bool> ParseBool(const std::string& flag, const std::string& text) {
  if (text == "true" || text == "1") return true;
  if (text == "false" || text == "0") return false;
  return absl::InvalidArgumentError(
      absl::StrCat(flag, " ", Quoted(text), " is not a boolean: expected true or false"));
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

absl::Status ValidateFlags(const FusionFlags& flags) {
  if (flags.backend) ARFUSE_RETURN_IF_ERROR(ParseBackendFlag(*flags.backend).status());
  if (!flags.model_architecture.empty()) {
    ARFUSE_RETURN_IF_ERROR(ParseModelArchitecture(flags.model_architecture).status());
  }
  return ParseMoeA2aBackend(flags.moe_a2a_backend).status();
}

absl::StatusOr<FusionArgs> ExtractFusionArgs(std::vector<std::string>& args) {
  FusionArgs out;
  std::vector<std::string> rest;
  // Valued flags and what each value sets; every value is parsed, the last occurrence wins, as
  // with argparse.
  struct Valued {
    const char* name;
    std::function<absl::Status(const std::string&)> set;
  };
  auto into = [](auto* field, auto parse) {
    return [field, parse](const std::string& v) -> absl::Status {
      auto parsed = parse(v);
      if (!parsed.ok()) return parsed.status();
      *field = *std::move(parsed);
      return absl::OkStatus();
    };
  };
  const Valued valued[] = {
      {kFlagBackend, into(&out.flags.backend, ParseBackendFlag)},
      {kFlagFusionRules, into(&out.flags.rules, ParseRuleSet)},
      {kFlagModelArchitecture, into(&out.flags.model_architecture, ParseModelArchitecture)},
      {kFlagMoeA2aBackend, into(&out.flags.moe_a2a_backend, ParseMoeA2aBackend)},
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      rest.insert(rest.end(), args.begin() + i, args.end());
      break;
    }
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    std::optional<std::string> value;
    if (eq != std::string::npos) value = arg.substr(eq + 1);

    const Valued* v = nullptr;
    for (const Valued& candidate : valued) {
      if (name == candidate.name) v = &candidate;
    }
    if (v != nullptr) {
      if (!value) {
        if (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0) {
          return absl::InvalidArgumentError(absl::StrCat(name, " needs a value"));
        }
        value = args[++i];
      }
      ARFUSE_RETURN_IF_ERROR(v->set(*value));
      continue;
    }

    bool* switch_target = nullptr;
    if (name == kFlagDeprecatedEnable) switch_target = &out.flags.enable_deprecated;
    if (name == kFlagEnforceDisable) switch_target = &out.flags.enforce_disable;
    if (name == kFlagDeterministic) switch_target = &out.flags.deterministic;
    if (name == kFlagDpAttention) switch_target = &out.flags.dp_attention;
    const bool is_capture_safe = name == kFlagMnnvlCaptureSafe;
    if (switch_target == nullptr && !is_capture_safe) {
      rest.push_back(arg);
      continue;
    }
    // Switches take no separate value ("--x true" would swallow a positional argument).
    bool on = true;
    if (value) {
      ARFUSE_ASSIGN_OR_RETURN(on, ParseBool(name, *value));
    }
    if (is_capture_safe) {
      out.mnnvl_capture_safe = on;
    } else {
      *switch_target = on;
    }
  }
  args = std::move(rest);
  return out;
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

namespace {

struct PhaseResult {
  PhaseCapture capture;
  std::vector<std::string> reasons;
  std::vector<std::string> warnings;
};

// One phase's mode and data plane.
PhaseResult NegotiatePhase(const Decision& d, CudaGraphMode mode, const CaptureRequest& capture,
                           const NegotiationEnvironment& env) {
  PhaseResult r;
  const bool fused = d.fusion_enabled && d.backend != kBackendNone;
  // The in-stream plane: the sidecar's kernel launched in the client's own stream, capturable in
  // full and piecewise graphs alike, nothing per call site in the sidecar.
  const bool instream = fused && capture.client_loads_kernels && env.instream_available;
  // The doorbell plane holds one slot per planned call site: a client that plans more sites
  // than there are slots (a real model: 2 per layer) is not offered it.
  const bool doorbell_fits = env.doorbell_slots == 0 || capture.call_sites <= env.doorbell_slots;
  const bool doorbell = env.doorbell_available && doorbell_fits;
  const bool wants_in_graph = fused && capture.fused_op_in_graph && mode != CudaGraphMode::kNone;
  if (fused && capture.client_loads_kernels && !env.instream_available) {
    r.warnings.push_back(
        absl::StrCat("the in-stream plane is unavailable (", env.instream_unavailable_reason, ")"));
  }
  if (fused && !instream && !doorbell_fits && env.doorbell_available) {
    r.warnings.push_back(absl::StrCat(
        "the doorbell plane has ", env.doorbell_slots, " slots and the client plans ",
        capture.call_sites,
        " call sites: not offered; without the in-stream plane (a client that loads the "
        "sidecar's kernels) every fused op runs on the eager plane (an RPC per op)"));
  }

  // Without a doorbell the fused op can only be an eager split op between graph pieces, which a
  // full graph cannot have.
  if (wants_in_graph && !instream && !doorbell && mode == CudaGraphMode::kFull) {
    mode = CudaGraphMode::kPiecewise;
    r.reasons.push_back(absl::StrCat(
        "doorbell plane unavailable (",
        env.doorbell_available ? "more call sites than slots" : env.doorbell_unavailable_reason,
        "): full CUDA graphs become piecewise with the fused op as an eager split op"));
  }

  // The piecewise-graph hang of FlashInfer's mnnvl kernels before its bitwise sentinel fix was
  // tied to piecewise capture; upstream turned piecewise (prefill) graphs off for mnnvl and kept
  // the decode graphs. A phase asking for full or no graphs is left as it is.
  if (fused && d.backend == kBackendMnnvl && mode == CudaGraphMode::kPiecewise) {
    if (capture.mnnvl_capture_safe.value_or(true)) {
      r.reasons.push_back(
          "mnnvl kernels are capture-safe (bitwise sentinel checks): piecewise CUDA graphs "
          "allowed");
    } else {
      mode = CudaGraphMode::kNone;
      r.reasons.push_back(absl::StrCat("mnnvl kernels are not capture-safe (",
                                       kFlagMnnvlCaptureSafe,
                                       "=false): piecewise CUDA graphs turned off"));
    }
  }
  r.capture.mode = mode;

  r.capture.data_plane = DataPlane::kEager;
  if (instream) {
    r.capture.data_plane = DataPlane::kInStream;
    r.reasons.push_back(
        "the client loads the sidecar's kernels: in-stream plane (one kernel launch per op in the "
        "client's own stream, inside its CUDA graphs or not)");
  } else if (!fused) {
    r.reasons.push_back("fusion is off: the unfused path runs on the eager plane");
  } else if (mode == CudaGraphMode::kNone) {
    r.reasons.push_back("no CUDA graphs: eager plane (one Execute call per op)");
  } else if (!capture.fused_op_in_graph) {
    r.reasons.push_back(
        "fused op kept out of the client's CUDA graphs: eager plane, a split op "
        "between graph pieces");
  } else if (!doorbell) {
    r.reasons.push_back(absl::StrCat(
        "doorbell plane unavailable (",
        env.doorbell_available ? "more call sites than slots" : env.doorbell_unavailable_reason,
        "): eager plane, a split op between graph pieces"));
  } else {
    r.capture.data_plane = DataPlane::kDoorbell;
    r.reasons.push_back(
        "fused op inside the client's CUDA graphs: doorbell plane (ring kernel "
        "captured in the graph)");
    if (env.mps_detected.has_value() && !*env.mps_detected) {
      r.warnings.push_back(absl::StrCat(
          "MPS not detected: every doorbell hop costs a context switch",
          env.doorbell_hop_us > 0 ? absl::StrCat(" (measured ", env.doorbell_hop_us, " us)") : "",
          "; run the sidecar and the client under MPS"));
    }
  }
  return r;
}

}  // namespace

Decision Negotiate(const Decision& resolved, const CaptureRequest& capture,
                   const NegotiationEnvironment& env) {
  Decision d = resolved;
  const PhaseResult prefill = NegotiatePhase(d, capture.ModeOf(Phase::kPrefill), capture, env);
  const PhaseResult decode = NegotiatePhase(d, capture.ModeOf(Phase::kDecode), capture, env);
  d.prefill = prefill.capture;
  d.decode = decode.capture;
  // Alike phases (every old client's request) read as one answer; different ones say which.
  if (prefill.capture == decode.capture && prefill.reasons == decode.reasons) {
    d.reasons.insert(d.reasons.end(), prefill.reasons.begin(), prefill.reasons.end());
  } else {
    for (const PhaseResult* p : {&prefill, &decode}) {
      const char* name = p == &prefill ? "prefill" : "decode";
      for (const std::string& reason : p->reasons)
        d.reasons.push_back(absl::StrCat(name, ": ", reason));
    }
  }
  AppendUnique(d.warnings, prefill.warnings);
  AppendUnique(d.warnings, decode.warnings);

  // One-mode clients get the answer that holds for both phases.
  const PhaseCapture& lower = decode.capture.mode < prefill.capture.mode ? d.decode : d.prefill;
  d.cuda_graph_mode = lower.mode;
  d.data_plane = lower.data_plane;

  if (d.fusion_enabled && env.workspace_max_tokens > 0 &&
      env.workspace_max_tokens < d.max_tokens_per_batch) {
    d.max_tokens_per_batch = env.workspace_max_tokens;
    d.reasons.push_back(absl::StrCat("the workspace holds ", env.workspace_max_tokens,
                                     " tokens (--max-tokens): fused ops take at most ",
                                     env.workspace_max_tokens, " tokens per batch"));
  }
  return d;
}

absl::StatusOr<Decision> Resolve(const FusionFlags& flags, const Topology& topology,
                                 const CaptureRequest& capture,
                                 const NegotiationEnvironment& environment) {
  ARFUSE_ASSIGN_OR_RETURN(Decision resolved, ResolveBackend(flags, topology));
  return Negotiate(resolved, capture, environment);
}

absl::StatusOr<Decision> Consensus(const std::vector<RankReport>& reports) {
  if (reports.empty()) return absl::InvalidArgumentError("consensus needs at least one rank");
  const int n = static_cast<int>(reports.size());
  std::vector<const RankReport*> by_rank(n, nullptr);
  for (const RankReport& r : reports) {
    if (r.rank < 0 || r.rank >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", r.rank, " is outside 0..", n - 1, " (", n, " reports)"));
    }
    if (by_rank[r.rank] != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", r.rank, " reported twice"));
    }
    by_rank[r.rank] = &r;
  }

  const RankReport& ref = *by_rank[0];
  const FusionFlags ref_flags = MigrateFlags(ref.flags).flags;
  std::vector<std::string> disagreements;
  for (int rank = 0; rank < n; ++rank) {
    const RankReport& r = *by_rank[rank];
    const std::string who = absl::StrCat("rank ", rank, ": ");
    if (!r.failure.empty()) disagreements.push_back(who + r.failure);
    if (!r.decision && r.failure.empty()) disagreements.push_back(who + "reported no decision");
    if (rank == 0) continue;
    if (r.topology.sm != ref.topology.sm) {
      disagreements.push_back(absl::StrCat(who, "sm ", r.topology.sm, " differs from rank 0's sm ",
                                           ref.topology.sm, " (mixed architectures)"));
    }
    if (r.topology.tp != ref.topology.tp || r.topology.nnodes != ref.topology.nnodes) {
      disagreements.push_back(absl::StrCat(who, "tp=", r.topology.tp, " nnodes=", r.topology.nnodes,
                                           " differ from rank 0's tp=", ref.topology.tp,
                                           " nnodes=", ref.topology.nnodes));
    }
    // Compared after migration: the deprecated flag and "auto" are the same request.
    const FusionFlags flags = MigrateFlags(r.flags).flags;
    if (flags != ref_flags) {
      disagreements.push_back(absl::StrCat(who, "fusion flags (", FlagsText(flags),
                                           ") differ from rank 0's (", FlagsText(ref_flags), ")"));
    }
    if (r.decision && ref.decision &&
        (r.decision->backend != ref.decision->backend ||
         r.decision->fusion_enabled != ref.decision->fusion_enabled)) {
      disagreements.push_back(absl::StrCat(who, "decided ", FusedText(*r.decision),
                                           " but rank 0 decided ", FusedText(*ref.decision)));
    }
  }

  if (disagreements.empty()) return *ref.decision;

  Decision d;
  d.rules = ref_flags.rules;
  if (ref.decision) {
    d.prefill = ref.decision->prefill;
    d.decode = ref.decision->decode;
    d.cuda_graph_mode = ref.decision->cuda_graph_mode;
    d.warnings = ref.decision->warnings;
  }
  d.reasons.push_back(
      absl::StrCat("fusion off on every rank: ", disagreements.size() == 1 ? "a rank" : "ranks",
                   " failed or disagreed; the unfused path runs"));
  for (std::string& reason : disagreements) d.reasons.push_back(std::move(reason));
  return d;
}

// ---- Encoding. ----

namespace {

constexpr char kReportVersion[] = "arfuse-rank-report-v2";
// Reports of the previous version carry no rule set, architecture, DP attention, MoE all-to-all
// backend, notices, per-phase capture or batch limit: those take their defaults.
constexpr char kReportVersionV1[] = "arfuse-rank-report-v1";

void Line(std::string& out, const std::string& key, const std::string& value) {
  absl::StrAppend(&out, key, "=", absl::CEscape(value), "\n");
}

const char* BoolText(bool b) { return b ? "true" : "false"; }

absl::StatusOr<DataPlane> ParseDataPlane(const std::string& text) {
  if (text == "eager") return DataPlane::kEager;
  if (text == "doorbell") return DataPlane::kDoorbell;
  if (text == "instream") return DataPlane::kInStream;
  return absl::InvalidArgumentError(absl::StrCat("unknown data plane ", Quoted(text)));
}

}  // namespace

std::string EncodeRankReport(const RankReport& r) {
  std::string out = absl::StrCat(kReportVersion, "\n");
  Line(out, "rank", absl::StrCat(r.rank));
  Line(out, "sm", absl::StrCat(r.topology.sm));
  Line(out, "tp", absl::StrCat(r.topology.tp));
  Line(out, "nnodes", absl::StrCat(r.topology.nnodes));
  if (r.flags.backend) Line(out, "flags.backend", *r.flags.backend);
  Line(out, "flags.enable_deprecated", BoolText(r.flags.enable_deprecated));
  Line(out, "flags.enforce_disable", BoolText(r.flags.enforce_disable));
  Line(out, "flags.deterministic", BoolText(r.flags.deterministic));
  Line(out, "flags.rules", RuleSetName(r.flags.rules));
  if (!r.flags.model_architecture.empty()) {
    Line(out, "flags.model_architecture", r.flags.model_architecture);
  }
  Line(out, "flags.dp_attention", BoolText(r.flags.dp_attention));
  Line(out, "flags.moe_a2a_backend", r.flags.moe_a2a_backend);
  if (!r.failure.empty()) Line(out, "failure", r.failure);
  if (r.decision) {
    const Decision& d = *r.decision;
    Line(out, "decision.backend", d.backend);
    Line(out, "decision.fusion_enabled", BoolText(d.fusion_enabled));
    Line(out, "decision.rules", RuleSetName(d.rules));
    Line(out, "decision.max_tokens_per_batch", absl::StrCat(d.max_tokens_per_batch));
    Line(out, "decision.prefill_cuda_graph_mode", CudaGraphModeName(d.prefill.mode));
    Line(out, "decision.prefill_data_plane", DataPlaneName(d.prefill.data_plane));
    Line(out, "decision.decode_cuda_graph_mode", CudaGraphModeName(d.decode.mode));
    Line(out, "decision.decode_data_plane", DataPlaneName(d.decode.data_plane));
    Line(out, "decision.cuda_graph_mode", CudaGraphModeName(d.cuda_graph_mode));
    Line(out, "decision.data_plane", DataPlaneName(d.data_plane));
    for (const std::string& w : d.warnings) Line(out, "decision.warning", w);
    for (const std::string& w : d.notices) Line(out, "decision.notice", w);
    for (const std::string& w : d.reasons) Line(out, "decision.reason", w);
  }
  return out;
}

absl::StatusOr<RankReport> DecodeRankReport(const std::string& text) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  if (lines.empty() || (lines[0] != kReportVersion && lines[0] != kReportVersionV1)) {
    return absl::InvalidArgumentError(absl::StrCat("rank report does not start with ",
                                                   kReportVersion, " (or ", kReportVersionV1, ")"));
  }
  RankReport r;
  std::set<std::string> seen;
  auto bad = [](const std::string& key, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("rank report field ", key, ": ", why));
  };
  auto number = [&](const std::string& key, const std::string& v, int* out) -> absl::Status {
    if (!absl::SimpleAtoi(v, out)) return bad(key, "not an integer");
    return absl::OkStatus();
  };
  auto boolean = [&](const std::string& key, const std::string& v, bool* out) -> absl::Status {
    if (v == "true")
      *out = true;
    else if (v == "false")
      *out = false;
    else
      return bad(key, "not true or false");
    return absl::OkStatus();
  };
  // Parses with one of the library's parsers, reporting its message under the field's name.
  auto parsed = [&](const std::string& key, auto result, auto* out) -> absl::Status {
    if (!result.ok()) return bad(key, std::string(result.status().message()));
    *out = *std::move(result);
    return absl::OkStatus();
  };
  auto decision = [&]() -> Decision& {
    if (!r.decision) r.decision.emplace();
    return *r.decision;
  };
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t eq = lines[i].find('=');
    if (eq == std::string::npos) return bad(absl::StrCat("line ", i + 1), "no '='");
    const std::string key = lines[i].substr(0, eq);
    std::string value;
    if (!absl::CUnescape(lines[i].substr(eq + 1), &value)) return bad(key, "bad escape");
    const bool repeatable =
        key == "decision.warning" || key == "decision.reason" || key == "decision.notice";
    if (!repeatable && !seen.insert(key).second) return bad(key, "given twice");
    if (key == "rank") {
      ARFUSE_RETURN_IF_ERROR(number(key, value, &r.rank));
    } else if (key == "sm") {
      ARFUSE_RETURN_IF_ERROR(number(key, value, &r.topology.sm));
    } else if (key == "tp") {
      ARFUSE_RETURN_IF_ERROR(number(key, value, &r.topology.tp));
    } else if (key == "nnodes") {
      ARFUSE_RETURN_IF_ERROR(number(key, value, &r.topology.nnodes));
    } else if (key == "flags.backend") {
      r.flags.backend = value;
    } else if (key == "flags.enable_deprecated") {
      ARFUSE_RETURN_IF_ERROR(boolean(key, value, &r.flags.enable_deprecated));
    } else if (key == "flags.enforce_disable") {
      ARFUSE_RETURN_IF_ERROR(boolean(key, value, &r.flags.enforce_disable));
    } else if (key == "flags.deterministic") {
      ARFUSE_RETURN_IF_ERROR(boolean(key, value, &r.flags.deterministic));
    } else if (key == "flags.rules") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseRuleSet(value), &r.flags.rules));
    } else if (key == "flags.model_architecture") {
      ARFUSE_RETURN_IF_ERROR(
          parsed(key, ParseModelArchitecture(value), &r.flags.model_architecture));
    } else if (key == "flags.dp_attention") {
      ARFUSE_RETURN_IF_ERROR(boolean(key, value, &r.flags.dp_attention));
    } else if (key == "flags.moe_a2a_backend") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseMoeA2aBackend(value), &r.flags.moe_a2a_backend));
    } else if (key == "failure") {
      r.failure = value;
    } else if (key == "decision.backend") {
      if (value != kBackendNone && value != kBackendTrtllm && value != kBackendMnnvl) {
        return bad(key, absl::StrCat("unknown backend ", Quoted(value)));
      }
      decision().backend = value;
    } else if (key == "decision.fusion_enabled") {
      ARFUSE_RETURN_IF_ERROR(boolean(key, value, &decision().fusion_enabled));
    } else if (key == "decision.rules") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseRuleSet(value), &decision().rules));
    } else if (key == "decision.max_tokens_per_batch") {
      if (!absl::SimpleAtoi(value, &decision().max_tokens_per_batch)) {
        return bad(key, "not an unsigned integer");
      }
    } else if (key == "decision.cuda_graph_mode") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseCudaGraphMode(value), &decision().cuda_graph_mode));
    } else if (key == "decision.prefill_cuda_graph_mode") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseCudaGraphMode(value), &decision().prefill.mode));
    } else if (key == "decision.decode_cuda_graph_mode") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseCudaGraphMode(value), &decision().decode.mode));
    } else if (key == "decision.data_plane") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseDataPlane(value), &decision().data_plane));
    } else if (key == "decision.prefill_data_plane") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseDataPlane(value), &decision().prefill.data_plane));
    } else if (key == "decision.decode_data_plane") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseDataPlane(value), &decision().decode.data_plane));
    } else if (key == "decision.warning") {
      decision().warnings.push_back(value);
    } else if (key == "decision.notice") {
      decision().notices.push_back(value);
    } else if (key == "decision.reason") {
      decision().reasons.push_back(value);
    } else {
      return bad(key, "unknown field");
    }
  }
  for (const char* required : {"rank", "sm", "tp", "nnodes"}) {
    if (!seen.count(required)) return bad(required, "missing");
  }
  return r;
}

// ---- JSON. ----

namespace {

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string JsonList(const std::vector<std::string>& items) {
  std::vector<std::string> quoted;
  quoted.reserve(items.size());
  for (const std::string& s : items) quoted.push_back(JsonString(s));
  return absl::StrCat("[", absl::StrJoin(quoted, ","), "]");
}

std::string JsonPhase(const PhaseCapture& p) {
  return absl::StrCat("{\"cuda_graph_mode\":", JsonString(CudaGraphModeName(p.mode)),
                      ",\"data_plane\":", JsonString(DataPlaneName(p.data_plane)), "}");
}

}  // namespace

std::string DecisionToJson(const Decision& d) {
  return absl::StrCat("{\"backend\":", JsonString(d.backend),
                      ",\"fusion_enabled\":", d.fusion_enabled ? "true" : "false",
                      ",\"cuda_graph_mode\":", JsonString(CudaGraphModeName(d.cuda_graph_mode)),
                      ",\"data_plane\":", JsonString(DataPlaneName(d.data_plane)),
                      ",\"prefill\":", JsonPhase(d.prefill), ",\"decode\":", JsonPhase(d.decode),
                      ",\"max_tokens_per_batch\":", d.max_tokens_per_batch,
                      ",\"fusion_rules\":", JsonString(RuleSetName(d.rules)),
                      ",\"warnings\":", JsonList(d.warnings), ",\"notices\":", JsonList(d.notices),
                      ",\"reasons\":", JsonList(d.reasons), "}");
}

}  // namespace arfuse::config
