// Every rank alike: the consensus over the ranks' reports, and the reports' text form (the
// payload of the config vote's Allgather).
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "config/fusion_config.h"
#include "config/internal.h"

namespace arfuse::config {
namespace {

using internal::Quoted;

std::string FusedText(const Decision& d) {
  return absl::StrCat(d.backend, d.fusion_enabled ? " (fused)" : " (unfused)");
}

}  // namespace

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
  d.rules = ref_flags.rules;
  if (ref.decision) {
    d.prefill = ref.decision->prefill;
    d.decode = ref.decision->decode;
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

constexpr char kReportVersion[] = "arfuse-rank-report-v2";
// Reports of the previous version carry no rule set, architecture, DP attention, MoE all-to-all
// backend, notices, per-phase capture or batch limit: those take their defaults.
constexpr char kReportVersionV1[] = "arfuse-rank-report-v1";

void Line(std::string& out, const std::string& key, const std::string& value) {
  absl::StrAppend(&out, key, "=", absl::CEscape(value), "\n");
}

const char* BoolText(bool b) { return b ? "true" : "false"; }

// The fusion flags' keys: flags.<FusionFlags member>.
constexpr char kFlagsPrefix[] = "flags.";

const FusionFlagSpec* FlagOfKey(const std::string& key) {
  if (key.rfind(kFlagsPrefix, 0) != 0) return nullptr;
  const std::string field = key.substr(sizeof(kFlagsPrefix) - 1);
  for (const FusionFlagSpec& spec : FusionFlagTable()) {
    if (spec.field == field) return &spec;
  }
  return nullptr;
}

absl::StatusOr<DataPlane> ParseDataPlane(const std::string& text) {
  if (text == "eager") return DataPlane::kEager;
  if (text == "doorbell") return DataPlane::kDoorbell;
  if (text == "instream") return DataPlane::kInStream;
  return absl::InvalidArgumentError(absl::StrCat("unknown data plane ", Quoted(text)));
}

}  // namespace

std::string EncodeRankReport(const RankReport& r) {
  std::string out = absl::StrCat(kReportVersion, "\n");
  Line(out, "rank", absl::StrCat(r.rank));
  Line(out, "sm", absl::StrCat(r.topology.sm));
  Line(out, "tp", absl::StrCat(r.topology.tp));
  Line(out, "nnodes", absl::StrCat(r.topology.nnodes));
  // One line per fusion flag that has a value, named after its FusionFlags member.
  for (const FusionFlagSpec& spec : FusionFlagTable()) {
    if (std::optional<std::string> text = spec.Get(r.flags)) {
      Line(out, absl::StrCat(kFlagsPrefix, spec.field), *text);
    }
  }
  if (!r.failure.empty()) Line(out, "failure", r.failure);
  if (r.decision) {
    const Decision& d = *r.decision;
    Line(out, "decision.backend", d.backend);
    Line(out, "decision.fusion_enabled", BoolText(d.fusion_enabled));
    Line(out, "decision.rules", RuleSetName(d.rules));
    Line(out, "decision.max_tokens_per_batch", absl::StrCat(d.max_tokens_per_batch));
    Line(out, "decision.prefill_cuda_graph_mode", CudaGraphModeName(d.prefill.mode));
    Line(out, "decision.prefill_data_plane", DataPlaneName(d.prefill.data_plane));
    Line(out, "decision.decode_cuda_graph_mode", CudaGraphModeName(d.decode.mode));
    Line(out, "decision.decode_data_plane", DataPlaneName(d.decode.data_plane));
    Line(out, "decision.cuda_graph_mode", CudaGraphModeName(d.cuda_graph_mode));
    Line(out, "decision.data_plane", DataPlaneName(d.data_plane));
    for (const std::string& w : d.warnings) Line(out, "decision.warning", w);
    for (const std::string& w : d.notices) Line(out, "decision.notice", w);
    for (const std::string& w : d.reasons) Line(out, "decision.reason", w);
  }
  return out;
}

absl::StatusOr<RankReport> DecodeRankReport(const std::string& text) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  if (lines.empty() || (lines[0] != kReportVersion && lines[0] != kReportVersionV1)) {
    return absl::InvalidArgumentError(absl::StrCat("rank report does not start with ",
                                                   kReportVersion, " (or ", kReportVersionV1, ")"));
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
  // Parses with one of the library's parsers, reporting its message under the field's name.
  auto parsed = [&](const std::string& key, auto result, auto* out) -> absl::Status {
    if (!result.ok()) return bad(key, std::string(result.status().message()));
    *out = *std::move(result);
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
    const bool repeatable =
        key == "decision.warning" || key == "decision.reason" || key == "decision.notice";
    if (!repeatable && !seen.insert(key).second) return bad(key, "given twice");
    if (key == "rank") {
      ARFUSE_RETURN_IF_ERROR(number(key, value, &r.rank));
    } else if (key == "sm") {
      ARFUSE_RETURN_IF_ERROR(number(key, value, &r.topology.sm));
    } else if (key == "tp") {
      ARFUSE_RETURN_IF_ERROR(number(key, value, &r.topology.tp));
    } else if (key == "nnodes") {
      ARFUSE_RETURN_IF_ERROR(number(key, value, &r.topology.nnodes));
    } else if (const FusionFlagSpec* spec = FlagOfKey(key)) {
      if (spec->kind == FusionFlagKind::kSwitch) {
        bool on = false;
        ARFUSE_RETURN_IF_ERROR(boolean(key, value, &on));
        ARFUSE_RETURN_IF_ERROR(spec->Assign(r.flags, on ? "true" : "false"));
      } else if (absl::Status st = spec->Set(r.flags, value); !st.ok()) {
        return bad(key, std::string(st.message()));
      }
    } else if (key == "failure") {
      r.failure = value;
    } else if (key == "decision.backend") {
      if (value != kBackendNone && value != kBackendTrtllm && value != kBackendMnnvl) {
        return bad(key, absl::StrCat("unknown backend ", Quoted(value)));
      }
      decision().backend = value;
    } else if (key == "decision.fusion_enabled") {
      ARFUSE_RETURN_IF_ERROR(boolean(key, value, &decision().fusion_enabled));
    } else if (key == "decision.rules") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseRuleSet(value), &decision().rules));
    } else if (key == "decision.max_tokens_per_batch") {
      if (!absl::SimpleAtoi(value, &decision().max_tokens_per_batch)) {
        return bad(key, "not an unsigned integer");
      }
    } else if (key == "decision.cuda_graph_mode") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseCudaGraphMode(value), &decision().cuda_graph_mode));
    } else if (key == "decision.prefill_cuda_graph_mode") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseCudaGraphMode(value), &decision().prefill.mode));
    } else if (key == "decision.decode_cuda_graph_mode") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseCudaGraphMode(value), &decision().decode.mode));
    } else if (key == "decision.data_plane") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseDataPlane(value), &decision().data_plane));
    } else if (key == "decision.prefill_data_plane") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseDataPlane(value), &decision().prefill.data_plane));
    } else if (key == "decision.decode_data_plane") {
      ARFUSE_RETURN_IF_ERROR(parsed(key, ParseDataPlane(value), &decision().decode.data_plane));
    } else if (key == "decision.warning") {
      decision().warnings.push_back(value);
    } else if (key == "decision.notice") {
      decision().notices.push_back(value);
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

}  // namespace arfuse::config
