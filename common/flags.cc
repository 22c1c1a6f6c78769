#include "common/flags.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace arfuse::flags {

std::string Hyphenated(absl::string_view name) { return absl::StrReplaceAll(name, {{"_", "-"}}); }

std::string EnvName(absl::string_view name) {
  return absl::StrCat("ARFUSE_", absl::AsciiStrToUpper(name));
}

bool WasGiven(const std::vector<GivenFlag>& given, absl::string_view name) {
  for (const GivenFlag& g : given) {
    if (g.name == name) return true;
  }
  return false;
}

FlagSet::FlagSet(std::string program, std::vector<std::string> names, std::string prefix,
                 Strict strict)
    : program_(std::move(program)),
      names_(std::move(names)),
      prefix_(std::move(prefix)),
      strict_(std::move(strict)) {}

bool FlagSet::Owns(absl::string_view name) const {
  for (const auto& n : names_) {
    if (n == name) return true;
  }
  return false;
}

// A name listed without its ABSL_FLAG stays unknown instead of crashing.
absl::CommandLineFlag* FlagSet::Find(absl::string_view name) const {
  return Owns(name) ? absl::FindCommandLineFlag(absl::StrCat(prefix_, name)) : nullptr;
}

absl::Status FlagSet::Set(absl::string_view name, absl::string_view value,
                          absl::string_view origin) const {
  absl::CommandLineFlag* flag = Find(name);
  if (flag == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": unknown flag --", Hyphenated(name), " (see --help)"));
  }
  std::string error;
  if (!flag->ParseFrom(value, &error)) {
    // abseil names its flag in the error; a subcommand's user knows it without the prefix.
    if (!prefix_.empty()) {
      error = absl::StrReplaceAll(
          error, {{absl::StrCat("'", prefix_, name, "'"), absl::StrCat("'", name, "'")}});
    }
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": bad value \"", value, "\" for --", Hyphenated(name), ": ", error));
  }
  return absl::OkStatus();
}

absl::Status FlagSet::ApplyEnvironment(
    const std::vector<std::string>& skip,
    const std::function<void(const std::string&)>& on_set) const {
  for (const auto& name : names_) {
    bool skipped = false;
    for (const auto& s : skip) skipped = skipped || s == name;
    if (skipped) continue;
    const char* value = std::getenv(EnvName(name).c_str());
    if (value == nullptr) continue;
    if (absl::Status set = Set(name, value, EnvName(name)); !set.ok()) return set;
    on_set(name);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<GivenFlag>> FlagSet::Tokenize(int argc, char** argv) const {
  std::vector<GivenFlag> out;
  // Appends one flag; under Strict::single refuses a second one of a name not repeatable.
  auto given = [&](std::string name, std::string value) -> absl::Status {
    if (strict_.single && WasGiven(out, name) &&
        std::find(strict_.repeatable.begin(), strict_.repeatable.end(), name) ==
            strict_.repeatable.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", Hyphenated(name), " given more than once"));
    }
    out.push_back({std::move(name), std::move(value)});
    return absl::OkStatus();
  };
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) {
      return absl::InvalidArgumentError(
          strict_.name_program ? absl::StrCat("unexpected argument \"", arg, "\" for '", program_,
                                              "': options are --name value")
                               : absl::StrCat("unexpected argument \"", arg, "\" (", program_,
                                              " takes only flags; see --help)"));
    }
    if (arg.empty()) {
      return absl::InvalidArgumentError("empty flag \"--\" (see --help)");
    }
    const size_t eq = arg.find('=');
    std::string name = absl::StrReplaceAll(arg.substr(0, eq), {{"-", "_"}});
    absl::CommandLineFlag* f = Find(name);
    if (f == nullptr && absl::StartsWith(name, "no") && eq == absl::string_view::npos) {
      // --noflag for booleans.
      std::string base = name.substr(2);
      absl::CommandLineFlag* b = Find(base);
      if (b != nullptr && b->IsOfType<bool>()) {
        ARFUSE_RETURN_IF_ERROR(given(std::move(base), "false"));
        continue;
      }
    }
    if (f == nullptr) {
      return absl::InvalidArgumentError(
          strict_.name_program
              ? absl::StrCat("unknown option --", Hyphenated(name), " for '", program_, "' (see ",
                             program_, " --help)")
              : absl::StrCat("unknown flag --", Hyphenated(name), " (see --help)"));
    }
    std::string value;
    if (eq != absl::string_view::npos) {
      value = std::string(arg.substr(eq + 1));
      if (strict_.bool_words && f->IsOfType<bool>() && value != "true" && value != "false") {
        const std::string flag = absl::StrCat("--", Hyphenated(name));
        return absl::InvalidArgumentError(absl::StrCat(flag, "=", value, ": expected ", flag, ", ",
                                                       flag, "=true or ", flag, "=false"));
      }
    } else if (f->IsOfType<bool>()) {
      value = "true";
    } else if (i + 1 < argc && !(strict_.value_not_flag && absl::StartsWith(argv[i + 1], "--"))) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("flag --", Hyphenated(name), " needs a value"));
    }
    ARFUSE_RETURN_IF_ERROR(given(std::move(name), std::move(value)));
  }
  return out;
}

absl::StatusOr<std::vector<GivenFlag>> FlagSet::Parse(int argc, char** argv) const {
  absl::StatusOr<std::vector<GivenFlag>> given = Tokenize(argc, argv);
  if (!given.ok()) return given.status();
  for (const GivenFlag& g : *given) {
    if (absl::Status set = Set(g.name, g.value, "command line"); !set.ok()) return set;
  }
  return given;
}

bool AbslParseFlag(absl::string_view text, PositiveList* out, std::string* error) {
  std::vector<uint32_t> values;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    uint32_t x = 0;
    if (!absl::SimpleAtoi(part, &x) || x == 0) {
      *error = absl::StrCat("\"", part, "\" is not a positive number");
      return false;
    }
    values.push_back(x);
  }
  if (values.empty()) {
    *error = "the list is empty";
    return false;
  }
  out->values = std::move(values);
  return true;
}

std::string AbslUnparseFlag(const PositiveList& list) { return absl::StrJoin(list.values, ","); }

}  // namespace arfuse::flags
