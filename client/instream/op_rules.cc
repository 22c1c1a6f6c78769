#include "client/instream/op_rules.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace arfuse::instream::lib {
namespace {

plain::Status Unavailable(std::string_view why) {
  return plain::OutOfRangeError(plain::StrCat("fusion unavailable for this op: ", why));
}

const char* AlgoName(uint8_t algo) { return algo == kAlgoOneShot ? "one-shot" : "two-shot"; }

// A tensor's extent [begin, end) in the address space.
struct Extent {
  const char* name;
  uintptr_t begin;
  uintptr_t end;
};

bool Overlap(const Extent& a, const Extent& b) { return a.begin < b.end && b.begin < a.end; }

}  // namespace

plain::Status CheckEnums(int pattern, int dtype) {
  if (pattern < 1 || pattern > kMaxPattern) {
    return plain::InvalidArgumentError(plain::StrCat(
        "pattern ", pattern,
        " is not 1 (allreduce), 2 (allreduce + residual + RMSNorm) or 3 to 5 (the same with "
        "FP8 output: static, per-token, per-group scales)"));
  }
  if (dtype < 0 || !IsKnownDType(static_cast<uint32_t>(dtype))) {
    return plain::InvalidArgumentError(plain::StrCat(
        "dtype ", dtype,
        " is not ARFUSE_DTYPE_BF16 (1), ARFUSE_DTYPE_FP16 (2) or ARFUSE_DTYPE_FP32 (3)"));
  }
  return plain::OkStatus();
}

plain::StatusOr<Pattern> Fp8PatternOf(int quant, int scale_layout) {
  Pattern p;
  switch (quant) {
    case 1:
      p = Pattern::kAllReduceResidualRmsNormFp8Static;
      break;
    case 2:
      p = Pattern::kAllReduceResidualRmsNormFp8PerToken;
      break;
    case 3:
      p = Pattern::kAllReduceResidualRmsNormFp8PerGroup;
      break;
    default:
      return plain::InvalidArgumentError(
          plain::StrCat("quant ", quant,
                        " is not ARFUSE_QUANT_FP8_STATIC (1), ARFUSE_QUANT_FP8_PER_TOKEN (2) or "
                        "ARFUSE_QUANT_FP8_PER_GROUP (3)"));
  }
  if (p == Pattern::kAllReduceResidualRmsNormFp8PerGroup) {
    if (scale_layout < 0 || scale_layout > 255 ||
        !fp8::IsGroupScaleLayout(static_cast<fp8::GroupScaleLayout>(scale_layout))) {
      return plain::InvalidArgumentError(plain::StrCat(
          "scale_layout ", scale_layout,
          " is not ARFUSE_SCALE_FP32_ROW_MAJOR (1), ARFUSE_SCALE_FP32_MN_MAJOR (2) or "
          "ARFUSE_SCALE_UE8M0_PACKED (3)"));
    }
  } else if (scale_layout != 0) {
    return plain::InvalidArgumentError(
        plain::StrCat("scale_layout ", scale_layout,
                      " is for ARFUSE_QUANT_FP8_PER_GROUP only: pass 0 with quant ", quant));
  }
  return p;
}

plain::StatusOr<Dispatch> DispatchOp(const ParsedBlob& blob, const Plane& plane,
                                     const contract::OpShape& op, DeclineReason* why) {
  DeclineReason unused;
  DeclineReason& reason = why != nullptr ? *why : unused;
  const AttachHeader& h = blob.header;
  const Pattern pattern = op.pattern;
  const DType dtype = op.dtype;
  const uint32_t tokens = op.num_tokens, hidden = op.hidden;
  contract::OpRule rule = contract::OpRule::kNone;
  if (plain::Status s =
          contract::CheckOp(op, contract::WorkspaceCapacity{h.max_tokens, h.hidden, blob.dtype()},
                            contract::OpVoice::kClient, &rule);
      !s.ok()) {
    reason = rule == contract::OpRule::kDType      ? DeclineReason::kDtype
             : rule == contract::OpRule::kCapacity ? DeclineReason::kCapacity
                                                   : DeclineReason::kShape;
    return s;
  }
  const uint64_t elems = uint64_t{tokens} * hidden;
  reason = DeclineReason::kCapacity;
  if (plain::Status s = plane.CheckCapacity(tokens, hidden, dtype); !s.ok()) return s;
  Dispatch d;
  d.payload = elems * DTypeSize(dtype);
  reason = DeclineReason::kRange;
  if (d.payload > h.twoshot_max_bytes) {
    return Unavailable(plain::StrCat("a payload of ", d.payload,
                                     " bytes is above the fused range (twoshot_max_bytes ",
                                     h.twoshot_max_bytes, "): the framework's path is as fast"));
  }
  d.algo = d.payload <= h.oneshot_max_bytes ? kAlgoOneShot : kAlgoTwoShot;
  bool hidden_attached = false;
  for (size_t i = 0; i < blob.entries.size(); ++i) {
    const KernelEntry& e = blob.entries[i];
    if (e.hidden != hidden) continue;
    hidden_attached = true;
    if (e.pattern == static_cast<uint8_t>(pattern) && e.algo == d.algo &&
        e.dtype == static_cast<uint8_t>(dtype)) {
      d.entry = &e;
      d.entry_index = static_cast<uint32_t>(i);
      return d;
    }
  }
  if (!hidden_attached) {
    reason = DeclineReason::kNotAttached;
    std::vector<uint32_t> attached;
    for (const KernelEntry& e : blob.entries) {
      if (std::find(attached.begin(), attached.end(), e.hidden) == attached.end()) {
        attached.push_back(e.hidden);
      }
    }
    return Unavailable(plain::StrCat("hidden ", hidden, " was not attached (attached: ",
                                     plain::StrJoin(attached, ", "), "): attach with it"));
  }
  reason = DeclineReason::kNoKernel;
  return Unavailable(plain::StrCat("the sidecar has no ", AlgoName(d.algo), " kernel for ",
                                   PatternName(pattern), " ", DTypeName(dtype), " at hidden ",
                                   hidden));
}

plain::Status CheckTensors(const OpRequest& op) {
  const uint64_t bytes = uint64_t{op.num_tokens} * op.hidden * DTypeSize(op.dtype);
  const uint64_t gamma_bytes = uint64_t{op.hidden} * DTypeSize(op.dtype);
  const PatternTraits traits = TraitsOf(op.pattern);
  std::vector<Extent> reads, writes;
  auto add = [&](std::vector<Extent>& to, const void* p, const char* name, uint64_t n,
                 uint64_t align = 16) -> plain::Status {
    if (p == nullptr) return plain::InvalidArgumentError(plain::StrCat(name, " is NULL"));
    const auto begin = reinterpret_cast<uintptr_t>(p);
    if (begin % align != 0) {
      return plain::InvalidArgumentError(plain::StrCat(name, " is not ", align, "-byte aligned"));
    }
    if (n > UINTPTR_MAX - begin) {
      return plain::InvalidArgumentError(
          plain::StrCat(name, "'s ", n, " bytes wrap the address space"));
    }
    to.push_back(Extent{name, begin, static_cast<uintptr_t>(begin + n)});
    return plain::OkStatus();
  };
  plain::Status s;
  if (!traits.norm) {
    if (!(s = add(reads, op.input, "input", bytes)).ok()) return s;
    if (!(s = add(writes, op.output, "output", bytes)).ok()) return s;
    // In place is elementwise: output may be input, but not shifted against it.
    if (writes[0].begin != reads[0].begin && Overlap(writes[0], reads[0])) {
      return plain::InvalidArgumentError("output partially overlaps input (it may only equal it)");
    }
    return plain::OkStatus();
  }
  if (!std::isfinite(op.eps) || op.eps < 0) {
    return plain::InvalidArgumentError(
        plain::StrCat("eps ", op.eps, " must be finite and non-negative"));
  }
  if (!(s = add(reads, op.input, "input", bytes)).ok()) return s;
  if (!(s = add(reads, op.residual_in, "residual_in", bytes)).ok()) return s;
  if (!(s = add(reads, op.gamma, "gamma", gamma_bytes)).ok()) return s;
  if (!(s = add(writes, op.residual_out, "residual_out", bytes)).ok()) return s;
  // The FP8 patterns' norm_out is optional (NULL: only the codes and scales are written).
  if (traits.norm_out_required || op.norm_out != nullptr) {
    if (!(s = add(writes, op.norm_out, "norm_out", bytes)).ok()) return s;
  }
  if (traits.quant != QuantKind::kNone) {
    if (!(s = add(writes, op.quant_out, "quant_out", uint64_t{op.num_tokens} * op.hidden)).ok()) {
      return s;
    }
    // fp32 scales (or UE8M0 words) are read and written as 4-byte values.
    switch (traits.quant) {
      case QuantKind::kStatic:
        s = add(reads, op.scale, "scale", 4, 4);
        break;
      case QuantKind::kPerToken:
        s = add(writes, op.scale, "scale", uint64_t{op.num_tokens} * 4, 4);
        break;
      default:
        s = add(writes, op.scale, "scale",
                fp8::GroupScaleBytes(static_cast<fp8::GroupScaleLayout>(op.scale_layout),
                                     op.num_tokens, op.hidden / fp8::kGroupSize),
                4);
        break;
    }
    if (!s.ok()) return s;
  }
  // No two outputs overlap ("norm_out overlaps residual_out": the later names the earlier).
  for (size_t j = 1; j < writes.size(); ++j) {
    for (size_t i = 0; i < j; ++i) {
      if (Overlap(writes[j], writes[i])) {
        return plain::InvalidArgumentError(
            plain::StrCat(writes[j].name, " overlaps ", writes[i].name));
      }
    }
  }
  const Extent& residual_out = writes[0];
  for (const Extent& out : writes) {
    for (const Extent& in : reads) {
      // residual_out may be residual_in (in place, elementwise), exactly.
      const bool in_place = &out == &residual_out && &in == &reads[1];
      if (in_place && residual_out.begin == in.begin) continue;
      if (Overlap(out, in)) {
        return plain::InvalidArgumentError(plain::StrCat(
            out.name, " overlaps ", in.name, in_place ? " partially (it may only equal it)" : ""));
      }
    }
  }
  return plain::OkStatus();
}

}  // namespace arfuse::instream::lib
