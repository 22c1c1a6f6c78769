#include "server/config/fusion_config.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/common/op_types.h"
#include "server/core/status_macros.h"

namespace arfuse::config {
namespace {

// Far above any NVLink domain; rejects garbage without limiting real deployments.
constexpr int kMaxRanks = 1 << 16;

std::string Quoted(const std::string& text) {
  // Bound what an error message echoes back, and keep it on one line.
  return absl::StrCat("\"", absl::CHexEscape(text.substr(0, 64)), text.size() > 64 ? "..." : "",
                      "\"");
}

std::string TopologyText(const Topology& t) {
  return absl::StrCat("sm=", t.sm, " tp=", t.tp, " nnodes=", t.nnodes);
}

std::string FlagsText(const FusionFlags& f) {
  return absl::StrCat("backend=", f.backend ? *f.backend : "unset",
                      " enable_deprecated=", f.enable_deprecated ? "true" : "false",
                      " enforce_disable=", f.enforce_disable ? "true" : "false",
                      " deterministic=", f.deterministic ? "true" : "false");
}

std::string FusedText(const Decision& d) {
  return absl::StrCat(d.backend, d.fusion_enabled ? " (fused)" : " (unfused)");
}

std::string NodesText(int nnodes) {
  return nnodes == 1 ? "one node" : absl::StrCat(nnodes, " nodes");
}

}  // namespace

const char* CudaGraphModeName(CudaGraphMode mode) {
  switch (mode) {
    case CudaGraphMode::kNone:
      return "none";
    case CudaGraphMode::kPiecewise:
      return "piecewise";
    case CudaGraphMode::kFull:
      return "full";
  }
  return "unknown";
}

const char* DataPlaneName(DataPlane plane) {
  switch (plane) {
    case DataPlane::kEager:
      return "eager";
    case DataPlane::kDoorbell:
      return "doorbell";
    case DataPlane::kInStream:
      return "instream";
  }
  return "unknown";
}

absl::StatusOr<CudaGraphMode> ParseCudaGraphMode(const std::string& text) {
  if (text == "none") return CudaGraphMode::kNone;
  if (text == "piecewise") return CudaGraphMode::kPiecewise;
  if (text == "full") return CudaGraphMode::kFull;
  return absl::InvalidArgumentError(absl::StrCat("unknown --cuda-graph-mode ", Quoted(text),
                                                 ": expected none, piecewise or full"));
}

absl::StatusOr<std::string> ParseBackendFlag(const std::string& text) {
  if (text == kBackendAuto || text == kBackendTrtllm || text == kBackendMnnvl) return text;
  return absl::InvalidArgumentError(absl::StrCat("unknown ", kFlagBackend, " value ", Quoted(text),
                                                 ": expected auto, trtllm or mnnvl"));
}

absl::StatusOr<int> ParseSm(const std::string& text) {
  int sm = 0;
  const bool digits =
      !text.empty() && text.size() <= 4 &&
      std::all_of(text.begin(), text.end(), [](char c) { return absl::ascii_isdigit(c); });
  if (!digits || !absl::SimpleAtoi(text, &sm)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sm ", Quoted(text),
                     " is not a number: give the compute capability as <major><minor>, e.g. 90 "
                     "or 100"));
  }
  Topology probe{sm, 1, 1};
  ARFUSE_RETURN_IF_ERROR(ValidateTopology(probe));
  return sm;
}

absl::StatusOr<int> ParsePositiveInt(const std::string& flag, const std::string& text) {
  int value = 0;
  const bool digits = !text.empty() && std::all_of(text.begin(), text.end(),
                                                   [](char c) { return absl::ascii_isdigit(c); });
  if (!digits || !absl::SimpleAtoi(text, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", Quoted(text), " is not a positive integer"));
  }
  if (value < 1) return absl::InvalidArgumentError(absl::StrCat(flag, " must be >= 1, got 0"));
  if (value > kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", value, " is too large (max ", kMaxRanks, ")"));
  }
  return value;
}

absl::StatusOr<bool> ParseBool(const std::string& flag, const std::string& text) {
  if (text == "true" || text == "1") return true;
  if (text == "false" || text == "0") return false;
  return absl::InvalidArgumentError(
      absl::StrCat(flag, " ", Quoted(text), " is not a boolean: expected true or false"));
}

absl::Status ValidateTopology(const Topology& t) {
  if (t.sm < kMinSm || t.sm > kMaxSm) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sm ", t.sm, " is not a compute capability: give <major><minor>, e.g. 90 or 100"));
  }
  if (t.tp < 1) return absl::InvalidArgumentError(absl::StrCat("tp must be >= 1, got ", t.tp));
  if (t.nnodes < 1) {
    return absl::InvalidArgumentError(absl::StrCat("nnodes must be >= 1, got ", t.nnodes));
  }
  if (t.tp > kMaxRanks || t.nnodes > kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("topology ", TopologyText(t), " is too large (max ", kMaxRanks, ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateFlags(const FusionFlags& flags) {
  if (flags.backend) return ParseBackendFlag(*flags.backend).status();
  return absl::OkStatus();
}

absl::StatusOr<FusionArgs> ExtractFusionArgs(std::vector<std::string>& args) {
  FusionArgs out;
  std::vector<std::string> rest;
  std::set<std::string> seen;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      rest.insert(rest.end(), args.begin() + i, args.end());
      break;
    }
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    std::optional<std::string> value;
    if (eq != std::string::npos) value = arg.substr(eq + 1);
    const bool is_backend = name == kFlagBackend;
    bool* switch_target = nullptr;
    if (name == kFlagDeprecatedEnable) switch_target = &out.flags.enable_deprecated;
    if (name == kFlagEnforceDisable) switch_target = &out.flags.enforce_disable;
    if (name == kFlagDeterministic) switch_target = &out.flags.deterministic;
    const bool is_capture_safe = name == kFlagMnnvlCaptureSafe;
    if (!is_backend && switch_target == nullptr && !is_capture_safe) {
      rest.push_back(arg);
      continue;
    }
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat(name, " given more than once"));
    }
    if (is_backend) {
      if (!value) {
        if (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(name, " needs a value: auto, trtllm or mnnvl"));
        }
        value = args[++i];
      }
      ARFUSE_ASSIGN_OR_RETURN(out.flags.backend, ParseBackendFlag(*value));
      continue;
    }
    // Switches take no separate value ("--x true" would swallow a positional argument).
    bool on = true;
    if (value) {
      ARFUSE_ASSIGN_OR_RETURN(on, ParseBool(name, *value));
    }
    if (is_capture_safe) {
      out.mnnvl_capture_safe = on;
    } else {
      *switch_target = on;
    }
  }
  args = std::move(rest);
  return out;
}

bool IsSm100Family(int sm) { return sm / 10 == 10; }

bool MnnvlSupported(int sm, int nnodes) {
  // Our mnnvl is unicast VMM (no multicast): the SM100 family reaches across an NVLink domain;
  // on SM90 it is only validated within one node.
  return IsSm100Family(sm) || (sm == 90 && nnodes == 1);
}

MigratedFlags MigrateFlags(const FusionFlags& flags) {
  MigratedFlags out{flags, {}};
  if (flags.enable_deprecated) {
    if (!flags.backend) {
      out.flags.backend = kBackendAuto;
      out.warnings.push_back(absl::StrCat(kFlagDeprecatedEnable, " is deprecated: treated as ",
                                          kFlagBackend, "=auto; use that flag instead"));
    } else {
      out.warnings.push_back(absl::StrCat(kFlagDeprecatedEnable,
                                          " is deprecated and was ignored: ", kFlagBackend, "=",
                                          *flags.backend, " is set explicitly and wins"));
    }
    // The old setting never survives: a second migration must not warn again.
    out.flags.enable_deprecated = false;
  }
  if (out.flags.enforce_disable && out.flags.backend) {
    out.warnings.push_back(absl::StrCat(kFlagEnforceDisable, " overrides ", kFlagBackend, "=",
                                        *out.flags.backend, ": fusion is off"));
    out.flags.backend.reset();
  }
  return out;
}

absl::StatusOr<Decision> ResolveBackend(const FusionFlags& flags, const Topology& topology) {
  ARFUSE_RETURN_IF_ERROR(ValidateTopology(topology));
  ARFUSE_RETURN_IF_ERROR(ValidateFlags(flags));
  const int sm = topology.sm;
  const int tp = topology.tp;
  const int nnodes = topology.nnodes;

  MigratedFlags migrated = MigrateFlags(flags);
  Decision d;
  d.warnings = std::move(migrated.warnings);
  const FusionFlags& f = migrated.flags;

  // Overrides first: each one alone forces the unfused path, so report every one given.
  if (f.enforce_disable) {
    d.reasons.push_back(absl::StrCat("fusion disabled by ", kFlagEnforceDisable));
  }
  if (f.deterministic) {
    d.reasons.push_back(
        absl::StrCat(kFlagDeterministic, " clears the backend: the unfused path runs"));
  }
  if (!d.reasons.empty()) return d;

  std::string requested;
  if (f.backend) {
    requested = *f.backend;
  } else if (IsSm100Family(sm) && tp > 1) {
    requested = kBackendAuto;
    d.reasons.push_back(
        absl::StrCat("no backend flag: fusion auto-enabled (auto) on the SM100 "
                     "family (sm ",
                     sm, ") with tp=", tp));
  } else if (tp == 1) {
    d.reasons.push_back("tp=1: nothing to reduce, fusion off");
    return d;
  } else {
    d.reasons.push_back(
        absl::StrCat("no backend flag: fusion off (auto-enable only on the SM100 "
                     "family with tp > 1; sm ",
                     sm, " needs ", kFlagBackend, ")"));
    return d;
  }

  if (tp == 1) {
    d.reasons.push_back(
        absl::StrCat("tp=1: nothing to reduce, fusion off (", kFlagBackend, "=", requested, ")"));
    return d;
  }
  if (!IsSm100Family(sm) && sm != 90) {
    d.reasons.push_back(absl::StrCat("sm ", sm,
                                     " is not supported by the fused backends (SM90 or "
                                     "the SM100 family, compute capability 10.x): backend ",
                                     requested, " resolves to none, the unfused path runs"));
    return d;
  }

  if (requested == kBackendAuto) {
    d.backend = (IsSm100Family(sm) || nnodes == 1) ? kBackendMnnvl : kBackendTrtllm;
    d.reasons.push_back(
        absl::StrCat("auto resolved to ", d.backend, " for sm ", sm, " on ", NodesText(nnodes)));
  } else if (requested == kBackendMnnvl) {
    if (MnnvlSupported(sm, nnodes)) {
      d.backend = kBackendMnnvl;
      d.reasons.push_back(
          absl::StrCat(kFlagBackend, "=mnnvl, supported on sm ", sm, " on ", NodesText(nnodes)));
    } else {
      d.backend = kBackendTrtllm;
      d.warnings.push_back(absl::StrCat("mnnvl is not supported on sm ", sm, " across ", nnodes,
                                        " nodes (SM100 family, or SM90 within one node): falling "
                                        "back to trtllm"));
    }
  } else {
    d.backend = kBackendTrtllm;
    d.reasons.push_back(absl::StrCat(kFlagBackend, "=trtllm on sm ", sm));
  }

  // Feasibility: keeps the resolved name (the frameworks' tests check it) but may turn fusion
  // off. Workspace creation and the rank vote can turn it off later as well.
  d.fusion_enabled = true;
  if (d.backend == kBackendTrtllm && nnodes > 1) {
    d.fusion_enabled = false;
    d.reasons.push_back(absl::StrCat("trtllm needs every rank on one node (nnodes=", nnodes,
                                     "): fusion disabled, the unfused path runs"));
  }
  if (!IsSupportedWorldSize(tp)) {
    d.fusion_enabled = false;
    d.reasons.push_back(absl::StrCat("tp=", tp,
                                     " is not a world size the fused kernels support "
                                     "(2, 4, 8, 16): fusion disabled, the unfused path runs"));
  }
  return d;
}

Decision Negotiate(const Decision& resolved, const CaptureRequest& capture,
                   const NegotiationEnvironment& env) {
  Decision d = resolved;
  CudaGraphMode mode = capture.mode;
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
    d.warnings.push_back(
        absl::StrCat("the in-stream plane is unavailable (", env.instream_unavailable_reason, ")"));
  }
  if (fused && !instream && !doorbell_fits && env.doorbell_available) {
    d.warnings.push_back(absl::StrCat(
        "the doorbell plane has ", env.doorbell_slots, " slots and the client plans ",
        capture.call_sites,
        " call sites: not offered; without the in-stream plane (a client that loads the "
        "sidecar's kernels) every fused op runs on the eager plane (an RPC per op)"));
  }

  // Without a doorbell the fused op can only be an eager split op between graph pieces, which a
  // full graph cannot have.
  if (wants_in_graph && !instream && !doorbell && mode == CudaGraphMode::kFull) {
    mode = CudaGraphMode::kPiecewise;
    d.reasons.push_back(absl::StrCat(
        "doorbell plane unavailable (",
        env.doorbell_available ? "more call sites than slots" : env.doorbell_unavailable_reason,
        "): full CUDA graphs become piecewise with the fused op as an eager split op"));
  }

  if (fused && d.backend == kBackendMnnvl && mode == CudaGraphMode::kPiecewise) {
    if (capture.mnnvl_capture_safe.value_or(true)) {
      d.reasons.push_back(
          "mnnvl kernels are capture-safe (bitwise sentinel checks): piecewise CUDA graphs "
          "allowed");
    } else {
      mode = CudaGraphMode::kNone;
      d.reasons.push_back(absl::StrCat("mnnvl kernels are not capture-safe (",
                                       kFlagMnnvlCaptureSafe,
                                       "=false): piecewise CUDA graphs turned off"));
    }
  }
  d.cuda_graph_mode = mode;

  d.data_plane = DataPlane::kEager;
  if (instream) {
    d.data_plane = DataPlane::kInStream;
    d.reasons.push_back(
        "the client loads the sidecar's kernels: in-stream plane (one kernel launch per op in the "
        "client's own stream, inside its CUDA graphs or not)");
  } else if (!fused) {
    d.reasons.push_back("fusion is off: the unfused path runs on the eager plane");
  } else if (mode == CudaGraphMode::kNone) {
    d.reasons.push_back("no CUDA graphs: eager plane (one Execute call per op)");
  } else if (!capture.fused_op_in_graph) {
    d.reasons.push_back(
        "fused op kept out of the client's CUDA graphs: eager plane, a split op "
        "between graph pieces");
  } else if (!doorbell) {
    d.reasons.push_back(absl::StrCat(
        "doorbell plane unavailable (",
        env.doorbell_available ? "more call sites than slots" : env.doorbell_unavailable_reason,
        "): eager plane, a split op between graph pieces"));
  } else {
    d.data_plane = DataPlane::kDoorbell;
    d.reasons.push_back(
        "fused op inside the client's CUDA graphs: doorbell plane (ring kernel "
        "captured in the graph)");
    if (env.mps_detected.has_value() && !*env.mps_detected) {
      d.warnings.push_back(absl::StrCat(
          "MPS not detected: every doorbell hop costs a context switch",
          env.doorbell_hop_us > 0 ? absl::StrCat(" (measured ", env.doorbell_hop_us, " us)") : "",
          "; run the sidecar and the client under MPS"));
    }
  }
  return d;
}

absl::StatusOr<Decision> Resolve(const FusionFlags& flags, const Topology& topology,
                                 const CaptureRequest& capture,
                                 const NegotiationEnvironment& environment) {
  ARFUSE_ASSIGN_OR_RETURN(Decision resolved, ResolveBackend(flags, topology));
  return Negotiate(resolved, capture, environment);
}

absl::StatusOr<Decision> Consensus(const std::vector<RankReport>& reports) {
  if (reports.empty()) return absl::InvalidArgumentError("consensus needs at least one rank");
  const int n = static_cast<int>(reports.size());
  std::vector<const RankReport*> by_rank(n, nullptr);
  for (const RankReport& r : reports) {
    if (r.rank < 0 || r.rank >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", r.rank, " is outside 0..", n - 1, " (", n, " reports)"));
    }
    if (by_rank[r.rank] != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", r.rank, " reported twice"));
    }
    by_rank[r.rank] = &r;
  }

  const RankReport& ref = *by_rank[0];
  const FusionFlags ref_flags = MigrateFlags(ref.flags).flags;
  std::vector<std::string> disagreements;
  for (int rank = 0; rank < n; ++rank) {
    const RankReport& r = *by_rank[rank];
    const std::string who = absl::StrCat("rank ", rank, ": ");
    if (!r.failure.empty()) disagreements.push_back(who + r.failure);
    if (!r.decision && r.failure.empty()) disagreements.push_back(who + "reported no decision");
    if (rank == 0) continue;
    if (r.topology.sm != ref.topology.sm) {
      disagreements.push_back(absl::StrCat(who, "sm ", r.topology.sm, " differs from rank 0's sm ",
                                           ref.topology.sm, " (mixed architectures)"));
    }
    if (r.topology.tp != ref.topology.tp || r.topology.nnodes != ref.topology.nnodes) {
      disagreements.push_back(absl::StrCat(who, "tp=", r.topology.tp, " nnodes=", r.topology.nnodes,
                                           " differ from rank 0's tp=", ref.topology.tp,
                                           " nnodes=", ref.topology.nnodes));
    }
    // Compared after migration: the deprecated flag and "auto" are the same request.
    const FusionFlags flags = MigrateFlags(r.flags).flags;
    if (flags != ref_flags) {
      disagreements.push_back(absl::StrCat(who, "fusion flags (", FlagsText(flags),
                                           ") differ from rank 0's (", FlagsText(ref_flags), ")"));
    }
    if (r.decision && ref.decision &&
        (r.decision->backend != ref.decision->backend ||
         r.decision->fusion_enabled != ref.decision->fusion_enabled)) {
      disagreements.push_back(absl::StrCat(who, "decided ", FusedText(*r.decision),
                                           " but rank 0 decided ", FusedText(*ref.decision)));
    }
  }

  if (disagreements.empty()) return *ref.decision;

  Decision d;
  if (ref.decision) {
    d.cuda_graph_mode = ref.decision->cuda_graph_mode;
    d.warnings = ref.decision->warnings;
  }
  d.reasons.push_back(
      absl::StrCat("fusion off on every rank: ", disagreements.size() == 1 ? "a rank" : "ranks",
                   " failed or disagreed; the unfused path runs"));
  for (std::string& reason : disagreements) d.reasons.push_back(std::move(reason));
  return d;
}

// ---- Encoding. ----

namespace {

constexpr char kReportVersion[] = "arfuse-rank-report-v1";

void Line(std::string& out, const std::string& key, const std::string& value) {
  absl::StrAppend(&out, key, "=", absl::CEscape(value), "\n");
}

const char* BoolText(bool b) { return b ? "true" : "false"; }

}  // namespace

std::string EncodeRankReport(const RankReport& r) {
  std::string out = absl::StrCat(kReportVersion, "\n");
  Line(out, "rank", absl::StrCat(r.rank));
  Line(out, "sm", absl::StrCat(r.topology.sm));
  Line(out, "tp", absl::StrCat(r.topology.tp));
  Line(out, "nnodes", absl::StrCat(r.topology.nnodes));
  if (r.flags.backend) Line(out, "flags.backend", *r.flags.backend);
  Line(out, "flags.enable_deprecated", BoolText(r.flags.enable_deprecated));
  Line(out, "flags.enforce_disable", BoolText(r.flags.enforce_disable));
  Line(out, "flags.deterministic", BoolText(r.flags.deterministic));
  if (!r.failure.empty()) Line(out, "failure", r.failure);
  if (r.decision) {
    const Decision& d = *r.decision;
    Line(out, "decision.backend", d.backend);
    Line(out, "decision.fusion_enabled", BoolText(d.fusion_enabled));
    Line(out, "decision.cuda_graph_mode", CudaGraphModeName(d.cuda_graph_mode));
    Line(out, "decision.data_plane", DataPlaneName(d.data_plane));
    for (const std::string& w : d.warnings) Line(out, "decision.warning", w);
    for (const std::string& w : d.reasons) Line(out, "decision.reason", w);
  }
  return out;
}

absl::StatusOr<RankReport> DecodeRankReport(const std::string& text) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  if (lines.empty() || lines[0] != kReportVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank report does not start with ", kReportVersion));
  }
  RankReport r;
  std::set<std::string> seen;
  auto bad = [](const std::string& key, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("rank report field ", key, ": ", why));
  };
  auto number = [&](const std::string& key, const std::string& v, int* out) -> absl::Status {
    if (!absl::SimpleAtoi(v, out)) return bad(key, "not an integer");
    return absl::OkStatus();
  };
  auto boolean = [&](const std::string& key, const std::string& v, bool* out) -> absl::Status {
    if (v == "true")
      *out = true;
    else if (v == "false")
      *out = false;
    else
      return bad(key, "not true or false");
    return absl::OkStatus();
  };
  auto decision = [&]() -> Decision& {
    if (!r.decision) r.decision.emplace();
    return *r.decision;
  };
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t eq = lines[i].find('=');
    if (eq == std::string::npos) return bad(absl::StrCat("line ", i + 1), "no '='");
    const std::string key = lines[i].substr(0, eq);
    std::string value;
    if (!absl::CUnescape(lines[i].substr(eq + 1), &value)) return bad(key, "bad escape");
    const bool repeatable = key == "decision.warning" || key == "decision.reason";
    if (!repeatable && !seen.insert(key).second) return bad(key, "given twice");
    if (key == "rank") {
      ARFUSE_RETURN_IF_ERROR(number(key, value, &r.rank));
    } else if (key == "sm") {
      ARFUSE_RETURN_IF_ERROR(number(key, value, &r.topology.sm));
    } else if (key == "tp") {
      ARFUSE_RETURN_IF_ERROR(number(key, value, &r.topology.tp));
    } else if (key == "nnodes") {
      ARFUSE_RETURN_IF_ERROR(number(key, value, &r.topology.nnodes));
    } else if (key == "flags.backend") {
      r.flags.backend = value;
    } else if (key == "flags.enable_deprecated") {
      ARFUSE_RETURN_IF_ERROR(boolean(key, value, &r.flags.enable_deprecated));
    } else if (key == "flags.enforce_disable") {
      ARFUSE_RETURN_IF_ERROR(boolean(key, value, &r.flags.enforce_disable));
    } else if (key == "flags.deterministic") {
      ARFUSE_RETURN_IF_ERROR(boolean(key, value, &r.flags.deterministic));
    } else if (key == "failure") {
      r.failure = value;
    } else if (key == "decision.backend") {
      if (value != kBackendNone && value != kBackendTrtllm && value != kBackendMnnvl) {
        return bad(key, absl::StrCat("unknown backend ", Quoted(value)));
      }
      decision().backend = value;
    } else if (key == "decision.fusion_enabled") {
      ARFUSE_RETURN_IF_ERROR(boolean(key, value, &decision().fusion_enabled));
    } else if (key == "decision.cuda_graph_mode") {
      absl::StatusOr<CudaGraphMode> mode = ParseCudaGraphMode(value);
      if (!mode.ok()) return bad(key, std::string(mode.status().message()));
      decision().cuda_graph_mode = *mode;
    } else if (key == "decision.data_plane") {
      if (value == "eager")
        decision().data_plane = DataPlane::kEager;
      else if (value == "doorbell")
        decision().data_plane = DataPlane::kDoorbell;
      else if (value == "instream")
        decision().data_plane = DataPlane::kInStream;
      else
        return bad(key, absl::StrCat("unknown data plane ", Quoted(value)));
    } else if (key == "decision.warning") {
      decision().warnings.push_back(value);
    } else if (key == "decision.reason") {
      decision().reasons.push_back(value);
    } else {
      return bad(key, "unknown field");
    }
  }
  for (const char* required : {"rank", "sm", "tp", "nnodes"}) {
    if (!seen.count(required)) return bad(required, "missing");
  }
  return r;
}

// ---- JSON. ----

namespace {

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string JsonList(const std::vector<std::string>& items) {
  std::vector<std::string> quoted;
  quoted.reserve(items.size());
  for (const std::string& s : items) quoted.push_back(JsonString(s));
  return absl::StrCat("[", absl::StrJoin(quoted, ","), "]");
}

}  // namespace

std::string DecisionToJson(const Decision& d) {
  return absl::StrCat("{\"backend\":", JsonString(d.backend),
                      ",\"fusion_enabled\":", d.fusion_enabled ? "true" : "false",
                      ",\"cuda_graph_mode\":", JsonString(CudaGraphModeName(d.cuda_graph_mode)),
                      ",\"data_plane\":", JsonString(DataPlaneName(d.data_plane)),
                      ",\"warnings\":", JsonList(d.warnings), ",\"reasons\":", JsonList(d.reasons),
                      "}");
}

}  // namespace arfuse::config
