// The op contract of the fused path, in one place: the hidden-size and capacity limits, the GPU
// workspace's layout and its sizing formula, the fused kernels' launch parameters (FusionParams),
// what fits a workspace (Fits), the op rules every station checks (CheckOp) and the one function
// that fills FusionParams for a launch. Each station that admits or launches an op (the
// registry's validation, the host and CUDA engines, the doorbell plane, CheckFusionParams, the
// CPU reference, libarfuse_client's op rules and launch) calls these, so the planes agree on what
// they accept by construction. docs/kernels.md ("The op contract") lists the rules.
//
// No CUDA, no protobuf, no abseil (statuses are kernels/common/plain_status.h's): libarfuse_client
// and the CPU implementation include this header on machines without the toolkit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/op_types.h"
#include "kernels/common/plain_status.h"
#include "kernels/contract/device_errors.h"
#include "kernels/quant/fp8_format.h"

namespace arfuse {

// ---- Limits -------------------------------------------------------------------------------

// Elements per 16-byte vector of the narrowest dtype: hidden must be a positive multiple of this.
inline constexpr int kHiddenMultiple = 8;
// Whether `hidden` is a positive multiple of kHiddenMultiple (the hidden rule of every station).
inline constexpr bool IsHiddenAligned(uint64_t hidden) {
  return hidden != 0 && hidden % kHiddenMultiple == 0;
}

// Largest grid any fused kernel uses; the two-shot barrier has one slot per block.
inline constexpr int kMaxFusionBlocks = 1024;
// Largest hidden the fused kernels accept, per dtype: 1024 threads x 8 vectors of 16 bytes per row.
inline constexpr uint32_t MaxFusionHidden(DType t) { return 1024u * 8u * (16u / DTypeSize(t)); }
// Whether the fused kernels take rows of `hidden` elements of `t`.
inline constexpr bool IsFusionHidden(uint64_t hidden, DType t) {
  return IsHiddenAligned(hidden) && hidden <= MaxFusionHidden(t);
}

inline constexpr bool IsFusionDType(DType t) {
  return t == DType::kBF16 || t == DType::kFP16 || t == DType::kFP32;
}

enum class FusionAlgo : uint8_t { kOneShot = 1, kTwoShot = 2 };

// ---- The GPU workspace's layout -------------------------------------------------------------

inline constexpr uint64_t kWorkspaceSectionAlign = 256;
inline constexpr uint64_t kWorkspaceTotalAlign = 2ull << 20;  // the VMM granularity
inline constexpr uint64_t kMaxWorkspaceBytes = 1ull << 47;
// sizeof(FusionControl) (kernels/allreduce_fusion/fusion_control.h, which needs CUDA and
// static_asserts that it is this): a 256-byte head, the two-shot barrier (a 32-bit slot per block
// and rank), four 32-byte op descriptors per rank and the in-stream launch counters
// (instream::InStreamOpTable, kernels/instream/op_counters.h: a 64-bit count per attachment slot,
// pattern and token bucket).
inline constexpr uint64_t kInStreamOpTableBytes = 4096;
inline constexpr uint64_t kFusionControlBytes =
    256 + uint64_t{kMaxFusionBlocks} * kMaxWorldSize * 4 + 4 * uint64_t{kMaxWorldSize} * 32 +
    kInStreamOpTableBytes;

// Byte offsets inside one rank's workspace. All offsets are multiples of 256 (16-byte vector
// access and cache-line friendly); total_bytes is a multiple of 2 MiB (the VMM granularity).
//
// Sizing rule (per rank), with E = DTypeSize(dtype), N = world_size, T = max_tokens, H = hidden:
//   control        = sizeof(FusionControl)   error/abort words, counters, two-shot barrier slots
//   lamport        = 3 x N x T x H x E       three rotating one-shot buffers, one slot per rank
//   twoshot_scatter= N x ceil(T/N) x H x E   reduce-scatter inbox: a slice row from every rank
//   twoshot_gather = T x H x E               all-gather inbox: every reduced row
//   total          = round_up(sum of the above, each rounded up to 256, 2 MiB)
// Example: N=8, T=2048, H=8192, bf16 -> lamport 768 MiB, scatter 32 MiB, gather 32 MiB.
struct WorkspaceLayout {
  uint64_t control_offset;
  uint64_t lamport_offset;
  uint64_t lamport_buffer_bytes;  // one of the three buffers: N slots
  uint64_t lamport_slot_bytes;    // one rank's slot: T x H x E
  uint64_t scatter_offset;
  uint64_t scatter_slot_bytes;  // one rank's slot: ceil(T/N) x H x E
  uint64_t gather_offset;
  uint64_t total_bytes;
  uint32_t max_tokens;
  uint32_t hidden;  // the hidden size the workspace was sized for; ops may use any hidden <= it
                    // as long as num_tokens x hidden <= max_tokens x this hidden
  int32_t world_size;
  DType dtype;  // the sentinel pattern depends on it: ops must use this dtype
  uint8_t reserved[3];
};
static_assert(sizeof(WorkspaceLayout) == 80, "WorkspaceLayout is copied into kernel params");
static_assert(offsetof(WorkspaceLayout, max_tokens) == 64);
static_assert(offsetof(WorkspaceLayout, dtype) == 76);

namespace contract_internal {
inline constexpr uint64_t RoundUp(uint64_t v, uint64_t m) { return (v + m - 1) / m * m; }
}  // namespace contract_internal

// The layout for a workspace, or a zero total_bytes when the arguments are unsupported (world
// size not in {2,4,8,16}, hidden not a positive multiple of 8 or above MaxFusionHidden, zero
// tokens, or a size above 2^47 bytes). `why` (optional) receives a static message then.
inline WorkspaceLayout ComputeWorkspaceLayout(int world_size, uint32_t max_tokens, uint32_t hidden,
                                              DType dtype, const char** why = nullptr) {
  using contract_internal::RoundUp;
  const char* problem = nullptr;
  if (!IsSupportedWorldSize(world_size)) {
    problem = "world size is not 2, 4, 8 or 16";
  } else if (!IsFusionDType(dtype)) {
    problem = "dtype is not bf16, fp16 or fp32";
  } else if (!IsHiddenAligned(hidden)) {
    problem = "hidden is not a positive multiple of 8";
  } else if (hidden > MaxFusionHidden(dtype)) {
    problem = "hidden is above the largest row the fused kernels take";
  } else if (max_tokens == 0) {
    problem = "max_tokens is zero";
  }
  if (problem != nullptr) {
    if (why != nullptr) *why = problem;
    return WorkspaceLayout{};
  }
  WorkspaceLayout layout{};
  const uint64_t n = static_cast<uint64_t>(world_size);
  const uint64_t row_bytes = static_cast<uint64_t>(hidden) * DTypeSize(dtype);
  const uint64_t slice_rows = (max_tokens + n - 1) / n;
  layout.control_offset = 0;
  layout.lamport_offset = RoundUp(kFusionControlBytes, kWorkspaceSectionAlign);
  layout.lamport_slot_bytes = RoundUp(max_tokens * row_bytes, kWorkspaceSectionAlign);
  layout.lamport_buffer_bytes = n * layout.lamport_slot_bytes;
  layout.scatter_offset = layout.lamport_offset + 3 * layout.lamport_buffer_bytes;
  layout.scatter_slot_bytes = RoundUp(slice_rows * row_bytes, kWorkspaceSectionAlign);
  layout.gather_offset = layout.scatter_offset + n * layout.scatter_slot_bytes;
  const uint64_t end =
      layout.gather_offset + RoundUp(max_tokens * row_bytes, kWorkspaceSectionAlign);
  layout.total_bytes = RoundUp(end, kWorkspaceTotalAlign);
  layout.max_tokens = max_tokens;
  layout.hidden = hidden;
  layout.world_size = world_size;
  layout.dtype = dtype;
  if (layout.total_bytes > kMaxWorkspaceBytes) {
    if (why != nullptr) *why = "workspace would exceed 2^47 bytes";
    return WorkspaceLayout{};
  }
  if (why != nullptr) *why = nullptr;
  return layout;
}

// ---- The fused kernels' launch parameters ---------------------------------------------------

// Everything one rank's launch needs. Plain data, copied by value into the kernel parameters.
struct FusionParams {
  // Base pointer of every rank's workspace, mapped in this process (unicast), indexed by rank;
  // peer_workspace[rank] is this rank's own workspace. Entries >= world_size are ignored.
  void* peer_workspace[kMaxWorldSize];
  const void* input;        // [num_tokens, hidden] this rank's contribution
  void* output;             // kAllReduce: [num_tokens, hidden] the sum
  const void* residual_in;  // kAllReduceResidualRmsNorm: [num_tokens, hidden]
  void* residual_out;       // kAllReduceResidualRmsNorm: pre-norm sum; may equal residual_in
  void* norm_out;           // kAllReduceResidualRmsNorm: [num_tokens, hidden]
  const void* gamma;        // kAllReduceResidualRmsNorm: [hidden]
  // Optional (may be null): a word the host can set at any time to make every spin exit with
  // kHostAbort, e.g. cudaHostAlloc(cudaHostAllocMapped) memory's device pointer.
  const uint32_t* host_abort;
  // Optional (may be null): host-mapped word the kernel also writes its error code into, so the
  // host sees a failure without a copy.
  uint32_t* host_error;
  uint64_t
      spin_timeout_ns;     // each spin's budget, measured from the spin's first poll (%globaltimer)
  WorkspaceLayout layout;  // ComputeWorkspaceLayout(...) of the workspaces (same on all ranks)
  uint32_t num_tokens;     // may be 0: nothing is launched
  uint32_t hidden;
  float eps;
  int32_t rank;
  int32_t world_size;
  // SMs the launcher may assume are free for this kernel; 0 = the device's SM count. Must be the
  // same on every rank. Tests that run all ranks on one GPU set it to SMs / world_size so that the
  // spinning grids of every simulated rank are co-resident.
  uint32_t sm_budget;
  DType dtype;
  Pattern pattern;
  FusionAlgo algo;
  uint8_t scale_layout;  // kAllReduceResidualRmsNormFp8PerGroup: a fp8::GroupScaleLayout value
  uint8_t reserved[4];
  // The FP8 patterns (FusedOpArgs::quant_out, ::scale): [num_tokens, hidden] E4M3 codes, and the
  // static scale (one fp32, read) or the per-token / per-group scales (written).
  void* quant_out;
  void* scale;
};
static_assert(sizeof(FusionParams) == 328, "FusionParams layout is part of the kernel ABI");
static_assert(offsetof(FusionParams, input) == 128);
static_assert(offsetof(FusionParams, spin_timeout_ns) == 192);
static_assert(offsetof(FusionParams, layout) == 200);
static_assert(offsetof(FusionParams, num_tokens) == 280);
static_assert(offsetof(FusionParams, dtype) == 304);
static_assert(offsetof(FusionParams, quant_out) == 312);

// Where a launch runs, besides the op: what differs between the sidecar's own launches
// (server/cuda_device/fusion_workspace.cc) and an in-stream client's
// (client/instream/cuda_plane.cc).
struct FusionLaunchSite {
  void* const* peer_workspace = nullptr;  // world_size entries, indexed by rank
  int32_t rank = 0;
  int32_t world_size = 0;
  WorkspaceLayout layout{};
  uint64_t spin_timeout_ns = 0;
  uint32_t sm_budget = 0;
  const uint32_t* host_abort = nullptr;  // may be null
  uint32_t* host_error = nullptr;        // may be null
};

// The one filling of FusionParams: the op's tensors and shape, the site's workspaces and knobs.
// Checks nothing (CheckFusionParams does, before a launch).
inline FusionParams MakeFusionParams(const FusedOpArgs& op, FusionAlgo algo,
                                     const FusionLaunchSite& site) {
  FusionParams p = {};
  for (int32_t r = 0; r < site.world_size && r < kMaxWorldSize; ++r) {
    p.peer_workspace[r] = site.peer_workspace[r];
  }
  p.input = op.input;
  p.output = op.output;
  p.residual_in = op.residual_in;
  p.residual_out = op.residual_out;
  p.norm_out = op.norm_out;
  p.gamma = op.gamma;
  p.host_abort = site.host_abort;
  p.host_error = site.host_error;
  p.spin_timeout_ns = site.spin_timeout_ns;
  p.layout = site.layout;
  p.num_tokens = op.num_tokens;
  p.hidden = op.hidden;
  p.eps = op.eps;
  p.rank = site.rank;
  p.world_size = site.world_size;
  p.sm_budget = site.sm_budget;
  p.dtype = op.dtype;
  p.pattern = op.pattern;
  p.algo = algo;
  p.scale_layout = op.scale_layout;
  p.quant_out = op.quant_out;
  p.scale = op.scale;
  return p;
}

// ---- Op rules -------------------------------------------------------------------------------

namespace contract {

// The part of an op the rules read.
struct OpShape {
  DType dtype = DType::kBF16;
  uint32_t hidden = 0;
  uint32_t num_tokens = 0;
  Pattern pattern = Pattern::kAllReduceResidualRmsNorm;
  uint8_t scale_layout = 0;  // the per-group FP8 pattern's
};

inline OpShape ShapeOf(const FusedOpArgs& op) {
  return OpShape{op.dtype, op.hidden, op.num_tokens, op.pattern, op.scale_layout};
}

// Bytes of an FP8 pattern's scale tensor at op.num_tokens: one fp32 (static, read), one per token,
// or the per-group layout's tensor (written); 0 for the unquantized patterns. Assumes CheckPattern
// passed (a per-group op has hidden % 128 == 0 and a valid layout).
inline constexpr uint64_t ScaleBytes(const OpShape& op) {
  switch (TraitsOf(op.pattern).quant) {
    case QuantKind::kStatic:
      return 4;
    case QuantKind::kPerToken:
      return uint64_t{op.num_tokens} * 4;
    case QuantKind::kPerGroup:
      return fp8::GroupScaleBytes(static_cast<fp8::GroupScaleLayout>(op.scale_layout),
                                  op.num_tokens, op.hidden / fp8::kGroupSize);
    case QuantKind::kNone:
      break;
  }
  return 0;
}

// What a workspace serves (--max-tokens, --hidden, --dtype): ops with hidden <= `hidden` and
// tokens x hidden <= max_tokens x hidden, of `dtype`. byte_slot: a host-mode workspace, whose
// slot holds max_tokens x hidden elements of `dtype` as bytes, so an op of any dtype fits when
// its bytes do.
struct WorkspaceCapacity {
  uint32_t max_tokens = 0;
  uint32_t hidden = 0;
  DType dtype = DType::kBF16;
  bool byte_slot = false;
};

inline constexpr uint64_t CapacityElements(const WorkspaceCapacity& w) {
  return uint64_t{w.max_tokens} * w.hidden;
}
inline constexpr uint64_t CapacityBytes(const WorkspaceCapacity& w) {
  return CapacityElements(w) * DTypeSize(w.dtype);
}
inline WorkspaceCapacity CapacityOf(const WorkspaceLayout& l) {
  return WorkspaceCapacity{l.max_tokens, l.hidden, l.dtype, false};
}

// Who answers, which decides the status code and the wording of a refusal (each keeps what its
// callers and tests read):
//   kEngine   the sidecar's engines and planes: INVALID_ARGUMENT for every rule;
//   kRegistry the sidecar's validation of a plan (server/registry/validation.h): INVALID_ARGUMENT
//             for the hidden rule, OUT_OF_RANGE "fusion unavailable for this op: ..." naming the
//             flags for what the workspace cannot serve;
//   kClient   libarfuse_client's dispatch: OUT_OF_RANGE "fusion unavailable for this op: ..." for
//             every rule (the caller runs its own path).
enum class OpVoice : uint8_t { kEngine, kRegistry, kClient };

// The rule an op broke (kNone: it passed).
enum class OpRule : uint8_t {
  kNone = 0,
  kDType = 1,                 // another dtype than the workspace's (not for a byte slot)
  kHidden = 2,                // hidden not a positive multiple of kHiddenMultiple
  kHiddenAboveWorkspace = 3,  // hidden above the workspace's hidden
  kCapacity = 4,              // tokens x hidden above max_tokens x hidden (bytes: a byte slot)
  kPattern = 5,               // not a pattern, or an FP8 pattern's own rule (CheckPattern)
};

inline constexpr char kUnavailablePrefix[] = "fusion unavailable for this op: ";

// "hidden 12 is not a positive multiple of 8": the hidden rule's text where a station describes
// a malformed value (the attach blob, the CPU reference, the client's dispatch).
inline std::string HiddenNotAligned(uint64_t hidden) {
  return plain::StrCat("hidden ", hidden, " is not a positive multiple of ", kHiddenMultiple);
}

// The hidden rule alone (for stations that see no workspace, e.g. the registry's shape check).
inline plain::Status CheckHidden(uint32_t hidden, OpVoice voice) {
  if (IsHiddenAligned(hidden)) return plain::OkStatus();
  if (voice == OpVoice::kClient) {
    return plain::OutOfRangeError(plain::StrCat(kUnavailablePrefix, HiddenNotAligned(hidden)));
  }
  return plain::InvalidArgumentError(
      plain::StrCat("hidden ", hidden, " must be a positive multiple of ", kHiddenMultiple));
}

// The rules a pattern adds, without a workspace: a Pattern value; the FP8 patterns take bf16 or
// fp16 input; the per-group pattern needs hidden a multiple of the group (128) and a scale
// layout of fp8::GroupScaleLayout. INVALID_ARGUMENT (kEngine, kRegistry) or OUT_OF_RANGE
// "fusion unavailable for this op: ..." (kClient).
inline plain::Status CheckPattern(const OpShape& op, OpVoice voice) {
  const PatternTraits traits = TraitsOf(op.pattern);
  auto refuse = [voice](std::string text) {
    return voice == OpVoice::kClient
               ? plain::OutOfRangeError(plain::StrCat(kUnavailablePrefix, text))
               : plain::InvalidArgumentError(text);
  };
  if (!traits.valid) {
    return refuse(
        plain::StrCat("pattern ", static_cast<int>(op.pattern), " is not 1 to ", kMaxPattern));
  }
  if (traits.quant == QuantKind::kNone) return plain::OkStatus();
  if (op.dtype != DType::kBF16 && op.dtype != DType::kFP16) {
    return refuse(plain::StrCat("pattern ", PatternName(op.pattern),
                                " takes bf16 or fp16 input, not ", DTypeName(op.dtype)));
  }
  if (traits.quant == QuantKind::kPerGroup) {
    if (op.hidden % fp8::kGroupSize != 0) {
      return refuse(plain::StrCat("pattern ", PatternName(op.pattern), ": hidden ", op.hidden,
                                  " is not a multiple of the group size ", fp8::kGroupSize));
    }
    if (!fp8::IsGroupScaleLayout(static_cast<fp8::GroupScaleLayout>(op.scale_layout))) {
      return refuse(plain::StrCat("pattern ", PatternName(op.pattern), ": scale layout ",
                                  static_cast<int>(op.scale_layout),
                                  " is not 1 (fp32 row-major), 2 (fp32 MN-major) or 3 "
                                  "(UE8M0 packed)"));
    }
  }
  return plain::OkStatus();
}

// Every op rule against a workspace's capacity, in this order: the pattern (CheckPattern), dtype,
// hidden, hidden above the workspace's, tokens x hidden. OK or the first broken rule's status in
// `voice`'s code and words; `broken` (optional) receives the rule. num_tokens may be 0 (it fits).
inline plain::Status CheckOp(const OpShape& op, const WorkspaceCapacity& w, OpVoice voice,
                             OpRule* broken = nullptr) {
  OpRule unused;
  OpRule& rule = broken != nullptr ? *broken : unused;
  auto refuse = [voice](std::string text) {
    return voice == OpVoice::kEngine
               ? plain::InvalidArgumentError(text)
               : plain::OutOfRangeError(plain::StrCat(kUnavailablePrefix, text));
  };
  rule = OpRule::kPattern;
  if (plain::Status s = CheckPattern(op, voice); !s.ok()) return s;
  rule = OpRule::kDType;
  if (!w.byte_slot && op.dtype != w.dtype) {
    switch (voice) {
      case OpVoice::kEngine:
        return refuse(plain::StrCat("dtype ", DTypeName(op.dtype),
                                    " does not match the workspace's dtype ", DTypeName(w.dtype)));
      case OpVoice::kRegistry:
        return refuse(plain::StrCat("dtype ", DTypeName(op.dtype), " is not the workspace's ",
                                    DTypeName(w.dtype), " (--dtype)"));
      case OpVoice::kClient:
        return refuse(plain::StrCat("dtype ", DTypeName(op.dtype), " differs from the workspace's ",
                                    DTypeName(w.dtype)));
    }
  }
  rule = OpRule::kHidden;
  if (plain::Status s = CheckHidden(op.hidden, voice); !s.ok()) return s;
  rule = OpRule::kHiddenAboveWorkspace;
  if (op.hidden > w.hidden) {
    switch (voice) {
      case OpVoice::kEngine:
        return refuse(plain::StrCat("hidden ", op.hidden, " exceeds the workspace's max_hidden ",
                                    w.hidden, " (the op does not fit the workspace)"));
      case OpVoice::kRegistry:
        return refuse(plain::StrCat("hidden ", op.hidden, " exceeds the workspace's hidden ",
                                    w.hidden, " (--hidden)"));
      case OpVoice::kClient:
        return refuse(plain::StrCat("hidden ", op.hidden, " exceeds the workspace's ", w.hidden));
    }
  }
  rule = OpRule::kCapacity;
  const uint64_t elems = uint64_t{op.num_tokens} * op.hidden;
  if (w.byte_slot) {
    const uint64_t bytes = elems * DTypeSize(op.dtype);
    if (bytes > CapacityBytes(w)) {
      return refuse(plain::StrCat(
          "op of ", op.num_tokens, " tokens x ", op.hidden, " hidden ", DTypeName(op.dtype), " (",
          bytes, " bytes) exceeds the workspace slot of ", CapacityBytes(w), " bytes (max_tokens ",
          w.max_tokens, " x max_hidden ", w.hidden, " ", DTypeName(w.dtype), ")"));
    }
  } else if (elems > CapacityElements(w)) {
    switch (voice) {
      case OpVoice::kEngine:
        return refuse(plain::StrCat("op of ", op.num_tokens, " tokens x ", op.hidden,
                                    " hidden does not fit the workspace (", w.max_tokens,
                                    " tokens x ", w.hidden, " hidden)"));
      case OpVoice::kRegistry:
        return refuse(plain::StrCat(op.num_tokens, " tokens x hidden ", op.hidden,
                                    " exceed the workspace's ", w.max_tokens, " tokens x hidden ",
                                    w.hidden, " (--max-tokens, --hidden)"));
      case OpVoice::kClient:
        return refuse(plain::StrCat(op.num_tokens, " tokens x ", op.hidden,
                                    " hidden exceeds the workspace's ", w.max_tokens, " tokens x ",
                                    w.hidden));
    }
  }
  rule = OpRule::kNone;
  return plain::OkStatus();
}

// ---- What fits a GPU workspace's buffers ----------------------------------------------------

// Whether an op's rows fit the layout's buffers for both algorithms: tokens x hidden elements in
// a one-shot slot, and the two-shot slice (ceil(tokens / world_size) rows) in a scatter slot.
// The buffers are rounded up to 256 bytes, so this may hold a little beyond the capacity rule;
// CheckOp is what the stations answer, Fits what the kernels need.
inline bool Fits(const WorkspaceLayout& l, const OpShape& op) {
  if (l.world_size <= 0) return false;
  const uint64_t row = uint64_t{op.hidden} * DTypeSize(op.dtype);
  const uint64_t n = static_cast<uint64_t>(l.world_size);
  const uint64_t slice = (uint64_t{op.num_tokens} + n - 1) / n;
  return uint64_t{op.num_tokens} * row <= l.lamport_slot_bytes &&
         slice * row <= l.scatter_slot_bytes;
}

// The largest token count with `hidden` (of the layout's dtype) that Fits the layout: 0 when not
// even one row does.
inline uint32_t MaxTokensThatFit(const WorkspaceLayout& l, uint32_t hidden) {
  const uint64_t row = uint64_t{hidden} * DTypeSize(l.dtype);
  if (row == 0 || l.world_size <= 0) return 0;
  const uint64_t lamport = l.lamport_slot_bytes / row;
  const uint64_t twoshot = l.scatter_slot_bytes / row * static_cast<uint64_t>(l.world_size);
  uint64_t fit = lamport < twoshot ? lamport : twoshot;
  return static_cast<uint32_t>(fit < 0xffffffffu ? fit : 0xffffffffu);
}

// Fits as a refusal: OUT_OF_RANGE "fusion unavailable for this op: ..." naming the buffer the op
// does not fit (libarfuse_client's dispatch on CUDA).
inline plain::Status CheckFits(const WorkspaceLayout& l, const OpShape& op) {
  const uint64_t row = uint64_t{op.hidden} * DTypeSize(op.dtype);
  const uint64_t world = l.world_size > 0 ? static_cast<uint64_t>(l.world_size) : 1;
  const uint64_t slice = (uint64_t{op.num_tokens} + world - 1) / world;
  if (uint64_t{op.num_tokens} * row > l.lamport_slot_bytes) {
    return plain::OutOfRangeError(plain::StrCat(
        kUnavailablePrefix, op.num_tokens, " tokens x ", op.hidden, " hidden (",
        uint64_t{op.num_tokens} * row, " bytes) exceed the workspace's one-shot slot of ",
        l.lamport_slot_bytes, " bytes"));
  }
  if (slice * row > l.scatter_slot_bytes) {
    return plain::OutOfRangeError(plain::StrCat(
        kUnavailablePrefix, "the two-shot slice of ", slice, " tokens x ", op.hidden,
        " hidden exceeds the workspace's scatter slot of ", l.scatter_slot_bytes, " bytes"));
  }
  return plain::OkStatus();
}

}  // namespace contract
}  // namespace arfuse
