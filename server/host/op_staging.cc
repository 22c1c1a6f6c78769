#include "server/host/op_staging.h"

#include "common/status_macros.h"
#include "kernels/contract/op_contract.h"
#include "server/host/guarded_copy.h"

namespace arfuse {
namespace {

size_t TensorBytesOf(const OpArgs& op) {
  return static_cast<size_t>(op.num_tokens) * op.hidden * DTypeSize(op.dtype);
}

}  // namespace

absl::Status OpStaging::In(const OpArgs& op, OpArgs* staged) {
  const size_t bytes = TensorBytesOf(op);
  out_.resize(bytes);
  if (op.pattern == Pattern::kAllReduce) {
    staged->output = out_.data();
    return absl::OkStatus();
  }
  const size_t gamma_bytes = static_cast<size_t>(op.hidden) * DTypeSize(op.dtype);
  in_.resize(bytes);
  gamma_.resize(gamma_bytes);
  norm_.resize(bytes);
  // The private pointers first: the collective runs on them even when a copy below fails.
  staged->residual_in = in_.data();
  staged->gamma = gamma_.data();
  staged->residual_out = out_.data();
  // An FP8 op without norm_out writes none (the collective skips it).
  staged->norm_out = op.norm_out != nullptr ? norm_.data() : nullptr;
  const QuantKind quant = TraitsOf(op.pattern).quant;
  if (quant != QuantKind::kNone) {
    quant_.resize(static_cast<size_t>(op.num_tokens) * op.hidden);
    scale_.resize(static_cast<size_t>(contract::ScaleBytes(contract::ShapeOf(op))));
    staged->quant_out = quant_.data();
    staged->scale = scale_.data();
  }
  ARFUSE_RETURN_IF_ERROR(GuardedCopy(in_.data(), op.residual_in, bytes, "residual_in"));
  if (quant == QuantKind::kStatic) {
    // The static pattern reads its scale: the one fp32 the client wrote.
    ARFUSE_RETURN_IF_ERROR(GuardedCopy(scale_.data(), op.scale, scale_.size(), "scale"));
  }
  return GuardedCopy(gamma_.data(), op.gamma, gamma_bytes, "gamma");
}

absl::Status OpStaging::Out(const OpArgs& op) const {
  const size_t bytes = TensorBytesOf(op);
  if (op.pattern == Pattern::kAllReduce) {
    return GuardedCopy(op.output, out_.data(), bytes, "output");
  }
  ARFUSE_RETURN_IF_ERROR(GuardedCopy(op.residual_out, out_.data(), bytes, "residual_out"));
  const QuantKind quant = TraitsOf(op.pattern).quant;
  if (quant != QuantKind::kNone) {
    ARFUSE_RETURN_IF_ERROR(GuardedCopy(op.quant_out, quant_.data(), quant_.size(), "quant_out"));
    if (quant != QuantKind::kStatic) {
      ARFUSE_RETURN_IF_ERROR(GuardedCopy(op.scale, scale_.data(), scale_.size(), "scale"));
    }
    if (op.norm_out == nullptr) return absl::OkStatus();
  }
  return GuardedCopy(op.norm_out, norm_.data(), bytes, "norm_out");
}

}  // namespace arfuse
