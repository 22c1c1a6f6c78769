// arfusectl's options, parsed by the binaries' one command-line library (common/flags.h):
// one FlagSet per subcommand over abseil flags named arfusectl_<name>, with the library's
// spellings ("--name value", "--name=value", hyphens or underscores, "--switch", "--noswitch")
// and its Strict rules: no positional arguments, a switch takes true or false only, and an
// option given twice is an error, except the serving frameworks' fusion flags, which take the
// last value as argparse does. No ARFUSE_<NAME> variables: an operator's shell is not a config.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/flags.h"
#include "config/fusion_flags.h"

namespace arfuse::cli {

struct OptionSpec {
  // A switch is an abseil bool flag, a valued option a string flag (its spec's check and the
  // command's run parse it).
  enum class Kind { kSwitch, kValue };
  std::string name;  // without the leading "--", hyphenated
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

// What one command line gave: read from the subcommand's flags, and only for the options given
// (the flags keep values of an earlier in-process run otherwise).
class ParsedArgs {
 public:
  bool Has(const std::string& name) const;
  std::optional<std::string> Get(const std::string& name) const;
  // Switches: false when absent, else the parsed value ("--x" is true).
  bool Switch(const std::string& name) const;

 private:
  friend absl::StatusOr<ParsedArgs> ParseArgs(const std::string&, const std::vector<OptionSpec>&,
                                              const std::vector<std::string>&);
  ParsedArgs(flags::FlagSet set, std::vector<flags::GivenFlag> given)
      : set_(std::move(set)), given_(std::move(given)) {}
  flags::FlagSet set_;
  std::vector<flags::GivenFlag> given_;
};

// `command` names the subcommand in messages. INVALID_ARGUMENT, one line, for an unknown option,
// a missing value, a repeated option (unless last_wins), a positional argument, a switch given
// a non-boolean value, or a value its spec's check refuses (that check's message).
absl::StatusOr<ParsedArgs> ParseArgs(const std::string& command,
                                     const std::vector<OptionSpec>& specs,
                                     const std::vector<std::string>& args);

// The fusion flags' options, one per row of config/fusion_flags.inc: the serving
// frameworks' own flags, so a repeated one takes its last value (argparse's rule), each value
// checked as it comes; the help is the table's first sentence.
std::vector<OptionSpec> FusionFlagOptions();
// `options` with FusionFlagOptions() inserted before its element `at`.
std::vector<OptionSpec> WithFusionFlags(size_t at, std::vector<OptionSpec> options);
// The fusion flags given in `args`, into `flags` (the others keep their values).
absl::Status ReadFusionFlags(const ParsedArgs& args, config::FusionFlags& flags);

// "  --name VALUE   help" lines for usage text.
std::string OptionsHelp(const std::vector<OptionSpec>& specs);

}  // namespace arfuse::cli
