#include "bench/rank_launch.h"

#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace arfuse::bench {

std::string SelfExe() {
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : self.string();
}

std::vector<std::string> RankCommand(const std::string& self, const std::string& subcommand,
                                     const std::string& rank_flag, int rank, const std::string& dir,
                                     const std::vector<std::string>& flags) {
  std::vector<std::string> argv = {self, subcommand, absl::StrCat("--", rank_flag, "=", rank),
                                   absl::StrCat("--dir=", dir)};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return argv;
}

}  // namespace arfuse::bench
