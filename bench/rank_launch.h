// The launcher side of the arfuse-bench subcommands that run one process per rank: each rank is
// this binary again, started with the subcommand's internal flags (which rank, the run's
// directory) ahead of the user's flags, which it parses as its launcher did.
#pragma once

#include <string>
#include <vector>

namespace arfuse::bench {

// This binary's path (/proc/self/exe); empty when it cannot be read.
std::string SelfExe();

// The command line of rank `rank`'s process: `self subcommand --<rank_flag>=<rank> --dir=<dir>`,
// then `flags` as given.
std::vector<std::string> RankCommand(const std::string& self, const std::string& subcommand,
                                     const std::string& rank_flag, int rank, const std::string& dir,
                                     const std::vector<std::string>& flags);

}  // namespace arfuse::bench
