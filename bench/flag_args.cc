#include "bench/flag_args.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

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

}  // namespace arfuse::bench
