#include "bench/flag_args.h"

#include <cstdio>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/version.h"

namespace arfuse::bench {
namespace {

std::vector<std::string> WithInternal(std::vector<std::string> keys, const std::string& rank_key) {
  keys.push_back(rank_key);
  keys.push_back("dir");
  return keys;
}

}  // namespace

SubcommandFlags::SubcommandFlags(const std::string& subcommand, std::vector<std::string> user,
                                 const std::string& rank_key)
    : user_(user),
      set_(absl::StrCat("arfuse-bench ", subcommand), WithInternal(std::move(user), rank_key),
           absl::StrCat(subcommand, "_")) {}

absl::StatusOr<FlagOutcome> SubcommandFlags::Parse(int argc, char** argv,
                                                   std::vector<std::string>* user_flags) const {
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--help" || a == "-h") return FlagOutcome::kHelp;
    if (a == "--version") return FlagOutcome::kVersion;
  }
  ARFUSE_ASSIGN_OR_RETURN(std::vector<flags::GivenFlag> given, set_.Parse(argc, argv));
  for (const flags::GivenFlag& g : given) {
    // Never recorded as the user's: the launcher adds them to each rank's command line itself.
    bool internal = true;
    for (const auto& key : user_) internal = internal && key != g.name;
    if (!internal) user_flags->push_back(absl::StrCat("--", g.name, "=", g.value));
  }
  return FlagOutcome::kRun;
}

std::string SubcommandFlags::Help() const {
  std::string out;
  for (const auto& key : user_) {
    const absl::CommandLineFlag* flag = set_.Find(key);
    if (flag == nullptr) continue;
    absl::StrAppend(&out, "  --", key, "=", flag->DefaultValue(), "\n      ", flag->Help(), "\n");
  }
  return out;
}

SubcommandFlags::Field::Field(std::string k, int* out)
    : key(std::move(k)), read([out](const absl::CommandLineFlag& flag) {
        const auto v = flag.TryGet<int>();
        if (v) *out = *v;
        return v.has_value();
      }) {}

SubcommandFlags::Field::Field(std::string k, std::string* out)
    : key(std::move(k)), read([out](const absl::CommandLineFlag& flag) {
        auto v = flag.TryGet<std::string>();
        if (v) *out = std::move(*v);
        return v.has_value();
      }) {}

SubcommandFlags::Field::Field(std::string k, std::vector<uint32_t>* out)
    : key(std::move(k)), read([out](const absl::CommandLineFlag& flag) {
        auto v = flag.TryGet<flags::PositiveList>();
        if (v) *out = std::move(v->values);
        return v.has_value();
      }) {}

absl::Status SubcommandFlags::Read(std::initializer_list<Field> fields) const {
  for (const Field& field : fields) {
    const absl::CommandLineFlag* flag = set_.Find(field.key);
    if (flag == nullptr || !field.read(*flag)) {
      return absl::InternalError(absl::StrCat("no flag --", field.key, " of its field's type"));
    }
  }
  return absl::OkStatus();
}

int PrintHelpOrVersion(FlagOutcome outcome, const char* name, const char* description,
                       const SubcommandFlags& flags) {
  if (outcome == FlagOutcome::kVersion) {
    std::printf("%s\n", VersionLine("arfuse-bench").c_str());
  } else {
    std::printf("usage: arfuse-bench %s [--key=value ...]\n%s\n\nflags (with their defaults):\n%s",
                name, description, flags.Help().c_str());
  }
  return 0;
}

}  // namespace arfuse::bench
