// A small argv parser for arfusectl: long options with hyphens, as the serving frameworks spell
// them (abseil flags cannot), "--name value" or "--name=value", boolean switches "--name" or
// "--name=true|false". No positional arguments. An option given twice is an error, except the
// serving frameworks' fusion flags, which take the last value as argparse does.
#pragma once

#include <functional>
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
  // Given twice: the last value wins (argparse's rule, for the frameworks' own flags) instead
  // of an error.
  bool last_wins = false;
  // Checks every occurrence's value as it is parsed, as argparse checks each against its
  // choices (so an earlier bad value is refused even when a later one is good). Optional.
  std::function<absl::Status(const std::string&)> check = nullptr;
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
// a missing value, a repeated option (unless last_wins), a positional argument, a switch given
// a non-boolean value, or a value its spec's check refuses (that check's message).
absl::StatusOr<ParsedArgs> ParseArgs(const std::string& command,
                                     const std::vector<OptionSpec>& specs,
                                     const std::vector<std::string>& args);

// "  --name VALUE   help" lines for usage text.
std::string OptionsHelp(const std::vector<OptionSpec>& specs);

}  // namespace arfuse::cli
