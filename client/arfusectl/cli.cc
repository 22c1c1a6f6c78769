#include "client/arfusectl/cli.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "arfuse/v1/admin.grpc.pb.h"
#include "arfuse/v1/config.grpc.pb.h"
#include "arfuse/v1/fusion.grpc.pb.h"
#include "client/arfusectl/args.h"
#include "client/arfusectl/top.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "server/config/config_convert.h"
#include "server/config/fusion_config.h"
#include "server/core/json.h"
#include "server/core/version.h"

namespace arfuse::cli {
namespace {

using Kind = OptionSpec::Kind;

struct Io {
  std::ostream& out;
  std::ostream& err;
};

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

int Usage(Io& io, const std::string& message) {
  io.err << "arfusectl: " << message << "\n";
  return kExitUsage;
}

// ---- Talking to arfused. ----

// The status message gRPC's client sets when a call's own deadline passes.
constexpr char kGrpcDeadlineMessage[] = "Deadline Exceeded";

struct Remote {
  std::string addr;
  int timeout_ms = kDefaultTimeoutMs;
  std::shared_ptr<grpc::Channel> channel;

  // Every call carries our API version and a deadline, so no command hangs on a stuck server.
  std::unique_ptr<grpc::ClientContext> Context() const {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
    context->AddMetadata(kApiVersionMetadataKey, absl::StrCat(kApiMajor, ".", kApiMinor));
    return context;
  }

  // Maps a failed call to an exit status with one line that names the address.
  int Fail(Io& io, const char* what, const grpc::Status& status) const {
    switch (status.error_code()) {
      case grpc::StatusCode::UNAVAILABLE:
        io.err << "arfusectl: cannot reach arfused at " << addr << ": " << status.error_message()
               << "\n";
        return kExitUnreachable;
      case grpc::StatusCode::DEADLINE_EXCEEDED:
        // gRPC's own words when this call's deadline passed; any other text is the sidecar's
        // answer (a collective that timed out waiting for other ranks, say), which it sent
        // before our deadline and which names what went wrong.
        if (status.error_message() == kGrpcDeadlineMessage) {
          io.err << "arfusectl: no answer from arfused at " << addr << " within " << timeout_ms
                 << " ms (" << what << ")\n";
          return kExitUnreachable;
        }
        io.err << "arfusectl: " << what << " at " << addr
               << " failed: DEADLINE_EXCEEDED: " << status.error_message() << "\n";
        return kExitFailure;
      case grpc::StatusCode::INVALID_ARGUMENT:
        io.err << "arfusectl: " << status.error_message() << " (from " << addr << ")\n";
        return kExitUsage;
      default:
        io.err << "arfusectl: " << what << " at " << addr << " failed: "
               << absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code()))
               << ": " << status.error_message() << "\n";
        return kExitFailure;
    }
  }
};

const OptionSpec kAddrOption{
    "addr", Kind::kValue, "ADDR",
    "arfused address: unix:/path or host:port (default " + DefaultAddress() + ")"};
const OptionSpec kTimeoutOption{
    "timeout-ms", Kind::kValue, "N",
    absl::StrCat("deadline of each call (default ", kDefaultTimeoutMs, ")")};
const OptionSpec kJsonOption{"json", Kind::kSwitch, "", "print one JSON object"};

// Reads --addr/--timeout-ms; --addr must not be empty.
absl::StatusOr<Remote> OpenRemote(const ParsedArgs& args) {
  Remote remote;
  remote.addr = args.Get("addr").value_or(DefaultAddress());
  if (remote.addr.empty()) return absl::InvalidArgumentError("--addr must not be empty");
  if (auto t = args.Get("timeout-ms")) {
    absl::StatusOr<int> ms = config::ParsePositiveInt("--timeout-ms", *t);
    if (!ms.ok()) return ms.status();
    remote.timeout_ms = *ms;
  }
  remote.channel = grpc::CreateChannel(remote.addr, grpc::InsecureChannelCredentials());
  return remote;
}

// ---- resolve ----

// Checks a value with one of the library's parsers (for OptionSpec::check).
template <typename Parse>
std::function<absl::Status(const std::string&)> Checked(Parse parse) {
  return [parse](const std::string& text) { return parse(text).status(); };
}

// The serving frameworks' own flags (FusionFlagOptions) take the last value when repeated, each
// value checked as it comes (argparse); arfusectl's own options stay single.
const std::vector<OptionSpec>& ResolveOptions() {
  // arfusectl's own options; the fusion flags go after --tp.
  static const std::vector<OptionSpec> own = {
      {"sm", Kind::kValue, "<major><minor>", "compute capability, e.g. 90 or 100"},
      {"nnodes", Kind::kValue, "N", "nodes in the group (at most --tp)"},
      {"tp", Kind::kValue, "N", "tensor-parallel size"},
      {"cuda-graph-mode", Kind::kValue, "none|piecewise|full",
       "the CUDA-graph mode wanted for every phase (default none)"},
      {"prefill-cuda-graph-mode", Kind::kValue, "none|piecewise|full",
       "the mode wanted for prefill/extend (default: --cuda-graph-mode)"},
      {"decode-cuda-graph-mode", Kind::kValue, "none|piecewise|full",
       "the mode wanted for decode (default: --cuda-graph-mode)"},
      {"fused-op-in-graph", Kind::kValue, "true|false",
       "want the fused op inside the graphs (default: true unless every mode is none)"},
      {"mnnvl-capture-safe", Kind::kValue, "true|false",
       "whether mnnvl kernels are capture-safe (default true)", true,
       [](const std::string& text) {
         return config::ParseBool(config::kFlagMnnvlCaptureSafe, text).status();
       }},
      kJsonOption,
      {"addr", Kind::kValue, "ADDR", "ask a running arfused instead of computing locally"},
      kTimeoutOption,
  };
  static const std::vector<OptionSpec> options = WithFusionFlags(3, own);
  return options;
}

struct ResolveInput {
  config::FusionFlags flags;
  // --fusion-rules given; a remote Resolve without it takes the server's rule set.
  bool rules_given = false;
  std::optional<config::Topology> topology;  // unset: the server's own (--addr only)
  config::CaptureRequest capture;
};

// Parses an option's value with one of the library's parsers when the option is given.
template <typename T, typename Parse>
absl::Status ReadOption(const ParsedArgs& args, const char* name, Parse parse, T* out) {
  std::optional<std::string> text = args.Get(name);
  if (!text) return absl::OkStatus();
  auto value = parse(*text);
  if (!value.ok()) return value.status();
  *out = *std::move(value);
  return absl::OkStatus();
}

absl::StatusOr<ResolveInput> ReadResolveInput(const ParsedArgs& args, bool remote) {
  ResolveInput in;
  absl::Status st = ReadFusionFlags(args, in.flags);
  if (!st.ok()) return st;
  in.rules_given = args.Has("fusion-rules");

  const int given = args.Has("sm") + args.Has("tp") + args.Has("nnodes");
  if (given > 0 || !remote) {
    for (const char* name : {"sm", "nnodes", "tp"}) {
      if (!args.Has(name)) {
        return absl::InvalidArgumentError(
            remote ? absl::StrCat("--", name,
                                  " is missing: give --sm, --nnodes and --tp together, or none "
                                  "of them to use the server's own")
                   : absl::StrCat("--", name, " is required (or --addr to ask a running arfused)"));
      }
    }
    config::Topology t;
    absl::StatusOr<int> sm = config::ParseSm(*args.Get("sm"));
    if (!sm.ok()) return sm.status();
    absl::StatusOr<int> nnodes = config::ParsePositiveInt("--nnodes", *args.Get("nnodes"));
    if (!nnodes.ok()) return nnodes.status();
    absl::StatusOr<int> tp = config::ParsePositiveInt("--tp", *args.Get("tp"));
    if (!tp.ok()) return tp.status();
    t.sm = *sm;
    t.nnodes = *nnodes;
    t.tp = *tp;
    in.topology = t;
  }

  auto mode_parser = [](const char* flag) {
    return [flag](const std::string& text) { return config::ParseCudaGraphMode(text, flag); };
  };
  st = ReadOption(args, "cuda-graph-mode", mode_parser("--cuda-graph-mode"), &in.capture.mode);
  if (st.ok()) {
    st = ReadOption(args, "prefill-cuda-graph-mode", mode_parser("--prefill-cuda-graph-mode"),
                    &in.capture.prefill_mode);
  }
  if (st.ok()) {
    st = ReadOption(args, "decode-cuda-graph-mode", mode_parser("--decode-cuda-graph-mode"),
                    &in.capture.decode_mode);
  }
  if (!st.ok()) return st;
  // A client that captures graphs normally wants the fused op inside them (the doorbell plane).
  in.capture.fused_op_in_graph =
      in.capture.ModeOf(config::Phase::kPrefill) != config::CudaGraphMode::kNone ||
      in.capture.ModeOf(config::Phase::kDecode) != config::CudaGraphMode::kNone;
  if (auto v = args.Get("fused-op-in-graph")) {
    absl::StatusOr<bool> b = config::ParseBool("--fused-op-in-graph", *v);
    if (!b.ok()) return b.status();
    in.capture.fused_op_in_graph = *b;
  }
  if (auto v = args.Get("mnnvl-capture-safe")) {
    absl::StatusOr<bool> b = config::ParseBool(config::kFlagMnnvlCaptureSafe, *v);
    if (!b.ok()) return b.status();
    in.capture.mnnvl_capture_safe = *b;
  }
  return in;
}

int RunResolve(const ParsedArgs& args, Io& io) {
  const bool remote = args.Has("addr");
  if (!remote && args.Has("timeout-ms")) return Usage(io, "--timeout-ms needs --addr");
  absl::StatusOr<ResolveInput> in = ReadResolveInput(args, remote);
  if (!in.ok()) return Usage(io, std::string(in.status().message()));

  config::Decision decision;
  if (!remote) {
    absl::StatusOr<config::Decision> local = config::Resolve(in->flags, *in->topology, in->capture);
    if (!local.ok()) return Usage(io, std::string(local.status().message()));
    decision = *std::move(local);
  } else {
    absl::StatusOr<Remote> server = OpenRemote(args);
    if (!server.ok()) return Usage(io, std::string(server.status().message()));
    v1::ResolveRequest request;
    // Flags and capture always travel as given (so remote and local answers agree); only the
    // topology may be left to the server.
    *request.mutable_flags() = config::FlagsToProto(in->flags);
    if (!in->rules_given) request.mutable_flags()->clear_fusion_rules();
    *request.mutable_capture() = config::CaptureToProto(in->capture);
    if (in->topology) *request.mutable_topology() = config::TopologyToProto(*in->topology);
    v1::ResolveResponse response;
    auto stub = v1::Config::NewStub(server->channel);
    grpc::Status status = stub->Resolve(server->Context().get(), request, &response);
    if (!status.ok()) return server->Fail(io, "Config.Resolve", status);
    absl::StatusOr<config::Decision> got = config::DecisionFromProto(response.decision());
    if (!got.ok()) {
      io.err << "arfusectl: arfused at " << server->addr
             << " sent an invalid decision: " << got.status().message() << "\n";
      return kExitFailure;
    }
    decision = *std::move(got);
  }
  io.out << config::DecisionToJson(decision) << "\n";
  return kExitOk;
}

// ---- health ----

int RunHealthOne(const Remote& remote, const ParsedArgs& args, Io& io) {
  const Remote* server = &remote;
  const std::string service = args.Get("service").value_or("");
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  auto stub = grpc::health::v1::Health::NewStub(server->channel);
  grpc::Status status = stub->Check(server->Context().get(), request, &response);

  std::string state;
  int code = kExitFailure;
  if (status.ok()) {
    state = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
    if (response.status() == grpc::health::v1::HealthCheckResponse::SERVING) code = kExitOk;
  } else if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
    // The health service answers NOT_FOUND for a service name it does not know.
    state = "SERVICE_UNKNOWN";
  } else {
    return server->Fail(io, "grpc.health.v1.Health.Check", status);
  }
  if (args.Switch("json")) {
    io.out << "{\"addr\":" << JsonQuote(server->addr) << ",\"service\":" << JsonQuote(service)
           << ",\"status\":" << JsonQuote(state) << "}\n";
  } else {
    io.out << state << "\n";
  }
  if (code != kExitOk) {
    io.err << "arfusectl: arfused at " << server->addr << " service \"" << service << "\" is "
           << state << "\n";
  }
  return code;
}

// ---- info ----

std::string Mib(uint64_t bytes) {
  return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
}

std::string DeviceName(v1::DeviceKind kind) {
  switch (kind) {
    case v1::DEVICE_KIND_CUDA:
      return "cuda";
    case v1::DEVICE_KIND_HOST:
      return "host";
    default:
      return "unknown";
  }
}

std::string DTypeText(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return "bf16";
    case v1::DTYPE_FP16:
      return "fp16";
    case v1::DTYPE_FP32:
      return "fp32";
    default:
      return "unspecified";
  }
}

std::string StateText(v1::WorkspaceState state) {
  std::string name = v1::WorkspaceState_Name(state);
  const std::string prefix = "WORKSPACE_STATE_";
  return name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
}

// The in-stream clients' ops (GetWorkspaceInfoResponse.instream_ops): fused share and the
// reasons of the declined ones, the largest first.
constexpr int kTopDeclineReasons = 3;

std::string FusedShare(const v1::InStreamOps& ops) {
  const uint64_t all = ops.fused_total() + ops.declined_total();
  if (all == 0) return "-";
  return absl::StrFormat("%.1f%%",
                         100.0 * static_cast<double>(ops.fused_total()) / static_cast<double>(all));
}

std::string InStreamOpsText(const v1::InStreamOps& ops) {
  if (ops.fused_total() + ops.declined_total() == 0) return "in-stream ops: none counted";
  std::string text = absl::StrCat("in-stream ops: ", ops.fused_total(), " fused (", FusedShare(ops),
                                  ops.kernel_counted() ? ", counted by the kernels" : "", "), ",
                                  ops.declined_total(), " declined");
  if (ops.declined_size() > 0) {
    std::vector<std::string> top;
    for (int i = 0; i < ops.declined_size() && i < kTopDeclineReasons; ++i) {
      top.push_back(absl::StrCat(ops.declined(i).reason(), " ", ops.declined(i).count()));
    }
    absl::StrAppend(&text, "; top declines: ", absl::StrJoin(top, ", "));
  }
  return text;
}

std::string InStreamOpsJson(const v1::InStreamOps& ops) {
  const uint64_t all = ops.fused_total() + ops.declined_total();
  std::string j = absl::StrCat("{\"fused\":", ops.fused_total(),
                               ",\"declined\":", ops.declined_total(), ",\"fused_share\":");
  if (all == 0) {
    absl::StrAppend(&j, "null");
  } else {
    absl::StrAppend(&j, absl::StrFormat("%.4f", static_cast<double>(ops.fused_total()) /
                                                    static_cast<double>(all)));
  }
  absl::StrAppend(&j, ",\"fused_by_bucket\":[");
  for (int i = 0; i < ops.fused_size(); ++i) {
    const v1::InStreamOps::Fused& f = ops.fused(i);
    absl::StrAppend(&j, i ? "," : "", "{\"pattern\":", JsonQuote(f.pattern()),
                    ",\"tokens\":", JsonQuote(f.tokens()), ",\"count\":", f.count(), "}");
  }
  absl::StrAppend(&j, "],\"declined_by_reason\":[");
  for (int i = 0; i < ops.declined_size(); ++i) {
    const v1::InStreamOps::Declined& d = ops.declined(i);
    absl::StrAppend(&j, i ? "," : "", "{\"reason\":", JsonQuote(d.reason()),
                    ",\"count\":", d.count(), "}");
  }
  absl::StrAppend(&j, "],\"kernel_counted\":", ops.kernel_counted() ? "true" : "false", "}");
  return j;
}

// GetWorkspaceInfoResponse.instream_divergence: ranks found declining what their peers fused.
std::string InStreamDivergenceText(const v1::InStreamDivergence& d) {
  if (d.total() == 0) return "in-stream divergence: none found";
  std::string text =
      absl::StrCat("in-stream divergence: ERROR, found ", d.total(), " time(s); last: rank ",
                   d.last_rank(), " declined ", d.last_ops(), " op(s) its peers fused");
  if (!d.last_reasons().empty()) absl::StrAppend(&text, " (top declines: ", d.last_reasons(), ")");
  return text;
}

std::string InStreamDivergenceJson(const v1::InStreamDivergence& d) {
  return absl::StrCat("{\"total\":", d.total(), ",\"last_rank\":", d.last_rank(),
                      ",\"last_ops\":", d.last_ops(),
                      ",\"last_reasons\":", JsonQuote(d.last_reasons()), "}");
}

int RunInfoOne(const Remote& remote, const ParsedArgs& args, Io& io) {
  const Remote* server = &remote;
  v1::NegotiateRequest negotiate;
  if (args.Has("cuda-graph-mode") || args.Has("prefill-cuda-graph-mode") ||
      args.Has("decode-cuda-graph-mode") || args.Has("fused-op-in-graph") ||
      args.Has("mnnvl-capture-safe")) {
    absl::StatusOr<ResolveInput> in = ReadResolveInput(args, /*remote=*/true);
    if (!in.ok()) return Usage(io, std::string(in.status().message()));
    *negotiate.mutable_capture() = config::CaptureToProto(in->capture);
  }

  v1::GetWorkspaceInfoResponse ws;
  grpc::Status status =
      v1::Fusion::NewStub(server->channel)->GetWorkspaceInfo(server->Context().get(), {}, &ws);
  if (!status.ok()) return server->Fail(io, "Fusion.GetWorkspaceInfo", status);
  // The workspace answered, so the server is reachable: a failed negotiation (UNAVAILABLE while
  // the group has not decided yet) is reported beside the workspace, not as "unreachable".
  v1::NegotiateResponse neg;
  status =
      v1::Config::NewStub(server->channel)->Negotiate(server->Context().get(), negotiate, &neg);
  std::optional<config::Decision> decision;
  std::string negotiation_error;
  if (status.ok()) {
    absl::StatusOr<config::Decision> got = config::DecisionFromProto(neg.decision());
    if (got.ok()) {
      decision = *std::move(got);
    } else {
      negotiation_error = absl::StrCat("invalid decision: ", got.status().message());
    }
  } else {
    negotiation_error =
        absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
                     ": ", status.error_message());
  }

  if (args.Switch("json")) {
    io.out << "{\"addr\":" << JsonQuote(server->addr) << ",\"workspace\":{"
           << "\"backend\":" << JsonQuote(ws.backend())
           << ",\"fusion_enabled\":" << (ws.fusion_enabled() ? "true" : "false")
           << ",\"reason\":" << JsonQuote(ws.reason())
           << ",\"state\":" << JsonQuote(StateText(ws.state()))
           << ",\"generation\":" << ws.generation() << ",\"rank\":" << ws.rank()
           << ",\"world_size\":" << ws.world_size() << ",\"nnodes\":" << ws.nnodes()
           << ",\"sm\":" << ws.sm() << ",\"max_tokens\":" << ws.max_tokens()
           << ",\"hidden\":" << ws.hidden() << ",\"dtype\":" << JsonQuote(DTypeText(ws.dtype()))
           << ",\"workspace_bytes\":" << ws.workspace_bytes()
           << ",\"device\":" << JsonQuote(DeviceName(ws.device()))
           << ",\"mps_detected\":" << (ws.mps_detected() ? "true" : "false")
           << ",\"doorbell_hop_us\":" << ws.doorbell_hop_us()
           << "},\"instream_ops\":" << InStreamOpsJson(ws.instream_ops())
           << ",\"instream_divergence\":" << InStreamDivergenceJson(ws.instream_divergence())
           << ",\"negotiation\":" << (decision ? config::DecisionToJson(*decision) : "null");
    if (decision) {
      io.out << ",\"server_api\":"
             << JsonQuote(absl::StrCat(neg.server_api().major(), ".", neg.server_api().minor()));
    } else {
      io.out << ",\"negotiation_error\":" << JsonQuote(negotiation_error);
    }
    io.out << "}\n";
  } else {
    std::ostream& o = io.out;
    o << "arfused at " << server->addr;
    if (decision)
      o << " (API " << neg.server_api().major() << "." << neg.server_api().minor() << ")";
    o << "\n";
    o << "  rank " << ws.rank() << " of " << ws.world_size() << ", " << ws.nnodes()
      << (ws.nnodes() == 1 ? " node" : " nodes") << ", device " << DeviceName(ws.device())
      << ", sm " << ws.sm() << "\n";
    o << "  backend " << ws.backend() << ", fusion "
      << (ws.fusion_enabled() ? "enabled" : "disabled") << ", state " << StateText(ws.state())
      << ", generation " << ws.generation() << "\n";
    if (!ws.reason().empty()) o << "  reason: " << ws.reason() << "\n";
    o << "  workspace " << ws.workspace_bytes() << " bytes (" << Mib(ws.workspace_bytes())
      << "), max_tokens " << ws.max_tokens() << ", hidden " << ws.hidden() << ", dtype "
      << DTypeText(ws.dtype()) << "\n";
    o << "  MPS " << (ws.mps_detected() ? "detected" : "not detected");
    if (ws.doorbell_hop_us() > 0) o << ", doorbell hop " << ws.doorbell_hop_us() << " us";
    o << "\n";
    o << "  " << InStreamOpsText(ws.instream_ops()) << "\n";
    o << "  " << InStreamDivergenceText(ws.instream_divergence()) << "\n";
    if (decision) {
      o << "  negotiation: cuda_graph_mode " << config::CudaGraphModeName(decision->cuda_graph_mode)
        << ", data plane " << config::DataPlaneName(decision->data_plane) << " (prefill "
        << config::CudaGraphModeName(decision->prefill.mode) << "/"
        << config::DataPlaneName(decision->prefill.data_plane) << ", decode "
        << config::CudaGraphModeName(decision->decode.mode) << "/"
        << config::DataPlaneName(decision->decode.data_plane) << "), rules "
        << config::RuleSetName(decision->rules) << ", max " << decision->max_tokens_per_batch
        << " tokens per batch\n";
      for (const std::string& w : decision->warnings) o << "    warning: " << w << "\n";
      for (const std::string& n : decision->notices) o << "    notice: " << n << "\n";
      for (const std::string& r : decision->reasons) o << "    reason: " << r << "\n";
    } else {
      o << "  negotiation: not available\n";
    }
  }
  if (!decision) {
    io.err << "arfusectl: Config.Negotiate at " << server->addr << " failed: " << negotiation_error
           << "\n";
    return kExitFailure;
  }
  return kExitOk;
}

// ---- addressing ranks ----
//
// A group's sidecars on one node have sockets named after rank 0's (arfused's default names, as
// the Kubernetes manifests use them): <socket> for rank 0 and <socket>.rank<r> for rank r. So
// --rank N / --ranks 0,1 / --all name ranks next to --addr (rank 0's socket, by default
// DefaultAddress()), and --addr A,B,... names every address explicitly.

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

// unix:/run/arfuse/arfused.sock -> /run/arfuse/arfused.sock; other targets have no path.
std::optional<std::string> UnixPath(const std::string& addr) {
  if (addr.rfind("unix:", 0) == 0) return addr.substr(5);
  if (!addr.empty() && addr[0] == '/') return addr;
  return std::nullopt;
}

std::string RankAddress(const std::string& base_path, int rank) {
  return absl::StrCat("unix:", base_path, rank > 0 ? absl::StrCat(".rank", rank) : "");
}

// The ranks whose sockets exist next to `base_path` (rank 0's name), in rank order.
std::vector<int> LocalRanks(const std::string& base_path) {
  std::vector<int> ranks;
  std::error_code ec;
  const std::filesystem::path base(base_path);
  if (std::filesystem::exists(base, ec)) ranks.push_back(0);
  const std::string prefix = base.filename().string() + ".rank";
  for (const auto& entry : std::filesystem::directory_iterator(base.parent_path(), ec)) {
    const std::string name = entry.path().filename().string();
    int rank = 0;
    if (name.rfind(prefix, 0) == 0 && absl::SimpleAtoi(name.substr(prefix.size()), &rank) &&
        rank > 0 && name == prefix + std::to_string(rank)) {
      ranks.push_back(rank);
    }
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

struct Addressed {
  std::vector<Remote> remotes;
  bool by_rank = false;  // --rank/--ranks/--all (else --addr, or the default address)
};

// Reads --addr, --rank, --ranks, --all and --timeout-ms. `collective_default`: with none of
// --rank/--ranks/--all and no --addr, address every local rank (--all).
absl::StatusOr<Addressed> OpenRemotes(const ParsedArgs& args, int default_timeout_ms,
                                      bool collective_default) {
  absl::StatusOr<Remote> first = OpenRemote(args);
  if (!first.ok()) return first.status();
  if (!args.Has("timeout-ms")) first->timeout_ms = default_timeout_ms;
  const int by_rank = args.Has("rank") + args.Has("ranks") + args.Switch("all");
  if (by_rank > 1) return absl::InvalidArgumentError("give one of --rank, --ranks and --all");
  const bool all = args.Switch("all") || (by_rank == 0 && collective_default && !args.Has("addr"));
  Addressed out;
  std::vector<std::string> addrs;
  if (by_rank == 0 && !all) {
    for (absl::string_view part : absl::StrSplit(first->addr, ',')) {
      if (part.empty()) return absl::InvalidArgumentError("--addr has an empty address");
      addrs.emplace_back(part);
    }
  } else {
    out.by_rank = true;
    std::optional<std::string> base = UnixPath(first->addr);
    if (!base || first->addr.find(',') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--rank, --ranks and --all name sockets next to rank 0's: --addr must be one Unix "
          "socket (unix:/path), got \"",
          first->addr.substr(0, 64), "\"; to name other addresses, list them: --addr A,B,..."));
    }
    std::vector<int> ranks;
    if (all) {
      ranks = LocalRanks(*base);
      if (ranks.empty()) {
        return absl::UnavailableError(absl::StrCat("no arfused socket at ", *base, " or ", *base,
                                                   ".rank<N> (is the group running here?)"));
      }
    } else {
      const std::string spec = *args.Get(args.Has("rank") ? "rank" : "ranks");
      for (absl::string_view part : absl::StrSplit(spec, ',')) {
        int rank = -1;
        if (!absl::SimpleAtoi(part, &rank) || rank < 0 || rank >= 1024) {
          return absl::InvalidArgumentError(absl::StrCat("--", args.Has("rank") ? "rank" : "ranks",
                                                         ": \"", std::string(part).substr(0, 16),
                                                         "\" is not a rank (0, 1, ...)"));
        }
        if (std::find(ranks.begin(), ranks.end(), rank) != ranks.end()) {
          return absl::InvalidArgumentError(absl::StrCat("--ranks names rank ", rank, " twice"));
        }
        ranks.push_back(rank);
      }
      if (args.Has("rank") && ranks.size() != 1) {
        return absl::InvalidArgumentError("--rank takes one rank; use --ranks N,M,...");
      }
    }
    for (int rank : ranks) addrs.push_back(RankAddress(*base, rank));
  }
  for (const std::string& addr : addrs) {
    Remote r = *first;
    r.addr = addr;
    r.channel = grpc::CreateChannel(r.addr, grpc::InsecureChannelCredentials());
    out.remotes.push_back(std::move(r));
  }
  return out;
}

// Runs `call` on every remote concurrently; prints one line per address; exit status is the
// worst of them.
int RunOnAll(const std::vector<Remote>& remotes, Io& io, const char* what,
             const std::function<grpc::Status(const Remote&, std::string*)>& call) {
  std::vector<grpc::Status> statuses(remotes.size());
  std::vector<std::string> lines(remotes.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < remotes.size(); ++i) {
    threads.emplace_back([&, i] { statuses[i] = call(remotes[i], &lines[i]); });
  }
  for (auto& t : threads) t.join();
  int worst = kExitOk;
  for (size_t i = 0; i < remotes.size(); ++i) {
    if (statuses[i].ok()) {
      io.out << remotes[i].addr << ": " << lines[i] << "\n";
    } else {
      worst = std::max(worst, remotes[i].Fail(io, what, statuses[i]));
    }
  }
  return worst;
}

// A collective call (set-backend, reinitialize) reaches every rank of the group at about the same
// time, or none: a rank asked alone waits for the others until its deadline and leaves the switch
// half done. Asks each addressed sidecar for its rank and group first, and refuses (exit 2, before
// anything changes) when the addressed ranks are not the whole group, or (several nodes) not
// every rank of one node. Returns the exit status on refusal, nullopt to go ahead.
std::optional<int> CheckCollective(const std::vector<Remote>& remotes, Io& io, const char* verb) {
  struct Seen {
    uint32_t rank, world_size, nnodes;
  };
  std::vector<Seen> seen(remotes.size());
  std::vector<grpc::Status> statuses(remotes.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < remotes.size(); ++i) {
    threads.emplace_back([&, i] {
      Remote quick = remotes[i];
      quick.timeout_ms = std::min(quick.timeout_ms, kDefaultTimeoutMs);
      v1::GetWorkspaceInfoResponse ws;
      statuses[i] =
          v1::Fusion::NewStub(quick.channel)->GetWorkspaceInfo(quick.Context().get(), {}, &ws);
      seen[i] = {ws.rank(), ws.world_size(), ws.nnodes()};
    });
  }
  for (auto& t : threads) t.join();
  int worst = kExitOk;
  for (size_t i = 0; i < remotes.size(); ++i) {
    if (!statuses[i].ok())
      worst = std::max(worst, remotes[i].Fail(io, "Fusion.GetWorkspaceInfo", statuses[i]));
  }
  if (worst != kExitOk) return worst;
  std::vector<uint32_t> ranks;
  for (size_t i = 0; i < remotes.size(); ++i) {
    if (seen[i].world_size != seen[0].world_size || seen[i].nnodes != seen[0].nnodes) {
      return Usage(
          io, absl::StrCat(remotes[i].addr, " is rank ", seen[i].rank, " of ", seen[i].world_size,
                           " but ", remotes[0].addr, " is rank ", seen[0].rank, " of ",
                           seen[0].world_size, ": these sidecars are not one group"));
    }
    if (std::find(ranks.begin(), ranks.end(), seen[i].rank) != ranks.end()) {
      return Usage(
          io, absl::StrCat("rank ", seen[i].rank, " is addressed twice (", remotes[i].addr, ")"));
    }
    ranks.push_back(seen[i].rank);
  }
  std::sort(ranks.begin(), ranks.end());
  const uint32_t world = seen[0].world_size, nnodes = std::max<uint32_t>(seen[0].nnodes, 1);
  // Several nodes: each node's ranks are asked from that node; here, one node's share.
  const uint32_t expected = nnodes > 1 ? world / nnodes : world;
  if (ranks.size() < expected) {
    std::vector<std::string> missing;
    for (uint32_t r = 0; r < world && nnodes == 1; ++r) {
      if (!std::binary_search(ranks.begin(), ranks.end(), r)) missing.push_back(std::to_string(r));
    }
    return Usage(io, absl::StrCat(verb,
                                  " is collective: every rank of the group must be asked at once, "
                                  "but ",
                                  ranks.size(), " of ", nnodes > 1 ? expected : world, " ranks",
                                  nnodes > 1 ? " of this node" : "", " were addressed",
                                  missing.empty() ? ""
                                                  : absl::StrCat(" (missing: rank ",
                                                                 absl::StrJoin(missing, ", "), ")"),
                                  "; nothing was changed. Address every rank: arfusectl ", verb,
                                  " --all (sockets next to rank 0's) or --addr A,B,..."));
  }
  if (nnodes > 1) {
    io.err << "arfusectl: the group spans " << nnodes << " nodes: run the same " << verb
           << " on every node at about the same time (each node's ranks wait for the others)\n";
  }
  return std::nullopt;
}

// ---- admin: stats, drain, set-backend, reinitialize ----

constexpr int kCollectiveTimeoutMs = 30000;

// One id for the calls of one collective command on every rank: the sidecars match the calls by
// it, so a call that failed earlier on one rank only cannot pair with a later one.
std::string NewCollectiveId() {
  std::random_device rd;
  return absl::StrFormat("%08x%08x", rd(), rd());
}

int RunSetBackend(const ParsedArgs& args, Io& io) {
  std::optional<std::string> backend = args.Get("backend");
  if (!backend)
    return Usage(io, "set-backend needs a backend: arfusectl set-backend auto|trtllm|mnnvl|none");
  if (*backend != "auto" && *backend != "trtllm" && *backend != "mnnvl" && *backend != "none") {
    return Usage(io, absl::StrCat("unknown backend \"", backend->substr(0, 64),
                                  "\": expected auto, trtllm, mnnvl or none"));
  }
  absl::StatusOr<Addressed> to =
      OpenRemotes(args, kCollectiveTimeoutMs, /*collective_default=*/true);
  if (!to.ok()) return Usage(io, std::string(to.status().message()));
  if (std::optional<int> refused = CheckCollective(to->remotes, io, "set-backend")) return *refused;
  const std::string id = NewCollectiveId();
  return RunOnAll(to->remotes, io, "Admin.SetBackend", [&](const Remote& r, std::string* line) {
    v1::SetBackendRequest req;
    req.set_backend(*backend);
    req.set_collective_id(id);
    v1::SetBackendResponse resp;
    grpc::Status st = v1::Admin::NewStub(r.channel)->SetBackend(r.Context().get(), req, &resp);
    if (st.ok()) {
      *line = absl::StrCat("backend ", resp.previous_backend(), " -> ", resp.backend(), ", fusion ",
                           resp.fusion_enabled() ? "enabled" : "disabled", ", generation ",
                           resp.generation());
    }
    return st;
  });
}

int RunReinitialize(const ParsedArgs& args, Io& io) {
  absl::StatusOr<Addressed> to =
      OpenRemotes(args, kCollectiveTimeoutMs, /*collective_default=*/true);
  if (!to.ok()) return Usage(io, std::string(to.status().message()));
  if (std::optional<int> refused = CheckCollective(to->remotes, io, "reinitialize")) {
    return *refused;
  }
  return RunOnAll(to->remotes, io, "Admin.Reinitialize", [&](const Remote& r, std::string* line) {
    v1::ReinitializeResponse resp;
    grpc::Status st = v1::Admin::NewStub(r.channel)->Reinitialize(r.Context().get(), {}, &resp);
    if (st.ok()) {
      *line = absl::StrCat("re-initialized, generation ", resp.generation(), ", state ",
                           StateText(resp.state()));
    }
    return st;
  });
}

int RunDrain(const ParsedArgs& args, Io& io) {
  absl::StatusOr<Addressed> to = OpenRemotes(args, kDefaultTimeoutMs, /*collective_default=*/false);
  if (!to.ok()) return Usage(io, std::string(to.status().message()));
  return RunOnAll(to->remotes, io, "Admin.Drain", [&](const Remote& r, std::string* line) {
    v1::DrainRequest req;
    req.set_timeout_ms(static_cast<uint32_t>(r.timeout_ms));
    v1::DrainResponse resp;
    grpc::Status st = v1::Admin::NewStub(r.channel)->Drain(r.Context().get(), req, &resp);
    if (st.ok()) *line = absl::StrCat("drained (waited for ", resp.ops_waited(), " op(s))");
    return st;
  });
}

int RunStatsOne(const Remote& server, const ParsedArgs& args, Io& io) {
  v1::GetStatsResponse s;
  grpc::Status st = v1::Admin::NewStub(server.channel)->GetStats(server.Context().get(), {}, &s);
  if (!st.ok()) return server.Fail(io, "Admin.GetStats", st);
  if (args.Switch("json")) {
    io.out << "{\"addr\":" << JsonQuote(server.addr) << ",\"backend\":" << JsonQuote(s.backend())
           << ",\"state\":" << JsonQuote(StateText(s.state())) << ",\"sessions\":" << s.sessions()
           << ",\"regions\":" << s.regions() << ",\"region_bytes\":" << s.region_bytes()
           << ",\"plans\":" << s.plans() << ",\"ops_ok\":" << s.ops_ok()
           << ",\"ops_failed\":" << s.ops_failed() << ",\"ops_fused\":" << s.ops_fused()
           << ",\"ops_unfused\":" << s.ops_unfused() << ",\"bytes_reduced\":" << s.bytes_reduced()
           << ",\"poisonings\":" << s.poisonings()
           << ",\"reinitializations\":" << s.reinitializations()
           << ",\"uptime_seconds\":" << s.uptime_seconds()
           << ",\"version\":" << JsonQuote(s.version()) << "}\n";
  } else {
    io.out << "arfused at " << server.addr << " (version " << s.version() << ", up "
           << s.uptime_seconds() << " s)\n  backend " << s.backend() << ", state "
           << StateText(s.state()) << "\n  sessions " << s.sessions() << ", regions " << s.regions()
           << " (" << s.region_bytes() << " bytes), plans " << s.plans() << "\n  ops ok "
           << s.ops_ok() << " (fused " << s.ops_fused() << ", unfused " << s.ops_unfused()
           << "), failed " << s.ops_failed() << ", bytes reduced " << s.bytes_reduced()
           << "\n  poisonings " << s.poisonings() << ", re-initializations "
           << s.reinitializations() << "\n";
  }
  return kExitOk;
}

// A command of one sidecar (health, info, stats) run on every addressed one in turn; the exit
// status is the worst.
int RunEach(const ParsedArgs& args, Io& io,
            const std::function<int(const Remote&, const ParsedArgs&, Io&)>& one) {
  absl::StatusOr<Addressed> to = OpenRemotes(args, kDefaultTimeoutMs, /*collective_default=*/false);
  if (!to.ok()) return Usage(io, std::string(to.status().message()));
  int worst = kExitOk;
  for (const Remote& r : to->remotes) worst = std::max(worst, one(r, args, io));
  return worst;
}

// ---- top ----

int RunTopCommand(const ParsedArgs& args, Io& io) {
  TopOptions o;
  auto positive = [&](const char* name, int* out) -> absl::Status {
    if (auto v = args.Get(name)) {
      absl::StatusOr<int> n = config::ParsePositiveInt(absl::StrCat("--", name), *v);
      if (!n.ok()) return n.status();
      *out = *n;
    }
    return absl::OkStatus();
  };
  for (const auto& [name, field] :
       std::vector<std::pair<const char*, int*>>{{"interval-ms", &o.interval_ms},
                                                 {"iterations", &o.iterations},
                                                 {"timeout-ms", &o.timeout_ms}}) {
    if (absl::Status st = positive(name, field); !st.ok()) {
      return Usage(io, std::string(st.message()));
    }
  }
  absl::StatusOr<Addressed> to = OpenRemotes(args, o.timeout_ms, /*collective_default=*/false);
  if (!to.ok()) return Usage(io, std::string(to.status().message()));
  for (const Remote& r : to->remotes) o.addrs.push_back(r.addr);
  if (auto m = args.Get("metrics")) {
    for (absl::string_view part : absl::StrSplit(*m, ',')) {
      if (part.empty() || part.rfind(':') == absl::string_view::npos) {
        return Usage(io, absl::StrCat("--metrics: \"", std::string(part).substr(0, 64),
                                      "\" is not HOST:PORT (one per address, in --addr's order)"));
      }
      o.metrics.emplace_back(part);
    }
    if (o.metrics.size() != o.addrs.size()) {
      return Usage(io, absl::StrCat("--metrics names ", o.metrics.size(), " endpoint(s) for ",
                                    o.addrs.size(),
                                    " address(es): give one HOST:PORT per address, in order"));
    }
  }
  o.json = args.Switch("json");
  // A terminal gets one screen redrawn per refresh; a pipe or file gets plain lines.
  o.screen = !o.json && !args.Switch("plain") && io.out.rdbuf() == std::cout.rdbuf() &&
             isatty(STDOUT_FILENO) == 1;
  return RunTop(o, io.out, io.err);
}

// ---- the table ----

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
