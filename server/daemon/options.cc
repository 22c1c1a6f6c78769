#include "server/daemon/options.h"

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "config/fusion_config.h"
#include "kernels/common/op_types.h"
#include "server/daemon/config_file.h"

ABSL_FLAG(std::string, socket, "",
          "Unix socket of the main gRPC server (Config, Fusion, Admin, Health); the fd channel "
          "listens beside it on <socket>.fd. Default: "
          "$XDG_RUNTIME_DIR/arfuse/arfused.sock, else /run/arfuse/arfused.sock (rank N > 0 adds "
          "'.rankN'). Created with mode 0660; a stale socket left by a dead process is replaced.");
ABSL_FLAG(int, health_port, 0,
          "Plaintext TCP port serving only grpc.health.v1 for Kubernetes probes; 0 picks a free "
          "port and logs it. Entry \"\" is liveness, \"arfuse.v1.Fusion\" readiness.");
ABSL_FLAG(std::string, health_host, "0.0.0.0", "Address the health port binds to.");
ABSL_FLAG(int, metrics_port, -1,
          "TCP port for Prometheus metrics (/metrics); -1 turns metrics off, 0 picks a free port.");
ABSL_FLAG(std::string, metrics_host, "",
          "Address the metrics port binds to. Default: the same as --health-host.");
ABSL_FLAG(int, max_connections_per_uid, 64,
          "Connections one user may hold open on the main Unix socket; more are closed at once "
          "and logged. 0: no cap. Connections in all (both Unix sockets) are also capped below "
          "RLIMIT_NOFILE, so that descriptors stay in reserve for the health port.");
ABSL_FLAG(int, max_fd_connections_per_uid, 16,
          "Connections one user may hold open on the fd channel (<socket>.fd), counted apart "
          "from --max-connections-per-uid; more are closed at once and logged. 0: no cap.");
ABSL_FLAG(int, max_pending_fds, 0,
          "Descriptors the fd channel holds for all users together (deposited or offered and "
          "not yet claimed or picked up, or on their way); a DEPOSIT or an attach beyond it gets "
          "RESOURCE_EXHAUSTED. 0: half the descriptor reserve (RLIMIT_NOFILE / 8, at least 32; "
          "128 at 1024).");
ABSL_FLAG(int, max_pending_fds_per_uid, 0,
          "The same for one user. 0: a quarter of --max-pending-fds, at least 16 (one full "
          "DEPOSIT); 32 at RLIMIT_NOFILE 1024.");
ABSL_FLAG(std::string, device, "",
          "cuda (fused kernels on this rank's GPU) or host (host shared memory and the CPU "
          "implementation, for machines without a GPU). Default: cuda when a GPU is present.");
ABSL_FLAG(int, rank, 0, "This sidecar's rank in the tensor-parallel group (0-based).");
ABSL_FLAG(int, gpu, -1,
          "CUDA device index of this rank; -1 picks rank % visible GPUs (ranks share GPUs when "
          "there are fewer GPUs than ranks; run MPS then).");
ABSL_FLAG(int, world_size, 1,
          "Ranks in the tensor-parallel group (tp size), 1..16: the fused kernels hold 16 peer "
          "workspaces (docs/config.md, world sizes 32 and 64).");
ABSL_FLAG(int, nnodes, 1, "Nodes the group spans.");
ABSL_FLAG(std::string, peer_dir, "",
          "Directory where the sidecars of one node meet (Unix sockets, file-descriptor passing). "
          "Default: the socket's directory.");
ABSL_FLAG(std::string, peer_addr, "",
          "host:port where rank 0 serves the peer rendezvous over TCP (groups across nodes).");
ABSL_FLAG(std::string, peer_tls_cert, "",
          "PEM certificate chain this sidecar shows its peers on the TCP peer channel (groups "
          "across nodes, which run it with mutual TLS only); signed by the group's CA. Default: "
          "--tls-cert.");
ABSL_FLAG(std::string, peer_tls_key, "", "PEM private key of --peer-tls-cert. Default: --tls-key.");
ABSL_FLAG(std::string, peer_tls_ca, "",
          "PEM CA bundle every peer's certificate must chain to on the TCP peer channel; it "
          "should sign the group's sidecars and nothing else. Default: --tls-client-ca.");
ABSL_FLAG(std::string, group, "arfuse", "Name of the group; sidecars of one group share it.");
ABSL_FLAG(double, peer_timeout, 60,
          "Seconds to wait for every peer to join; past it the missing ranks are named.");
ABSL_FLAG(double, peer_heartbeat_timeout, 5,
          "Seconds a peer may stay silent on the peer channel before the group counts it lost "
          "(heartbeats go every fifth of it): a peer sidecar that is frozen (SIGSTOP) or hung "
          "while its connection stays open is noticed within this time even when no op runs, "
          "readiness goes NOT_SERVING and the group re-forms. 0 turns heartbeats off (then only "
          "an op's --spin-timeout notices such a peer); otherwise 0.1..3600.");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error, critical or off.");
// The fusion flags, from their one declaration (config/fusion_flags.inc): a switch is a
// bool, a value unset by default an optional string, any other value a string with the table's
// default.
#define ARFUSED_FLAG_TYPE_kSwitch bool
#define ARFUSED_FLAG_TYPE_kOptional std::optional<std::string>
#define ARFUSED_FLAG_TYPE_kValue std::string
#define ARFUSED_FLAG_DEFAULT_kSwitch(ident) \
  (::arfuse::config::FindFusionFlag(#ident)->default_text == "true")
#define ARFUSED_FLAG_DEFAULT_kOptional(ident) std::nullopt
#define ARFUSED_FLAG_DEFAULT_kValue(ident) ::arfuse::config::FindFusionFlag(#ident)->default_text
#define ARFUSE_FUSION_FLAG(kind, ident, field, Type, init, values, check, help) \
  ABSL_FLAG(ARFUSED_FLAG_TYPE_##kind, ident, ARFUSED_FLAG_DEFAULT_##kind(ident), help);
#include "config/fusion_flags.inc"
#undef ARFUSE_FUSION_FLAG
ABSL_FLAG(std::optional<int>, sm, std::nullopt,
          "Compute capability as major*10+minor (90, 100, ...); overrides the GPU's (tests, CPU "
          "machines).");
ABSL_FLAG(std::string, cuda_graph_mode, "full",
          "The CUDA-graph mode clients ask for by default: none, piecewise or full.");
ABSL_FLAG(bool, mnnvl_capture_safe, true,
          "Whether the mnnvl kernels may be captured in piecewise CUDA graphs (ours compare "
          "sentinel bits, so they are; false for older builds and tests).");
ABSL_FLAG(int, max_tokens, 2048, "Workspace capacity in tokens.");
ABSL_FLAG(int, hidden, 8192, "Workspace capacity in hidden size (a multiple of 8).");
ABSL_FLAG(std::string, dtype, "bf16", "Workspace dtype sizing: bf16, fp16 or fp32.");
ABSL_FLAG(double, spin_timeout, 5,
          "Seconds any cross-rank wait may take before it gives up and poisons the workspace.");
ABSL_FLAG(int, sm_budget, 0,
          "SMs each rank's fused grids may count on (0: automatic: all when the rank has its GPU "
          "to itself, else an equal share of what every rank's resident doorbell blocks leave, "
          "docs/mps.md). Every rank must use the same value. An override for diagnosis: grids "
          "whose peers' grids cannot all be resident beside them wait to the spin timeout.");
ABSL_FLAG(int, doorbell_serve_blocks, 16,
          "Most blocks the doorbell plane keeps resident to run one-shot ops in place, one row "
          "each (0..128; at most the plans' largest one-shot token count; at most 32 when ranks "
          "share the GPU; 0: a waiter warp and a launch per op, about +20 us per op). Each one "
          "holds registers on its SM between rings (half of them at hidden 4096 bf16): a model "
          "kernel whose block needs more than the rest (large GEMM tiles) cannot use that SM "
          "meanwhile (1.28x its time with 32 such blocks on an H200, 1.59x with 64; "
          "docs/doorbell.md). Ops of more tokens than blocks run several rows per block.");
ABSL_FLAG(double, grace_period, 10,
          "Seconds in-flight calls get to finish on SIGTERM/SIGINT before they are cancelled.");
ABSL_FLAG(double, default_deadline, 10, "Deadline in seconds for calls that carry none.");
ABSL_FLAG(std::vector<std::string>, allowed_uids, {},
          "Comma-separated uids allowed on the main socket besides the sidecar's own (checked "
          "with SO_PEERCRED).");
ABSL_FLAG(std::vector<std::string>, allowed_gids, {},
          "Comma-separated gids whose members may use the main socket (checked with "
          "SO_PEERCRED and SO_PEERGROUPS against the client process's groups).");
ABSL_FLAG(std::string, listen, "",
          "Also serve the main API on TCP host:port, with mutual TLS only (--tls-cert, "
          "--tls-key, --tls-client-ca); for clients that cannot reach the Unix socket.");
ABSL_FLAG(std::string, tls_cert, "", "PEM server certificate chain for --listen.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key for --listen.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle that client certificates on --listen must chain to.");
// Operations: the config file's format and the logs' (docs/operations.md). Keep additions of this
// kind in this block.
ABSL_FLAG(std::string, config, "",
          "YAML file of flags, as vLLM's and SGLang's --config take it: one key per flag, "
          "named as on the command line (dashes or underscores, no leading --), each value a "
          "scalar or, for list flags, a list (allowed-uids: [1000, 1001]). Files of "
          "'name=value' lines (the older format) are still read, with a warning. The command "
          "line and ARFUSE_* variables take precedence.");
ABSL_FLAG(std::string, log_format, "text",
          "text (one line per event: time, level=, pid=, key=value fields) or json (one JSON "
          "object per line: time, level, pid, event, msg).");
ABSL_FLAG(bool, help, false, "Show this help and exit.");
ABSL_FLAG(bool, version, false, "Print the version and exit.");

namespace arfuse {
namespace {

// Flags defined in this file, in the order --help lists them.
const std::vector<std::string>& OwnFlagNames() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n = {"socket",        "health_port",  "health_host",
                                  "metrics_port",  "metrics_host", "device",
                                  "rank",          "gpu",          "world_size",
                                  "nnodes",        "peer_dir",     "peer_addr",
                                  "peer_tls_cert", "peer_tls_key", "peer_tls_ca",
                                  "group",         "peer_timeout", "peer_heartbeat_timeout",
                                  "log_level",     "log_format"};
    for (const config::FusionFlagSpec& spec : config::FusionFlagTable()) n.push_back(spec.ident);
    n.insert(n.end(), {"sm",
                       "cuda_graph_mode",
                       "mnnvl_capture_safe",
                       "max_tokens",
                       "hidden",
                       "dtype",
                       "spin_timeout",
                       "sm_budget",
                       "doorbell_serve_blocks",
                       "grace_period",
                       "default_deadline",
                       "allowed_uids",
                       "allowed_gids",
                       "max_connections_per_uid",
                       "max_fd_connections_per_uid",
                       "max_pending_fds",
                       "max_pending_fds_per_uid",
                       "listen",
                       "tls_cert",
                       "tls_key",
                       "tls_client_ca",
                       "config",
                       "help",
                       "version"});
    return n;
  }();
  return names;
}

using flags::EnvName;
using flags::GivenFlag;
using flags::Hyphenated;

const flags::FlagSet& OwnFlags() {
  static const flags::FlagSet set("arfused", OwnFlagNames());
  return set;
}

// Sets one flag from text and records where its value came from.
absl::Status SetFlag(absl::string_view name, absl::string_view value, absl::string_view origin,
                     std::map<std::string, std::string>& sources, absl::string_view source) {
  ARFUSE_RETURN_IF_ERROR(OwnFlags().Set(name, value, origin));
  sources[std::string(name)] = std::string(source);
  return absl::OkStatus();
}

absl::Status ApplyEnvironment(std::map<std::string, std::string>& sources) {
  return OwnFlags().ApplyEnvironment({"config", "help", "version"},
                                     [&](const std::string& name) { sources[name] = "env"; });
}

absl::Status CheckOneOf(absl::string_view flag, const std::string& value,
                        const std::vector<std::string>& allowed) {
  for (const std::string& a : allowed) {
    if (value == a) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("bad value \"", value, "\" for --", flag,
                                                 ": expected one of ",
                                                 absl::StrJoin(allowed, ", ")));
}

// One value of a fusion flag, from the command line, the environment or the config file.
absl::Status CheckFusionValue(const config::FusionFlagSpec& spec, const std::string& value) {
  // A valued flag's default is its default ("" for --model-architecture: not known).
  if (spec.kind == config::FusionFlagKind::kValue && value == spec.default_text) {
    return absl::OkStatus();
  }
  absl::Status checked = spec.Check(value);
  // A choice flag that is unset by default (the backend) is worded as arfused's own choice flags
  // (--device, --dtype, ...): "bad value ... expected one of ...".
  if (!checked.ok() && spec.kind == config::FusionFlagKind::kOptional && !spec.choices.empty()) {
    return CheckOneOf(spec.name, value, spec.choices);
  }
  return checked;
}

// The serving frameworks' flags: argparse checks every occurrence against the choices (the last
// one wins), so an earlier bad value is refused even when a later one is good. Switches are
// abseil's bools, which abseil checks.
absl::Status CheckFrameworkFlagOccurrence(const GivenFlag& flag) {
  const config::FusionFlagSpec* spec = config::FindFusionFlag(flag.name);
  if (spec == nullptr || spec->kind == config::FusionFlagKind::kSwitch) return absl::OkStatus();
  return CheckFusionValue(*spec, flag.value);
}

// The fusion flags' values into `to`, checked as on the command line.
absl::Status ReadFusionFlag(const char* ident, bool value, config::FusionFlags& to) {
  return config::FindFusionFlag(ident)->Assign(to, value ? "true" : "false");
}
absl::Status ReadFusionFlag(const char* ident, const std::string& value, config::FusionFlags& to) {
  const config::FusionFlagSpec& spec = *config::FindFusionFlag(ident);
  ARFUSE_RETURN_IF_ERROR(CheckFusionValue(spec, value));
  return spec.Assign(to, value);
}
absl::Status ReadFusionFlag(const char* ident, const std::optional<std::string>& value,
                            config::FusionFlags& to) {
  return value ? ReadFusionFlag(ident, *value, to) : absl::OkStatus();
}

absl::Status ReadFusionFlags(config::FusionFlags& to) {
#define ARFUSE_FUSION_FLAG(kind, ident, ...) \
  ARFUSE_RETURN_IF_ERROR(ReadFusionFlag(#ident, absl::GetFlag(FLAGS_##ident), to));
#include "config/fusion_flags.inc"
#undef ARFUSE_FUSION_FLAG
  return absl::OkStatus();
}

// `fusion`: how reading the fusion flags went (ReadFusionFlags).
absl::Status Validate(const DaemonOptions& o, const absl::Status& fusion) {
  if (!o.device.empty()) ARFUSE_RETURN_IF_ERROR(CheckOneOf("device", o.device, {"cuda", "host"}));
  // The workspace holds one slot per rank up to kMaxWorldSize; a larger group would start and
  // never become ready (the peer exchange refuses it), so it is refused here, at startup.
  if (o.world_size < 1 || o.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--world-size must be between 1 and ", kMaxWorldSize, ", got ", o.world_size,
        " (the fused kernels hold ", kMaxWorldSize,
        " peer workspaces; a larger group runs the framework's own path: docs/config.md)"));
  }
  if (o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("--rank must be in [0, ", o.world_size,
                                                   ") for --world-size=", o.world_size, ", got ",
                                                   o.rank));
  }
  if (o.nnodes < 1 || o.nnodes > o.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("--nnodes must be between 1 and --world-size (",
                                                   o.world_size, "), got ", o.nnodes));
  }
  if (o.health_port < 0 || o.health_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--health-port must be between 0 and 65535, got ", o.health_port));
  }
  if (o.max_connections_per_uid < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-connections-per-uid must be 0 (no cap) or positive, got ",
                     o.max_connections_per_uid));
  }
  if (o.max_fd_connections_per_uid < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-fd-connections-per-uid must be 0 (no cap) or positive, got ",
                     o.max_fd_connections_per_uid));
  }
  if (o.max_pending_fds < 0 || o.max_pending_fds_per_uid < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-pending-fds and --max-pending-fds-per-uid must be 0 (derived from RLIMIT_NOFILE) "
        "or positive, got ",
        o.max_pending_fds, " and ", o.max_pending_fds_per_uid));
  }
  if ((o.max_pending_fds > 0 && o.max_pending_fds < 16) ||
      (o.max_pending_fds_per_uid > 0 && o.max_pending_fds_per_uid < 16)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-pending-fds and --max-pending-fds-per-uid must be at least 16 (one DEPOSIT's "
        "descriptors), got ",
        o.max_pending_fds, " and ", o.max_pending_fds_per_uid));
  }
  if (o.max_pending_fds > 0 && o.max_pending_fds_per_uid > o.max_pending_fds) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-pending-fds-per-uid (", o.max_pending_fds_per_uid,
                     ") must not exceed --max-pending-fds (", o.max_pending_fds, ")"));
  }
  if (o.metrics_port < -1 || o.metrics_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics-port must be -1 (off) or between 0 and 65535, got ", o.metrics_port));
  }
  if (!IsValidLogFormat(o.log_format)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad value \"", o.log_format, "\" for --log-format: expected text or json"));
  }
  if (!IsValidLogLevel(o.log_level)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad value \"", o.log_level,
        "\" for --log-level: expected trace, debug, info, warn, error, critical or off"));
  }
  ARFUSE_RETURN_IF_ERROR(fusion);
  ARFUSE_RETURN_IF_ERROR(
      CheckOneOf("cuda-graph-mode", o.cuda_graph_mode, {"none", "piecewise", "full"}));
  ARFUSE_RETURN_IF_ERROR(CheckOneOf("dtype", o.dtype, {"bf16", "fp16", "fp32"}));
  if (o.sm && (*o.sm < config::kMinSm || *o.sm > config::kMaxSm)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sm must be major*10+minor (for example 90 or 100) between ", config::kMinSm,
                     " and ", config::kMaxSm, ", got ", *o.sm));
  }
  if (o.max_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-tokens must be positive, got ", o.max_tokens));
  }
  if (o.sm_budget < 0 || o.sm_budget > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sm-budget must be 0..1024 (0: automatic), got ", o.sm_budget));
  }
  if (o.doorbell_serve_blocks < 0 || o.doorbell_serve_blocks > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("--doorbell-serve-blocks must be 0..128, got ", o.doorbell_serve_blocks));
  }
  if (o.hidden < 8 || o.hidden % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--hidden must be a positive multiple of 8, got ", o.hidden));
  }
  for (auto [name, v] : {std::pair<const char*, double>{"peer-timeout", o.peer_timeout_s},
                         {"spin-timeout", o.spin_timeout_s},
                         {"grace-period", o.grace_period_s},
                         {"default-deadline", o.default_deadline_s}}) {
    if (!(v > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, " must be a positive number of seconds, got ", v));
    }
  }
  if (!(o.peer_heartbeat_timeout_s == 0 ||
        (o.peer_heartbeat_timeout_s >= 0.1 && o.peer_heartbeat_timeout_s <= 3600))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--peer-heartbeat-timeout must be 0 (off) or between 0.1 and 3600 seconds, got ",
        o.peer_heartbeat_timeout_s));
  }
  for (const auto& [flag, ids] :
       {std::pair<const char*, const std::vector<std::string>*>{"allowed-uids", &o.allowed_uids},
        {"allowed-gids", &o.allowed_gids}}) {
    for (const auto& id : *ids) {
      if (id.empty() || id.size() > 10 || id.find_first_not_of("0123456789") != std::string::npos ||
          std::strtoull(id.c_str(), nullptr, 10) > 0xFFFFFFFEull) {
        return absl::InvalidArgumentError(
            absl::StrCat("bad value \"", id, "\" in --", flag, ": expected numeric ids"));
      }
    }
  }
  if (!o.listen.empty() && (o.tls_cert.empty() || o.tls_key.empty() || o.tls_client_ca.empty())) {
    return absl::InvalidArgumentError(
        "--listen serves the main API over TCP only with mutual TLS: give --tls-cert, --tls-key "
        "and --tls-client-ca");
  }
  const bool peer_tls_given =
      !o.peer_tls.cert.empty() || !o.peer_tls.key.empty() || !o.peer_tls.ca.empty();
  if (peer_tls_given &&
      (o.peer_tls.cert.empty() || o.peer_tls.key.empty() || o.peer_tls.ca.empty())) {
    return absl::InvalidArgumentError(
        "the peer channel's mutual TLS needs all of --peer-tls-cert, --peer-tls-key and "
        "--peer-tls-ca (or none, to use --tls-cert, --tls-key and --tls-client-ca)");
  }
  if (const peers::PeerTlsFiles f = o.peer_tls_files();
      !o.peer_addr.empty() && (f.cert.empty() || f.key.empty() || f.ca.empty())) {
    // --peer-addr is what puts the peer channel on TCP (a group within one node meets in
    // --peer-dir, over Unix sockets whose peers the kernel names).
    return absl::InvalidArgumentError(absl::StrCat(
        "--peer-addr=", o.peer_addr,
        ": the peer channel runs over TCP with mutual TLS only: give "
        "--peer-tls-cert, --peer-tls-key and --peer-tls-ca (or --tls-cert, --tls-key and "
        "--tls-client-ca), a certificate of the group's CA for every sidecar"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string DefaultSocketPath(int rank) {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  std::string dir = (xdg != nullptr && xdg[0] != '\0') ? absl::StrCat(xdg, "/arfuse")
                                                       : std::string("/run/arfuse");
  std::string path = absl::StrCat(dir, "/arfused.sock");
  if (rank > 0) absl::StrAppend(&path, ".rank", rank);
  return path;
}

absl::StatusOr<ParsedCommandLine> ParseDaemonCommandLine(int argc, char** argv) {
  ParsedCommandLine parsed;
  auto& sources = parsed.options.sources;
  for (const auto& name : OwnFlagNames()) sources[name] = "default";
  ARFUSE_ASSIGN_OR_RETURN(std::vector<GivenFlag> cli, OwnFlags().Tokenize(argc, argv));
  // The config file is named on the command line or in the environment; read it first so that
  // the environment and the command line override it.
  std::string config_path;
  if (const char* env = std::getenv("ARFUSE_CONFIG")) config_path = env;
  for (const auto& f : cli) {
    if (f.name == "config") config_path = f.value;
  }
  for (const auto& f : cli) {
    if (f.name == "help" && f.value != "false") {
      parsed.outcome = ParseOutcome::kHelp;
      return parsed;
    }
    if (f.name == "version" && f.value != "false") {
      parsed.outcome = ParseOutcome::kVersion;
      return parsed;
    }
  }
  if (!config_path.empty()) {
    ARFUSE_RETURN_IF_ERROR(ApplyConfigFile(
        config_path,
        [&](const std::string& name, const std::string& value, const std::string& where) {
          return SetFlag(name, value, where, sources, "file");
        },
        parsed.options.warnings));
    sources["config"] = "cli";
  }
  ARFUSE_RETURN_IF_ERROR(ApplyEnvironment(sources));
  for (const auto& f : cli) {
    ARFUSE_RETURN_IF_ERROR(CheckFrameworkFlagOccurrence(f));
    ARFUSE_RETURN_IF_ERROR(SetFlag(f.name, f.value, "command line", sources, "cli"));
  }

  DaemonOptions& o = parsed.options;
  o.health_port = absl::GetFlag(FLAGS_health_port);
  o.health_host = absl::GetFlag(FLAGS_health_host);
  o.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  o.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  if (o.metrics_host.empty()) o.metrics_host = o.health_host;
  o.max_connections_per_uid = absl::GetFlag(FLAGS_max_connections_per_uid);
  o.max_fd_connections_per_uid = absl::GetFlag(FLAGS_max_fd_connections_per_uid);
  o.max_pending_fds = absl::GetFlag(FLAGS_max_pending_fds);
  o.max_pending_fds_per_uid = absl::GetFlag(FLAGS_max_pending_fds_per_uid);
  o.device = absl::GetFlag(FLAGS_device);
  o.rank = absl::GetFlag(FLAGS_rank);
  o.gpu = absl::GetFlag(FLAGS_gpu);
  o.world_size = absl::GetFlag(FLAGS_world_size);
  o.nnodes = absl::GetFlag(FLAGS_nnodes);
  o.peer_dir = absl::GetFlag(FLAGS_peer_dir);
  o.peer_addr = absl::GetFlag(FLAGS_peer_addr);
  o.peer_tls.cert = absl::GetFlag(FLAGS_peer_tls_cert);
  o.peer_tls.key = absl::GetFlag(FLAGS_peer_tls_key);
  o.peer_tls.ca = absl::GetFlag(FLAGS_peer_tls_ca);
  o.group = absl::GetFlag(FLAGS_group);
  o.peer_timeout_s = absl::GetFlag(FLAGS_peer_timeout);
  o.peer_heartbeat_timeout_s = absl::GetFlag(FLAGS_peer_heartbeat_timeout);
  o.log_level = absl::GetFlag(FLAGS_log_level);
  o.log_format = absl::GetFlag(FLAGS_log_format);
  const absl::Status fusion = ReadFusionFlags(o.fusion);
  o.sm = absl::GetFlag(FLAGS_sm);
  o.cuda_graph_mode = absl::GetFlag(FLAGS_cuda_graph_mode);
  o.mnnvl_capture_safe = absl::GetFlag(FLAGS_mnnvl_capture_safe);
  o.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  o.hidden = absl::GetFlag(FLAGS_hidden);
  o.dtype = absl::GetFlag(FLAGS_dtype);
  o.spin_timeout_s = absl::GetFlag(FLAGS_spin_timeout);
  o.doorbell_serve_blocks = absl::GetFlag(FLAGS_doorbell_serve_blocks);
  o.sm_budget = absl::GetFlag(FLAGS_sm_budget);
  o.grace_period_s = absl::GetFlag(FLAGS_grace_period);
  o.default_deadline_s = absl::GetFlag(FLAGS_default_deadline);
  o.allowed_uids = absl::GetFlag(FLAGS_allowed_uids);
  o.allowed_gids = absl::GetFlag(FLAGS_allowed_gids);
  o.listen = absl::GetFlag(FLAGS_listen);
  o.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key = absl::GetFlag(FLAGS_tls_key);
  o.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  ARFUSE_RETURN_IF_ERROR(Validate(o, fusion));
  o.socket = absl::GetFlag(FLAGS_socket);
  if (o.socket.empty()) o.socket = DefaultSocketPath(o.rank);
  return parsed;
}

std::string DaemonUsage() {
  std::string out =
      "arfused: the arfuse sidecar of one GPU rank (fused allreduce + residual add + RMSNorm).\n"
      "usage: arfused [--flag=value ...]\n\n"
      "Every flag may also come from the environment (ARFUSE_<NAME>, e.g. ARFUSE_HEALTH_PORT)\n"
      "or a --config file; precedence: command line > environment > file > default.\n\nflags:\n";
  for (const auto& name : OwnFlagNames()) {
    absl::CommandLineFlag* f = absl::FindCommandLineFlag(name);
    if (f == nullptr) continue;
    std::string def = f->DefaultValue();
    absl::StrAppend(&out, "  --", Hyphenated(name), "  (default: ", def.empty() ? "unset" : def,
                    "; env ", EnvName(name), ")\n      ", f->Help(), "\n");
  }
  return out;
}

std::string DescribeOptions(const DaemonOptions& options) {
  std::vector<std::string> parts;
  for (const auto& name : OwnFlagNames()) {
    if (name == "help" || name == "version") continue;
    absl::CommandLineFlag* f = absl::FindCommandLineFlag(name);
    if (f == nullptr) continue;
    auto it = options.sources.find(name);
    parts.push_back(absl::StrCat(name, "=", f->CurrentValue(), "(",
                                 it == options.sources.end() ? "default" : it->second, ")"));
  }
  return absl::StrJoin(parts, " ");
}

}  // namespace arfuse
