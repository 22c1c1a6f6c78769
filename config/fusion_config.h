// The config rules (docs/config.md): deprecated-flag migration, auto-enable,
// backend resolution under a named upstream rule set, the serving framework's runtime gate,
// feasibility, per-phase capture-mode negotiation and the cross-rank consensus. Plain structs and
// pure, deterministic functions: no gRPC, no CUDA, no protobuf, no logging. Every rank runs the
// same code on the same inputs and must reach the same answer, so nothing here reads the clock,
// the environment or the GPU. docs/config.md has the table of inputs and outcomes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "config/fusion_flags.h"

namespace arfuse::config {

// Bounds of an SM version (major * 10 + minor) that catch typos ("9" for 90, "1000") without
// rejecting future architectures; the daemon's --sm and the config rules use both.
inline constexpr int kMinSm = 10;
inline constexpr int kMaxSm = 999;

// Upstream's per-batch limit of the fused path: the communicator's runtime gate
// (apply_flashinfer_allreduce_fusion) fuses only batches of 1..FUSE_ALLREDUCE_MAX_BATCH_SIZE
// tokens; larger batches run the framework's own allreduce and norm.
inline constexpr uint32_t kFuseAllreduceMaxBatchSize = 2048;

// The model architectures upstream auto-enables fusion for (hf_config.architectures[0]).
const std::vector<std::string>& AutoEnableArchitectures(RuleSet rules);

struct Topology {
  // Compute capability as major*10 + minor: 90 (H100/H200), 100 (B200), 103 (B300), 120, ...
  int sm = 0;
  // Tensor-parallel size: ranks in the group.
  int tp = 0;
  // Nodes the group spans; at most tp.
  int nnodes = 0;

  bool operator==(const Topology&) const = default;
};

enum class CudaGraphMode { kNone, kPiecewise, kFull };
enum class DataPlane { kEager, kDoorbell, kInStream };

// The serving frameworks capture two kinds of CUDA graphs: piecewise graphs of the prefill/extend
// forward (SGLang's --enable-piecewise-cuda-graph) and graphs of the decode forward.
enum class Phase { kPrefill, kDecode };
const char* PhaseName(Phase phase);  // "prefill", "decode"

struct CaptureRequest {
  // The mode for every phase (the field old clients send).
  CudaGraphMode mode = CudaGraphMode::kNone;
  // Whether the client wants the fused op inside its CUDA graphs.
  bool fused_op_in_graph = false;
  // Ops override for older builds; unset means ours are capture-safe (bitwise sentinel checks).
  std::optional<bool> mnnvl_capture_safe;
  // The client can load the sidecar's kernels (libarfuse_client): the in-stream plane.
  bool client_loads_kernels = false;
  // Fused-op call sites the client will plan; 0 = not said.
  uint32_t call_sites = 0;
  // Per phase; unset: `mode`.
  std::optional<CudaGraphMode> prefill_mode = std::nullopt;
  std::optional<CudaGraphMode> decode_mode = std::nullopt;

  bool operator==(const CaptureRequest&) const = default;
  CudaGraphMode ModeOf(Phase phase) const;
};

struct PhaseCapture {
  CudaGraphMode mode = CudaGraphMode::kNone;
  DataPlane data_plane = DataPlane::kEager;

  bool operator==(const PhaseCapture&) const = default;
};

struct Decision {
  // "trtllm", "mnnvl" or "none". Neither feasibility nor the runtime gate renames it (trtllm
  // across nodes stays "trtllm" with fusion_enabled false, as the frameworks' tests check the
  // name); the consensus turns a disagreeing group to "none".
  std::string backend = kBackendNone;
  bool fusion_enabled = false;
  // The rule set the decision was made under.
  RuleSet rules = kDefaultRuleSet;
  // The largest batch (tokens) the fused path takes; larger batches run the framework's own
  // path. 0 when fusion is off.
  uint32_t max_tokens_per_batch = 0;
  // The CUDA-graph mode and data plane per phase (filled by Negotiate).
  PhaseCapture prefill;
  PhaseCapture decode;
  // For clients that know one mode: the phase with the lower mode (prefill on a tie), so that
  // the answer is safe for every phase.
  CudaGraphMode cuda_graph_mode = CudaGraphMode::kNone;
  DataPlane data_plane = DataPlane::kEager;
  std::vector<std::string> warnings;
  // Lines a framework logs at INFO once per process (upstream's mnnvl-to-trtllm fallback).
  std::vector<std::string> notices;
  std::vector<std::string> reasons;

  bool operator==(const Decision&) const = default;
};

// What the sidecar knows about its own data planes; the CLI and Resolve use the defaults.
struct NegotiationEnvironment {
  // False where the doorbell plane cannot run (host device mode): the fused op is then eager.
  bool doorbell_available = true;
  // Why it is unavailable, for the reason text.
  std::string doorbell_unavailable_reason;
  // Unset: not known (the CLI). False adds a warning when the doorbell plane is chosen.
  std::optional<bool> mps_detected;
  // Doorbell hop measured by the self-test; 0 when not measured.
  double doorbell_hop_us = 0;
  // Slots of the doorbell plane (one per planned call site); 0 = not known.
  uint32_t doorbell_slots = 0;
  // Whether a client that loads kernels can attach (the engine can hand out its workspace).
  bool instream_available = true;
  std::string instream_unavailable_reason;
  // The workspace's capacity in tokens; 0: not known. Caps max_tokens_per_batch.
  uint32_t workspace_max_tokens = 0;
};

// ---- Names and parsing (INVALID_ARGUMENT with a message naming the flag and the bad value). ----

const char* CudaGraphModeName(CudaGraphMode mode);  // "none", "piecewise", "full"
const char* DataPlaneName(DataPlane plane);         // "eager", "doorbell", "instream"
absl::StatusOr<CudaGraphMode> ParseCudaGraphMode(const std::string& text,
                                                 const std::string& flag = "--cuda-graph-mode");
// Compute capability as <major><minor> digits ("90", "100", "103").
absl::StatusOr<int> ParseSm(const std::string& text);
// A decimal integer >= 1; `flag` names it in the message ("--tp").
absl::StatusOr<int> ParsePositiveInt(const std::string& flag, const std::string& text);

// INVALID_ARGUMENT for an sm outside kMinSm..kMaxSm, tp or nnodes below 1, or more nodes than
// ranks (the message names both numbers).
absl::Status ValidateTopology(const Topology& topology);

// ---- The rules. ----

// True for the SM100 family (compute capability 10.x: SM100, SM103): upstream's
// is_sm100_supported().
bool IsSm100Family(int sm);
// Upstream's _mnnvl_supported: the SM100 family, or SM90 within one node.
bool MnnvlSupported(int sm, int nnodes);

struct MigratedFlags {
  FusionFlags flags;
  std::vector<std::string> warnings;
};

// Upstream's _handle_deprecated_args (and the enforce-disable override), applied to flags alone:
// the deprecated flag maps to "auto" with upstream's warning only when the backend is unset (an
// explicit backend wins silently), and is always cleared; enforce-disable clears the backend.
// Idempotent: migrating migrated flags changes nothing and warns nothing. arfused applies this
// to its own flags at startup and logs the warnings.
MigratedFlags MigrateFlags(const FusionFlags& flags);

// Migration, auto-enable, the overrides (enforce-disable, deterministic inference), resolution
// of the backend name under flags.rules, the runtime gate and feasibility. The result's capture
// fields are the defaults until Negotiate fills them. INVALID_ARGUMENT for an invalid topology or
// flag value, and (sglang-29063) for the configurations upstream stops the server for, with
// upstream's ValueError text.
absl::StatusOr<Decision> ResolveBackend(const FusionFlags& flags, const Topology& topology);

// Capture-mode negotiation for a resolved decision, per phase (appends reasons and warnings).
Decision Negotiate(const Decision& resolved, const CaptureRequest& capture,
                   const NegotiationEnvironment& environment = {});

// ResolveBackend followed by Negotiate.
absl::StatusOr<Decision> Resolve(const FusionFlags& flags, const Topology& topology,
                                 const CaptureRequest& capture,
                                 const NegotiationEnvironment& environment = {});

// ---- Every rank alike. ----

// What one rank contributes to the vote: its inputs and its decision, or why it cannot fuse
// (for example its workspace allocation failed).
struct RankReport {
  int rank = 0;
  FusionFlags flags;
  Topology topology;
  std::optional<Decision> decision;
  // Non-empty: this rank cannot fuse, for this reason.
  std::string failure;

  bool operator==(const RankReport&) const = default;
};

// One decision for the group: rank 0's when every rank has the same migrated flags, the same
// topology and the same backend/fusion_enabled and none failed; otherwise backend "none", fusion
// off, with a "rank N: ..." reason for every rank that differs from rank 0 or failed. Capture
// fields are rank 0's; callers negotiate again for a client. INVALID_ARGUMENT when the reports
// are not exactly ranks 0..n-1, once each.
absl::StatusOr<Decision> Consensus(const std::vector<RankReport>& reports);

// A RankReport as text, for Exchange::Allgather payloads (one "key=value" line per field, values
// C-escaped, version line "arfuse-rank-report-v2"). Decode also reads v1 reports (their new
// fields take the defaults) and returns INVALID_ARGUMENT for malformed or unknown input.
std::string EncodeRankReport(const RankReport& report);
absl::StatusOr<RankReport> DecodeRankReport(const std::string& text);

// One JSON object: backend, fusion_enabled, cuda_graph_mode, data_plane (the one-mode answer),
// prefill and decode ({cuda_graph_mode, data_plane}), max_tokens_per_batch, fusion_rules,
// warnings, notices, reasons.
std::string DecisionToJson(const Decision& decision);

}  // namespace arfuse::config
