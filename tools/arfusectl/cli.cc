// arfusectl's table of subcommands, its usage text and the dispatch of a command line to a
// subcommand's run function (commands.h lists them and what they share).
#include "tools/arfusectl/cli.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/version.h"
#include "tools/arfusectl/commands.h"

namespace arfuse::cli {
namespace {

using Kind = OptionSpec::Kind;

// A subcommand: its options and what it does. run() returns the exit status; it reports usage
// errors through Usage() so every one of them is one line and exit 2.
struct Command {
  std::string name;
  std::string summary;
  std::string synopsis;
  std::vector<OptionSpec> options;
  std::function<int(const ParsedArgs&, Io&)> run;
  // An option that may also be given as the first argument ("set-backend mnnvl").
  std::string positional;
};

// The addressing options of the commands that ask running sidecars (commands.h, OpenRemotes).
const OptionSpec kRankOption{"rank", Kind::kValue, "N",
                             "the sidecar of rank N (its socket next to --addr's)"};
const OptionSpec kRanksOption{"ranks", Kind::kValue, "N,M,...",
                              "the sidecars of these ranks (sockets next to --addr's)"};
const OptionSpec kAllOption{"all", Kind::kSwitch, "",
                            "every rank whose socket is next to --addr's (on this node)"};
const OptionSpec kAddrListOption{"addr", Kind::kValue, "ADDR[,ADDR...]",
                                 "arfused address(es): unix:/path or host:port (default " +
                                     DefaultAddress() +
                                     "; with --rank/--ranks/--all: rank 0's socket)"};

std::vector<OptionSpec> WithRanks(std::vector<OptionSpec> options) {
  options.insert(options.end(), {kRankOption, kRanksOption, kAllOption});
  return options;
}

int PrintVersion(Io& io) {
  io.out << VersionLine("arfusectl") << "\n";
  return kExitOk;
}

const std::vector<Command>& Commands() {
  static const std::vector<Command> commands = {
      {"resolve", "compute the fusion decision (locally, or with --addr by a running arfused)",
       "arfusectl resolve --sm <major><minor> --nnodes N --tp N [options]", ResolveOptions(),
       RunResolve, ""},
      {"health", "grpc.health.v1 check: exit 0 SERVING, 1 not serving, 3 unreachable",
       "arfusectl health [--addr ADDR | --rank N | --all] [--service NAME] [--json]",
       WithRanks(
           {kAddrListOption,
            {"service", Kind::kValue, "NAME", "service name to check (default \"\": the server)"},
            kJsonOption,
            kTimeoutOption}),
       [](const ParsedArgs& a, Io& io) { return RunEach(a, io, RunHealthOne); }, ""},
      {"info", "workspace and negotiation of a running arfused",
       "arfusectl info [--addr ADDR | --rank N | --all] [--json]",
       WithRanks(
           {kAddrListOption,
            kJsonOption,
            kTimeoutOption,
            {"cuda-graph-mode", Kind::kValue, "none|piecewise|full", "negotiate for this mode"},
            {"prefill-cuda-graph-mode", Kind::kValue, "none|piecewise|full",
             "negotiate for this prefill/extend mode"},
            {"decode-cuda-graph-mode", Kind::kValue, "none|piecewise|full",
             "negotiate for this decode mode"},
            {"fused-op-in-graph", Kind::kValue, "true|false", "negotiate with the op in graphs"},
            {"mnnvl-capture-safe", Kind::kValue, "true|false",
             "negotiate as if capture-(un)safe"}}),
       [](const ParsedArgs& a, Io& io) { return RunEach(a, io, RunInfoOne); }, ""},
      {"stats", "counters and state of a running arfused",
       "arfusectl stats [--addr ADDR | --rank N | --all] [--json]",
       WithRanks({kAddrListOption, kJsonOption, kTimeoutOption}),
       [](const ParsedArgs& a, Io& io) { return RunEach(a, io, RunStatsOne); }, ""},
      {"drain", "stop accepting ops and wait for those in flight (readiness goes NOT_SERVING)",
       "arfusectl drain [--addr ADDR[,ADDR...] | --rank N | --ranks N,M | --all] [--timeout-ms N]",
       WithRanks({kAddrListOption, kTimeoutOption}), RunDrain, ""},
      {"set-backend",
       "switch the backend live on every rank of the group (drain, vote, rebuild; refused if "
       "infeasible)",
       "arfusectl set-backend auto|trtllm|mnnvl|none [--addr ADDR[,ADDR...] | --ranks N,M | "
       "--all]\n  (default: every rank whose socket is next to " +
           DefaultAddress() + ")",
       WithRanks({kAddrListOption,
                  {"backend", Kind::kValue, "auto|trtllm|mnnvl|none",
                   "the backend (or give it as the first argument)"},
                  kTimeoutOption}),
       RunSetBackend, "backend"},
      {"reinitialize", "re-form the group and re-initialize its workspace (every rank)",
       "arfusectl reinitialize [--addr ADDR[,ADDR...] | --ranks N,M | --all]\n  (default: every "
       "rank whose socket is next to " +
           DefaultAddress() + ")",
       WithRanks({kAddrListOption, kTimeoutOption}), RunReinitialize, ""},
      {"top",
       "one line per rank, refreshed: plane, backend, generation, ops/s fused and declined, "
       "latency, poisonings",
       "arfusectl top [--addr ADDR[,ADDR...] | --ranks N,M | --all] [--metrics HOST:PORT[,...]] "
       "[--interval-ms N] [--iterations N] [--plain | --json]",
       WithRanks(
           {kAddrListOption,
            {"metrics", Kind::kValue, "HOST:PORT[,...]",
             "each sidecar's --metrics-port endpoint, in --addr's order (planes, fused and "
             "declined ops, latency; without it those columns show -)"},
            {"interval-ms", Kind::kValue, "N", "refresh interval (default 1000)"},
            {"iterations", Kind::kValue, "N", "refreshes before exiting (default: until stopped)"},
            {"plain", Kind::kSwitch, "", "plain lines even on a terminal"},
            {"json", Kind::kSwitch, "", "one JSON object per rank and refresh"},
            {"timeout-ms", Kind::kValue, "N", "deadline of each call (default 2000)"}}),
       RunTopCommand, ""},
      {"version",
       "print the version (also: arfusectl --version)",
       "arfusectl version",
       {},
       [](const ParsedArgs&, Io& io) { return PrintVersion(io); },
       ""},
  };
  return commands;
}

void PrintUsage(std::ostream& o) {
  o << "usage: arfusectl <command> [options]\n\ncommands:\n";
  for (const Command& c : Commands()) {
    // Pad to the longest name (set-backend, reinitialize) plus two spaces; never truncate.
    std::string name = "  " + c.name;
    name.resize(std::max<size_t>(name.size() + 2, 16), ' ');
    o << name << c.summary << "\n";
  }
  o << "\nexit status: 0 ok, 1 server error or not serving, 2 invalid input, 3 unreachable\n"
       "'arfusectl <command> --help' lists a command's options; 'arfusectl --version' prints the "
       "version.\n";
}

}  // namespace

std::string DefaultAddress() {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg != nullptr && xdg[0] != '\0') return absl::StrCat("unix:", xdg, "/arfuse/arfused.sock");
  return "unix:/run/arfuse/arfused.sock";
}

int RunArfusectl(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  Io io{out, err};
  if (args.empty()) {
    PrintUsage(err);
    return kExitUsage;
  }
  const std::string& verb = args[0];
  if (verb == "help" || verb == "--help" || verb == "-h") {
    PrintUsage(out);
    return kExitOk;
  }
  if (verb == "--version") return PrintVersion(io);
  for (const Command& command : Commands()) {
    if (command.name != verb) continue;
    std::vector<std::string> rest(args.begin() + 1, args.end());
    for (const std::string& a : rest) {
      if (a == "--help" || a == "-h") {
        out << "usage: " << command.synopsis << "\n"
            << command.summary << "\n\noptions:\n"
            << OptionsHelp(command.options);
        return kExitOk;
      }
    }
    if (!command.positional.empty() && !rest.empty() && !absl::StartsWith(rest[0], "-")) {
      rest[0] = absl::StrCat("--", command.positional, "=", rest[0]);
    }
    absl::StatusOr<ParsedArgs> parsed = ParseArgs(command.name, command.options, rest);
    if (!parsed.ok()) return Usage(io, std::string(parsed.status().message()));
    return command.run(*parsed, io);
  }
  return Usage(io,
               absl::StrCat("unknown command \"", verb.substr(0, 64),
                            "\" (commands: resolve, health, info, stats, top, drain, set-backend, "
                            "reinitialize, version; see arfusectl --help)"));
}

}  // namespace arfuse::cli
