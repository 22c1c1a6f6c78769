#include "server/daemon/config_file.h"

#include <fstream>
#include <map>
#include <sstream>
#include <utility>

#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/flags.h"
#include "common/status_macros.h"
#include "yaml-cpp/yaml.h"

namespace arfuse {
namespace {

using flags::Hyphenated;

absl::Status CheckFileKey(const std::string& name, absl::string_view where) {
  if (name == "config" || name == "help" || name == "version") {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": --", Hyphenated(name), " is not allowed in a file"));
  }
  return absl::OkStatus();
}

// The older format: "name=value" lines, '#' comments.
absl::Status ApplyLineConfig(const std::string& path, const std::string& text,
                             const ConfigFileSetter& set) {
  int lineno = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++lineno;
    absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line[0] == '#') continue;
    absl::ConsumePrefix(&line, "--");
    std::pair<std::string, std::string> kv = absl::StrSplit(line, absl::MaxSplits('=', 1));
    std::string name = absl::StrReplaceAll(absl::StripAsciiWhitespace(kv.first), {{"-", "_"}});
    std::string value(absl::StripAsciiWhitespace(kv.second));
    const std::string where = absl::StrCat(path, ":", lineno);
    ARFUSE_RETURN_IF_ERROR(CheckFileKey(name, where));
    ARFUSE_RETURN_IF_ERROR(set(name, value, where));
  }
  return absl::OkStatus();
}

// A file of "name=value" lines reads as one YAML scalar (or nothing); a YAML config is a map.
bool LooksLikeLineConfig(const std::string& text) {
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line[0] == '#') continue;
    return line.find('=') != absl::string_view::npos && line.find(':') == absl::string_view::npos;
  }
  return false;
}

// YAML: a map of flag name -> scalar, or a list for list flags (vLLM's and SGLang's --config).
absl::Status ApplyYamlConfig(const std::string& path, const std::string& text,
                             const ConfigFileSetter& set) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ":", e.mark.line + 1, ": not valid YAML (", e.msg, ")"));
  }
  if (root.IsNull()) return absl::OkStatus();  // empty, or only comments
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path,
        ": expected a YAML map of flag names to values (\"health-port: 9310\"), one per line"));
  }
  std::map<std::string, int> seen;  // normalized name -> line
  for (const auto& entry : root) {
    const int line = entry.first.Mark().line + 1;
    const std::string where = absl::StrCat(path, ":", line);
    if (!entry.first.IsScalar()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": a key must be a flag name"));
    }
    std::string key = entry.first.Scalar();
    absl::string_view bare = key;
    absl::ConsumePrefix(&bare, "--");
    const std::string name = absl::StrReplaceAll(bare, {{"-", "_"}});
    ARFUSE_RETURN_IF_ERROR(CheckFileKey(name, where));
    if (auto [it, added] = seen.emplace(name, line); !added) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": --", Hyphenated(name), " is set twice (first on line ", it->second, ")"));
    }
    const YAML::Node& value = entry.second;
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    const bool list_flag = flag != nullptr && flag->IsOfType<std::vector<std::string>>();
    std::string text_value;
    if (value.IsScalar()) {
      text_value = value.Scalar();
    } else if (value.IsSequence() && list_flag) {
      std::vector<std::string> items;
      for (const auto& item : value) {
        if (!item.IsScalar()) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": --", Hyphenated(name), " takes a list of plain values"));
        }
        items.push_back(item.Scalar());
      }
      text_value = absl::StrJoin(items, ",");
    } else if (value.IsNull()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": --", Hyphenated(name), " has no value (leave it out instead)"));
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": --", Hyphenated(name), " takes ", list_flag ? "a value or a list" : "one value",
          ", not a ", value.IsSequence() ? "list" : "map"));
    }
    ARFUSE_RETURN_IF_ERROR(set(name, text_value, where));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ApplyConfigFile(const std::string& path, const ConfigFileSetter& set,
                             std::vector<std::string>& warnings) {
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("--config: cannot read ", path));
  }
  std::stringstream text;
  text << in.rdbuf();
  if (LooksLikeLineConfig(text.str())) {
    warnings.push_back(absl::StrCat(
        "--config ", path,
        ": 'name=value' lines are the older format; write YAML instead (\"name: value\" per line, "
        "as vLLM's and SGLang's --config files)"));
    return ApplyLineConfig(path, text.str(), set);
  }
  return ApplyYamlConfig(path, text.str(), set);
}

}  // namespace arfuse
