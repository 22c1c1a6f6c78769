// The one command-line library of arfuse's binaries, over abseil's flag registry: each binary
// defines its flags with ABSL_FLAG (type, default, help) and names the ones it owns in a FlagSet,
// which parses the spellings the serving frameworks use (abseil's own parser cannot):
// "--name=value", "--name value", "--bool", "--nobool", with hyphens or underscores
// (--world-size and --world_size are one flag). Values may also come from ARFUSE_<NAME>
// environment variables. A flag given twice takes the last value, as argparse does, unless the
// FlagSet is Strict.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace arfuse::flags {

// A flag as given on the command line: its name with underscores, and its value ("true" for a
// bare boolean, "false" for --nobool).
struct GivenFlag {
  std::string name;
  std::string value;
};

// Stricter rules for a command line that refuses what argparse lets through (arfusectl's
// subcommands), for a FlagSet. Every one is off by default.
struct Strict {
  // A flag given twice is INVALID_ARGUMENT "--name given more than once", except the ones named
  // in `repeatable`, which take the last value.
  bool single = false;
  std::vector<std::string> repeatable;
  // A boolean takes "--name", "--noname", "--name=true" or "--name=false" only; any other value
  // is "--name=V: expected --name, --name=true or --name=false" (abseil also takes 1, yes, t).
  bool bool_words = false;
  // "--name value" does not take a next argument that starts with "--" as the value: that is
  // "--name needs a value".
  bool value_not_flag = false;
  // Messages call flags options and name `program` ("unknown option --x for 'arfusectl
  // resolve' (see arfusectl resolve --help)").
  bool name_program = false;
};

// The flags one binary (or subcommand) owns, by their command-line names with underscores, in the
// order its --help lists them. Flags of linked libraries (abseil's, gRPC's) are not on the command
// line unless named here.
class FlagSet {
 public:
  // `program` names the binary in messages about positional arguments. The abseil flag of name N
  // is `prefix` + N: subcommands of one binary keep their flags apart in abseil's one registry
  // (ABSL_FLAG(int, kernels_world, ...) is `arfuse-bench kernels --world`).
  FlagSet(std::string program, std::vector<std::string> names, std::string prefix = "",
          Strict strict = {});

  const std::vector<std::string>& names() const { return names_; }
  bool Owns(absl::string_view name) const;
  // The abseil flag behind command-line name `name`; nullptr when not owned.
  absl::CommandLineFlag* Find(absl::string_view name) const;

  // Splits argv[1..] into flags, checking each name (not its value). INVALID_ARGUMENT, one line,
  // for a positional argument, an unknown flag or a non-boolean flag without a value (and what
  // Strict refuses).
  absl::StatusOr<std::vector<GivenFlag>> Tokenize(int argc, char** argv) const;

  // Sets one flag from text; `origin` (a file and line, a variable, "command line") starts the
  // error message of an unknown flag or a value its type refuses.
  absl::Status Set(absl::string_view name, absl::string_view value, absl::string_view origin) const;

  // Sets every owned flag (but those in `skip`) whose ARFUSE_<NAME> variable is set; calls
  // `on_set` with each flag's name.
  absl::Status ApplyEnvironment(const std::vector<std::string>& skip,
                                const std::function<void(const std::string&)>& on_set) const;

  // Tokenize, then Set every flag in order. For binaries without a config file.
  absl::StatusOr<std::vector<GivenFlag>> Parse(int argc, char** argv) const;

 private:
  std::string program_;
  std::vector<std::string> names_;
  std::string prefix_;
  Strict strict_;
};

// "world_size" -> "world-size", as --help and messages spell a flag.
std::string Hyphenated(absl::string_view name);
// "world_size" -> "ARFUSE_WORLD_SIZE".
std::string EnvName(absl::string_view name);
// True when `name` was given in `given` (the last value is the one set).
bool WasGiven(const std::vector<GivenFlag>& given, absl::string_view name);

// A flag type: a comma-separated list of positive numbers ("1,8,32"). Parsing refuses an empty
// list and any part that is not a positive number, naming the part.
struct PositiveList {
  std::vector<uint32_t> values;
};
bool AbslParseFlag(absl::string_view text, PositiveList* out, std::string* error);
std::string AbslUnparseFlag(const PositiveList& list);

}  // namespace arfuse::flags
