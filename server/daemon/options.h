// arfused's configuration: every flag, from the command line, an ARFUSE_* environment variable or
// a --config file in YAML (precedence CLI > environment > file > default), each value's source
// recorded.
// Flag names take SGLang's hyphenated spellings (--flashinfer-allreduce-fusion-backend); the
// underscore form is accepted too. A flag given twice takes the last value, as argparse does.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "config/fusion_flags.h"
#include "server/peers/peer_tls.h"

namespace arfuse {

struct DaemonOptions {
  std::string socket;  // resolved default when empty on the command line
  int health_port = 0;
  std::string health_host = "0.0.0.0";
  int metrics_port = -1;     // -1: off
  std::string metrics_host;  // empty: the same as health_host
  // Open connections one uid may hold on the main Unix socket, and on the fd channel (counted
  // apart); 0: no cap.
  int max_connections_per_uid = 64;
  int max_fd_connections_per_uid = 16;
  // Budgets of the descriptors the fd channel holds, in all and per uid; 0: derived from
  // RLIMIT_NOFILE (PendingFdBudget).
  int max_pending_fds = 0;
  int max_pending_fds_per_uid = 0;
  std::string device;  // "cuda" or "host"
  int rank = 0;
  int gpu = -1;  // -1: rank % visible GPUs
  int world_size = 1;
  int nnodes = 1;
  std::string peer_dir;
  std::string peer_addr;  // rank 0's host:port for groups across nodes
  // The TCP peer channel's mutual TLS (--peer-tls-*); empty: --listen's files stand in.
  peers::PeerTlsFiles peer_tls;
  std::string group;
  double peer_timeout_s = 60;
  // Silence after which a peer counts as lost (heartbeats every fifth of it); 0: no heartbeats.
  double peer_heartbeat_timeout_s = 5;
  std::string log_level = "info";
  std::string log_format = "text";  // "text" or "json"
  // The fusion flags (config/fusion_flags.inc), as SGLang spells them.
  config::FusionFlags fusion;
  std::optional<int> sm;
  std::string cuda_graph_mode = "full";
  bool mnnvl_capture_safe = true;
  int max_tokens = 2048;
  int hidden = 8192;
  std::string dtype = "bf16";
  double spin_timeout_s = 5;
  // Blocks the doorbell plane's serving launch keeps resident to run one-shot ops in place
  // (docs/doorbell.md); 0 = no in-place serving (one waiter warp, a launch per op).
  int doorbell_serve_blocks = 16;
  // FusionParams::sm_budget override (0: automatic; SharedGpuSmBudget when ranks share the GPU).
  int sm_budget = 0;
  double grace_period_s = 10;
  double default_deadline_s = 10;
  std::vector<std::string> allowed_uids;
  std::vector<std::string> allowed_gids;
  // Main API over TCP (host:port), only with mutual TLS.
  std::string listen;
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  // What the TCP peer channel authenticates with: --peer-tls-* when given, else --listen's
  // --tls-cert, --tls-key and --tls-client-ca.
  peers::PeerTlsFiles peer_tls_files() const {
    if (peer_tls.any()) return peer_tls;
    return peers::PeerTlsFiles{tls_cert, tls_key, tls_client_ca};
  }
  // name -> "cli", "env", "file" or "default", for the start-up log line.
  std::map<std::string, std::string> sources;
  // Said once logging is set up (an older --config format, say).
  std::vector<std::string> warnings;
};

// What to do after parsing.
enum class ParseOutcome { kRun, kHelp, kVersion };

struct ParsedCommandLine {
  ParseOutcome outcome = ParseOutcome::kRun;
  DaemonOptions options;
};

// Parses argv (and the environment and --config file). INVALID_ARGUMENT with one line naming the
// problem: unknown flag, malformed value, value out of range, positional argument.
absl::StatusOr<ParsedCommandLine> ParseDaemonCommandLine(int argc, char** argv);

// --help text: every flag with its hyphenated name, default and explanation.
std::string DaemonUsage();

// The socket path used when --socket is not given: $XDG_RUNTIME_DIR/arfuse/arfused.sock when
// XDG_RUNTIME_DIR is set, else /run/arfuse/arfused.sock (rank > 0 appends ".rank<N>").
std::string DefaultSocketPath(int rank);

// One line per option with its source, for the start-up log.
std::string DescribeOptions(const DaemonOptions& options);

}  // namespace arfuse
