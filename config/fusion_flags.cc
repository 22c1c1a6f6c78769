#include "config/fusion_flags.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "config/internal.h"

namespace arfuse::config {
namespace {

using internal::Contains;
using internal::Quoted;

constexpr size_t kMaxArchitectureLength = 128;

bool IsArchitectureChar(char c) { return absl::ascii_isalnum(c) || c == '_'; }

// "a or b", "a, b or c"; longer lists "one of a, b, c, d".
std::string ChoicesText(const std::vector<std::string>& choices) {
  if (choices.size() > 3) return absl::StrCat("one of ", absl::StrJoin(choices, ", "));
  if (choices.size() < 2) return absl::StrJoin(choices, "");
  return absl::StrCat(absl::StrJoin(choices.begin(), choices.end() - 1, ", "), " or ",
                      choices.back());
}

absl::Status ChoiceError(const FusionFlagSpec& spec, const std::string& text) {
  return absl::InvalidArgumentError(absl::StrCat("unknown ", spec.Flag(), " value ", Quoted(text),
                                                 ": expected ", ChoicesText(spec.choices)));
}

// How a member of each type takes its text and gives it back.
absl::Status AssignText(const FusionFlagSpec& spec, bool& to, const std::string& text) {
  ARFUSE_ASSIGN_OR_RETURN(to, ParseBool(spec.Flag(), text));
  return absl::OkStatus();
}
absl::Status AssignText(const FusionFlagSpec&, std::string& to, const std::string& text) {
  to = text;
  return absl::OkStatus();
}
absl::Status AssignText(const FusionFlagSpec&, std::optional<std::string>& to,
                        const std::string& text) {
  to = text;
  return absl::OkStatus();
}
// An enum member holds the index of its choice.
absl::Status AssignText(const FusionFlagSpec& spec, RuleSet& to, const std::string& text) {
  auto it = std::find(spec.choices.begin(), spec.choices.end(), text);
  if (it == spec.choices.end()) return ChoiceError(spec, text);
  to = static_cast<RuleSet>(it - spec.choices.begin());
  return absl::OkStatus();
}

std::optional<std::string> TextOf(const FusionFlagSpec&, bool value) {
  return value ? "true" : "false";
}
std::optional<std::string> TextOf(const FusionFlagSpec&, const std::string& value) {
  if (value.empty()) return std::nullopt;
  return value;
}
std::optional<std::string> TextOf(const FusionFlagSpec&, const std::optional<std::string>& value) {
  return value;
}
std::optional<std::string> TextOf(const FusionFlagSpec& spec, RuleSet value) {
  const size_t i = static_cast<size_t>(value);
  if (i >= spec.choices.size()) return std::nullopt;
  return spec.choices[i];
}

template <typename T>
FusionFlagSpec Row(FusionFlagKind kind, const char* ident, const char* field,
                   T FusionFlags::*member, const char* values,
                   absl::StatusOr<std::string> (*check)(const std::string&), const char* help) {
  FusionFlagSpec s;
  s.kind = kind;
  s.ident = ident;
  s.name = absl::StrReplaceAll(ident, {{"_", "-"}});
  s.field = field;
  if (check != nullptr) {
    s.hint = values;
  } else if (values[0] != '\0') {
    s.choices = absl::StrSplit(values, '|');
  }
  s.help = help;
  s.check = check;
  s.assign = [member](const FusionFlagSpec& spec, FusionFlags& flags, const std::string& text) {
    return AssignText(spec, flags.*member, text);
  };
  s.get = [member](const FusionFlagSpec& spec, const FusionFlags& flags) {
    return TextOf(spec, flags.*member);
  };
  s.default_text = s.get(s, FusionFlags{}).value_or("");
  return s;
}

// A Markdown table cell: no line breaks, no unescaped column separator.
std::string Cell(const std::string& text) { return absl::StrReplaceAll(text, {{"|", "\\|"}}); }

}  // namespace

// ---- The table. ----

const std::vector<FusionFlagSpec>& FusionFlagTable() {
  static const std::vector<FusionFlagSpec>* const table = new std::vector<FusionFlagSpec>{
#define ARFUSE_FUSION_FLAG(kind, ident, field, Type, init, values, check, help) \
  Row(FusionFlagKind::kind, #ident, #field, &FusionFlags::field, values, check, help),
#include "config/fusion_flags.inc"
#undef ARFUSE_FUSION_FLAG
  };
  return *table;
}

const FusionFlagSpec* FindFusionFlag(absl::string_view name) {
  const std::string ident = absl::StrReplaceAll(name, {{"-", "_"}});
  for (const FusionFlagSpec& spec : FusionFlagTable()) {
    if (spec.ident == ident) return &spec;
  }
  return nullptr;
}

std::string FusionFlagSpec::ValueHint() const {
  if (!hint.empty() || choices.empty()) return hint;
  if (choices.size() > 3) return absl::StrCat(choices[0], "|", choices[1], "|...");
  return absl::StrJoin(choices, "|");
}

std::string FusionFlagSpec::ShortHelp() const {
  const size_t end = help.find(". ");
  return end == std::string::npos ? help : help.substr(0, end + 1);
}

absl::Status FusionFlagSpec::Check(const std::string& text) const {
  if (kind == FusionFlagKind::kSwitch) return ParseBool(Flag(), text).status();
  if (check != nullptr) return check(text).status();
  if (Contains(choices, text)) return absl::OkStatus();
  return ChoiceError(*this, text);
}

absl::Status FusionFlagSpec::Set(FusionFlags& flags, const std::string& text) const {
  ARFUSE_RETURN_IF_ERROR(Check(text));
  return Assign(flags, text);
}

absl::Status FusionFlagSpec::Assign(FusionFlags& flags, const std::string& text) const {
  return assign(*this, flags, text);
}

std::optional<std::string> FusionFlagSpec::Get(const FusionFlags& flags) const {
  return get(*this, flags);
}

std::string FusionFlagsMarkdown() {
  std::string out = "| flag | default | meaning |\n|---|---|---|\n";
  for (const FusionFlagSpec& s : FusionFlagTable()) {
    std::string flag = s.Flag();
    if (!s.choices.empty()) {
      absl::StrAppend(&flag, " {", absl::StrJoin(s.choices, ","), "}");
    } else if (!s.hint.empty()) {
      absl::StrAppend(&flag, " ", s.hint);
    }
    const std::string def =
        s.default_text.empty() ? "unset" : absl::StrCat("`", s.default_text, "`");
    absl::StrAppend(&out, "| `", Cell(flag), "` | ", def, " | ", Cell(s.help), " |\n");
  }
  return out;
}

// ---- The flags' values. ----

const char* RuleSetName(RuleSet rules) {
  const std::vector<std::string>& names = FindFusionFlag("fusion_rules")->choices;
  const size_t i = static_cast<size_t>(rules);
  return i < names.size() ? names[i].c_str() : "unknown";
}

absl::StatusOr<RuleSet> ParseRuleSet(const std::string& text) {
  RuleSet rules = kDefaultRuleSet;
  ARFUSE_RETURN_IF_ERROR(AssignText(*FindFusionFlag("fusion_rules"), rules, text));
  return rules;
}

const std::vector<std::string>& MoeA2aBackendChoices() {
  return FindFusionFlag("moe_a2a_backend")->choices;
}

absl::StatusOr<std::string> ParseBackendFlag(const std::string& text) {
  ARFUSE_RETURN_IF_ERROR(FindFusionFlag("flashinfer_allreduce_fusion_backend")->Check(text));
  return text;
}

absl::StatusOr<std::string> ParseMoeA2aBackend(const std::string& text) {
  ARFUSE_RETURN_IF_ERROR(FindFusionFlag("moe_a2a_backend")->Check(text));
  return text;
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

absl::StatusOr<bool> ParseBool(const std::string& flag, const std::string& text) {
  if (text == "true" || text == "1") return true;
  if (text == "false" || text == "0") return false;
  return absl::InvalidArgumentError(
      absl::StrCat(flag, " ", Quoted(text), " is not a boolean: expected true or false"));
}

absl::Status ValidateFlags(const FusionFlags& flags) {
  for (const FusionFlagSpec& spec : FusionFlagTable()) {
    if (std::optional<std::string> text = spec.Get(flags)) {
      ARFUSE_RETURN_IF_ERROR(spec.Check(*text));
    } else if (spec.kind == FusionFlagKind::kValue && !spec.default_text.empty()) {
      // Empty where the default is not: no value at all.
      ARFUSE_RETURN_IF_ERROR(spec.Check(""));
    }
  }
  return absl::OkStatus();
}

std::string FlagsText(const FusionFlags& flags) {
  std::vector<std::string> parts;
  for (const FusionFlagSpec& spec : FusionFlagTable()) {
    parts.push_back(absl::StrCat(spec.field, "=", spec.Get(flags).value_or("unset")));
  }
  return absl::StrJoin(parts, " ");
}

}  // namespace arfuse::config
