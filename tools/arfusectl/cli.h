// arfusectl: the command line for arfused. One table of subcommands (cli.cc); a new verb is one
// more entry there with its options and a run function (commands.h).
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace arfuse::cli {

// Exit statuses, the same for every subcommand (scripts rely on them).
inline constexpr int kExitOk = 0;
// The server answered with an error, or (health) the service is not serving.
inline constexpr int kExitFailure = 1;
// Invalid input: unknown option or value, missing required option. One line on stderr.
inline constexpr int kExitUsage = 2;
// The server could not be reached (or did not answer before the deadline).
inline constexpr int kExitUnreachable = 3;

inline constexpr int kDefaultTimeoutMs = 5000;

// unix:$XDG_RUNTIME_DIR/arfuse/arfused.sock when XDG_RUNTIME_DIR is set, else
// unix:/run/arfuse/arfused.sock.
std::string DefaultAddress();

// Runs `arfusectl <args...>` (args exclude the program name). Results go to `out`, diagnostics to
// `err`; returns the exit status.
int RunArfusectl(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace arfuse::cli
