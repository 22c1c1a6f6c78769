// The config rules (docs/config.md): the full table, SGLang's rules case by case
// under both rule sets (upstream_cases.h), migration, overrides, per-phase negotiation, world
// sizes against the dispatch table, consensus and the encodings.
#include "config/fusion_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/collective/dispatch_table.h"
#include "tests/config/upstream_cases.h"

namespace arfuse::config {
namespace {

using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

bool AnyContains(const std::vector<std::string>& lines, const std::string& part) {
  return std::any_of(lines.begin(), lines.end(),
                     [&](const std::string& l) { return l.find(part) != std::string::npos; });
}

FusionFlags Backend(const char* value) {
  FusionFlags f;
  if (value != nullptr) f.backend = value;
  return f;
}

// ---------------------------------------------------------------------------------------------
// The full table of the default rule set (sglang-23402): every architecture family x one/two
// nodes x backend flag, at tp=2, no model architecture (so nothing is auto-enabled). Expected
// values are written out by hand from docs/config.md's rules and SGLang #23402
// (flashinfer_comm_fusion.py _mnnvl_supported/_resolve_backend, communicator.py's runtime gate,
// test_flashinfer_comm_fusion.py's "trtllm" for other architectures), not computed.
// ---------------------------------------------------------------------------------------------

struct Row {
  int sm;
  int nnodes;
  const char* flag;  // nullptr: no backend flag
  const char* backend;
  bool fused;
  bool fallback_notice;  // explicit mnnvl fell back to trtllm (INFO, once per process)
};

void PrintTo(const Row& r, std::ostream* os) {
  *os << "sm" << r.sm << " nnodes=" << r.nnodes << " flag=" << (r.flag ? r.flag : "unset");
}

std::string RowName(const ::testing::TestParamInfo<Row>& info) {
  const Row& r = info.param;
  return absl::StrCat("sm", r.sm, "_nnodes", r.nnodes, "_", r.flag ? r.flag : "unset");
}

const Row kTable[] = {
    // Other architectures: named trtllm (upstream's unit test), never fused (the runtime gate).
    {80, 1, nullptr, "none", false, false},
    {80, 1, "auto", "trtllm", false, false},
    {80, 1, "trtllm", "trtllm", false, false},
    {80, 1, "mnnvl", "trtllm", false, true},
    {80, 2, nullptr, "none", false, false},
    {80, 2, "auto", "trtllm", false, false},
    {80, 2, "trtllm", "trtllm", false, false},
    {80, 2, "mnnvl", "trtllm", false, true},
    {89, 1, nullptr, "none", false, false},
    {89, 1, "auto", "trtllm", false, false},
    {89, 1, "trtllm", "trtllm", false, false},
    {89, 1, "mnnvl", "trtllm", false, true},
    {89, 2, nullptr, "none", false, false},
    {89, 2, "auto", "trtllm", false, false},
    {89, 2, "trtllm", "trtllm", false, false},
    {89, 2, "mnnvl", "trtllm", false, true},
    {110, 1, nullptr, "none", false, false},
    {110, 1, "auto", "trtllm", false, false},
    {110, 1, "trtllm", "trtllm", false, false},
    {110, 1, "mnnvl", "trtllm", false, true},
    {110, 2, nullptr, "none", false, false},
    {110, 2, "auto", "trtllm", false, false},
    {110, 2, "trtllm", "trtllm", false, false},
    {110, 2, "mnnvl", "trtllm", false, true},
    {120, 1, nullptr, "none", false, false},
    {120, 1, "auto", "trtllm", false, false},
    {120, 1, "trtllm", "trtllm", false, false},
    {120, 1, "mnnvl", "trtllm", false, true},
    {120, 2, nullptr, "none", false, false},
    {120, 2, "auto", "trtllm", false, false},
    {120, 2, "trtllm", "trtllm", false, false},
    {120, 2, "mnnvl", "trtllm", false, true},
    // SM90: no auto-enable; auto is mnnvl on one node, trtllm (infeasible) on several.
    {90, 1, nullptr, "none", false, false},
    {90, 1, "auto", "mnnvl", true, false},
    {90, 1, "trtllm", "trtllm", true, false},
    {90, 1, "mnnvl", "mnnvl", true, false},
    {90, 2, nullptr, "none", false, false},
    {90, 2, "auto", "trtllm", false, false},
    {90, 2, "trtllm", "trtllm", false, false},
    {90, 2, "mnnvl", "trtllm", false, true},
    // SM100 family: mnnvl on one node and on several; auto-enable needs an allowlisted model.
    {100, 1, nullptr, "none", false, false},
    {100, 1, "auto", "mnnvl", true, false},
    {100, 1, "trtllm", "trtllm", true, false},
    {100, 1, "mnnvl", "mnnvl", true, false},
    {100, 2, nullptr, "none", false, false},
    {100, 2, "auto", "mnnvl", true, false},
    {100, 2, "trtllm", "trtllm", false, false},
    {100, 2, "mnnvl", "mnnvl", true, false},
    {103, 1, nullptr, "none", false, false},
    {103, 1, "auto", "mnnvl", true, false},
    {103, 1, "trtllm", "trtllm", true, false},
    {103, 1, "mnnvl", "mnnvl", true, false},
    {103, 2, nullptr, "none", false, false},
    {103, 2, "auto", "mnnvl", true, false},
    {103, 2, "trtllm", "trtllm", false, false},
    {103, 2, "mnnvl", "mnnvl", true, false},
};

class ResolveTable : public ::testing::TestWithParam<Row> {};

TEST_P(ResolveTable, BackendAndFeasibility) {
  const Row& row = GetParam();
  absl::StatusOr<Decision> d = ResolveBackend(Backend(row.flag), Topology{row.sm, 2, row.nnodes});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->backend, row.backend);
  EXPECT_EQ(d->fusion_enabled, row.fused);
  EXPECT_EQ(AnyContains(d->notices, "FlashInfer allreduce fusion: forcing trtllm backend ("),
            row.fallback_notice);
  EXPECT_EQ(AnyContains(d->reasons, "falling back to trtllm"), row.fallback_notice);
  EXPECT_THAT(d->warnings, IsEmpty());
  EXPECT_EQ(d->max_tokens_per_batch, row.fused ? 2048u : 0u);
  // Every decision says why.
  EXPECT_THAT(d->reasons, Not(IsEmpty()));
  if (!row.fused) {
    EXPECT_TRUE(AnyContains(d->reasons, "unfused") || AnyContains(d->reasons, "fusion off"))
        << ::testing::PrintToString(d->reasons);
  }
}

// The deprecated flag behaves exactly like "auto" (plus its warning) wherever "auto" appears.
TEST(ResolveTableDeprecated, DeprecatedFlagIsAutoOnEveryAutoRow) {
  int rows = 0;
  for (const Row& row : kTable) {
    if (row.flag == nullptr || std::string(row.flag) != "auto") continue;
    ++rows;
    FusionFlags f;
    f.enable_deprecated = true;
    absl::StatusOr<Decision> d = ResolveBackend(f, Topology{row.sm, 2, row.nnodes});
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->backend, row.backend) << ::testing::PrintToString(row);
    EXPECT_EQ(d->fusion_enabled, row.fused) << ::testing::PrintToString(row);
    EXPECT_THAT(d->warnings, ::testing::ElementsAre(
                                 "--enable-flashinfer-allreduce-fusion is deprecated. Please use "
                                 "--flashinfer-allreduce-fusion-backend=auto instead."));
  }
  EXPECT_EQ(rows, 14);
}

// tp=1, deterministic inference and enforce-disable each give none on every row.
TEST_P(ResolveTable, OverridesGiveNone) {
  const Row& row = GetParam();
  absl::StatusOr<Decision> tp1 = ResolveBackend(Backend(row.flag), Topology{row.sm, 1, 1});
  ASSERT_TRUE(tp1.ok()) << tp1.status();
  EXPECT_EQ(tp1->backend, "none");
  EXPECT_FALSE(tp1->fusion_enabled);

  FusionFlags det = Backend(row.flag);
  det.deterministic = true;
  absl::StatusOr<Decision> d = ResolveBackend(det, Topology{row.sm, 2, row.nnodes});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->backend, "none");
  EXPECT_FALSE(d->fusion_enabled);
  EXPECT_TRUE(AnyContains(d->reasons, "--enable-deterministic-inference clears the backend"));

  FusionFlags off = Backend(row.flag);
  off.enforce_disable = true;
  absl::StatusOr<Decision> e = ResolveBackend(off, Topology{row.sm, 2, row.nnodes});
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->backend, "none");
  EXPECT_FALSE(e->fusion_enabled);
  EXPECT_TRUE(AnyContains(e->reasons, "--enforce-disable-flashinfer-allreduce-fusion"));
}

INSTANTIATE_TEST_SUITE_P(AllArchitectures, ResolveTable, ::testing::ValuesIn(kTable), RowName);

// The seed's own cases, spelled out.
TEST(ResolveSeedCases, AutoOnSm100IsMnnvlOnOneAndTwoNodes) {
  for (int nnodes : {1, 2}) {
    absl::StatusOr<Decision> d = ResolveBackend(Backend("auto"), Topology{100, 4, nnodes});
    ASSERT_TRUE(d.ok());
    EXPECT_EQ(d->backend, "mnnvl") << "nnodes=" << nnodes;
    EXPECT_TRUE(d->fusion_enabled);
  }
}

TEST(ResolveSeedCases, AutoOnSm90IsMnnvlOnOneNodeTrtllmOnTwo) {
  absl::StatusOr<Decision> one = ResolveBackend(Backend("auto"), Topology{90, 2, 1});
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->backend, "mnnvl");
  absl::StatusOr<Decision> two = ResolveBackend(Backend("auto"), Topology{90, 2, 2});
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->backend, "trtllm");
  // Feasibility keeps the name but turns fusion off: trtllm cannot cross nodes.
  EXPECT_FALSE(two->fusion_enabled);
  EXPECT_TRUE(AnyContains(two->reasons, "trtllm needs every rank on one node (nnodes=2)"));
}

// SGLang #23402 flashinfer_comm_fusion.py: an explicit mnnvl where _mnnvl_supported is false is
// forced to trtllm and logged at INFO (a notice, not a warning).
TEST(ResolveRules, ExplicitMnnvlOnSm90AcrossNodesFallsBackWithANoticeThenInfeasible) {
  absl::StatusOr<Decision> d = ResolveBackend(Backend("mnnvl"), Topology{90, 8, 2});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "trtllm");
  EXPECT_FALSE(d->fusion_enabled);
  EXPECT_THAT(d->warnings, IsEmpty());
  EXPECT_THAT(d->notices,
              ::testing::ElementsAre(
                  "FlashInfer allreduce fusion: forcing trtllm backend (mnnvl is supported on the "
                  "SM100 family, or SM90 within one node; this is sm 90 on 2 nodes)."));
  EXPECT_TRUE(AnyContains(d->reasons, "mnnvl is not supported on sm 90 on 2 nodes"));
  EXPECT_TRUE(AnyContains(d->reasons, "trtllm needs every rank on one node"));
}

// SGLang #23402 test_flashinfer_comm_fusion.py expects the name "trtllm" outside SM90/SM10X;
// communicator.py's runtime gate keeps them unfused.
TEST(ResolveRules, UnsupportedArchitectureIsNamedTrtllmAndNeverFuses) {
  for (int sm : {80, 89, 110, 120}) {
    for (const char* flag : {"auto", "trtllm", "mnnvl"}) {
      absl::StatusOr<Decision> d = ResolveBackend(Backend(flag), Topology{sm, 2, 1});
      ASSERT_TRUE(d.ok());
      EXPECT_EQ(d->backend, "trtllm") << sm << " " << flag;
      EXPECT_FALSE(d->fusion_enabled);
      EXPECT_TRUE(AnyContains(d->reasons, absl::StrCat("sm ", sm, ": the runtime gate")));
    }
  }
}

// SGLang server_args.py _handle_model_specific_adjustments (#23402): auto-enable needs an
// allowlisted architecture, the SM100 family, tp > 1, no DP attention, MoE all-to-all "none".
TEST(ResolveRules, AutoEnableNeedsEveryUpstreamCondition) {
  FusionFlags f;
  f.model_architecture = "DeepseekV3ForCausalLM";
  absl::StatusOr<Decision> sm100 = ResolveBackend(f, Topology{100, 2, 1});
  ASSERT_TRUE(sm100.ok());
  EXPECT_EQ(sm100->backend, "mnnvl");
  EXPECT_TRUE(sm100->fusion_enabled);
  EXPECT_TRUE(AnyContains(sm100->reasons, "Auto-enabling FlashInfer AllReduce Fusion"));
  for (const std::string& arch : AutoEnableArchitectures(RuleSet::kSglang23402)) {
    f.model_architecture = arch;
    absl::StatusOr<Decision> d = ResolveBackend(f, Topology{103, 4, 1});
    ASSERT_TRUE(d.ok());
    EXPECT_TRUE(d->fusion_enabled) << arch;
  }
  EXPECT_EQ(AutoEnableArchitectures(RuleSet::kSglang23402).size(), 13u);
  // Negative cases, each condition alone, and every failing condition named at once.
  f.model_architecture = "DeepseekV3ForCausalLM";
  absl::StatusOr<Decision> sm90 = ResolveBackend(f, Topology{90, 2, 1});
  ASSERT_TRUE(sm90.ok());
  EXPECT_EQ(sm90->backend, "none");
  EXPECT_TRUE(AnyContains(sm90->reasons, "sm 90 is not the SM100 family"));
  absl::StatusOr<Decision> tp1 = ResolveBackend(f, Topology{100, 1, 1});
  ASSERT_TRUE(tp1.ok());
  EXPECT_EQ(tp1->backend, "none");
  EXPECT_TRUE(AnyContains(tp1->reasons, "tp=1: nothing to reduce"));
  FusionFlags all = f;
  all.model_architecture = "MixtralForCausalLM";
  all.dp_attention = true;
  all.moe_a2a_backend = "deepep";
  absl::StatusOr<Decision> blocked = ResolveBackend(all, Topology{90, 4, 2});
  ASSERT_TRUE(blocked.ok());
  EXPECT_EQ(blocked->backend, "none");
  EXPECT_TRUE(AnyContains(
      blocked->reasons,
      "no --flashinfer-allreduce-fusion-backend: fusion off, not auto-enabled (architecture "
      "MixtralForCausalLM is not on the allowlist; sm 90 is not the SM100 family (sglang-23402 "
      "auto-enables only there); --enable-dp-attention is set; --moe-a2a-backend=deepep (not "
      "none))"));
}

TEST(ResolveRules, ExplicitBackendWithTp1IsNone) {
  absl::StatusOr<Decision> d = ResolveBackend(Backend("mnnvl"), Topology{100, 1, 1});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "none");
  EXPECT_FALSE(d->fusion_enabled);
  EXPECT_TRUE(AnyContains(d->reasons, "tp=1"));
}

TEST(ResolveRules, WorldSizeTheKernelsDoNotSupportKeepsNameButUnfused) {
  absl::StatusOr<Decision> d = ResolveBackend(Backend("mnnvl"), Topology{100, 3, 1});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "mnnvl");
  EXPECT_FALSE(d->fusion_enabled);
  EXPECT_TRUE(AnyContains(d->reasons, "tp=3 is not a world size the fused kernels support"));
  for (int tp : {2, 4, 8, 16}) {
    absl::StatusOr<Decision> ok = ResolveBackend(Backend("mnnvl"), Topology{100, tp, 1});
    ASSERT_TRUE(ok.ok());
    EXPECT_TRUE(ok->fusion_enabled) << "tp=" << tp;
  }
  // FlashInfer's mnnvl runs 32 and 64 ranks; ours cannot (FusionParams' 16 peer slots), and the
  // reason says so instead of "not supported".
  for (int tp : {32, 64}) {
    absl::StatusOr<Decision> big = ResolveBackend(Backend("auto"), Topology{100, tp, tp / 8});
    ASSERT_TRUE(big.ok());
    EXPECT_EQ(big->backend, "mnnvl");
    EXPECT_FALSE(big->fusion_enabled);
    EXPECT_TRUE(AnyContains(big->reasons, absl::StrCat("tp=", tp,
                                                       " is more ranks than arfuse's fused "
                                                       "kernels serve (2, 4, 8 or 16: "
                                                       "FusionParams holds kMaxWorldSize=16")));
    EXPECT_TRUE(AnyContains(big->reasons, "FlashInfer's mnnvl runs 2-64"));
  }
}

// Decision and data path agree (docs/config.md, "World sizes"): every group the config fuses finds
// a row of the published dispatch table, so its ops do not all fall to the unfused path.
TEST(ResolveRules, EveryFusedGroupHasADispatchRow) {
  const DispatchTable table = DispatchTable::Published();
  int fused = 0;
  for (RuleSet rules : {RuleSet::kSglang23402, RuleSet::kSglang29063}) {
    for (int sm : {80, 89, 90, 100, 103, 110, 120}) {
      for (int tp : {2, 3, 4, 6, 8, 12, 16, 32, 64}) {
        for (int nnodes : {1, 2, 4}) {
          if (nnodes > tp) continue;
          for (const char* flag : {"auto", "trtllm", "mnnvl"}) {
            FusionFlags f = Backend(flag);
            f.rules = rules;
            absl::StatusOr<Decision> d = ResolveBackend(f, Topology{sm, tp, nnodes});
            if (!d.ok() || !d->fusion_enabled) continue;
            ++fused;
            EXPECT_NE(table.Find(sm, tp), nullptr) << RuleSetName(rules) << " sm " << sm << " tp "
                                                   << tp << " nnodes " << nnodes << " " << flag;
          }
        }
      }
    }
  }
  EXPECT_GT(fused, 50);
}

TEST(ResolveRules, DeterministicDoesNotClearWhenOff) {
  FusionFlags f = Backend("trtllm");
  f.deterministic = false;
  absl::StatusOr<Decision> d = ResolveBackend(f, Topology{90, 2, 1});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "trtllm");
  EXPECT_TRUE(d->fusion_enabled);
}

TEST(ResolveRules, EnforceDisableBeatsAutoEnableAndWarnsAboutTheIgnoredBackend) {
  FusionFlags f;
  f.enforce_disable = true;
  f.model_architecture = "DeepseekV3ForCausalLM";
  absl::StatusOr<Decision> autoenable = ResolveBackend(f, Topology{100, 8, 1});
  ASSERT_TRUE(autoenable.ok());
  EXPECT_EQ(autoenable->backend, "none");
  EXPECT_THAT(autoenable->warnings, IsEmpty());

  f.backend = "mnnvl";
  absl::StatusOr<Decision> explicit_backend = ResolveBackend(f, Topology{100, 8, 1});
  ASSERT_TRUE(explicit_backend.ok());
  EXPECT_EQ(explicit_backend->backend, "none");
  EXPECT_TRUE(AnyContains(explicit_backend->warnings,
                          "--enforce-disable-flashinfer-allreduce-fusion overrides "
                          "--flashinfer-allreduce-fusion-backend=mnnvl"));
}

TEST(ResolveRules, DeterministicAndEnforceDisableBothReported) {
  FusionFlags f = Backend("auto");
  f.enforce_disable = true;
  f.deterministic = true;
  absl::StatusOr<Decision> d = ResolveBackend(f, Topology{100, 2, 1});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "none");
  EXPECT_TRUE(AnyContains(d->reasons, "--enforce-disable"));
  EXPECT_TRUE(AnyContains(d->reasons, "--enable-deterministic-inference"));
}

// ---------------------------------------------------------------------------------------------
// Validation: each rule's negative case asserts the code and the message.
// ---------------------------------------------------------------------------------------------

void ExpectInvalid(const absl::Status& status, const std::string& part) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(part));
}

TEST(Validation, Topology) {
  ExpectInvalid(ResolveBackend({}, Topology{90, 0, 1}).status(), "tp must be >= 1, got 0");
  ExpectInvalid(ResolveBackend({}, Topology{90, 2, 0}).status(), "nnodes must be >= 1, got 0");
  ExpectInvalid(ResolveBackend({}, Topology{9, 2, 1}).status(), "sm 9 is not a compute capability");
  ExpectInvalid(ResolveBackend({}, Topology{1000, 2, 1}).status(), "sm 1000");
  ExpectInvalid(ResolveBackend({}, Topology{90, -2, 1}).status(), "tp must be >= 1");
  ExpectInvalid(ResolveBackend({}, Topology{90, 1 << 20, 1}).status(), "too large");
  EXPECT_TRUE(ResolveBackend({}, Topology{90, 2, 1}).ok());
  // More nodes than ranks: refused, naming both numbers (docs/config.md, "World sizes").
  ExpectInvalid(ResolveBackend(Backend("auto"), Topology{100, 2, 3}).status(),
                "nnodes 3 is more than tp 2: every node holds at least one rank");
  ExpectInvalid(ValidateTopology(Topology{90, 1, 2}), "nnodes 2 is more than tp 1");
  EXPECT_TRUE(ValidateTopology(Topology{100, 8, 8}).ok());
}

// Each new input's bad values: INVALID_ARGUMENT naming the flag and the value.
TEST(Validation, RuleSetArchitectureAndMoeA2aBackend) {
  EXPECT_EQ(*ParseRuleSet("sglang-23402"), RuleSet::kSglang23402);
  EXPECT_EQ(*ParseRuleSet("sglang-29063"), RuleSet::kSglang29063);
  for (const char* bad : {"", "23402", "SGLANG-23402", "sglang-28789", "vllm"}) {
    ExpectInvalid(ParseRuleSet(bad).status(),
                  absl::StrCat("unknown --fusion-rules value \"", bad,
                               "\": expected sglang-23402 or sglang-29063"));
  }
  EXPECT_EQ(*ParseModelArchitecture("Qwen3_5MoeForConditionalGeneration"),
            "Qwen3_5MoeForConditionalGeneration");
  for (const std::string& bad : {std::string(""), std::string("Deepseek V3"), std::string("3Model"),
                                 std::string("a;rm -rf"), std::string(129, 'A')}) {
    ExpectInvalid(ParseModelArchitecture(bad).status(), "--model-architecture \"");
    ExpectInvalid(ParseModelArchitecture(bad).status(), "is not an architecture name");
  }
  for (const std::string& ok : MoeA2aBackendChoices()) EXPECT_EQ(*ParseMoeA2aBackend(ok), ok);
  ExpectInvalid(ParseMoeA2aBackend("nccl").status(),
                "unknown --moe-a2a-backend value \"nccl\": expected one of none, deepep");
  ExpectInvalid(ParseMoeA2aBackend("").status(), "unknown --moe-a2a-backend value \"\"");
  // The rules validate them too, whatever layer the flags came through.
  FusionFlags f = Backend("auto");
  f.model_architecture = "no spaces allowed";
  ExpectInvalid(ResolveBackend(f, Topology{100, 2, 1}).status(), "is not an architecture name");
  f = Backend("auto");
  f.moe_a2a_backend = "bogus";
  ExpectInvalid(ResolveBackend(f, Topology{100, 2, 1}).status(), "unknown --moe-a2a-backend");
  ExpectInvalid(ParseCudaGraphMode("graphs", "--prefill-cuda-graph-mode").status(),
                "unknown --prefill-cuda-graph-mode \"graphs\"");
}

TEST(Validation, BackendValue) {
  ExpectInvalid(ResolveBackend(Backend("nccl"), Topology{90, 2, 1}).status(),
                "unknown --flashinfer-allreduce-fusion-backend value \"nccl\": expected auto, "
                "trtllm or mnnvl");
  // Case-sensitive, like the frameworks' choices; "none" is not a flag value.
  ExpectInvalid(ParseBackendFlag("AUTO").status(), "\"AUTO\"");
  ExpectInvalid(ParseBackendFlag("none").status(), "expected auto, trtllm or mnnvl");
  ExpectInvalid(ParseBackendFlag("").status(), "\"\"");
  for (const char* ok : {"auto", "trtllm", "mnnvl"}) EXPECT_EQ(*ParseBackendFlag(ok), ok);
}

TEST(Validation, ParseSm) {
  EXPECT_EQ(*ParseSm("90"), 90);
  EXPECT_EQ(*ParseSm("103"), 103);
  ExpectInvalid(ParseSm("abc").status(), "--sm \"abc\" is not a number");
  ExpectInvalid(ParseSm("9.0").status(), "is not a number");
  ExpectInvalid(ParseSm("").status(), "is not a number");
  ExpectInvalid(ParseSm("-90").status(), "is not a number");
  ExpectInvalid(ParseSm("sm90").status(), "is not a number");
  ExpectInvalid(ParseSm("8").status(), "sm 8 is not a compute capability");
}

TEST(Validation, ParsePositiveIntAndBoolAndMode) {
  EXPECT_EQ(*ParsePositiveInt("--tp", "8"), 8);
  ExpectInvalid(ParsePositiveInt("--tp", "0").status(), "--tp must be >= 1, got 0");
  ExpectInvalid(ParsePositiveInt("--nnodes", "-1").status(), "--nnodes \"-1\" is not a positive");
  ExpectInvalid(ParsePositiveInt("--tp", "2x").status(), "--tp \"2x\"");
  ExpectInvalid(ParsePositiveInt("--tp", "99999999999").status(), "--tp");
  EXPECT_TRUE(*ParseBool("--x", "true"));
  EXPECT_FALSE(*ParseBool("--x", "0"));
  ExpectInvalid(ParseBool("--mnnvl-capture-safe", "maybe").status(),
                "--mnnvl-capture-safe \"maybe\" is not a boolean");
  EXPECT_EQ(*ParseCudaGraphMode("piecewise"), CudaGraphMode::kPiecewise);
  ExpectInvalid(ParseCudaGraphMode("partial").status(),
                "unknown --cuda-graph-mode \"partial\": expected none, piecewise or full");
}

TEST(Validation, ParsePositiveIntAboveTheRankLimit) {
  EXPECT_EQ(*ParsePositiveInt("--tp", "65536"), 65536);
  ExpectInvalid(ParsePositiveInt("--tp", "65537").status(), "--tp 65537 is too large (max 65536)");
  ExpectInvalid(ParsePositiveInt("--nnodes", "99999999999").status(),
                "--nnodes \"99999999999\" is not a positive integer");
}

// ---------------------------------------------------------------------------------------------
// Migration.
// ---------------------------------------------------------------------------------------------

// SGLang server_args.py _handle_deprecated_args: upstream's warning text, verbatim.
TEST(Migration, DeprecatedAloneMapsToAutoWithUpstreamsWarning) {
  FusionFlags f;
  f.enable_deprecated = true;
  MigratedFlags m = MigrateFlags(f);
  EXPECT_EQ(m.flags.backend, std::optional<std::string>("auto"));
  EXPECT_FALSE(m.flags.enable_deprecated);
  EXPECT_THAT(m.warnings, ::testing::ElementsAre(
                              "--enable-flashinfer-allreduce-fusion is deprecated. Please use "
                              "--flashinfer-allreduce-fusion-backend=auto instead."));
}

// SGLang server_args.py _handle_deprecated_args warns only when it applies the old flag: with an
// explicit backend the old flag is dropped silently.
TEST(Migration, ExplicitNewValueWinsSilently) {
  for (const char* value : {"auto", "trtllm", "mnnvl"}) {
    FusionFlags f = Backend(value);
    f.enable_deprecated = true;
    MigratedFlags m = MigrateFlags(f);
    EXPECT_EQ(m.flags.backend, std::optional<std::string>(value));
    EXPECT_FALSE(m.flags.enable_deprecated);
    EXPECT_THAT(m.warnings, IsEmpty()) << value;
  }
  // The resolved decision follows the new value, not "auto", and warns nothing either.
  FusionFlags f = Backend("trtllm");
  f.enable_deprecated = true;
  absl::StatusOr<Decision> d = ResolveBackend(f, Topology{90, 2, 1});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "trtllm");
  EXPECT_THAT(d->warnings, IsEmpty());
}

TEST(Migration, NothingToMigrateWarnsNothing) {
  for (const FusionFlags& f : {FusionFlags{}, Backend("mnnvl")}) {
    MigratedFlags m = MigrateFlags(f);
    EXPECT_EQ(m.flags, f);
    EXPECT_THAT(m.warnings, IsEmpty());
  }
}

TEST(Migration, IdempotentAndResolveAgreesWithPreMigratedFlags) {
  // Every combination of the four flags and the backend value.
  for (int bits = 0; bits < 8; ++bits) {
    for (const char* value : {static_cast<const char*>(nullptr), "auto", "trtllm", "mnnvl"}) {
      FusionFlags f = Backend(value);
      f.enable_deprecated = bits & 1;
      f.enforce_disable = bits & 2;
      f.deterministic = bits & 4;
      MigratedFlags once = MigrateFlags(f);
      MigratedFlags twice = MigrateFlags(once.flags);
      EXPECT_EQ(twice.flags, once.flags);
      EXPECT_THAT(twice.warnings, IsEmpty());
      EXPECT_FALSE(once.flags.enable_deprecated);
      for (int sm : {90, 100}) {
        absl::StatusOr<Decision> a = ResolveBackend(f, Topology{sm, 4, 1});
        absl::StatusOr<Decision> b = ResolveBackend(once.flags, Topology{sm, 4, 1});
        ASSERT_TRUE(a.ok() && b.ok());
        EXPECT_EQ(a->backend, b->backend);
        EXPECT_EQ(a->fusion_enabled, b->fusion_enabled);
      }
    }
  }
}

TEST(Migration, EnforceDisableClearsTheBackendForTheDaemon) {
  FusionFlags f;
  f.enable_deprecated = true;
  f.enforce_disable = true;
  MigratedFlags m = MigrateFlags(f);
  EXPECT_FALSE(m.flags.backend.has_value());
  EXPECT_TRUE(m.flags.enforce_disable);
  EXPECT_TRUE(AnyContains(m.warnings, "deprecated"));
  EXPECT_TRUE(AnyContains(m.warnings, "overrides --flashinfer-allreduce-fusion-backend=auto"));
}

// ---------------------------------------------------------------------------------------------
// Negotiation.
// ---------------------------------------------------------------------------------------------

Decision Resolved(const char* flag, int sm, int nnodes = 1, int tp = 2) {
  absl::StatusOr<Decision> d = ResolveBackend(Backend(flag), Topology{sm, tp, nnodes});
  EXPECT_TRUE(d.ok()) << d.status();
  return d.value_or(Decision{});
}

CaptureRequest Capture(CudaGraphMode mode, bool in_graph, std::optional<bool> safe = {}) {
  return CaptureRequest{mode, in_graph, safe};
}

TEST(Negotiation, MnnvlPiecewiseAllowedByDefaultBecauseOurKernelsAreCaptureSafe) {
  Decision d = Negotiate(Resolved("mnnvl", 100), Capture(CudaGraphMode::kPiecewise, true));
  EXPECT_EQ(d.cuda_graph_mode, CudaGraphMode::kPiecewise);
  EXPECT_EQ(d.data_plane, DataPlane::kDoorbell);
  EXPECT_TRUE(AnyContains(d.reasons, "capture-safe (bitwise sentinel checks)"));
}

TEST(Negotiation, MnnvlNotCaptureSafeTurnsPiecewiseOff) {
  Decision d = Negotiate(Resolved("mnnvl", 100), Capture(CudaGraphMode::kPiecewise, true, false));
  EXPECT_EQ(d.cuda_graph_mode, CudaGraphMode::kNone);
  EXPECT_EQ(d.data_plane, DataPlane::kEager);
  EXPECT_TRUE(AnyContains(d.reasons,
                          "--mnnvl-capture-safe=false): piecewise CUDA graphs turned "
                          "off"));
}

TEST(Negotiation, MnnvlNotCaptureSafeLeavesFullAndNone) {
  for (CudaGraphMode mode : {CudaGraphMode::kFull, CudaGraphMode::kNone}) {
    Decision d = Negotiate(Resolved("mnnvl", 100), Capture(mode, true, false));
    EXPECT_EQ(d.cuda_graph_mode, mode);
  }
}

TEST(Negotiation, TrtllmLeavesTheModeAsAsked) {
  for (CudaGraphMode mode :
       {CudaGraphMode::kNone, CudaGraphMode::kPiecewise, CudaGraphMode::kFull}) {
    Decision d = Negotiate(Resolved("trtllm", 90), Capture(mode, true, false));
    EXPECT_EQ(d.cuda_graph_mode, mode) << CudaGraphModeName(mode);
  }
}

TEST(Negotiation, DataPlane) {
  const Decision fused = Resolved("trtllm", 90);
  Decision in_graph = Negotiate(fused, Capture(CudaGraphMode::kFull, true));
  EXPECT_EQ(in_graph.data_plane, DataPlane::kDoorbell);
  EXPECT_TRUE(AnyContains(in_graph.reasons, "doorbell plane"));

  Decision out_of_graph = Negotiate(fused, Capture(CudaGraphMode::kPiecewise, false));
  EXPECT_EQ(out_of_graph.data_plane, DataPlane::kEager);
  EXPECT_EQ(out_of_graph.cuda_graph_mode, CudaGraphMode::kPiecewise);
  EXPECT_TRUE(AnyContains(out_of_graph.reasons, "split op"));

  Decision no_graphs = Negotiate(fused, Capture(CudaGraphMode::kNone, true));
  EXPECT_EQ(no_graphs.data_plane, DataPlane::kEager);
  EXPECT_TRUE(AnyContains(no_graphs.reasons, "no CUDA graphs"));
}

TEST(Negotiation, UnfusedKeepsModeAndIsEager) {
  Decision unfused = Resolved("trtllm", 90, /*nnodes=*/2);
  ASSERT_FALSE(unfused.fusion_enabled);
  Decision d = Negotiate(unfused, Capture(CudaGraphMode::kPiecewise, true, false));
  EXPECT_EQ(d.cuda_graph_mode, CudaGraphMode::kPiecewise);
  EXPECT_EQ(d.data_plane, DataPlane::kEager);
  EXPECT_TRUE(AnyContains(d.reasons, "fusion is off"));
}

TEST(Negotiation, NoDoorbellMakesFullGraphsPiecewiseWithAnEagerSplitOp) {
  NegotiationEnvironment host;
  host.doorbell_available = false;
  host.doorbell_unavailable_reason = "host device mode";
  Decision d = Negotiate(Resolved("trtllm", 90), Capture(CudaGraphMode::kFull, true), host);
  EXPECT_EQ(d.cuda_graph_mode, CudaGraphMode::kPiecewise);
  EXPECT_EQ(d.data_plane, DataPlane::kEager);
  EXPECT_TRUE(AnyContains(d.reasons, "doorbell plane unavailable (host device mode)"));
  // And for capture-unsafe mnnvl that piecewise mode goes off too.
  Decision m = Negotiate(Resolved("mnnvl", 100), Capture(CudaGraphMode::kFull, true, false), host);
  EXPECT_EQ(m.cuda_graph_mode, CudaGraphMode::kNone);
  // Full graphs without the op inside stay full.
  Decision out = Negotiate(Resolved("trtllm", 90), Capture(CudaGraphMode::kFull, false), host);
  EXPECT_EQ(out.cuda_graph_mode, CudaGraphMode::kFull);
}

TEST(Negotiation, WarnsWhenDoorbellRunsWithoutMps) {
  NegotiationEnvironment no_mps;
  no_mps.mps_detected = false;
  no_mps.doorbell_hop_us = 286;
  Decision d = Negotiate(Resolved("trtllm", 90), Capture(CudaGraphMode::kFull, true), no_mps);
  EXPECT_EQ(d.data_plane, DataPlane::kDoorbell);
  EXPECT_TRUE(AnyContains(d.warnings, "MPS not detected"));
  EXPECT_TRUE(AnyContains(d.warnings, "measured 286 us"));

  NegotiationEnvironment mps;
  mps.mps_detected = true;
  Decision ok = Negotiate(Resolved("trtllm", 90), Capture(CudaGraphMode::kFull, true), mps);
  EXPECT_THAT(ok.warnings, IsEmpty());
  // Unknown (the CLI): no warning either.
  Decision unknown = Negotiate(Resolved("trtllm", 90), Capture(CudaGraphMode::kFull, true));
  EXPECT_THAT(unknown.warnings, IsEmpty());
}

// SGLang #23402: with a FlashInfer older than the piecewise fix, mnnvl turned off only the
// piecewise (prefill/extend) graphs and kept the decode graphs. Per phase, as upstream.
TEST(Negotiation, MnnvlNotCaptureSafeTurnsOffPiecewisePrefillAndKeepsDecodeGraphs) {
  CaptureRequest c = Capture(CudaGraphMode::kPiecewise, true, false);
  c.decode_mode = CudaGraphMode::kFull;
  Decision d = Negotiate(Resolved("mnnvl", 100), c);
  EXPECT_EQ(d.prefill, (PhaseCapture{CudaGraphMode::kNone, DataPlane::kEager}));
  EXPECT_EQ(d.decode, (PhaseCapture{CudaGraphMode::kFull, DataPlane::kDoorbell}));
  EXPECT_TRUE(AnyContains(d.reasons,
                          "prefill: mnnvl kernels are not capture-safe "
                          "(--mnnvl-capture-safe=false): piecewise CUDA graphs "
                          "turned off"));
  EXPECT_TRUE(AnyContains(d.reasons, "decode: fused op inside the client's CUDA graphs"));
  // One-mode clients get what holds for both phases: no graphs, the old answer.
  EXPECT_EQ(d.cuda_graph_mode, CudaGraphMode::kNone);
  EXPECT_EQ(d.data_plane, DataPlane::kEager);
  // trtllm keeps both phases as asked.
  Decision t = Negotiate(Resolved("trtllm", 90), c);
  EXPECT_EQ(t.prefill, (PhaseCapture{CudaGraphMode::kPiecewise, DataPlane::kDoorbell}));
  EXPECT_EQ(t.decode, (PhaseCapture{CudaGraphMode::kFull, DataPlane::kDoorbell}));
  EXPECT_EQ(t.cuda_graph_mode, CudaGraphMode::kPiecewise);
  // Capture-safe mnnvl (ours) keeps both too.
  c.mnnvl_capture_safe.reset();
  Decision safe = Negotiate(Resolved("mnnvl", 100), c);
  EXPECT_EQ(safe.prefill.mode, CudaGraphMode::kPiecewise);
  EXPECT_EQ(safe.decode.mode, CudaGraphMode::kFull);
}

TEST(Negotiation, OneModeRequestsAnswerBothPhasesAlikeWithoutPhasePrefixes) {
  for (CudaGraphMode mode :
       {CudaGraphMode::kNone, CudaGraphMode::kPiecewise, CudaGraphMode::kFull}) {
    Decision d = Negotiate(Resolved("mnnvl", 100), Capture(mode, true, false));
    EXPECT_EQ(d.prefill, d.decode) << CudaGraphModeName(mode);
    EXPECT_EQ(d.cuda_graph_mode, d.prefill.mode);
    EXPECT_EQ(d.data_plane, d.prefill.data_plane);
    EXPECT_FALSE(AnyContains(d.reasons, "prefill: ")) << CudaGraphModeName(mode);
  }
  // The lower phase wins, prefill or decode.
  CaptureRequest c = Capture(CudaGraphMode::kFull, false);
  c.prefill_mode = CudaGraphMode::kFull;
  c.decode_mode = CudaGraphMode::kNone;
  Decision d = Negotiate(Resolved("trtllm", 90), c);
  EXPECT_EQ(d.cuda_graph_mode, CudaGraphMode::kNone);
  EXPECT_EQ(d.prefill.mode, CudaGraphMode::kFull);
  EXPECT_TRUE(AnyContains(d.reasons, "decode: no CUDA graphs"));
}

TEST(Negotiation, WorkspaceCapsTheTokensPerBatch) {
  NegotiationEnvironment env;
  env.workspace_max_tokens = 512;
  Decision d = Negotiate(Resolved("trtllm", 90), Capture(CudaGraphMode::kFull, true), env);
  EXPECT_EQ(d.max_tokens_per_batch, 512u);
  EXPECT_TRUE(AnyContains(d.reasons,
                          "the workspace holds 512 tokens (--max-tokens): fused ops "
                          "take at most 512 tokens per batch"));
  env.workspace_max_tokens = 8192;  // upstream's 2048 stays the limit
  EXPECT_EQ(Negotiate(Resolved("trtllm", 90), {}, env).max_tokens_per_batch, 2048u);
  EXPECT_EQ(Negotiate(Resolved("trtllm", 90, 2), {}, env).max_tokens_per_batch, 0u);
}

TEST(Negotiation, ResolveIsResolveBackendThenNegotiate) {
  const CaptureRequest c = Capture(CudaGraphMode::kPiecewise, true, false);
  absl::StatusOr<Decision> all = Resolve(Backend("auto"), Topology{100, 2, 2}, c);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(*all, Negotiate(Resolved("auto", 100, 2), c));
  ExpectInvalid(Resolve({}, Topology{90, 0, 1}, c).status(), "tp must be >= 1");
}

// ---------------------------------------------------------------------------------------------
// SGLang's rules, case by case, under both rule sets (the table the gRPC and CLI tests share).
// ---------------------------------------------------------------------------------------------

TEST(UpstreamRules, EveryCaseThroughTheLibrary) {
  int refused = 0;
  for (const testing::UpstreamCase& c : testing::UpstreamCases()) {
    SCOPED_TRACE(testing::CaseName(c));
    absl::StatusOr<Decision> d = Resolve(c.flags, c.topology, CaptureRequest{});
    if (c.where == testing::Where::kError) {
      ++refused;
      ExpectInvalid(d.status(), c.text);
      continue;
    }
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->backend, c.backend);
    EXPECT_EQ(d->fusion_enabled, c.fused);
    EXPECT_EQ(d->rules, c.flags.rules);
    EXPECT_EQ(d->max_tokens_per_batch, c.fused ? 2048u : 0u);
    const std::vector<std::string>& lines = c.where == testing::Where::kWarning  ? d->warnings
                                            : c.where == testing::Where::kNotice ? d->notices
                                                                                 : d->reasons;
    EXPECT_TRUE(AnyContains(lines, c.text)) << ::testing::PrintToString(lines);
    if (c.no_warnings) {
      EXPECT_THAT(d->warnings, IsEmpty());
    }
  }
  EXPECT_GE(refused, 10);
}

// Every difference between the rule sets, case by case: the same inputs, each rule set's answer.
TEST(UpstreamRules, TheRuleSetsDifferExactlyWhereUpstreamChanged) {
  struct Diff {
    Topology topology;
    const char* backend;  // nullptr: no flag (auto-enable)
    const char* arch;
    std::string expected_23402;  // "<backend> fused|unfused"
    std::string expected_29063;  // likewise, or "ValueError: <text>"
  };
  const Diff diffs[] = {
      {{90, 2, 1}, "auto", "", "mnnvl fused", "trtllm fused"},
      {{90, 4, 2},
       "auto",
       "",
       "trtllm unfused",
       "ValueError: does not support multi-node on non-Blackwell systems"},
      {{90, 4, 2},
       "trtllm",
       "",
       "trtllm unfused",
       "ValueError: trtllm backend supports single-node only"},
      {{90, 4, 2},
       "mnnvl",
       "",
       "trtllm unfused",
       "ValueError: mnnvl backend requires a Blackwell system, or SM90 single-node"},
      {{100, 4, 2},
       "trtllm",
       "",
       "trtllm unfused",
       "ValueError: trtllm backend supports single-node only"},
      {{80, 2, 1}, "auto", "", "trtllm unfused", "ValueError: requires SM90 or SM10X"},
      {{120, 2, 1}, "trtllm", "", "trtllm unfused", "ValueError: requires SM90 or SM10X"},
      {{90, 2, 1}, nullptr, "Glm4MoeForCausalLM", "none unfused", "trtllm fused"},
      // Unchanged: the SM100 family, and SM90 with explicit single-node backends.
      {{100, 2, 1}, "auto", "", "mnnvl fused", "mnnvl fused"},
      {{100, 8, 2}, "auto", "", "mnnvl fused", "mnnvl fused"},
      {{100, 2, 1}, nullptr, "KimiK25ForConditionalGeneration", "mnnvl fused", "mnnvl fused"},
      {{90, 2, 1}, "trtllm", "", "trtllm fused", "trtllm fused"},
      {{90, 2, 1}, "mnnvl", "", "mnnvl fused", "mnnvl fused"},
  };
  auto outcome = [](RuleSet rules, const Diff& diff) -> std::string {
    FusionFlags f = Backend(diff.backend);
    f.rules = rules;
    f.model_architecture = diff.arch;
    absl::StatusOr<Decision> d = ResolveBackend(f, diff.topology);
    if (!d.ok()) return absl::StrCat("ValueError: ", d.status().message());
    return absl::StrCat(d->backend, d->fusion_enabled ? " fused" : " unfused");
  };
  for (const Diff& diff : diffs) {
    SCOPED_TRACE(absl::StrCat("sm ", diff.topology.sm, " tp ", diff.topology.tp, " nnodes ",
                              diff.topology.nnodes, " ", diff.backend ? diff.backend : diff.arch));
    EXPECT_EQ(outcome(RuleSet::kSglang23402, diff), diff.expected_23402);
    const std::string got = outcome(RuleSet::kSglang29063, diff);
    if (diff.expected_29063.rfind("ValueError: ", 0) == 0) {
      EXPECT_THAT(got, ::testing::StartsWith("ValueError: FlashInfer allreduce fusion "));
      EXPECT_THAT(got, HasSubstr(diff.expected_29063.substr(12)));
    } else {
      EXPECT_EQ(got, diff.expected_29063);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Every rank alike.
// ---------------------------------------------------------------------------------------------

RankReport Report(int rank, const char* flag, Topology t) {
  RankReport r;
  r.rank = rank;
  r.flags = Backend(flag);
  r.topology = t;
  absl::StatusOr<Decision> d = ResolveBackend(r.flags, t);
  EXPECT_TRUE(d.ok());
  r.decision = *d;
  return r;
}

std::vector<RankReport> Group(int n, const char* flag, Topology t) {
  std::vector<RankReport> reports;
  for (int i = 0; i < n; ++i) reports.push_back(Report(i, flag, t));
  return reports;
}

TEST(Consensus, AgreeingRanksKeepTheDecision) {
  std::vector<RankReport> g = Group(4, "auto", Topology{100, 4, 1});
  absl::StatusOr<Decision> d = Consensus(g);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(*d, *g[0].decision);
  EXPECT_EQ(d->backend, "mnnvl");
  EXPECT_TRUE(d->fusion_enabled);
  // Report order does not matter.
  std::reverse(g.begin(), g.end());
  EXPECT_EQ(*Consensus(g), *d);
}

TEST(Consensus, AgreeingUnfusedGroupIsNotRenamed) {
  absl::StatusOr<Decision> d = Consensus(Group(2, "trtllm", Topology{90, 2, 2}));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "trtllm");
  EXPECT_FALSE(d->fusion_enabled);
}

TEST(Consensus, MixedArchitecturesGiveNoneForAll) {
  std::vector<RankReport> g = {Report(0, "auto", Topology{90, 2, 1}),
                               Report(1, "auto", Topology{100, 2, 1})};
  // Both resolve to mnnvl; the architectures still differ.
  ASSERT_EQ(g[0].decision->backend, g[1].decision->backend);
  absl::StatusOr<Decision> d = Consensus(g);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "none");
  EXPECT_FALSE(d->fusion_enabled);
  EXPECT_THAT(d->reasons,
              Contains("rank 1: sm 100 differs from rank 0's sm 90 (mixed architectures)"));
}

TEST(Consensus, OneRankUnableToAllocateTurnsEveryRankOff) {
  std::vector<RankReport> g = Group(4, "mnnvl", Topology{100, 4, 1});
  g[2].failure = "workspace allocation failed: cuMemCreate out of memory";
  absl::StatusOr<Decision> d = Consensus(g);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "none");
  EXPECT_FALSE(d->fusion_enabled);
  EXPECT_THAT(d->reasons,
              Contains("rank 2: workspace allocation failed: cuMemCreate out of memory"));
  EXPECT_TRUE(AnyContains(d->reasons, "fusion off on every rank"));
}

TEST(Consensus, RankZeroFailingAlsoTurnsEveryRankOff) {
  std::vector<RankReport> g = Group(2, "mnnvl", Topology{100, 2, 1});
  g[0].decision.reset();
  g[0].failure = "peer channel lost";
  absl::StatusOr<Decision> d = Consensus(g);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "none");
  EXPECT_THAT(d->reasons, Contains("rank 0: peer channel lost"));
}

TEST(Consensus, MismatchedFlagsGiveNoneForAll) {
  std::vector<RankReport> g = {Report(0, "trtllm", Topology{90, 2, 1}),
                               Report(1, "mnnvl", Topology{90, 2, 1})};
  absl::StatusOr<Decision> d = Consensus(g);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "none");
  EXPECT_TRUE(AnyContains(d->reasons, "rank 1: fusion flags (backend=mnnvl"));
  EXPECT_TRUE(AnyContains(d->reasons, "rank 1: decided mnnvl (fused) but rank 0 decided trtllm"));
}

TEST(Consensus, MismatchedRuleSetOrModelFlagsGiveNoneForAll) {
  std::vector<RankReport> g = Group(2, "trtllm", Topology{90, 2, 1});
  g[1].flags.rules = RuleSet::kSglang29063;
  absl::StatusOr<Decision> d = Consensus(g);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "none");
  EXPECT_TRUE(AnyContains(d->reasons, "rules=sglang-29063"));
  g = Group(2, "trtllm", Topology{90, 2, 1});
  g[1].flags.dp_attention = true;
  g[1].flags.model_architecture = "GptOssForCausalLM";
  d = Consensus(g);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "none");
  EXPECT_TRUE(AnyContains(d->reasons, "model_architecture=GptOssForCausalLM dp_attention=true"));
}

TEST(Consensus, DeprecatedFlagAndAutoAreTheSameRequest) {
  std::vector<RankReport> g = Group(2, "auto", Topology{90, 2, 1});
  g[1].flags = FusionFlags{};
  g[1].flags.enable_deprecated = true;
  absl::StatusOr<Decision> d = Consensus(g);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "mnnvl");
  EXPECT_TRUE(d->fusion_enabled);
}

TEST(Consensus, MismatchedGroupShape) {
  std::vector<RankReport> g = {Report(0, "auto", Topology{100, 2, 1}),
                               Report(1, "auto", Topology{100, 2, 2})};
  absl::StatusOr<Decision> d = Consensus(g);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "none");
  EXPECT_TRUE(AnyContains(d->reasons, "rank 1: tp=2 nnodes=2 differ from rank 0's tp=2 nnodes=1"));
}

TEST(Consensus, InvalidReportSets) {
  ExpectInvalid(Consensus({}).status(), "at least one rank");
  std::vector<RankReport> dup = Group(2, "auto", Topology{100, 2, 1});
  dup[1].rank = 0;
  ExpectInvalid(Consensus(dup).status(), "rank 0 reported twice");
  std::vector<RankReport> gap = Group(2, "auto", Topology{100, 2, 1});
  gap[1].rank = 5;
  ExpectInvalid(Consensus(gap).status(), "rank 5 is outside 0..1");
  std::vector<RankReport> empty = Group(2, "auto", Topology{100, 2, 1});
  empty[1].decision.reset();
  absl::StatusOr<Decision> d = Consensus(empty);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->backend, "none");
  EXPECT_THAT(d->reasons, Contains("rank 1: reported no decision"));
}

// ---------------------------------------------------------------------------------------------
// Encodings.
// ---------------------------------------------------------------------------------------------

TEST(RankReportEncoding, RoundTrips) {
  RankReport r = Report(3, "mnnvl", Topology{90, 8, 2});
  r.flags.enable_deprecated = true;
  r.decision->warnings.push_back("line one\nline two = with \"quotes\"");
  r.decision->cuda_graph_mode = CudaGraphMode::kFull;
  r.decision->data_plane = DataPlane::kDoorbell;
  absl::StatusOr<RankReport> back = DecodeRankReport(EncodeRankReport(r));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, r);
  ASSERT_FALSE(r.decision->notices.empty());  // the mnnvl fallback

  // Every new field survives too.
  RankReport all = Report(0, "auto", Topology{100, 4, 1});
  all.flags.rules = RuleSet::kSglang29063;
  all.flags.model_architecture = "Qwen3NextForCausalLM";
  all.flags.dp_attention = true;
  all.flags.moe_a2a_backend = "mori";
  all.decision->rules = RuleSet::kSglang29063;
  all.decision->prefill = {CudaGraphMode::kNone, DataPlane::kEager};
  all.decision->decode = {CudaGraphMode::kFull, DataPlane::kDoorbell};
  absl::StatusOr<RankReport> again = DecodeRankReport(EncodeRankReport(all));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, all);
  EXPECT_EQ(again->decision->max_tokens_per_batch, 2048u);

  RankReport failed;
  failed.rank = 1;
  failed.topology = Topology{100, 2, 1};
  failed.failure = "out of memory";
  absl::StatusOr<RankReport> f = DecodeRankReport(EncodeRankReport(failed));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(*f, failed);
  EXPECT_FALSE(f->decision.has_value());
}

TEST(RankReportEncoding, RejectsMalformedInput) {
  const std::string good = EncodeRankReport(Report(0, "auto", Topology{100, 2, 1}));
  ExpectInvalid(DecodeRankReport("").status(), "does not start with arfuse-rank-report-v2");
  ExpectInvalid(DecodeRankReport("arfuse-rank-report-v9\nrank=0\n").status(), "does not start");
  ExpectInvalid(DecodeRankReport(good + "colour=blue\n").status(), "colour: unknown field");
  ExpectInvalid(DecodeRankReport(good + "rank=1\n").status(), "rank: given twice");
  ExpectInvalid(DecodeRankReport("arfuse-rank-report-v1\nrank=x\n").status(),
                "rank: not an integer");
  ExpectInvalid(DecodeRankReport("arfuse-rank-report-v1\nrank=0\nsm=90\ntp=2\n").status(),
                "nnodes: missing");
  ExpectInvalid(DecodeRankReport(good + "decision.backend_x=1\n").status(), "unknown field");
  ExpectInvalid(DecodeRankReport("arfuse-rank-report-v1\nrank=0\nsm=90\ntp=2\nnnodes=1\n"
                                 "decision.backend=nccl\n")
                    .status(),
                "unknown backend");
  ExpectInvalid(DecodeRankReport("arfuse-rank-report-v1\nbroken\n").status(), "no '='");
}

// A report of the previous version (no rule set, architecture, DP attention, ...) still reads,
// with the defaults.
TEST(RankReportEncoding, ReadsVersionOneReports) {
  absl::StatusOr<RankReport> r = DecodeRankReport(
      "arfuse-rank-report-v1\nrank=1\nsm=90\ntp=2\nnnodes=1\nflags.backend=trtllm\n"
      "flags.enable_deprecated=false\nflags.enforce_disable=false\nflags.deterministic=false\n"
      "decision.backend=trtllm\ndecision.fusion_enabled=true\ndecision.cuda_graph_mode=none\n"
      "decision.data_plane=eager\n");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->flags.rules, RuleSet::kSglang23402);
  EXPECT_EQ(r->flags.moe_a2a_backend, "none");
  EXPECT_FALSE(r->flags.dp_attention);
  EXPECT_EQ(r->decision->backend, "trtllm");
  EXPECT_EQ(r->decision->max_tokens_per_batch, 0u);
}

TEST(RankReportEncoding, RejectsBadValuesOfKnownFields) {
  const std::string head = "arfuse-rank-report-v1\nrank=0\nsm=90\ntp=2\nnnodes=1\n";
  ExpectInvalid(DecodeRankReport(head + "failure=oops\\q\n").status(),
                "rank report field failure: bad escape");
  ExpectInvalid(DecodeRankReport(head + "flags.deterministic=yes\n").status(),
                "rank report field flags.deterministic: not true or false");
  ExpectInvalid(DecodeRankReport(head + "decision.data_plane=rdma\n").status(),
                "rank report field decision.data_plane: unknown data plane \"rdma\"");
  ExpectInvalid(DecodeRankReport(head + "decision.cuda_graph_mode=partial\n").status(),
                "rank report field decision.cuda_graph_mode: unknown --cuda-graph-mode "
                "\"partial\"");
  ExpectInvalid(DecodeRankReport(head + "flags.rules=sglang-1\n").status(),
                "rank report field flags.rules: unknown --fusion-rules value");
  ExpectInvalid(DecodeRankReport(head + "flags.model_architecture=a b\n").status(),
                "rank report field flags.model_architecture: --model-architecture \"a b\"");
  ExpectInvalid(DecodeRankReport(head + "flags.moe_a2a_backend=x\n").status(),
                "rank report field flags.moe_a2a_backend: unknown --moe-a2a-backend");
  ExpectInvalid(DecodeRankReport(head + "flags.dp_attention=2\n").status(),
                "rank report field flags.dp_attention: not true or false");
  ExpectInvalid(DecodeRankReport(head + "decision.max_tokens_per_batch=-1\n").status(),
                "rank report field decision.max_tokens_per_batch: not an unsigned integer");
  ExpectInvalid(DecodeRankReport(head + "decision.decode_data_plane=rdma\n").status(),
                "rank report field decision.decode_data_plane: unknown data plane");
  ExpectInvalid(DecodeRankReport(head + "decision.prefill_cuda_graph_mode=x\n").status(),
                "rank report field decision.prefill_cuda_graph_mode: unknown --cuda-graph-mode");
}

TEST(DecisionJson, HasEveryKeyAndEscapes) {
  Decision d;
  d.backend = "mnnvl";
  d.fusion_enabled = true;
  d.rules = RuleSet::kSglang29063;
  d.max_tokens_per_batch = 2048;
  d.prefill = {CudaGraphMode::kNone, DataPlane::kEager};
  d.decode = {CudaGraphMode::kFull, DataPlane::kDoorbell};
  d.cuda_graph_mode = CudaGraphMode::kPiecewise;
  d.data_plane = DataPlane::kDoorbell;
  d.warnings = {"say \"hi\"\\", "tab\there"};
  d.notices = {"n1"};
  d.reasons = {"r1", "ctl\x01"};
  EXPECT_EQ(DecisionToJson(d),
            "{\"backend\":\"mnnvl\",\"fusion_enabled\":true,\"cuda_graph_mode\":\"piecewise\","
            "\"data_plane\":\"doorbell\",\"prefill\":{\"cuda_graph_mode\":\"none\",\"data_plane\":"
            "\"eager\"},\"decode\":{\"cuda_graph_mode\":\"full\",\"data_plane\":\"doorbell\"},"
            "\"max_tokens_per_batch\":2048,\"fusion_rules\":\"sglang-29063\","
            "\"warnings\":[\"say \\\"hi\\\"\\\\\",\"tab\\there\"],\"notices\":[\"n1\"],"
            "\"reasons\":[\"r1\",\"ctl\\u0001\"]}");
  EXPECT_EQ(DecisionToJson(Decision{}),
            "{\"backend\":\"none\",\"fusion_enabled\":false,\"cuda_graph_mode\":\"none\","
            "\"data_plane\":\"eager\",\"prefill\":{\"cuda_graph_mode\":\"none\",\"data_plane\":"
            "\"eager\"},\"decode\":{\"cuda_graph_mode\":\"none\",\"data_plane\":\"eager\"},"
            "\"max_tokens_per_batch\":0,\"fusion_rules\":\"sglang-23402\",\"warnings\":[],"
            "\"notices\":[],\"reasons\":[]}");
}

}  // namespace
}  // namespace arfuse::config
