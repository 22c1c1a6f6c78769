// The "--key=value" arguments of the arfuse-bench subcommands: split once here, interpreted by
// each subcommand's own Flags through a FlagTable that binds every key to its field.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace arfuse::bench {

struct FlagArg {
  std::string raw;  // as given, for the command line printed with the results
  std::string key;
  std::string value;
};

// INVALID_ARGUMENT naming the argument when one is not of the form --key=value.
absl::StatusOr<std::vector<FlagArg>> SplitFlagArgs(int argc, char** argv);
// The value as an int; INVALID_ARGUMENT "--key needs a number" otherwise.
absl::Status ParseIntFlag(const FlagArg& flag, int* out);
// A comma-separated list of positive numbers; INVALID_ARGUMENT naming the flag and the bad part,
// or saying the list is empty.
absl::StatusOr<std::vector<uint32_t>> ParsePositiveList(const FlagArg& flag);

// What a command line asks for: a run with the flags set, or --help / --version (nothing set).
enum class FlagOutcome { kRun, kHelp, kVersion };

// The flags a subcommand knows, each bound to the field it sets, with its help text. A subcommand
// that runs one process per rank starts each with RankCommand: the internal flags
// --<rank_key>=<rank> and --dir=<dir>, then the user's flags as given, which the table keeps apart
// to pass them on.
class FlagTable {
 public:
  // A key, the field its value sets, parsed by the field's type: an int (ParseIntFlag), a string
  // (as given) or a list of positive numbers (ParsePositiveList), and the line --help shows. The
  // field's value when the Flag is made is the default --help shows.
  class Flag {
   public:
    Flag(std::string key, int* out, std::string help);
    Flag(std::string key, std::string* out, std::string help);
    Flag(std::string key, std::vector<uint32_t>* out, std::string help);

   private:
    friend class FlagTable;
    std::string key_;
    std::string default_;
    std::string help_;
    std::function<absl::Status(const FlagArg&)> set_;
  };

  // The user's flags (--help lists them in this order), and the internal ones a launcher gives
  // its rank processes: `--<rank_key>` sets `rank`, `--dir` sets `dir`.
  FlagTable(std::vector<Flag> user, const std::string& rank_key, int* rank, std::string* dir);

  // kHelp or kVersion, setting nothing, when any argument is --help (or -h) or --version.
  // Otherwise sets the bound fields from argv (argv[0] is the subcommand), in order, appends
  // every user flag, as given, to `user_flags` and returns kRun. INVALID_ARGUMENT for an argument
  // not of the form --key=value (before any field is set), "unknown flag --key", or the first
  // bad value.
  absl::StatusOr<FlagOutcome> Parse(int argc, char** argv,
                                    std::vector<std::string>* user_flags) const;

  // The user's flags for --help: "  --key=<default>" and its help on the next line (internal
  // ones left out).
  std::string Help() const;

 private:
  struct Binding {
    bool internal = false;
    std::function<absl::Status(const FlagArg&)> set;
  };
  std::map<std::string, Binding> flags_;
  std::vector<std::pair<std::string, std::string>> help_;  // "--key=default", help; in order
};

// For a subcommand's --help and --version: prints, to stdout, either "usage: arfuse-bench <name>
// [--key=value ...]", `description` and the table's flags, or VersionLine("arfuse-bench").
// Returns the exit code (0).
int PrintHelpOrVersion(FlagOutcome outcome, const char* name, const char* description,
                       const FlagTable& table);

}  // namespace arfuse::bench
