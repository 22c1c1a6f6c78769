#include "bench/flag_args.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/core/status_macros.h"

namespace arfuse::bench {

absl::StatusOr<std::vector<FlagArg>> SplitFlagArgs(int argc, char** argv) {
  std::vector<FlagArg> out;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    if (a.rfind("--", 0) != 0 || eq == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("flag \"", a, "\" is not --key=value"));
    }
    out.push_back(FlagArg{a, a.substr(2, eq - 2), a.substr(eq + 1)});
  }
  return out;
}

absl::Status ParseIntFlag(const FlagArg& flag, int* out) {
  if (!absl::SimpleAtoi(flag.value, out)) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag.key, " needs a number"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint32_t>> ParsePositiveList(const FlagArg& flag) {
  std::vector<uint32_t> out;
  for (absl::string_view part : absl::StrSplit(flag.value, ',', absl::SkipEmpty())) {
    uint32_t x = 0;
    if (!absl::SimpleAtoi(part, &x) || x == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag.key, ": \"", std::string(part), "\" is not a positive number"));
    }
    out.push_back(x);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag.key, " is empty"));
  return out;
}

FlagTable::Flag::Flag(std::string key, int* out)
    : key_(std::move(key)), set_([out](const FlagArg& arg) { return ParseIntFlag(arg, out); }) {}

FlagTable::Flag::Flag(std::string key, std::string* out)
    : key_(std::move(key)), set_([out](const FlagArg& arg) {
        *out = arg.value;
        return absl::OkStatus();
      }) {}

FlagTable::Flag::Flag(std::string key, std::vector<uint32_t>* out)
    : key_(std::move(key)), set_([out](const FlagArg& arg) -> absl::Status {
        ARFUSE_ASSIGN_OR_RETURN(*out, ParsePositiveList(arg));
        return absl::OkStatus();
      }) {}

FlagTable::FlagTable(std::vector<Flag> user, const std::string& rank_key, int* rank,
                     std::string* dir) {
  for (Flag& flag : user) flags_[flag.key_] = Binding{false, std::move(flag.set_)};
  // Never recorded as the user's: the launcher adds them to each rank's command line itself.
  for (Flag flag : {Flag(rank_key, rank), Flag("dir", dir)}) {
    flags_[flag.key_] = Binding{true, std::move(flag.set_)};
  }
}

absl::Status FlagTable::Parse(int argc, char** argv, std::vector<std::string>* user_flags) const {
  ARFUSE_ASSIGN_OR_RETURN(std::vector<FlagArg> args, SplitFlagArgs(argc, argv));
  for (const FlagArg& arg : args) {
    auto it = flags_.find(arg.key);
    if (it == flags_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", arg.key));
    }
    if (!it->second.internal) user_flags->push_back(arg.raw);
    ARFUSE_RETURN_IF_ERROR(it->second.set(arg));
  }
  return absl::OkStatus();
}

}  // namespace arfuse::bench
