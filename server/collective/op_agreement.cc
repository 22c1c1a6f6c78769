#include "server/collective/op_agreement.h"

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "server/peers/exchange.h"

namespace arfuse {
namespace {

// The key as the ranks exchange it, copied as bytes (every host we run on is little-endian). The
// version first: a key from a sidecar of another
// encoding never compares equal by accident.
struct WireOpKey {
  uint8_t version;
  uint8_t dtype;
  uint8_t pattern;
  uint8_t symmetric;
  uint32_t num_tokens;
  uint32_t hidden;
  uint32_t eps_bits;  // bit for bit: -0.0 and 0.0 are other ops
  uint8_t scale_layout;
  uint8_t reserved[3];
};
static_assert(std::is_trivially_copyable_v<WireOpKey>);
static_assert(sizeof(WireOpKey) == 20);
static_assert(offsetof(WireOpKey, num_tokens) == 4);
static_assert(offsetof(WireOpKey, eps_bits) == 12);
static_assert(sizeof(float) == sizeof(uint32_t), "eps travels as its 32 bits");
static_assert(std::endian::native == std::endian::little);
// 2: scale_layout joined the key (a version-1 key from an older sidecar is unreadable here).
constexpr uint8_t kWireOpKeyVersion = 2;

bool DecodeUnfusedOp(const std::string& in, UnfusedOpKey* key) {
  WireOpKey w;
  if (in.size() != sizeof(w)) return false;
  std::memcpy(&w, in.data(), sizeof(w));
  if (w.version != kWireOpKeyVersion) return false;
  key->num_tokens = w.num_tokens;
  key->hidden = w.hidden;
  key->dtype = static_cast<DType>(w.dtype);
  key->pattern = static_cast<Pattern>(w.pattern);
  std::memcpy(&key->eps, &w.eps_bits, sizeof(w.eps_bits));
  key->symmetric = w.symmetric != 0;
  key->scale_layout = w.scale_layout;
  return true;
}

}  // namespace

std::string DescribeUnfusedOp(const UnfusedOpKey& key) {
  const std::string layout =
      key.pattern == Pattern::kAllReduceResidualRmsNormFp8PerGroup
          ? absl::StrCat(" scale_layout=", static_cast<int>(key.scale_layout))
          : std::string();
  return absl::StrCat("tokens=", key.num_tokens, " hidden=", key.hidden,
                      " dtype=", DTypeName(key.dtype), " pattern=", PatternName(key.pattern),
                      layout, " eps=", key.eps, " nccl=", key.symmetric ? "symmetric" : "regular");
}

std::string EncodeUnfusedOp(const UnfusedOpKey& key) {
  WireOpKey w = {};
  w.version = kWireOpKeyVersion;
  w.dtype = static_cast<uint8_t>(key.dtype);
  w.pattern = static_cast<uint8_t>(key.pattern);
  w.symmetric = key.symmetric ? 1 : 0;
  w.num_tokens = key.num_tokens;
  w.hidden = key.hidden;
  w.scale_layout = key.scale_layout;
  std::memcpy(&w.eps_bits, &key.eps, sizeof(w.eps_bits));
  return std::string(reinterpret_cast<const char*>(&w), sizeof(w));
}

std::string UnfusedOpTag(uint64_t generation) {
  return absl::StrCat("g", generation, "/unfused.op");
}

absl::Status AgreeOnUnfusedOp(Exchange& exchange, uint64_t generation, const UnfusedOpKey& mine,
                              const AgreementDeadlines& deadlines) {
  const std::string encoded = EncodeUnfusedOp(mine);
  absl::StatusOr<std::vector<std::string>> all = exchange.Allgather(
      UnfusedOpTag(generation), encoded, std::min(deadlines.arrive_by, deadlines.latest));
  if (!all.ok()) {
    return absl::Status(all.status().code(),
                        absl::StrCat("the ranks did not agree on the unfused op (",
                                     DescribeUnfusedOp(mine), "): ", all.status().message()));
  }
  for (size_t r = 0; r < all->size(); ++r) {
    if ((*all)[r] == encoded) continue;
    UnfusedOpKey theirs;
    const std::string their_op = DecodeUnfusedOp((*all)[r], &theirs)
                                     ? DescribeUnfusedOp(theirs)
                                     : std::string("an op this sidecar cannot read");
    return absl::InvalidArgumentError(absl::StrCat(
        "ranks disagree on the op: rank ", exchange.rank(), " runs ", DescribeUnfusedOp(mine),
        ", rank ", r, " runs ", their_op,
        " (two clients racing on one group?); NCCL was called on no rank, no output was written"));
  }
  absl::Status confirmed =
      exchange.Barrier(UnfusedOpTag(generation) + ".go",
                       std::min(absl::Now() + deadlines.confirm_within, deadlines.latest));
  if (!confirmed.ok()) {
    return absl::Status(
        confirmed.code(),
        absl::StrCat("every rank reached the unfused op (", DescribeUnfusedOp(mine),
                     ") but not every rank confirmed it (a peer died or froze after publishing "
                     "its op): ",
                     confirmed.message()));
  }
  return absl::OkStatus();
}

}  // namespace arfuse
