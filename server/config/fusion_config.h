// The config rules (design.md §4, issue 3): deprecated-flag migration, backend resolution,
// feasibility, capture-mode negotiation and the cross-rank consensus. Plain structs and pure,
// deterministic functions: no gRPC, no CUDA, no protobuf. Every rank runs the same code on the
// same inputs and must reach the same answer, so nothing here reads the clock, the environment
// or the GPU.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace arfuse::config {

// Requested backend values (the flag's choices) and resolved backend names.
// Bounds of an SM version (major * 10 + minor) that catch typos ("9" for 90, "1000") without
// rejecting future architectures; the daemon's --sm and the config rules use both.
inline constexpr int kMinSm = 10;
inline constexpr int kMaxSm = 999;

inline constexpr char kBackendAuto[] = "auto";
inline constexpr char kBackendTrtllm[] = "trtllm";
inline constexpr char kBackendMnnvl[] = "mnnvl";
inline constexpr char kBackendNone[] = "none";

// The flag spellings, as the serving frameworks use them; messages name them verbatim.
inline constexpr char kFlagBackend[] = "--flashinfer-allreduce-fusion-backend";
inline constexpr char kFlagDeprecatedEnable[] = "--enable-flashinfer-allreduce-fusion";
inline constexpr char kFlagEnforceDisable[] = "--enforce-disable-flashinfer-allreduce-fusion";
inline constexpr char kFlagDeterministic[] = "--enable-deterministic-inference";
inline constexpr char kFlagMnnvlCaptureSafe[] = "--mnnvl-capture-safe";

struct FusionFlags {
  // --flashinfer-allreduce-fusion-backend: "auto", "trtllm" or "mnnvl"; unset means off
  // (subject to auto-enable).
  std::optional<std::string> backend;
  // --enable-flashinfer-allreduce-fusion (deprecated).
  bool enable_deprecated = false;
  // --enforce-disable-flashinfer-allreduce-fusion.
  bool enforce_disable = false;
  // --enable-deterministic-inference.
  bool deterministic = false;

  bool operator==(const FusionFlags&) const = default;
};

struct Topology {
  // Compute capability as major*10 + minor: 90 (H100/H200), 100 (B200), 103 (B300), 120, ...
  int sm = 0;
  // Tensor-parallel size: ranks in the group.
  int tp = 0;
  int nnodes = 0;

  bool operator==(const Topology&) const = default;
};

enum class CudaGraphMode { kNone, kPiecewise, kFull };
enum class DataPlane { kEager, kDoorbell, kInStream };

struct CaptureRequest {
  CudaGraphMode mode = CudaGraphMode::kNone;
  // Whether the client wants the fused op inside its CUDA graphs.
  bool fused_op_in_graph = false;
  // Ops override for older builds; unset means ours are capture-safe (bitwise sentinel checks).
  std::optional<bool> mnnvl_capture_safe;
  // The client can load the sidecar's kernels (libarfuse_client): the in-stream plane.
  bool client_loads_kernels = false;
  // Fused-op call sites the client will plan; 0 = not said.
  uint32_t call_sites = 0;

  bool operator==(const CaptureRequest&) const = default;
};

struct Decision {
  // "trtllm", "mnnvl" or "none". Feasibility never renames it (trtllm across nodes stays
  // "trtllm" with fusion_enabled false); the consensus turns a disagreeing group to "none".
  std::string backend = kBackendNone;
  bool fusion_enabled = false;
  // The CUDA-graph mode the client may use (filled by Negotiate).
  CudaGraphMode cuda_graph_mode = CudaGraphMode::kNone;
  DataPlane data_plane = DataPlane::kEager;
  std::vector<std::string> warnings;
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
};

// ---- Names and parsing (INVALID_ARGUMENT with a message naming the flag and the bad value). ----

const char* CudaGraphModeName(CudaGraphMode mode);  // "none", "piecewise", "full"
const char* DataPlaneName(DataPlane plane);         // "eager", "doorbell", "instream"
absl::StatusOr<CudaGraphMode> ParseCudaGraphMode(const std::string& text);
// "auto", "trtllm" or "mnnvl", exactly (the frameworks' choices are case-sensitive).
absl::StatusOr<std::string> ParseBackendFlag(const std::string& text);
// Compute capability as <major><minor> digits ("90", "100", "103").
absl::StatusOr<int> ParseSm(const std::string& text);
// A decimal integer >= 1; `flag` names it in the message ("--tp").
absl::StatusOr<int> ParsePositiveInt(const std::string& flag, const std::string& text);
// "true"/"false" (also "1"/"0").
absl::StatusOr<bool> ParseBool(const std::string& flag, const std::string& text);

absl::Status ValidateTopology(const Topology& topology);
absl::Status ValidateFlags(const FusionFlags& flags);

// The fusion flags of a command line, as the serving frameworks spell them (hyphenated; abseil
// flags cannot). ExtractFusionArgs removes them from `args` and leaves every other argument, in
// order, for the program's own parser (arfused runs it before absl::ParseCommandLine). Accepts
// "--flag value" and "--flag=value" for valued flags, "--switch" and "--switch=true|false" for
// switches; stops at "--". INVALID_ARGUMENT naming the flag for a bad or missing value or a flag
// given twice.
struct FusionArgs {
  FusionFlags flags;
  // --mnnvl-capture-safe[=true|false]: the ops override; unset means ours are capture-safe.
  std::optional<bool> mnnvl_capture_safe;
};
absl::StatusOr<FusionArgs> ExtractFusionArgs(std::vector<std::string>& args);

// ---- The rules. ----

// True for the SM100 family (compute capability 10.x: SM100, SM103).
bool IsSm100Family(int sm);
// Where our mnnvl backend is supported: the SM100 family, or SM90 within one node.
bool MnnvlSupported(int sm, int nnodes);

struct MigratedFlags {
  FusionFlags flags;
  std::vector<std::string> warnings;
};

// Rule 1 (and the enforce-disable override), applied to flags alone: the deprecated flag maps to
// "auto" only when the backend is unset, and is always cleared; enforce-disable clears the
// backend. Idempotent: migrating migrated flags changes nothing and warns nothing. arfused applies
// this to its own flags at startup and logs the warnings.
MigratedFlags MigrateFlags(const FusionFlags& flags);

// Migration, resolution of the backend name, auto-enable, deterministic/enforce-disable, and
// feasibility. The result's cuda_graph_mode/data_plane are the defaults until Negotiate fills
// them. INVALID_ARGUMENT for an invalid topology or backend value.
absl::StatusOr<Decision> ResolveBackend(const FusionFlags& flags, const Topology& topology);

// Capture-mode negotiation for a resolved decision (appends reasons and warnings).
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

// One decision for the whole group: rank 0's when every rank has the same migrated flags, the
// same topology and the same backend/fusion_enabled and none failed; otherwise backend "none",
// fusion off, with a "rank N: ..." reason for every rank that differs from rank 0 or failed.
// Mode and data plane are rank 0's; callers negotiate again for a client. INVALID_ARGUMENT when
// the reports are not exactly ranks 0..n-1, once each.
absl::StatusOr<Decision> Consensus(const std::vector<RankReport>& reports);

// A RankReport as text, for Exchange::Allgather payloads (one "key=value" line per field, values
// C-escaped). Decode returns INVALID_ARGUMENT for malformed or unknown-version input.
std::string EncodeRankReport(const RankReport& report);
absl::StatusOr<RankReport> DecodeRankReport(const std::string& text);

// One JSON object: backend, fusion_enabled, cuda_graph_mode, data_plane, warnings, reasons.
std::string DecisionToJson(const Decision& decision);

}  // namespace arfuse::config
