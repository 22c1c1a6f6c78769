// The "--key=value" arguments of the arfuse-bench subcommands: split once here, interpreted by
// each subcommand's own Flags.
#pragma once

#include <cstdint>
#include <string>
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

}  // namespace arfuse::bench
