// The op rules of libarfuse_client, checked on the host before anything is launched: whether the
// attachment can fuse an op of this shape (the dispatch: OUT_OF_RANGE "fusion unavailable for
// this op: ..." when it cannot, so the caller runs its own path) and whether the tensors are
// usable (INVALID_ARGUMENT). The same answer on every rank for the same arguments.
#pragma once

#include "client/instream/blob_reader.h"
#include "client/instream/plane.h"
#include "kernels/common/plain_status.h"
#include "kernels/contract/op_contract.h"
#include "kernels/instream/op_counters.h"

namespace arfuse::instream::lib {

// The algorithm and entry for the op's pattern, tokens, hidden, dtype (and the per-group FP8
// pattern's scale layout, which CheckEnums checked): OUT_OF_RANGE "fusion unavailable for this
// op: ..." for what the attachment cannot fuse, the pattern's own rules first
// (contract::CheckPattern: an FP8 pattern of fp32, a per-group hidden that is not a multiple of
// 128). tokens may be 0 (nothing would run, and it fits). On failure `*why` (when not null) is
// the reason the op counter page counts it under (a pattern rule counts as kShape).
plain::StatusOr<Dispatch> DispatchOp(const ParsedBlob& blob, const Plane& plane,
                                     const contract::OpShape& op, DeclineReason* why = nullptr);

// INVALID_ARGUMENT when a tensor is NULL or misaligned (16 bytes; an FP8 scale 4), an output
// overlaps another tensor (residual_out may equal residual_in, output may equal input) or eps
// is not finite and non-negative (the norm patterns). The FP8 patterns' norm_out may be NULL;
// quant_out is tokens x hidden bytes, the scale one fp32 (static, read), tokens fp32 (per token)
// or fp8::GroupScaleBytes of the layout (per group), both written but the static scale. Needs
// tokens > 0.
plain::Status CheckTensors(const OpRequest& op);

// INVALID_ARGUMENT unless pattern is 1 to 5 and dtype 1, 2 or 3 (the C ABI's plain ints).
plain::Status CheckEnums(int pattern, int dtype);

// INVALID_ARGUMENT unless quant is ARFUSE_QUANT_FP8_* (1 static, 2 per token, 3 per group) and
// scale_layout is ARFUSE_SCALE_* (1..3) for per group, 0 otherwise. The pattern of `quant`.
plain::StatusOr<Pattern> Fp8PatternOf(int quant, int scale_layout);

}  // namespace arfuse::instream::lib
