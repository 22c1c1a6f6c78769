// Validation rules for regions and ops (docs/api.md; every rule's negative test:
// tests/registry/validation_test.cc). Pure functions over the plain types of types.h: no state, no
// I/O, never open anything, so unit tests and fuzzers call them freely. Messages name the field and
// the numbers the client sent, never handles, pointers or the names and paths of memory objects
// (Triton's CVE-2025-23319 chain started from an echoed shm key).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/registry/types.h"

namespace arfuse {

// Region name: 1..limits.max_name_bytes printable ASCII.
absl::Status ValidateRegionName(const std::string& name, const RegistryLimits& limits);

// POSIX shm object name: "/" then 1..250 of [A-Za-z0-9._-], no further "/".
absl::Status ValidateShmName(const std::string& shm_name);

// Everything that can be checked before opening the memory: name, byte_size > 0, a memory
// variant matching what this sidecar serves, a 64-byte non-zero handle for `our_device`, a
// claimed descriptor or a well-formed shm name for host memory.
absl::Status ValidateRegionSpec(const RegionSpec& spec, MemoryKind served, int32_t our_device,
                                const RegistryLimits& limits);

// The requested byte_size must fit in the real allocation (the opener measures it).
absl::Status CheckRegionSize(uint64_t byte_size, uint64_t allocation_size);

// tokens * hidden * dtype size, or INVALID_ARGUMENT if that overflows 64 bits.
absl::StatusOr<uint64_t> TensorBytes(DType dtype, uint64_t tokens, uint64_t hidden);

// A tensor of `bytes` at `offset` inside a region of `region_size` bytes: 16-byte aligned offset,
// no 64-bit overflow of offset + bytes, and the end within the region.
absl::Status CheckTensorRange(absl::string_view role, uint64_t offset, uint64_t bytes,
                              uint64_t region_size);

// Pattern and dtype known, hidden > 0 and a multiple of 8, 0 < max_tokens <= limits, eps finite
// and >= 0, and every tensor the pattern needs present.
absl::StatusOr<OpShape> ValidateOpShape(const OpRequest& op, const RegistryLimits& limits);

// An op the workspace cannot serve, though well formed: OUT_OF_RANGE with a message starting
// "fusion unavailable for this op: " and the reason (a dtype other than the workspace's, hidden
// above the workspace's, or `tokens` x hidden beyond its max_tokens x hidden). Clients treat
// OUT_OF_RANGE as "fusion unavailable, run your own path". Call after ValidateOpShape.
absl::Status CheckOpFitsWorkspace(const OpShape& shape, uint64_t tokens,
                                  const WorkspaceCapacity& workspace);

// 0 < num_tokens <= max_tokens.
absl::Status CheckNumTokens(uint32_t num_tokens, uint32_t max_tokens);

// FAILED_PRECONDITION "stale generation" when `sent` is not `current`; INVALID_ARGUMENT when the
// client sent none (0 is never issued). `what` names the object in the message.
absl::Status CheckGeneration(absl::string_view what, uint64_t sent, uint64_t current);
// The same check with the name made by `what()` only when it fails: the per-op paths check a
// generation for every tensor of every op and would otherwise format a name each time.
template <typename NameFn>
absl::Status CheckGeneration(uint64_t sent, uint64_t current, NameFn&& what) {
  if (sent != 0 && sent == current) return absl::OkStatus();
  return CheckGeneration(what(), sent, current);
}

// The tensors of one op, by role. Outputs may alias an input only where the op allows it
// (output == input for ALLREDUCE, residual_out == residual_in), and then exactly. The FP8
// patterns' scale counts as an output whether the pattern writes it or (static) reads it: it may
// overlap nothing.
enum class TensorRole : uint8_t {
  kInput,
  kOutput,
  kResidualIn,
  kResidualOut,
  kNormOut,
  kGamma,
  kQuantOut,
  kScale,
};
inline constexpr int kNumTensorRoles = 8;
const char* TensorRoleName(TensorRole role);
bool IsOutputRole(TensorRole role);
// The roles a pattern needs, in a fixed order.
std::vector<TensorRole> RolesFor(Pattern pattern);
// The roles a pattern takes when the client sends them (the FP8 patterns' norm_out).
std::vector<TensorRole> OptionalRolesFor(Pattern pattern);
const TensorRef& RefFor(const OpRequest& op, TensorRole role);
// Bytes of the tensor of `role` for `tokens` tokens (gamma is [hidden] whatever the tokens).
absl::StatusOr<uint64_t> RoleBytes(const OpShape& shape, TensorRole role, uint64_t tokens);

// One resolved tensor placement: which region, where, how many bytes.
struct Placement {
  TensorRole role;
  uint64_t region_id;
  uint64_t offset;
  uint64_t bytes;
};
// INVALID_ARGUMENT when an output overlaps another tensor of the op other than by an allowed
// exact alias: a kernel writing while another role reads the same bytes gives wrong results.
absl::Status CheckNoForbiddenOverlap(Pattern pattern, const std::vector<Placement>& placements);

}  // namespace arfuse
