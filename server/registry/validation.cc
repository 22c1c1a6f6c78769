#include "server/registry/validation.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/common/plain_status_absl.h"

namespace arfuse {
namespace {

bool IsDType(int32_t v) { return v >= 1 && v <= 3; }
bool IsPattern(int32_t v) { return v >= 1 && v <= kMaxPattern; }

bool Overlaps(const Placement& a, const Placement& b) {
  if (a.region_id != b.region_id) return false;
  // Offsets and sizes were bounds-checked against the region, so the ends cannot overflow.
  return a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
}

bool SamePlace(const Placement& a, const Placement& b) {
  return a.region_id == b.region_id && a.offset == b.offset && a.bytes == b.bytes;
}

// The exact aliases an op permits (in-place update), in either order.
bool AliasAllowed(Pattern pattern, TensorRole a, TensorRole b) {
  auto is = [&](TensorRole x, TensorRole y) { return (a == x && b == y) || (a == y && b == x); };
  if (pattern == Pattern::kAllReduce) return is(TensorRole::kInput, TensorRole::kOutput);
  return is(TensorRole::kResidualIn, TensorRole::kResidualOut);
}

}  // namespace

absl::Status ValidateRegionName(const std::string& name, const RegistryLimits& limits) {
  if (name.empty()) return absl::InvalidArgumentError("region name is empty");
  if (name.size() > limits.max_name_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("region name is ", name.size(),
                                                   " bytes; the limit is ", limits.max_name_bytes));
  }
  for (unsigned char c : name) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError("region name must be printable ASCII");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateShmName(const std::string& shm_name) {
  if (shm_name.size() < 2 || shm_name[0] != '/') {
    return absl::InvalidArgumentError(
        "host_shm.shm_name must start with \"/\" and name a POSIX shared-memory object");
  }
  if (shm_name.size() > 251) {
    return absl::InvalidArgumentError("host_shm.shm_name is longer than 251 bytes");
  }
  for (size_t i = 1; i < shm_name.size(); ++i) {
    char c = shm_name[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          "host_shm.shm_name may only contain [A-Za-z0-9._-] after the leading \"/\"");
    }
  }
  if (shm_name == "/." || shm_name == "/..") {
    return absl::InvalidArgumentError("host_shm.shm_name is not an object name");
  }
  return absl::OkStatus();
}

absl::Status ValidateRegionSpec(const RegionSpec& spec, MemoryKind served, int32_t our_device,
                                const RegistryLimits& limits) {
  absl::Status name = ValidateRegionName(spec.name, limits);
  if (!name.ok()) return name;
  if (spec.byte_size == 0) return absl::InvalidArgumentError("byte_size must be > 0");
  if (!spec.kind.has_value()) {
    return absl::InvalidArgumentError("region has no memory: set cuda_ipc, host_fd or host_shm");
  }
  if (*spec.kind != served) {
    return absl::InvalidArgumentError(absl::StrCat(
        "this sidecar serves ", MemoryKindName(served), " regions, not ",
        MemoryKindName(*spec.kind),
        served == MemoryKind::kHostShm ? " (it runs --device=host)" : " (it runs --device=cuda)"));
  }
  if (served == MemoryKind::kHostShm) {
    if (spec.host_fd != nullptr) return absl::OkStatus();
    if (spec.host_by_fd) {
      return absl::InvalidArgumentError("host_fd: the fd ticket was not redeemed");
    }
    return ValidateShmName(spec.shm_name);
  }

  if (spec.cuda_handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc.handle must be exactly ",
                                                   kCudaIpcHandleBytes, " bytes, got ",
                                                   spec.cuda_handle.size()));
  }
  bool all_zero = true;
  for (char c : spec.cuda_handle) all_zero = all_zero && c == 0;
  if (all_zero) {
    return absl::InvalidArgumentError(
        "cuda_ipc.handle is all zero bytes: not a cudaIpcGetMemHandle result");
  }
  if (spec.device_id != our_device) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc.device_id ", spec.device_id,
                                                   " is not this sidecar's device ", our_device));
  }
  return absl::OkStatus();
}

absl::Status CheckRegionSize(uint64_t byte_size, uint64_t allocation_size) {
  if (byte_size > allocation_size) {
    return absl::InvalidArgumentError(absl::StrCat("byte_size ", byte_size,
                                                   " exceeds the exported allocation of ",
                                                   allocation_size, " bytes"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> TensorBytes(DType dtype, uint64_t tokens, uint64_t hidden) {
  uint64_t elems = 0;
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(tokens, hidden, &elems) ||
      __builtin_mul_overflow(elems, static_cast<uint64_t>(DTypeSize(dtype)), &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor of ", tokens, " x ", hidden, " ",
                                                   DTypeName(dtype), " overflows 64 bits"));
  }
  return bytes;
}

absl::Status CheckTensorRange(absl::string_view role, uint64_t offset, uint64_t bytes,
                              uint64_t region_size) {
  if (offset % kTensorAlignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(role, ": offset ", offset, " is not a multiple of ", kTensorAlignment));
  }
  uint64_t end = 0;
  if (__builtin_add_overflow(offset, bytes, &end)) {
    return absl::InvalidArgumentError(
        absl::StrCat(role, ": offset ", offset, " + size ", bytes, " overflows 64 bits"));
  }
  if (end > region_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        role, ": bytes [", offset, ", ", end, ") end past the region's ", region_size, " bytes"));
  }
  return absl::OkStatus();
}

const char* TensorRoleName(TensorRole role) {
  switch (role) {
    case TensorRole::kInput:
      return "input";
    case TensorRole::kOutput:
      return "output";
    case TensorRole::kResidualIn:
      return "residual_in";
    case TensorRole::kResidualOut:
      return "residual_out";
    case TensorRole::kNormOut:
      return "norm_out";
    case TensorRole::kGamma:
      return "gamma";
    case TensorRole::kQuantOut:
      return "quant_out";
    case TensorRole::kScale:
      return "scale";
  }
  return "unknown";
}

bool IsOutputRole(TensorRole role) {
  return role == TensorRole::kOutput || role == TensorRole::kResidualOut ||
         role == TensorRole::kNormOut || role == TensorRole::kQuantOut ||
         role == TensorRole::kScale;
}

// Both lists come from the pattern's traits (kernels/common/op_types.h), the one statement of
// which tensors a pattern reads and writes.
std::vector<TensorRole> RolesFor(Pattern pattern) {
  const PatternTraits traits = TraitsOf(pattern);
  if (!traits.norm) return {TensorRole::kInput, TensorRole::kOutput};
  std::vector<TensorRole> roles = {TensorRole::kInput, TensorRole::kResidualIn,
                                   TensorRole::kResidualOut};
  if (traits.norm_out_required) roles.push_back(TensorRole::kNormOut);
  roles.push_back(TensorRole::kGamma);
  if (traits.quant != QuantKind::kNone) {
    roles.push_back(TensorRole::kQuantOut);
    roles.push_back(TensorRole::kScale);
  }
  return roles;
}

std::vector<TensorRole> OptionalRolesFor(Pattern pattern) {
  const PatternTraits traits = TraitsOf(pattern);
  if (traits.norm && !traits.norm_out_required) return {TensorRole::kNormOut};
  return {};
}

const TensorRef& RefFor(const OpRequest& op, TensorRole role) {
  switch (role) {
    case TensorRole::kInput:
      return op.input;
    case TensorRole::kOutput:
      return op.output;
    case TensorRole::kResidualIn:
      return op.residual_in;
    case TensorRole::kResidualOut:
      return op.residual_out;
    case TensorRole::kNormOut:
      return op.norm_out;
    case TensorRole::kGamma:
      return op.gamma;
    case TensorRole::kQuantOut:
      return op.quant_out;
    case TensorRole::kScale:
      return op.scale;
  }
  return op.input;
}

absl::StatusOr<uint64_t> RoleBytes(const OpShape& shape, TensorRole role, uint64_t tokens) {
  if (role == TensorRole::kQuantOut) {
    // One E4M3 byte per element; tokens x hidden fits 64 bits (both are 32-bit limited).
    return tokens * shape.hidden;
  }
  if (role == TensorRole::kScale) {
    if (TraitsOf(shape.pattern).quant == QuantKind::kNone) {
      return absl::InvalidArgumentError(
          absl::StrCat("pattern ", PatternName(shape.pattern), " has no scale"));
    }
    return contract::ScaleBytes(contract::OpShape{shape.dtype, shape.hidden,
                                                  static_cast<uint32_t>(tokens), shape.pattern,
                                                  shape.scale_layout});
  }
  return TensorBytes(shape.dtype, role == TensorRole::kGamma ? 1 : tokens, shape.hidden);
}

absl::StatusOr<OpShape> ValidateOpShape(const OpRequest& op, const RegistryLimits& limits) {
  if (!IsPattern(op.pattern)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pattern ", op.pattern,
        " is not supported (PATTERN_ALLREDUCE=1, PATTERN_ALLREDUCE_RESIDUAL_RMSNORM=2, "
        "PATTERN_ALLREDUCE_RESIDUAL_RMSNORM_FP8_STATIC=3, ..._FP8_PER_TOKEN=4, "
        "..._FP8_PER_GROUP=5)"));
  }
  if (!IsDType(op.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dtype ", op.dtype, " is not supported (DTYPE_BF16=1, DTYPE_FP16=2, DTYPE_FP32=3)"));
  }
  OpShape shape;
  shape.pattern = static_cast<Pattern>(op.pattern);
  shape.dtype = static_cast<DType>(op.dtype);
  if (plain::Status s = contract::CheckHidden(op.hidden, contract::OpVoice::kRegistry); !s.ok()) {
    return ToAbsl(s);
  }
  // Only the per-group pattern reads the layout; a value past a byte is no layout at all.
  const bool grouped = TraitsOf(shape.pattern).quant == QuantKind::kPerGroup;
  if (grouped && (op.scale_layout < 0 || op.scale_layout > 255)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scale_layout ", op.scale_layout,
        " is not 1 (SCALE_LAYOUT_FP32_ROW_MAJOR), 2 (..._FP32_MN_MAJOR) or 3 (..._UE8M0_PACKED)"));
  }
  shape.scale_layout = grouped ? static_cast<uint8_t>(op.scale_layout) : uint8_t{0};
  if (plain::Status s = contract::CheckPattern(
          contract::OpShape{shape.dtype, op.hidden, 0, shape.pattern, shape.scale_layout},
          contract::OpVoice::kRegistry);
      !s.ok()) {
    return ToAbsl(s);
  }
  if (op.hidden > limits.max_hidden) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden ", op.hidden, " exceeds the limit of ", limits.max_hidden));
  }
  if (op.max_tokens == 0) return absl::InvalidArgumentError("max_tokens must be > 0");
  if (op.max_tokens > limits.max_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens ", op.max_tokens, " exceeds the limit of ", limits.max_tokens));
  }
  shape.hidden = op.hidden;
  shape.max_tokens = op.max_tokens;
  if (op.eps.has_value()) {
    if (!std::isfinite(*op.eps) || *op.eps < 0.0f) {
      return absl::InvalidArgumentError("eps must be finite and >= 0");
    }
    shape.eps = *op.eps;
  }
  for (TensorRole role : RolesFor(shape.pattern)) {
    if (!RefFor(op, role).present) {
      return absl::InvalidArgumentError(absl::StrCat("pattern ", PatternName(shape.pattern),
                                                     " needs ", TensorRoleName(role),
                                                     ", which is missing"));
    }
  }
  return shape;
}

absl::Status CheckOpFitsWorkspace(const OpShape& shape, uint64_t tokens,
                                  const WorkspaceCapacity& workspace) {
  return ToAbsl(
      contract::CheckOp(contract::OpShape{shape.dtype, shape.hidden, static_cast<uint32_t>(tokens),
                                          shape.pattern, shape.scale_layout},
                        workspace, contract::OpVoice::kRegistry));
}

absl::Status CheckNumTokens(uint32_t num_tokens, uint32_t max_tokens) {
  if (num_tokens == 0) return absl::InvalidArgumentError("num_tokens must be > 0");
  if (num_tokens > max_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens ", num_tokens, " exceeds the plan's max_tokens ", max_tokens));
  }
  return absl::OkStatus();
}

absl::Status CheckGeneration(absl::string_view what, uint64_t sent, uint64_t current) {
  if (sent == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": generation is missing (pass the one RegisterRegion/CreatePlan returned)"));
  }
  if (sent != current) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": stale generation (registered again, or the sidecar restarted); register again"));
  }
  return absl::OkStatus();
}

absl::Status CheckNoForbiddenOverlap(Pattern pattern, const std::vector<Placement>& placements) {
  for (size_t i = 0; i < placements.size(); ++i) {
    for (size_t j = i + 1; j < placements.size(); ++j) {
      const Placement& a = placements[i];
      const Placement& b = placements[j];
      if (!IsOutputRole(a.role) && !IsOutputRole(b.role)) continue;  // reads may share bytes
      if (!Overlaps(a, b)) continue;
      if (SamePlace(a, b) && AliasAllowed(pattern, a.role, b.role)) continue;
      return absl::InvalidArgumentError(absl::StrCat(
          TensorRoleName(a.role), " and ", TensorRoleName(b.role), " overlap; only ",
          pattern == Pattern::kAllReduce ? "output == input" : "residual_out == residual_in",
          " may alias, and then exactly"));
    }
  }
  return absl::OkStatus();
}

}  // namespace arfuse
