// The fusion flags: the serving frameworks' own flags (and arfuse's few) that the config rules
// read. Each flag is declared once, in fusion_flags.inc; from that list come FusionFlags' members
// (below), the table every consumer reads (FusionFlagTable: arfused's flags and checks,
// arfusectl's options and help, the v1.FusionFlags conversion, the rank report, docs/config.md's
// flag table) and the flags' value parsers. Plain structs and pure functions, like the rules.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace arfuse::config {

// Requested backend values (the backend flag's choices) and resolved backend names.
inline constexpr char kBackendAuto[] = "auto";
inline constexpr char kBackendTrtllm[] = "trtllm";
inline constexpr char kBackendMnnvl[] = "mnnvl";
inline constexpr char kBackendNone[] = "none";

// The flag spellings the rules' messages name verbatim (the frameworks' spellings).
inline constexpr char kFlagBackend[] = "--flashinfer-allreduce-fusion-backend";
inline constexpr char kFlagDeprecatedEnable[] = "--enable-flashinfer-allreduce-fusion";
inline constexpr char kFlagEnforceDisable[] = "--enforce-disable-flashinfer-allreduce-fusion";
inline constexpr char kFlagDeterministic[] = "--enable-deterministic-inference";
inline constexpr char kFlagDpAttention[] = "--enable-dp-attention";
inline constexpr char kFlagMoeA2aBackend[] = "--moe-a2a-backend";
// arfuse's own (SGLang reads the architecture from the model's config.json).
inline constexpr char kFlagModelArchitecture[] = "--model-architecture";
inline constexpr char kFlagFusionRules[] = "--fusion-rules";
// An ops flag of the capture request, not a fusion flag.
inline constexpr char kFlagMnnvlCaptureSafe[] = "--mnnvl-capture-safe";

// Which upstream rules the decision follows (--fusion-rules; its choices in fusion_flags.inc
// are in this order).
enum class RuleSet {
  // SGLang PR #23402: auto is mnnvl wherever mnnvl is supported, else trtllm;
  // an unsupported explicit mnnvl falls back to trtllm; auto-enable only on the SM100 family.
  kSglang23402,
  // SGLang #28789 and #29063 (eight days later): SM90 one node resolves auto to trtllm and is
  // auto-enabled again; five configurations stop the server with a ValueError.
  kSglang29063,
};
inline constexpr RuleSet kDefaultRuleSet = RuleSet::kSglang23402;

// A Python class name (letters, digits, '_', not starting with a digit), 1..128 characters.
absl::StatusOr<std::string> ParseModelArchitecture(const std::string& text);

struct FusionFlags {
#define ARFUSE_FUSION_FLAG(kind, ident, field, Type, init, values, check, help) Type field = init;
#include "config/fusion_flags.inc"
#undef ARFUSE_FUSION_FLAG

  bool operator==(const FusionFlags&) const = default;
};

// ---- The table. ----

enum class FusionFlagKind { kSwitch, kOptional, kValue };

// One row of fusion_flags.inc.
struct FusionFlagSpec {
  FusionFlagKind kind = FusionFlagKind::kSwitch;
  std::string ident;  // "flashinfer_allreduce_fusion_backend": abseil's and v1.FusionFlags' name
  std::string name;   // "flashinfer-allreduce-fusion-backend": the command line's
  std::string field;  // "backend": the FusionFlags member, the rank report's flags.<field>
  std::vector<std::string> choices;  // empty: a switch or a free value
  std::string hint;                  // a free value's hint ("NAME"); empty otherwise
  std::string help;
  // The default as text ("" for unset: a kOptional flag, an empty kValue).
  std::string default_text;

  // "--flashinfer-allreduce-fusion-backend".
  std::string Flag() const { return "--" + name; }
  // "auto|trtllm|mnnvl", "NAME", or for more than three choices the first two and "...".
  std::string ValueHint() const;
  // The help's first sentence (arfusectl's help column).
  std::string ShortHelp() const;

  // Checks one value as given on a command line: a switch takes true/false (also 1/0); a value
  // one of the choices, or what `check` accepts; a kValue also its default ("" where that is the
  // default: not known). INVALID_ARGUMENT naming the flag and the value.
  absl::Status Check(const std::string& text) const;
  // Check, then stores the value in `flags`.
  absl::Status Set(FusionFlags& flags, const std::string& text) const;
  // Stores the value without checking what the rules check later (ValidateFlags): text as it is;
  // a value the field cannot hold (a rule set that is not one) is INVALID_ARGUMENT.
  absl::Status Assign(FusionFlags& flags, const std::string& text) const;
  // The value in `flags` as text; nullopt when unset (a kOptional flag, an empty kValue).
  std::optional<std::string> Get(const FusionFlags& flags) const;

  absl::StatusOr<std::string> (*check)(const std::string&) = nullptr;
  // The member's own conversions (fusion_flags.cc); Assign and Get call them.
  std::function<absl::Status(const FusionFlagSpec&, FusionFlags&, const std::string&)> assign;
  std::function<std::optional<std::string>(const FusionFlagSpec&, const FusionFlags&)> get;
};

// Every fusion flag, in fusion_flags.inc's order.
const std::vector<FusionFlagSpec>& FusionFlagTable();
// By ident or command-line name (hyphens or underscores, no leading "--"); nullptr if none.
const FusionFlagSpec* FindFusionFlag(absl::string_view name);

// docs/config.md's flag table (Markdown, a header row and one row per flag), from the table.
std::string FusionFlagsMarkdown();

// ---- The flags' values (INVALID_ARGUMENT with a message naming the flag and the bad value). ----

const char* RuleSetName(RuleSet rules);  // "sglang-23402", "sglang-29063"
absl::StatusOr<RuleSet> ParseRuleSet(const std::string& text);
// --moe-a2a-backend's choices, as SGLang's MOE_A2A_BACKEND_CHOICES lists them.
const std::vector<std::string>& MoeA2aBackendChoices();
// "auto", "trtllm" or "mnnvl", exactly (the frameworks' choices are case-sensitive).
absl::StatusOr<std::string> ParseBackendFlag(const std::string& text);
// One of MoeA2aBackendChoices(), exactly.
absl::StatusOr<std::string> ParseMoeA2aBackend(const std::string& text);
// "true"/"false" (also "1"/"0").
absl::StatusOr<bool> ParseBool(const std::string& flag, const std::string& text);

// Every flag's value as the table checks it.
absl::Status ValidateFlags(const FusionFlags& flags);
// One line, "backend=auto enable_deprecated=false ... moe_a2a_backend=none" (unset: "unset").
std::string FlagsText(const FusionFlags& flags);

}  // namespace arfuse::config
