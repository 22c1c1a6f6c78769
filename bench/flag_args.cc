#include "bench/flag_args.h"

#include <cstdio>
#include <string_view>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "server/core/status_macros.h"
#include "server/core/version.h"

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

FlagTable::Flag::Flag(std::string key, int* out, std::string help)
    : key_(std::move(key)),
      default_(absl::StrCat(*out)),
      help_(std::move(help)),
      set_([out](const FlagArg& arg) { return ParseIntFlag(arg, out); }) {}

FlagTable::Flag::Flag(std::string key, std::string* out, std::string help)
    : key_(std::move(key)), default_(*out), help_(std::move(help)), set_([out](const FlagArg& arg) {
        *out = arg.value;
        return absl::OkStatus();
      }) {}

FlagTable::Flag::Flag(std::string key, std::vector<uint32_t>* out, std::string help)
    : key_(std::move(key)),
      default_(absl::StrJoin(*out, ",")),
      help_(std::move(help)),
      set_([out](const FlagArg& arg) -> absl::Status {
        ARFUSE_ASSIGN_OR_RETURN(*out, ParsePositiveList(arg));
        return absl::OkStatus();
      }) {}

FlagTable::FlagTable(std::vector<Flag> user, const std::string& rank_key, int* rank,
                     std::string* dir) {
  for (Flag& flag : user) {
    help_.emplace_back(absl::StrCat("--", flag.key_, "=", flag.default_), flag.help_);
    flags_[flag.key_] = Binding{false, std::move(flag.set_)};
  }
  // Never recorded as the user's: the launcher adds them to each rank's command line itself.
  for (Flag flag : {Flag(rank_key, rank, ""), Flag("dir", dir, "")}) {
    flags_[flag.key_] = Binding{true, std::move(flag.set_)};
  }
}

absl::StatusOr<FlagOutcome> FlagTable::Parse(int argc, char** argv,
                                             std::vector<std::string>* user_flags) const {
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--help" || a == "-h") return FlagOutcome::kHelp;
    if (a == "--version") return FlagOutcome::kVersion;
  }
  ARFUSE_ASSIGN_OR_RETURN(std::vector<FlagArg> args, SplitFlagArgs(argc, argv));
  for (const FlagArg& arg : args) {
    auto it = flags_.find(arg.key);
    if (it == flags_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", arg.key, " (see --help)"));
    }
    if (!it->second.internal) user_flags->push_back(arg.raw);
    ARFUSE_RETURN_IF_ERROR(it->second.set(arg));
  }
  return FlagOutcome::kRun;
}

std::string FlagTable::Help() const {
  std::string out;
  for (const auto& [flag, help] : help_) absl::StrAppend(&out, "  ", flag, "\n      ", help, "\n");
  return out;
}

int PrintHelpOrVersion(FlagOutcome outcome, const char* name, const char* description,
                       const FlagTable& table) {
  if (outcome == FlagOutcome::kVersion) {
    std::printf("%s\n", VersionLine("arfuse-bench").c_str());
  } else {
    std::printf("usage: arfuse-bench %s [--key=value ...]\n%s\n\nflags (with their defaults):\n%s",
                name, description, table.Help().c_str());
  }
  return 0;
}

}  // namespace arfuse::bench
