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
  if (pattern != static_cast<int>(Pattern::kAllReduce) &&
      pattern != static_cast<int>(Pattern::kAllReduceResidualRmsNorm)) {
    return plain::InvalidArgumentError(plain::StrCat(
        "pattern ", pattern, " is not 1 (allreduce) or 2 (allreduce + residual + RMSNorm)"));
  }
  if (dtype < 0 || !IsKnownDType(static_cast<uint32_t>(dtype))) {
    return plain::InvalidArgumentError(plain::StrCat(
        "dtype ", dtype,
        " is not ARFUSE_DTYPE_BF16 (1), ARFUSE_DTYPE_FP16 (2) or ARFUSE_DTYPE_FP32 (3)"));
  }
  return plain::OkStatus();
}

plain::StatusOr<Dispatch> DispatchOp(const ParsedBlob& blob, const Plane& plane, Pattern pattern,
                                     uint32_t tokens, uint32_t hidden, DType dtype,
                                     DeclineReason* why) {
  DeclineReason unused;
  DeclineReason& reason = why != nullptr ? *why : unused;
  const AttachHeader& h = blob.header;
  contract::OpRule rule = contract::OpRule::kNone;
  if (plain::Status s =
          contract::CheckOp(contract::OpShape{dtype, hidden, tokens},
                            contract::WorkspaceCapacity{h.max_tokens, h.hidden, blob.dtype()},
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
  std::vector<Extent> reads, writes;
  auto add = [&](std::vector<Extent>& to, const void* p, const char* name,
                 uint64_t n) -> plain::Status {
    if (p == nullptr) return plain::InvalidArgumentError(plain::StrCat(name, " is NULL"));
    const auto begin = reinterpret_cast<uintptr_t>(p);
    if (begin % 16 != 0) {
      return plain::InvalidArgumentError(plain::StrCat(name, " is not 16-byte aligned"));
    }
    if (n > UINTPTR_MAX - begin) {
      return plain::InvalidArgumentError(
          plain::StrCat(name, "'s ", n, " bytes wrap the address space"));
    }
    to.push_back(Extent{name, begin, static_cast<uintptr_t>(begin + n)});
    return plain::OkStatus();
  };
  plain::Status s;
  if (op.pattern == Pattern::kAllReduce) {
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
  if (!(s = add(writes, op.norm_out, "norm_out", bytes)).ok()) return s;
  const Extent& residual_out = writes[0];
  const Extent& norm_out = writes[1];
  if (Overlap(norm_out, residual_out)) {
    return plain::InvalidArgumentError("norm_out overlaps residual_out");
  }
  for (const Extent& in : reads) {
    // residual_out may be residual_in (in place, elementwise), exactly.
    if (&in == &reads[1] && residual_out.begin == in.begin) continue;
    if (Overlap(residual_out, in)) {
      return plain::InvalidArgumentError(
          plain::StrCat("residual_out overlaps ", in.name,
                        &in == &reads[1] ? " partially (it may only equal it)" : ""));
    }
  }
  for (const Extent& in : reads) {
    if (Overlap(norm_out, in)) {
      return plain::InvalidArgumentError(plain::StrCat("norm_out overlaps ", in.name));
    }
  }
  return plain::OkStatus();
}

}  // namespace arfuse::instream::lib
