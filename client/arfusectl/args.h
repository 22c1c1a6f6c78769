// A small argv parser for arfusectl: long options with hyphens, as the serving frameworks spell
// them (abseil flags cannot), "--name value" or "--name=value", boolean switches "--name" or
// "--name=true|false". No positional arguments; each option at most once.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace arfuse::cli {

struct OptionSpec {
  enum class Kind { kSwitch, kValue };
  std::string name;  // without the leading "--"
  Kind kind = Kind::kValue;
  std::string value_hint;  // "N", "B", "true|false"; empty for switches
  std::string help;
};

class ParsedArgs {
 public:
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::optional<std::string> Get(const std::string& name) const;
  // Switches: false when absent, else the parsed value ("--x" is true).
  bool Switch(const std::string& name) const;

 private:
  friend absl::StatusOr<ParsedArgs> ParseArgs(const std::string&, const std::vector<OptionSpec>&,
                                              const std::vector<std::string>&);
  std::map<std::string, std::string> values_;
};

// `command` names the subcommand in messages. INVALID_ARGUMENT, one line, for an unknown option,
// a missing value, a repeated option, a positional argument or a switch given a non-boolean value.
absl::StatusOr<ParsedArgs> ParseArgs(const std::string& command,
                                     const std::vector<OptionSpec>& specs,
                                     const std::vector<std::string>& args);

// "  --name VALUE   help" lines for usage text.
std::string OptionsHelp(const std::vector<OptionSpec>& specs);

}  // namespace arfuse::cli
