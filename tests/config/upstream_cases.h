// The config rules against SGLang's, case by case, for both rule sets (docs/config.md). One table,
// checked through the library (fusion_config_test), the gRPC service (config_service_test) and
// the arfusectl binary (arfusectl_test): the three must give the same answer. Every case names
// the upstream source its expectation comes from; docs/config.md has the same table in prose.
#pragma once

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "config/fusion_config.h"

namespace arfuse::testing {

// Where a case's text must appear.
enum class Where { kReason, kWarning, kNotice, kError };

struct UpstreamCase {
  // The upstream file, function and PR the expectation is taken from.
  std::string source;
  config::FusionFlags flags;
  config::Topology topology;
  // Expected: INVALID_ARGUMENT whose message contains `text` (Where::kError), or a decision with
  // this backend and fusion state that has `text` among its reasons, warnings or notices.
  std::string backend;
  bool fused = false;
  std::string text;
  Where where = Where::kReason;
  // The decision has no warnings at all (the silent cases).
  bool no_warnings = false;
};

inline std::string CaseName(const UpstreamCase& c) {
  return absl::StrCat(
      config::RuleSetName(c.flags.rules), " sm", c.topology.sm, " tp", c.topology.tp, " nnodes",
      c.topology.nnodes, " backend=", c.flags.backend.value_or("unset"),
      c.flags.enable_deprecated ? " +deprecated" : "",
      c.flags.enforce_disable ? " +enforce-disable" : "",
      c.flags.deterministic ? " +deterministic" : "",
      c.flags.model_architecture.empty() ? "" : " arch=" + c.flags.model_architecture,
      c.flags.dp_attention ? " +dp-attention" : "",
      c.flags.moe_a2a_backend == "none" ? "" : " a2a=" + c.flags.moe_a2a_backend, " [", c.source,
      "]");
}

// The case as arfusectl resolve arguments (after "resolve").
inline std::vector<std::string> CaseArgs(const UpstreamCase& c) {
  std::vector<std::string> a = {
      "--sm",
      absl::StrCat(c.topology.sm),
      "--nnodes",
      absl::StrCat(c.topology.nnodes),
      "--tp",
      absl::StrCat(c.topology.tp),
      absl::StrCat("--fusion-rules=", config::RuleSetName(c.flags.rules))};
  const config::FusionFlags& f = c.flags;
  if (f.backend) a.push_back(absl::StrCat("--flashinfer-allreduce-fusion-backend=", *f.backend));
  if (f.enable_deprecated) a.push_back("--enable-flashinfer-allreduce-fusion");
  if (f.enforce_disable) a.push_back("--enforce-disable-flashinfer-allreduce-fusion");
  if (f.deterministic) a.push_back("--enable-deterministic-inference");
  if (!f.model_architecture.empty()) {
    a.push_back("--model-architecture");
    a.push_back(f.model_architecture);
  }
  if (f.dp_attention) a.push_back("--enable-dp-attention");
  if (f.moe_a2a_backend != "none") a.push_back("--moe-a2a-backend=" + f.moe_a2a_backend);
  return a;
}

// Builds a case's inputs.
struct In {
  config::FusionFlags flags;
  config::Topology topology;

  In(config::RuleSet rules, int sm, int tp, int nnodes, const char* backend = nullptr) {
    flags.rules = rules;
    if (backend != nullptr) flags.backend = backend;
    topology = {sm, tp, nnodes};
  }
  In& Deprecated() {
    flags.enable_deprecated = true;
    return *this;
  }
  In& EnforceDisable() {
    flags.enforce_disable = true;
    return *this;
  }
  In& Deterministic() {
    flags.deterministic = true;
    return *this;
  }
  In& Arch(const char* arch) {
    flags.model_architecture = arch;
    return *this;
  }
  In& DpAttention() {
    flags.dp_attention = true;
    return *this;
  }
  In& A2a(const char* backend) {
    flags.moe_a2a_backend = backend;
    return *this;
  }
};

inline UpstreamCase Decided(std::string source, const In& in, std::string backend, bool fused,
                            std::string text, Where where = Where::kReason,
                            bool no_warnings = false) {
  return UpstreamCase{std::move(source), in.flags, in.topology, std::move(backend), fused,
                      std::move(text),   where,    no_warnings};
}

inline UpstreamCase Refused(std::string source, const In& in, std::string text) {
  return UpstreamCase{std::move(source), in.flags,     in.topology, "", false,
                      std::move(text),   Where::kError};
}

inline const std::vector<UpstreamCase>& UpstreamCases() {
  using config::RuleSet;
  constexpr RuleSet k23402 = RuleSet::kSglang23402;
  constexpr RuleSet k29063 = RuleSet::kSglang29063;
  // Upstream sources, as the cases cite them.
  const std::string deprecated =
      "server_args.py ServerArgs._handle_deprecated_args (#23402; unchanged in #29063)";
  const std::string resolve23402 =
      "flashinfer_comm_fusion.py _mnnvl_supported/_resolve_backend (#23402)";
  const std::string resolve29063 =
      "flashinfer_comm_fusion.py _resolve_backend ValueError (#28789, #29063)";
  const std::string unit_test =
      "test_flashinfer_comm_fusion.py: non-SM90/SM10X resolves to trtllm (#23402)";
  const std::string autoenable23402 =
      "server_args.py ServerArgs._handle_model_specific_adjustments, SM10X-only gate (#23402)";
  const std::string autoenable29063 =
      "server_args.py ServerArgs._handle_model_specific_adjustments, SM90/SM10X gate (#28789)";
  const std::string gate = "communicator.py apply_flashinfer_allreduce_fusion (runtime gate)";
  const std::string overrides =
      "server_args.py enforce-disable (#21446) and _handle_deterministic_inference";
  const std::string world = "FlashInfer mnnvl 2-64 ranks vs arfuse FusionParams kMaxWorldSize=16";
  const char* dsv3 = "DeepseekV3ForCausalLM";
  static const std::vector<UpstreamCase> cases = {
      // ---- The deprecated flag: upstream's warning text, silent under an explicit backend. ----
      Decided(deprecated, In(k23402, 90, 2, 1).Deprecated(), "mnnvl", true,
              "--enable-flashinfer-allreduce-fusion is deprecated. Please use "
              "--flashinfer-allreduce-fusion-backend=auto instead.",
              Where::kWarning),
      Decided(deprecated, In(k29063, 90, 2, 1).Deprecated(), "trtllm", true,
              "--enable-flashinfer-allreduce-fusion is deprecated. Please use "
              "--flashinfer-allreduce-fusion-backend=auto instead.",
              Where::kWarning),
      Decided(deprecated, In(k23402, 90, 2, 1, "trtllm").Deprecated(), "trtllm", true,
              "--flashinfer-allreduce-fusion-backend=trtllm on sm 90", Where::kReason, true),
      Decided(deprecated, In(k29063, 100, 2, 1, "mnnvl").Deprecated(), "mnnvl", true,
              "--flashinfer-allreduce-fusion-backend=mnnvl on sm 100", Where::kReason, true),

      // ---- Resolution of auto, per rule set. ----
      // SM90, one node: mnnvl under #23402, trtllm since #28789.
      Decided(resolve23402, In(k23402, 90, 2, 1, "auto"), "mnnvl", true,
              "auto resolved to mnnvl for sm 90 on one node"),
      Decided(resolve29063, In(k29063, 90, 2, 1, "auto"), "trtllm", true,
              "auto resolved to trtllm for sm 90 on one node"),
      // SM90, several nodes: trtllm (then unfused) under #23402; a ValueError since #28789.
      Decided(resolve23402, In(k23402, 90, 4, 2, "auto"), "trtllm", false,
              "trtllm needs every rank on one node (nnodes=2)"),
      Refused(resolve29063, In(k29063, 90, 4, 2, "auto"),
              "FlashInfer allreduce fusion does not support multi-node on non-Blackwell "
              "systems."),
      // The SM100 family: mnnvl on one node and on several, under both.
      Decided(resolve23402, In(k23402, 100, 2, 1, "auto"), "mnnvl", true,
              "auto resolved to mnnvl for sm 100 on one node"),
      Decided(resolve29063, In(k29063, 100, 2, 1, "auto"), "mnnvl", true,
              "auto resolved to mnnvl for sm 100 on one node"),
      Decided(resolve23402, In(k23402, 103, 8, 2, "auto"), "mnnvl", true,
              "auto resolved to mnnvl for sm 103 on 2 nodes"),
      Decided(resolve29063, In(k29063, 103, 8, 2, "auto"), "mnnvl", true,
              "auto resolved to mnnvl for sm 103 on 2 nodes"),

      // ---- Explicit backends. ----
      Decided(resolve23402, In(k23402, 90, 2, 1, "mnnvl"), "mnnvl", true,
              "--flashinfer-allreduce-fusion-backend=mnnvl, supported on sm 90 on one node"),
      Decided(resolve29063, In(k29063, 90, 2, 1, "mnnvl"), "mnnvl", true,
              "--flashinfer-allreduce-fusion-backend=mnnvl on sm 90 on one node"),
      // Unsupported mnnvl: trtllm with a once-per-process INFO notice, or a ValueError.
      Decided(resolve23402, In(k23402, 90, 8, 2, "mnnvl"), "trtllm", false,
              "FlashInfer allreduce fusion: forcing trtllm backend (", Where::kNotice, true),
      Refused(resolve29063, In(k29063, 90, 8, 2, "mnnvl"),
              "FlashInfer allreduce fusion mnnvl backend requires a Blackwell system, or SM90 "
              "single-node."),
      // trtllm across nodes: unfused, or a ValueError (SM90 and the SM100 family alike).
      Decided(resolve23402, In(k23402, 90, 2, 2, "trtllm"), "trtllm", false,
              "trtllm needs every rank on one node (nnodes=2)"),
      Refused(resolve29063, In(k29063, 90, 2, 2, "trtllm"),
              "FlashInfer allreduce fusion trtllm backend supports single-node only."),
      Decided(resolve23402, In(k23402, 100, 8, 2, "trtllm"), "trtllm", false,
              "trtllm needs every rank on one node (nnodes=2)"),
      Refused(resolve29063, In(k29063, 100, 8, 2, "trtllm"),
              "FlashInfer allreduce fusion trtllm backend supports single-node only."),

      // ---- Architectures without fusion (SM80/89/110/120). ----
      Decided(unit_test, In(k23402, 80, 2, 1, "auto"), "trtllm", false,
              "sm 80: the runtime gate (apply_flashinfer_allreduce_fusion) fuses only on SM90 "
              "and the SM100 family"),
      Decided(unit_test, In(k23402, 89, 2, 1, "trtllm"), "trtllm", false,
              "sm 89: the runtime gate"),
      Decided(unit_test, In(k23402, 110, 2, 2, "auto"), "trtllm", false,
              "sm 110: the runtime gate"),
      Decided(unit_test, In(k23402, 120, 2, 1, "mnnvl"), "trtllm", false,
              "FlashInfer allreduce fusion: forcing trtllm backend (", Where::kNotice),
      Refused(resolve29063, In(k29063, 80, 2, 1, "auto"),
              "FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs."),
      Refused(resolve29063, In(k29063, 89, 2, 1, "trtllm"),
              "FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs."),
      Refused(resolve29063, In(k29063, 110, 2, 2, "auto"),
              "FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs."),
      Refused(resolve29063, In(k29063, 120, 2, 1, "mnnvl"),
              "FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs."),
      // No backend at all: nothing to refuse.
      Decided(resolve29063, In(k29063, 120, 2, 1).Arch(dsv3), "none", false,
              "sm 120 is neither SM90 nor the SM100 family"),

      // ---- Auto-enable (no backend flag). ----
      Decided(autoenable23402, In(k23402, 100, 2, 1).Arch(dsv3), "mnnvl", true,
              "Auto-enabling FlashInfer AllReduce Fusion on SM90/SM10X for DeepseekV3ForCausalLM"),
      Decided(autoenable29063, In(k29063, 100, 2, 1).Arch(dsv3), "mnnvl", true,
              "Auto-enabling FlashInfer AllReduce Fusion on SM90/SM10X for DeepseekV3ForCausalLM"),
      // SM90 one node: off under #23402, auto-enabled (trtllm) again since #28789.
      Decided(autoenable23402, In(k23402, 90, 8, 1).Arch("Qwen3MoeForCausalLM"), "none", false,
              "sm 90 is not the SM100 family (sglang-23402 auto-enables only there)"),
      Decided(autoenable29063, In(k29063, 90, 8, 1).Arch("Qwen3MoeForCausalLM"), "trtllm", true,
              "Auto-enabling FlashInfer AllReduce Fusion on SM90/SM10X for Qwen3MoeForCausalLM"),
      // SM90 across nodes: never auto-enabled (so never a ValueError either).
      Decided(autoenable29063, In(k29063, 90, 8, 2).Arch(dsv3), "none", false,
              "sm 90 on 2 nodes (several nodes need the SM100 family)"),
      Decided(autoenable23402, In(k23402, 100, 8, 2).Arch("GptOssForCausalLM"), "mnnvl", true,
              "Auto-enabling FlashInfer AllReduce Fusion on SM90/SM10X for GptOssForCausalLM"),
      // The allowlist, DP attention and the MoE all-to-all backend.
      Decided(autoenable23402, In(k23402, 100, 2, 1).Arch("LlamaForCausalLM"), "none", false,
              "architecture LlamaForCausalLM is not on the allowlist"),
      Decided(autoenable29063, In(k29063, 90, 2, 1).Arch("LlamaForCausalLM"), "none", false,
              "architecture LlamaForCausalLM is not on the allowlist"),
      Decided(autoenable23402, In(k23402, 100, 2, 1), "none", false,
              "no --model-architecture (only allowlisted architectures are auto-enabled)"),
      Decided(autoenable23402, In(k23402, 100, 4, 1).Arch(dsv3).DpAttention(), "none", false,
              "--enable-dp-attention is set"),
      Decided(autoenable29063, In(k29063, 90, 4, 1).Arch(dsv3).DpAttention(), "none", false,
              "--enable-dp-attention is set"),
      Decided(autoenable23402, In(k23402, 100, 4, 1).Arch(dsv3).A2a("deepep"), "none", false,
              "--moe-a2a-backend=deepep (not none)"),
      Decided(autoenable29063, In(k29063, 90, 4, 1).Arch(dsv3).A2a("mooncake"), "none", false,
              "--moe-a2a-backend=mooncake (not none)"),
      Decided(autoenable29063, In(k29063, 100, 1, 1).Arch(dsv3), "none", false,
              "tp=1: nothing to reduce, fusion off"),

      // ---- The runtime gate: DP attention refuses fusion even with the flag set. ----
      Decided(gate, In(k23402, 100, 4, 1, "mnnvl").DpAttention(), "mnnvl", false,
              "--enable-dp-attention: the runtime gate (apply_flashinfer_allreduce_fusion) "
              "refuses fusion under DP attention"),
      Decided(gate, In(k29063, 90, 4, 1, "trtllm").DpAttention(), "trtllm", false,
              "--enable-dp-attention: the runtime gate"),
      // Batches above 2048 tokens are the framework's path.
      Decided(gate, In(k23402, 90, 2, 1, "trtllm"), "trtllm", true,
              "fused ops take 1..2048 tokens per batch"),
      Decided(gate, In(k29063, 100, 2, 1, "auto"), "mnnvl", true,
              "fused ops take 1..2048 tokens per batch"),

      // ---- Overrides clear the backend before anything is resolved (so nothing is refused). --
      Decided(overrides, In(k23402, 100, 2, 1).Arch(dsv3).Deterministic(), "none", false,
              "--enable-deterministic-inference clears the backend"),
      Decided(overrides, In(k29063, 90, 2, 2, "trtllm").EnforceDisable(), "none", false,
              "fusion disabled by --enforce-disable-flashinfer-allreduce-fusion"),
      Decided(overrides, In(k29063, 80, 2, 1, "auto").Deterministic(), "none", false,
              "--enable-deterministic-inference clears the backend"),
      Decided(resolve29063, In(k29063, 80, 1, 1, "auto"), "none", false,
              "tp=1: nothing to reduce, fusion off (--flashinfer-allreduce-fusion-backend=auto)"),

      // ---- World sizes: the kernels' 2, 4, 8, 16; FlashInfer's mnnvl also 32 and 64. ----
      Decided(world, In(k23402, 100, 16, 2, "auto"), "mnnvl", true,
              "auto resolved to mnnvl for sm 100 on 2 nodes"),
      Decided(world, In(k29063, 100, 16, 4, "mnnvl"), "mnnvl", true,
              "fused ops take 1..2048 tokens per batch"),
      Decided(world, In(k23402, 100, 32, 4, "auto"), "mnnvl", false,
              "tp=32 is more ranks than arfuse's fused kernels serve"),
      Decided(world, In(k29063, 103, 64, 8, "mnnvl"), "mnnvl", false,
              "tp=64 is more ranks than arfuse's fused kernels serve"),
      Decided(world, In(k23402, 90, 6, 1, "trtllm"), "trtllm", false,
              "tp=6 is not a world size the fused kernels support (2, 4, 8, 16)"),

      // ---- More nodes than ranks is not a topology. ----
      Refused("arfuse topology validation", In(k23402, 90, 2, 4, "auto"),
              "nnodes 4 is more than tp 2"),
      Refused("arfuse topology validation", In(k29063, 100, 8, 16), "nnodes 16 is more than tp 8"),
  };
  return cases;
}

}  // namespace arfuse::testing
