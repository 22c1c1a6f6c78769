// What arfusectl's subcommands share: the output streams, the one-line usage error, a connection
// to one arfused (Remote) and the addressing of several (--addr A,B / --rank / --ranks / --all),
// and the run function of each subcommand. The table of subcommands is in cli.cc; each group's
// run functions live in a file of their own: resolve.cc, inspect.cc (the commands that only read:
// health, info, stats, top) and admin.cc (the ones that change a sidecar: drain, set-backend,
// reinitialize).
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "arfuse/v1/fusion.pb.h"
#include "config/fusion_config.h"
#include "tools/arfusectl/args.h"
#include "tools/arfusectl/cli.h"

namespace arfuse::cli {

struct Io {
  std::ostream& out;
  std::ostream& err;
};

// Writes "arfusectl: <message>" to stderr; returns kExitUsage. Every usage error goes through it
// so that each is one line and exit 2.
int Usage(Io& io, const std::string& message);

// A context for one call: our API version and a deadline, so no command hangs on a stuck server.
std::unique_ptr<grpc::ClientContext> NewCallContext(int timeout_ms);
// "CODE: message" of a failed call (the code as absl spells it).
std::string GrpcStatusText(const grpc::Status& status);
// A workspace state without its enum prefix: READY, POISONED, ...
std::string StateText(v1::WorkspaceState state);
// Runs fn(0) ... fn(n - 1) on a thread each and returns when every one has.
void ForEachConcurrently(size_t n, const std::function<void(size_t)>& fn);

// Parses an option's value with one of the library's parsers when the option is given (`out`
// keeps its value otherwise).
template <typename T, typename Parse>
absl::Status ReadOption(const ParsedArgs& args, const char* name, Parse parse, T* out) {
  std::optional<std::string> text = args.Get(name);
  if (!text) return absl::OkStatus();
  auto value = parse(*text);
  if (!value.ok()) return value.status();
  *out = *std::move(value);
  return absl::OkStatus();
}

// ReadOption for a positive int ("--name" in the message).
absl::Status ReadPositiveInt(const ParsedArgs& args, const char* name, int* out);

// ---- talking to arfused ----

struct Remote {
  std::string addr;
  int timeout_ms = kDefaultTimeoutMs;
  std::shared_ptr<grpc::Channel> channel;

  std::unique_ptr<grpc::ClientContext> Context() const { return NewCallContext(timeout_ms); }
  // Maps a failed call to an exit status with one line that names the address.
  int Fail(Io& io, const char* what, const grpc::Status& status) const;
};

extern const OptionSpec kTimeoutOption;  // --timeout-ms N
extern const OptionSpec kJsonOption;     // --json

// Reads --addr/--timeout-ms; --addr must not be empty.
absl::StatusOr<Remote> OpenRemote(const ParsedArgs& args);

// ---- addressing ranks ----
//
// A group's sidecars on one node have sockets named after rank 0's (arfused's default names, as
// the Kubernetes manifests use them): <socket> for rank 0 and <socket>.rank<r> for rank r. So
// --rank N / --ranks 0,1 / --all name ranks next to --addr (rank 0's socket, by default
// DefaultAddress()), and --addr A,B,... names every address explicitly.

struct Addressed {
  std::vector<Remote> remotes;
  bool by_rank = false;  // --rank/--ranks/--all (else --addr, or the default address)
};

// Reads --addr, --rank, --ranks, --all and --timeout-ms. `collective_default`: with none of
// --rank/--ranks/--all and no --addr, address every local rank (--all).
absl::StatusOr<Addressed> OpenRemotes(const ParsedArgs& args, int default_timeout_ms,
                                      bool collective_default);

// Runs `call` on every remote concurrently; prints one line per address; exit status is the
// worst of them.
int RunOnAll(const std::vector<Remote>& remotes, Io& io, const char* what,
             const std::function<grpc::Status(const Remote&, std::string*)>& call);

// A command of one sidecar (health, info, stats) run on every addressed one in turn; the exit
// status is the worst.
int RunEach(const ParsedArgs& args, Io& io,
            const std::function<int(const Remote&, const ParsedArgs&, Io&)>& one);

// ---- the subcommands (their options are in cli.cc's table) ----

// resolve.cc

const std::vector<OptionSpec>& ResolveOptions();

// What resolve (and info, for its negotiation) reads from the command line.
struct ResolveInput {
  config::FusionFlags flags;
  // --fusion-rules given; a remote Resolve without it takes the server's rule set.
  bool rules_given = false;
  std::optional<config::Topology> topology;  // unset: the server's own (--addr only)
  config::CaptureRequest capture;
};

// `remote`: --sm, --nnodes and --tp may all be left out (the server's topology), else each is
// required.
absl::StatusOr<ResolveInput> ReadResolveInput(const ParsedArgs& args, bool remote);
int RunResolve(const ParsedArgs& args, Io& io);

// inspect.cc: health, info and stats ask one sidecar each (through RunEach); top reads its
// options into TopOptions and calls RunTop (top.h).
int RunHealthOne(const Remote& remote, const ParsedArgs& args, Io& io);
int RunInfoOne(const Remote& remote, const ParsedArgs& args, Io& io);
int RunStatsOne(const Remote& remote, const ParsedArgs& args, Io& io);
int RunTopCommand(const ParsedArgs& args, Io& io);

// admin.cc
int RunDrain(const ParsedArgs& args, Io& io);
int RunSetBackend(const ParsedArgs& args, Io& io);
int RunReinitialize(const ParsedArgs& args, Io& io);

}  // namespace arfuse::cli
