// The fusion flags' one declaration (config/fusion_flags.inc): the table's rows, their
// values as the command lines set them, the v1.FusionFlags field of every row, and
// docs/config.md's flag table, which must be the generated one.
#include "config/fusion_flags.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "arfuse/v1/config.pb.h"
#include "config/config_convert.h"
#include "google/protobuf/descriptor.h"

namespace arfuse::config {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

void ExpectInvalid(const absl::Status& status, const std::string& part) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(part));
}

absl::Status SetFlag(FusionFlags& flags, const std::string& name, const std::string& value) {
  const FusionFlagSpec* spec = FindFusionFlag(name);
  if (spec == nullptr) return absl::NotFoundError(name);
  return spec->Set(flags, value);
}

TEST(FusionFlagTable, SetsEveryFlagFromTheFrameworksSpelling) {
  FusionFlags f;
  const std::vector<std::pair<std::string, std::string>> given = {
      {"flashinfer-allreduce-fusion-backend", "mnnvl"},
      {"enable-flashinfer-allreduce-fusion", "true"},
      {"enforce_disable_flashinfer_allreduce_fusion", "false"},
      {"enable-deterministic-inference", "1"},
      {"fusion-rules", "sglang-29063"},
      {"model-architecture", "GptOssForCausalLM"},
      {"enable-dp-attention", "true"},
      {"moe-a2a-backend", "deepep"}};
  for (const auto& [name, value] : given) {
    ASSERT_TRUE(SetFlag(f, name, value).ok()) << name << "=" << value;
  }
  EXPECT_EQ(f.backend, std::optional<std::string>("mnnvl"));
  EXPECT_TRUE(f.enable_deprecated);
  EXPECT_FALSE(f.enforce_disable);
  EXPECT_TRUE(f.deterministic);
  EXPECT_EQ(f.rules, RuleSet::kSglang29063);
  EXPECT_EQ(f.model_architecture, "GptOssForCausalLM");
  EXPECT_TRUE(f.dp_attention);
  EXPECT_EQ(f.moe_a2a_backend, "deepep");

  // Every value reads back as text that sets the same value (the rank report relies on it).
  FusionFlags again;
  for (const FusionFlagSpec& spec : FusionFlagTable()) {
    if (std::optional<std::string> text = spec.Get(f)) {
      ASSERT_TRUE(spec.Set(again, *text).ok()) << spec.name;
    }
  }
  EXPECT_EQ(again, f);
  // Every flag, as field=value (a flag added to the table adds its own).
  EXPECT_THAT(
      FlagsText(FusionFlags{}),
      StartsWith("backend=unset enable_deprecated=false enforce_disable=false deterministic=false "
                 "rules=sglang-23402 model_architecture=unset dp_attention=false "
                 "moe_a2a_backend=none"));
}

TEST(FusionFlagTable, RejectsBadValuesNamingTheFlag) {
  FusionFlags f;
  ExpectInvalid(SetFlag(f, "flashinfer-allreduce-fusion-backend", "nccl"),
                "unknown --flashinfer-allreduce-fusion-backend value \"nccl\": expected auto, "
                "trtllm or mnnvl");
  ExpectInvalid(SetFlag(f, "flashinfer-allreduce-fusion-backend", "AUTO"), "\"AUTO\"");
  ExpectInvalid(SetFlag(f, "enable-deterministic-inference", "maybe"),
                "--enable-deterministic-inference \"maybe\" is not a boolean");
  ExpectInvalid(SetFlag(f, "fusion-rules", "latest"),
                "unknown --fusion-rules value \"latest\": expected sglang-23402 or sglang-29063");
  ExpectInvalid(SetFlag(f, "model-architecture", ""),
                "--model-architecture \"\" is not an architecture name");
  ExpectInvalid(SetFlag(f, "moe-a2a-backend", "nvshmem"),
                "unknown --moe-a2a-backend value \"nvshmem\": expected one of none, deepep, ");
  ExpectInvalid(SetFlag(f, "enable-dp-attention", "on"),
                "--enable-dp-attention \"on\" is not a boolean");
  EXPECT_EQ(f, FusionFlags{});  // a refused value leaves the flags as they were
  // ValidateFlags checks what was stored unchecked (a Resolve request's text, say).
  FusionFlags stored;
  ASSERT_TRUE(FindFusionFlag("moe_a2a_backend")->Assign(stored, "").ok());
  ExpectInvalid(ValidateFlags(stored), "unknown --moe-a2a-backend value \"\"");
  ExpectInvalid(FindFusionFlag("fusion_rules")->Assign(stored, "x"), "unknown --fusion-rules");
}

TEST(FusionFlagTable, EveryRowIsComplete) {
  std::set<std::string> names;
  for (const FusionFlagSpec& spec : FusionFlagTable()) {
    SCOPED_TRACE(spec.name);
    EXPECT_TRUE(names.insert(spec.ident).second) << "declared twice";
    EXPECT_EQ(FindFusionFlag(spec.name), &spec);
    EXPECT_EQ(FindFusionFlag(spec.ident), &spec);
    EXPECT_FALSE(spec.help.empty());
    EXPECT_FALSE(spec.ShortHelp().empty());
    EXPECT_FALSE(spec.field.empty());
    if (spec.kind == FusionFlagKind::kSwitch) {
      EXPECT_TRUE(spec.choices.empty() && spec.hint.empty());
      EXPECT_EQ(spec.default_text, "false");
    } else {
      EXPECT_FALSE(spec.ValueHint().empty()) << "a value needs choices or a hint";
      EXPECT_NE(spec.choices.empty(), spec.check == nullptr) << "choices or a parser, not both";
      if (!spec.default_text.empty()) {
        EXPECT_TRUE(spec.Check(spec.default_text).ok());
      }
    }
  }
  EXPECT_EQ(FindFusionFlag("sm"), nullptr);
  EXPECT_EQ(std::string(RuleSetName(RuleSet::kSglang29063)), "sglang-29063");
  EXPECT_EQ(MoeA2aBackendChoices().front(), "none");
  // The rules' messages name flags the table declares.
  for (const char* flag :
       {kFlagBackend, kFlagDeprecatedEnable, kFlagEnforceDisable, kFlagDeterministic,
        kFlagDpAttention, kFlagMoeA2aBackend, kFlagModelArchitecture, kFlagFusionRules}) {
    const FusionFlagSpec* spec = FindFusionFlag(std::string(flag).substr(2));
    ASSERT_NE(spec, nullptr) << flag;
    EXPECT_EQ(spec->Flag(), flag);
  }
}

// The v1.FusionFlags field of each row: named after the flag, a bool for a switch, a string
// otherwise, so the conversion needs no code per flag.
TEST(FusionFlagTable, EveryRowHasItsProtoField) {
  const google::protobuf::Descriptor* message = v1::FusionFlags::descriptor();
  for (const FusionFlagSpec& spec : FusionFlagTable()) {
    const google::protobuf::FieldDescriptor* field = message->FindFieldByName(spec.ident);
    ASSERT_NE(field, nullptr) << "v1.FusionFlags has no field " << spec.ident;
    EXPECT_EQ(field->cpp_type(), spec.kind == FusionFlagKind::kSwitch
                                     ? google::protobuf::FieldDescriptor::CPPTYPE_BOOL
                                     : google::protobuf::FieldDescriptor::CPPTYPE_STRING)
        << spec.ident;
    EXPECT_FALSE(field->is_repeated()) << spec.ident;
  }
  EXPECT_EQ(message->field_count(), static_cast<int>(FusionFlagTable().size()))
      << "a v1.FusionFlags field without a row in fusion_flags.inc";

  FusionFlags f;
  f.backend = "trtllm";
  f.deterministic = true;
  f.rules = RuleSet::kSglang29063;
  f.model_architecture = "Qwen3MoeForCausalLM";
  f.moe_a2a_backend = "mori";
  const v1::FusionFlags p = FlagsToProto(f);
  EXPECT_EQ(p.flashinfer_allreduce_fusion_backend(), "trtllm");
  EXPECT_TRUE(p.enable_deterministic_inference());
  EXPECT_EQ(p.fusion_rules(), "sglang-29063");
  EXPECT_EQ(p.moe_a2a_backend(), "mori");
  absl::StatusOr<FusionFlags> back = FlagsFromProto(p);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, f);
  EXPECT_EQ(*FlagsFromProto(FlagsToProto(FusionFlags{})), FusionFlags{});
}

// docs/config.md's flag table is the generated one, between its two marker lines.
TEST(FusionFlagTable, DocsTableIsTheGeneratedOne) {
  const std::string path = std::string(ARFUSE_SOURCE_DIR) + "/docs/config.md";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "cannot read " << path;
  std::stringstream text;
  text << in.rdbuf();
  const std::string doc = text.str();
  const std::string begin = "<!-- fusion-flags: generated from config/fusion_flags.inc -->\n";
  const std::string end = "<!-- fusion-flags: end -->";
  const size_t from = doc.find(begin);
  ASSERT_NE(from, std::string::npos) << path << " has no line " << begin;
  const size_t to = doc.find(end, from);
  ASSERT_NE(to, std::string::npos) << path << " has no line " << end;
  EXPECT_EQ(doc.substr(from + begin.size(), to - from - begin.size()), FusionFlagsMarkdown())
      << "docs/config.md's flag table differs from fusion_flags.inc; replace it with:\n"
      << FusionFlagsMarkdown();
}

}  // namespace
}  // namespace arfuse::config
