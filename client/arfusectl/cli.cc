#include "client/arfusectl/cli.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "arfuse/v1/admin.grpc.pb.h"
#include "arfuse/v1/config.grpc.pb.h"
#include "arfuse/v1/fusion.grpc.pb.h"
#include "client/arfusectl/args.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "server/config/fusion_config.h"
#include "server/core/version.h"
#include "server/services/config/config_convert.h"

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
};

int Usage(Io& io, const std::string& message) {
  io.err << "arfusectl: " << message << "\n";
  return kExitUsage;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// ---- Talking to arfused. ----

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
        io.err << "arfusectl: no answer from arfused at " << addr << " within " << timeout_ms
               << " ms (" << what << ")\n";
        return kExitUnreachable;
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

const std::vector<OptionSpec>& ResolveOptions() {
  static const std::vector<OptionSpec> options = {
      {"sm", Kind::kValue, "<major><minor>", "compute capability, e.g. 90 or 100"},
      {"nnodes", Kind::kValue, "N", "nodes in the group"},
      {"tp", Kind::kValue, "N", "tensor-parallel size"},
      {"flashinfer-allreduce-fusion-backend", Kind::kValue, "auto|trtllm|mnnvl",
       "backend; unset means off (subject to auto-enable)"},
      {"enable-flashinfer-allreduce-fusion", Kind::kSwitch, "",
       "deprecated: same as --flashinfer-allreduce-fusion-backend=auto"},
      {"enforce-disable-flashinfer-allreduce-fusion", Kind::kSwitch, "", "fusion off, always"},
      {"enable-deterministic-inference", Kind::kSwitch, "", "clears the backend"},
      {"cuda-graph-mode", Kind::kValue, "none|piecewise|full",
       "the CUDA-graph mode wanted (default none)"},
      {"fused-op-in-graph", Kind::kValue, "true|false",
       "want the fused op inside the graphs (default: true unless the mode is none)"},
      {"mnnvl-capture-safe", Kind::kValue, "true|false",
       "whether mnnvl kernels are capture-safe (default true)"},
      kJsonOption,
      {"addr", Kind::kValue, "ADDR", "ask a running arfused instead of computing locally"},
      kTimeoutOption,
  };
  return options;
}

struct ResolveInput {
  config::FusionFlags flags;
  std::optional<config::Topology> topology;  // unset: the server's own (--addr only)
  config::CaptureRequest capture;
};

absl::StatusOr<ResolveInput> ReadResolveInput(const ParsedArgs& args, bool remote) {
  ResolveInput in;
  if (auto b = args.Get("flashinfer-allreduce-fusion-backend")) {
    absl::StatusOr<std::string> backend = config::ParseBackendFlag(*b);
    if (!backend.ok()) return backend.status();
    in.flags.backend = *backend;
  }
  in.flags.enable_deprecated = args.Switch("enable-flashinfer-allreduce-fusion");
  in.flags.enforce_disable = args.Switch("enforce-disable-flashinfer-allreduce-fusion");
  in.flags.deterministic = args.Switch("enable-deterministic-inference");

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

  if (auto m = args.Get("cuda-graph-mode")) {
    absl::StatusOr<config::CudaGraphMode> mode = config::ParseCudaGraphMode(*m);
    if (!mode.ok()) return mode.status();
    in.capture.mode = *mode;
  }
  // A client that captures graphs normally wants the fused op inside them (the doorbell plane).
  in.capture.fused_op_in_graph = in.capture.mode != config::CudaGraphMode::kNone;
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

int RunHealth(const ParsedArgs& args, Io& io) {
  absl::StatusOr<Remote> server = OpenRemote(args);
  if (!server.ok()) return Usage(io, std::string(server.status().message()));
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
    io.out << "{\"addr\":" << JsonString(server->addr) << ",\"service\":" << JsonString(service)
           << ",\"status\":" << JsonString(state) << "}\n";
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

int RunInfo(const ParsedArgs& args, Io& io) {
  absl::StatusOr<Remote> server = OpenRemote(args);
  if (!server.ok()) return Usage(io, std::string(server.status().message()));
  v1::NegotiateRequest negotiate;
  if (args.Has("cuda-graph-mode") || args.Has("fused-op-in-graph") ||
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
    io.out << "{\"addr\":" << JsonString(server->addr) << ",\"workspace\":{"
           << "\"backend\":" << JsonString(ws.backend())
           << ",\"fusion_enabled\":" << (ws.fusion_enabled() ? "true" : "false")
           << ",\"reason\":" << JsonString(ws.reason())
           << ",\"state\":" << JsonString(StateText(ws.state()))
           << ",\"generation\":" << ws.generation() << ",\"rank\":" << ws.rank()
           << ",\"world_size\":" << ws.world_size() << ",\"nnodes\":" << ws.nnodes()
           << ",\"sm\":" << ws.sm() << ",\"max_tokens\":" << ws.max_tokens()
           << ",\"hidden\":" << ws.hidden() << ",\"dtype\":" << JsonString(DTypeText(ws.dtype()))
           << ",\"workspace_bytes\":" << ws.workspace_bytes()
           << ",\"device\":" << JsonString(DeviceName(ws.device()))
           << ",\"mps_detected\":" << (ws.mps_detected() ? "true" : "false")
           << ",\"doorbell_hop_us\":" << ws.doorbell_hop_us()
           << "},\"negotiation\":" << (decision ? config::DecisionToJson(*decision) : "null");
    if (decision) {
      io.out << ",\"server_api\":"
             << JsonString(absl::StrCat(neg.server_api().major(), ".", neg.server_api().minor()));
    } else {
      io.out << ",\"negotiation_error\":" << JsonString(negotiation_error);
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
    if (decision) {
      o << "  negotiation: cuda_graph_mode " << config::CudaGraphModeName(decision->cuda_graph_mode)
        << ", data plane " << config::DataPlaneName(decision->data_plane) << "\n";
      for (const std::string& w : decision->warnings) o << "    warning: " << w << "\n";
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

// ---- admin: stats, drain, set-backend, reinitialize ----

constexpr int kCollectiveTimeoutMs = 30000;

// set-backend and reinitialize are collective: every rank's sidecar must be asked, at about the
// same time. --addr takes a comma-separated list and the calls run concurrently.
absl::StatusOr<std::vector<Remote>> OpenRemotes(const ParsedArgs& args,
                                                int default_timeout_ms = kDefaultTimeoutMs) {
  absl::StatusOr<Remote> first = OpenRemote(args);
  if (!first.ok()) return first.status();
  // Collective calls wait for every rank and may rebuild workspaces: a longer default.
  if (!args.Has("timeout-ms")) first->timeout_ms = default_timeout_ms;
  std::vector<Remote> remotes;
  for (absl::string_view part : absl::StrSplit(first->addr, ',')) {
    if (part.empty()) return absl::InvalidArgumentError("--addr has an empty address");
    Remote r = *first;
    r.addr = std::string(part);
    r.channel = grpc::CreateChannel(r.addr, grpc::InsecureChannelCredentials());
    remotes.push_back(std::move(r));
  }
  return remotes;
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

int RunSetBackend(const ParsedArgs& args, Io& io) {
  std::optional<std::string> backend = args.Get("backend");
  if (!backend) return Usage(io, "set-backend needs --backend auto|trtllm|mnnvl|none");
  if (*backend != "auto" && *backend != "trtllm" && *backend != "mnnvl" && *backend != "none") {
    return Usage(io, absl::StrCat("unknown backend \"", *backend,
                                  "\" for --backend: expected auto, trtllm, mnnvl or none"));
  }
  absl::StatusOr<std::vector<Remote>> remotes = OpenRemotes(args, kCollectiveTimeoutMs);
  if (!remotes.ok()) return Usage(io, std::string(remotes.status().message()));
  return RunOnAll(*remotes, io, "Admin.SetBackend", [&](const Remote& r, std::string* line) {
    v1::SetBackendRequest req;
    req.set_backend(*backend);
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
  absl::StatusOr<std::vector<Remote>> remotes = OpenRemotes(args, kCollectiveTimeoutMs);
  if (!remotes.ok()) return Usage(io, std::string(remotes.status().message()));
  return RunOnAll(*remotes, io, "Admin.Reinitialize", [&](const Remote& r, std::string* line) {
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
  absl::StatusOr<std::vector<Remote>> remotes = OpenRemotes(args);
  if (!remotes.ok()) return Usage(io, std::string(remotes.status().message()));
  return RunOnAll(*remotes, io, "Admin.Drain", [&](const Remote& r, std::string* line) {
    v1::DrainRequest req;
    req.set_timeout_ms(static_cast<uint32_t>(r.timeout_ms));
    v1::DrainResponse resp;
    grpc::Status st = v1::Admin::NewStub(r.channel)->Drain(r.Context().get(), req, &resp);
    if (st.ok()) *line = absl::StrCat("drained (waited for ", resp.ops_waited(), " op(s))");
    return st;
  });
}

int RunStats(const ParsedArgs& args, Io& io) {
  absl::StatusOr<Remote> server = OpenRemote(args);
  if (!server.ok()) return Usage(io, std::string(server.status().message()));
  v1::GetStatsResponse s;
  grpc::Status st = v1::Admin::NewStub(server->channel)->GetStats(server->Context().get(), {}, &s);
  if (!st.ok()) return server->Fail(io, "Admin.GetStats", st);
  if (args.Switch("json")) {
    io.out << "{\"addr\":" << JsonString(server->addr) << ",\"backend\":" << JsonString(s.backend())
           << ",\"state\":" << JsonString(StateText(s.state())) << ",\"sessions\":" << s.sessions()
           << ",\"regions\":" << s.regions() << ",\"region_bytes\":" << s.region_bytes()
           << ",\"plans\":" << s.plans() << ",\"ops_ok\":" << s.ops_ok()
           << ",\"ops_failed\":" << s.ops_failed() << ",\"ops_fused\":" << s.ops_fused()
           << ",\"ops_unfused\":" << s.ops_unfused() << ",\"bytes_reduced\":" << s.bytes_reduced()
           << ",\"poisonings\":" << s.poisonings()
           << ",\"reinitializations\":" << s.reinitializations()
           << ",\"uptime_seconds\":" << s.uptime_seconds()
           << ",\"version\":" << JsonString(s.version()) << "}\n";
  } else {
    io.out << "arfused at " << server->addr << " (version " << s.version() << ", up "
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

const OptionSpec kAddrListOption{
    "addr", Kind::kValue, "ADDR[,ADDR...]",
    "every rank's arfused (comma-separated), asked concurrently (default " + DefaultAddress() +
        ")"};

// ---- the table ----

const std::vector<Command>& Commands() {
  static const std::vector<Command> commands = {
      {"resolve", "compute the fusion decision (locally, or with --addr by a running arfused)",
       "arfusectl resolve --sm <major><minor> --nnodes N --tp N [options]", ResolveOptions(),
       RunResolve},
      {"health",
       "grpc.health.v1 check: exit 0 SERVING, 1 not serving, 3 unreachable",
       "arfusectl health [--addr ADDR] [--service NAME] [--json]",
       {kAddrOption,
        {"service", Kind::kValue, "NAME", "service name to check (default \"\": the server)"},
        kJsonOption,
        kTimeoutOption},
       RunHealth},
      {"info",
       "workspace and negotiation of a running arfused",
       "arfusectl info [--addr ADDR] [--json]",
       {kAddrOption,
        kJsonOption,
        kTimeoutOption,
        {"cuda-graph-mode", Kind::kValue, "none|piecewise|full", "negotiate for this mode"},
        {"fused-op-in-graph", Kind::kValue, "true|false", "negotiate with the op in graphs"},
        {"mnnvl-capture-safe", Kind::kValue, "true|false", "negotiate as if capture-(un)safe"}},
       RunInfo},
      {"stats",
       "counters and state of a running arfused",
       "arfusectl stats [--addr ADDR] [--json]",
       {kAddrOption, kJsonOption, kTimeoutOption},
       RunStats},
      {"drain",
       "stop accepting ops and wait for those in flight (readiness goes NOT_SERVING)",
       "arfusectl drain [--addr ADDR[,ADDR...]] [--timeout-ms N]",
       {kAddrListOption, kTimeoutOption},
       RunDrain},
      {"set-backend",
       "switch the backend live on every rank (drain, vote, rebuild; refused if infeasible)",
       "arfusectl set-backend --backend auto|trtllm|mnnvl|none --addr ADDR,ADDR,...",
       {kAddrListOption,
        {"backend", Kind::kValue, "auto|trtllm|mnnvl|none", "the backend to switch to"},
        kTimeoutOption},
       RunSetBackend},
      {"reinitialize",
       "re-form the group and re-initialize its workspace (every rank)",
       "arfusectl reinitialize --addr ADDR,ADDR,...",
       {kAddrListOption, kTimeoutOption},
       RunReinitialize},
      {"version",
       "print the version",
       "arfusectl version",
       {},
       [](const ParsedArgs&, Io& io) {
         io.out << VersionLine("arfusectl") << "\n";
         return kExitOk;
       }},
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
  if (verb == "--version") {
    out << VersionLine("arfusectl") << "\n";
    return kExitOk;
  }
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
    absl::StatusOr<ParsedArgs> parsed = ParseArgs(command.name, command.options, rest);
    if (!parsed.ok()) return Usage(io, std::string(parsed.status().message()));
    return command.run(*parsed, io);
  }
  return Usage(io, absl::StrCat("unknown command \"", verb.substr(0, 64),
                                "\" (commands: resolve, health, info, stats, drain, set-backend, "
                                "reinitialize, version; see arfusectl --help)"));
}

}  // namespace arfuse::cli
