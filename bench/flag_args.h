// The flags of the arfuse-bench subcommands, through the binaries' one command-line library
// (common/flags.h): each subcommand defines its flags with ABSL_FLAG, named
// <subcommand>_<key> (kernels_world is `arfuse-bench kernels --world`) so that the subcommands'
// flags stay apart in abseil's one registry, and reads them with absl::GetFlag after Parse.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/flags.h"

namespace arfuse::bench {

// What a command line asks for: a run with the flags set, or --help / --version (nothing set).
enum class FlagOutcome { kRun, kHelp, kVersion };

// A subcommand's flags. One that runs one process per rank starts each with RankCommand: the
// internal flags --<rank_key>=<rank> and --dir=<dir>, then the user's flags, which Parse keeps
// apart to pass them on.
class SubcommandFlags {
 public:
  // `user`: the user's keys, in the order --help lists them; `rank_key` and "dir" are the internal
  // ones. Every key K needs its ABSL_FLAG named <subcommand>_K.
  SubcommandFlags(const std::string& subcommand, std::vector<std::string> user,
                  const std::string& rank_key);

  // kHelp or kVersion, setting nothing, when any argument is --help (or -h) or --version.
  // Otherwise sets the flags from argv (argv[0] is the subcommand), appends every user flag, as
  // --key=value, to `user_flags` and returns kRun. INVALID_ARGUMENT for an argument that is not a
  // flag, an unknown flag, or the first bad value (common/flags.h's messages).
  absl::StatusOr<FlagOutcome> Parse(int argc, char** argv,
                                    std::vector<std::string>* user_flags) const;

  // The user's flags for --help: "  --key=<default>" and its help on the next line.
  std::string Help() const;

  // A field of the subcommand's own struct and the key whose value it takes after Parse.
  struct Field {
    Field(std::string key, int* out);
    Field(std::string key, std::string* out);
    Field(std::string key, std::vector<uint32_t>* out);  // a flags::PositiveList flag
    std::string key;
    std::function<bool(const absl::CommandLineFlag&)> read;
  };
  // Copies every key's value into its field. INTERNAL when a key has no flag of its field's type
  // (a mistake in the subcommand's table, not in the command line).
  absl::Status Read(std::initializer_list<Field> fields) const;

 private:
  std::vector<std::string> user_;
  flags::FlagSet set_;
};

// For a subcommand's --help and --version: prints, to stdout, either "usage: arfuse-bench <name>
// [--key=value ...]", `description` and the subcommand's flags, or VersionLine("arfuse-bench").
// Returns the exit code (0).
int PrintHelpOrVersion(FlagOutcome outcome, const char* name, const char* description,
                       const SubcommandFlags& flags);

}  // namespace arfuse::bench
