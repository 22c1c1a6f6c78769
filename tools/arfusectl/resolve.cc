// arfusectl resolve: the fusion decision, computed here from the command line (the same rules as
// arfused's, config/fusion_config.h) or asked of a running arfused with --addr.
#include "absl/strings/str_cat.h"
#include "arfuse/v1/config.grpc.pb.h"
#include "config/config_convert.h"
#include "tools/arfusectl/commands.h"

namespace arfuse::cli {

// The serving frameworks' own flags (FusionFlagOptions) take the last value when repeated, each
// value checked as it comes (argparse); arfusectl's own options stay single.
const std::vector<OptionSpec>& ResolveOptions() {
  using Kind = OptionSpec::Kind;
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
  st = ReadOption(
      args, "fused-op-in-graph",
      [](const std::string& text) { return config::ParseBool("--fused-op-in-graph", text); },
      &in.capture.fused_op_in_graph);
  if (st.ok()) {
    st = ReadOption(
        args, "mnnvl-capture-safe",
        [](const std::string& text) {
          return config::ParseBool(config::kFlagMnnvlCaptureSafe, text);
        },
        &in.capture.mnnvl_capture_safe);
  }
  if (!st.ok()) return st;
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

}  // namespace arfuse::cli
