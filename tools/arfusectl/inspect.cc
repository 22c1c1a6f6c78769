// The arfusectl commands that only read a sidecar's state: health, info, stats (one sidecar at a
// time, through RunEach) and top's command line (top.cc samples and prints).
#include <unistd.h>

#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "arfuse/v1/admin.grpc.pb.h"
#include "arfuse/v1/config.grpc.pb.h"
#include "arfuse/v1/fusion.grpc.pb.h"
#include "common/json.h"
#include "config/config_convert.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tools/arfusectl/commands.h"
#include "tools/arfusectl/top.h"

namespace arfuse::cli {

// ---- health ----

int RunHealthOne(const Remote& server, const ParsedArgs& args, Io& io) {
  const std::string service = args.Get("service").value_or("");
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  auto stub = grpc::health::v1::Health::NewStub(server.channel);
  grpc::Status status = stub->Check(server.Context().get(), request, &response);

  std::string state;
  int code = kExitFailure;
  if (status.ok()) {
    state = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
    if (response.status() == grpc::health::v1::HealthCheckResponse::SERVING) code = kExitOk;
  } else if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
    // The health service answers NOT_FOUND for a service name it does not know.
    state = "SERVICE_UNKNOWN";
  } else {
    return server.Fail(io, "grpc.health.v1.Health.Check", status);
  }
  if (args.Switch("json")) {
    io.out << "{\"addr\":" << JsonQuote(server.addr) << ",\"service\":" << JsonQuote(service)
           << ",\"status\":" << JsonQuote(state) << "}\n";
  } else {
    io.out << state << "\n";
  }
  if (code != kExitOk) {
    io.err << "arfusectl: arfused at " << server.addr << " service \"" << service << "\" is "
           << state << "\n";
  }
  return code;
}

// ---- info ----

namespace {

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

}  // namespace

int RunInfoOne(const Remote& server, const ParsedArgs& args, Io& io) {
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
      v1::Fusion::NewStub(server.channel)->GetWorkspaceInfo(server.Context().get(), {}, &ws);
  if (!status.ok()) return server.Fail(io, "Fusion.GetWorkspaceInfo", status);
  // The workspace answered, so the server is reachable: a failed negotiation (UNAVAILABLE while
  // the group has not decided yet) is reported beside the workspace, not as "unreachable".
  v1::NegotiateResponse neg;
  status = v1::Config::NewStub(server.channel)->Negotiate(server.Context().get(), negotiate, &neg);
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
    negotiation_error = GrpcStatusText(status);
  }

  if (args.Switch("json")) {
    io.out << "{\"addr\":" << JsonQuote(server.addr) << ",\"workspace\":{"
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
    o << "arfused at " << server.addr;
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
    io.err << "arfusectl: Config.Negotiate at " << server.addr << " failed: " << negotiation_error
           << "\n";
    return kExitFailure;
  }
  return kExitOk;
}

// ---- stats ----

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

// ---- top ----

int RunTopCommand(const ParsedArgs& args, Io& io) {
  TopOptions o;
  for (const auto& [name, field] :
       std::vector<std::pair<const char*, int*>>{{"interval-ms", &o.interval_ms},
                                                 {"iterations", &o.iterations},
                                                 {"timeout-ms", &o.timeout_ms}}) {
    if (absl::Status st = ReadPositiveInt(args, name, field); !st.ok()) {
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

}  // namespace arfuse::cli
