#include "client/arfusectl/args.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace arfuse::cli {
namespace {

std::string Clip(const std::string& s) { return s.size() > 64 ? s.substr(0, 64) + "..." : s; }

}  // namespace

std::optional<std::string> ParsedArgs::Get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

bool ParsedArgs::Switch(const std::string& name) const {
  auto it = values_.find(name);
  return it != values_.end() && it->second == "true";
}

absl::StatusOr<ParsedArgs> ParseArgs(const std::string& command,
                                     const std::vector<OptionSpec>& specs,
                                     const std::vector<std::string>& args) {
  ParsedArgs parsed;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (!absl::StartsWith(arg, "--") || arg.size() == 2) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument \"", Clip(arg),
                                                     "\" for 'arfusectl ", command,
                                                     "': options are --name value"));
    }
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    std::optional<std::string> value;
    if (eq != std::string::npos) value = arg.substr(eq + 1);

    auto spec = std::find_if(specs.begin(), specs.end(),
                             [&](const OptionSpec& s) { return s.name == name; });
    if (spec == specs.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown option --", Clip(name),
                                                     " for 'arfusectl ", command,
                                                     "' (see arfusectl ", command, " --help)"));
    }
    if (parsed.values_.count(name) && !spec->last_wins) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " given more than once"));
    }
    if (spec->kind == OptionSpec::Kind::kSwitch) {
      if (!value) {
        value = "true";
      } else if (*value != "true" && *value != "false") {
        return absl::InvalidArgumentError(absl::StrCat("--", name, "=", Clip(*value),
                                                       ": expected --", name, ", --", name,
                                                       "=true or --", name, "=false"));
      }
    } else if (!value) {
      // "--tp 2": the value is the next argument, unless that is another option.
      if (i + 1 >= args.size() || absl::StartsWith(args[i + 1], "--")) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " needs a value (--", name, " ", spec->value_hint, ")"));
      }
      value = args[++i];
    }
    if (spec->check) {
      absl::Status checked = spec->check(*value);
      if (!checked.ok()) return checked;
    }
    parsed.values_[name] = *value;
  }
  return parsed;
}

std::string OptionsHelp(const std::vector<OptionSpec>& specs) {
  std::string out;
  for (const OptionSpec& s : specs) {
    std::string left = absl::StrCat("  --", s.name);
    if (s.kind == OptionSpec::Kind::kValue) {
      absl::StrAppend(&left, s.value_hint.rfind("true", 0) == 0 ? "=" : " ", s.value_hint);
    }
    if (left.size() < 52)
      left.resize(52, ' ');
    else
      left += "  ";
    absl::StrAppend(&out, left, s.help, "\n");
  }
  return out;
}

}  // namespace arfuse::cli
