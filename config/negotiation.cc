// Capture-mode negotiation: per phase, the CUDA-graph mode and the data plane a resolved
// decision runs on (docs/config.md).
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "config/fusion_config.h"
#include "config/internal.h"

namespace arfuse::config {
namespace {

using internal::Contains;

void AppendUnique(std::vector<std::string>& to, const std::vector<std::string>& from) {
  for (const std::string& s : from) {
    if (!Contains(to, s)) to.push_back(s);
  }
}

}  // namespace

CudaGraphMode CaptureRequest::ModeOf(Phase phase) const {
  const std::optional<CudaGraphMode>& per_phase =
      phase == Phase::kPrefill ? prefill_mode : decode_mode;
  return per_phase.value_or(mode);
}

namespace {

struct PhaseResult {
  PhaseCapture capture;
  std::vector<std::string> reasons;
  std::vector<std::string> warnings;
};

// One phase's mode and data plane.
PhaseResult NegotiatePhase(const Decision& d, CudaGraphMode mode, const CaptureRequest& capture,
                           const NegotiationEnvironment& env) {
  PhaseResult r;
  const bool fused = d.fusion_enabled && d.backend != kBackendNone;
  // The in-stream plane: the sidecar's kernel launched in the client's own stream, capturable in
  // full and piecewise graphs alike, nothing per call site in the sidecar.
  const bool instream = fused && capture.client_loads_kernels && env.instream_available;
  // The doorbell plane holds one slot per planned call site: a client that plans more sites
  // than there are slots (a real model: 2 per layer) is not offered it.
  const bool doorbell_fits = env.doorbell_slots == 0 || capture.call_sites <= env.doorbell_slots;
  const bool doorbell = env.doorbell_available && doorbell_fits;
  const bool wants_in_graph = fused && capture.fused_op_in_graph && mode != CudaGraphMode::kNone;
  if (fused && capture.client_loads_kernels && !env.instream_available) {
    r.warnings.push_back(
        absl::StrCat("the in-stream plane is unavailable (", env.instream_unavailable_reason, ")"));
  }
  if (fused && !instream && !doorbell_fits && env.doorbell_available) {
    r.warnings.push_back(absl::StrCat(
        "the doorbell plane has ", env.doorbell_slots, " slots and the client plans ",
        capture.call_sites,
        " call sites: not offered; without the in-stream plane (a client that loads the "
        "sidecar's kernels) every fused op runs on the eager plane (an RPC per op)"));
  }

  // Without a doorbell the fused op can only be an eager split op between graph pieces, which a
  // full graph cannot have.
  if (wants_in_graph && !instream && !doorbell && mode == CudaGraphMode::kFull) {
    mode = CudaGraphMode::kPiecewise;
    r.reasons.push_back(absl::StrCat(
        "doorbell plane unavailable (",
        env.doorbell_available ? "more call sites than slots" : env.doorbell_unavailable_reason,
        "): full CUDA graphs become piecewise with the fused op as an eager split op"));
  }

  // The piecewise-graph hang of FlashInfer's mnnvl kernels before its bitwise sentinel fix was
  // tied to piecewise capture; upstream turned piecewise (prefill) graphs off for mnnvl and kept
  // the decode graphs. A phase asking for full or no graphs is left as it is.
  if (fused && d.backend == kBackendMnnvl && mode == CudaGraphMode::kPiecewise) {
    if (capture.mnnvl_capture_safe.value_or(true)) {
      r.reasons.push_back(
          "mnnvl kernels are capture-safe (bitwise sentinel checks): piecewise CUDA graphs "
          "allowed");
    } else {
      mode = CudaGraphMode::kNone;
      r.reasons.push_back(absl::StrCat("mnnvl kernels are not capture-safe (",
                                       kFlagMnnvlCaptureSafe,
                                       "=false): piecewise CUDA graphs turned off"));
    }
  }
  r.capture.mode = mode;

  r.capture.data_plane = DataPlane::kEager;
  if (instream) {
    r.capture.data_plane = DataPlane::kInStream;
    r.reasons.push_back(
        "the client loads the sidecar's kernels: in-stream plane (one kernel launch per op in the "
        "client's own stream, inside its CUDA graphs or not)");
  } else if (!fused) {
    r.reasons.push_back("fusion is off: the unfused path runs on the eager plane");
  } else if (mode == CudaGraphMode::kNone) {
    r.reasons.push_back("no CUDA graphs: eager plane (one Execute call per op)");
  } else if (!capture.fused_op_in_graph) {
    r.reasons.push_back(
        "fused op kept out of the client's CUDA graphs: eager plane, a split op "
        "between graph pieces");
  } else if (!doorbell) {
    r.reasons.push_back(absl::StrCat(
        "doorbell plane unavailable (",
        env.doorbell_available ? "more call sites than slots" : env.doorbell_unavailable_reason,
        "): eager plane, a split op between graph pieces"));
  } else {
    r.capture.data_plane = DataPlane::kDoorbell;
    r.reasons.push_back(
        "fused op inside the client's CUDA graphs: doorbell plane (ring kernel "
        "captured in the graph)");
    if (env.mps_detected.has_value() && !*env.mps_detected) {
      r.warnings.push_back(absl::StrCat(
          "MPS not detected: every doorbell hop costs a context switch",
          env.doorbell_hop_us > 0 ? absl::StrCat(" (measured ", env.doorbell_hop_us, " us)") : "",
          "; run the sidecar and the client under MPS"));
    }
  }
  return r;
}

}  // namespace

Decision Negotiate(const Decision& resolved, const CaptureRequest& capture,
                   const NegotiationEnvironment& env) {
  Decision d = resolved;
  const PhaseResult prefill = NegotiatePhase(d, capture.ModeOf(Phase::kPrefill), capture, env);
  const PhaseResult decode = NegotiatePhase(d, capture.ModeOf(Phase::kDecode), capture, env);
  d.prefill = prefill.capture;
  d.decode = decode.capture;
  // Alike phases (every old client's request) read as one answer; different ones say which.
  if (prefill.capture == decode.capture && prefill.reasons == decode.reasons) {
    d.reasons.insert(d.reasons.end(), prefill.reasons.begin(), prefill.reasons.end());
  } else {
    for (const PhaseResult* p : {&prefill, &decode}) {
      const char* name = p == &prefill ? "prefill" : "decode";
      for (const std::string& reason : p->reasons)
        d.reasons.push_back(absl::StrCat(name, ": ", reason));
    }
  }
  AppendUnique(d.warnings, prefill.warnings);
  AppendUnique(d.warnings, decode.warnings);

  // One-mode clients get the answer that holds for both phases.
  const PhaseCapture& lower = decode.capture.mode < prefill.capture.mode ? d.decode : d.prefill;
  d.cuda_graph_mode = lower.mode;
  d.data_plane = lower.data_plane;

  if (d.fusion_enabled && env.workspace_max_tokens > 0 &&
      env.workspace_max_tokens < d.max_tokens_per_batch) {
    d.max_tokens_per_batch = env.workspace_max_tokens;
    d.reasons.push_back(absl::StrCat("the workspace holds ", env.workspace_max_tokens,
                                     " tokens (--max-tokens): fused ops take at most ",
                                     env.workspace_max_tokens, " tokens per batch"));
  }
  return d;
}

absl::StatusOr<Decision> Resolve(const FusionFlags& flags, const Topology& topology,
                                 const CaptureRequest& capture,
                                 const NegotiationEnvironment& environment) {
  ARFUSE_ASSIGN_OR_RETURN(Decision resolved, ResolveBackend(flags, topology));
  return Negotiate(resolved, capture, environment);
}

}  // namespace arfuse::config
