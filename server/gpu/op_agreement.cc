#include "server/gpu/op_agreement.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "server/peers/exchange.h"

namespace arfuse {
namespace {

// Version byte first: a key from a sidecar of another encoding never compares equal by accident.
constexpr char kEncodingVersion = 1;
constexpr size_t kEncodedBytes = 1 + 4 + 4 + 1 + 1 + 4 + 1;

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t GetU32(const std::string& in, size_t at) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<uint32_t>(static_cast<uint8_t>(in[at + i])) << (8 * i);
  return v;
}

bool DecodeUnfusedOp(const std::string& in, UnfusedOpKey* key) {
  if (in.size() != kEncodedBytes || in[0] != kEncodingVersion) return false;
  key->num_tokens = GetU32(in, 1);
  key->hidden = GetU32(in, 5);
  key->dtype = static_cast<DType>(static_cast<uint8_t>(in[9]));
  key->pattern = static_cast<Pattern>(static_cast<uint8_t>(in[10]));
  const uint32_t eps_bits = GetU32(in, 11);
  std::memcpy(&key->eps, &eps_bits, sizeof(eps_bits));
  key->symmetric = in[15] != 0;
  return true;
}

}  // namespace

std::string DescribeUnfusedOp(const UnfusedOpKey& key) {
  return absl::StrCat("tokens=", key.num_tokens, " hidden=", key.hidden,
                      " dtype=", DTypeName(key.dtype), " pattern=", PatternName(key.pattern),
                      " eps=", key.eps, " nccl=", key.symmetric ? "symmetric" : "regular");
}

std::string EncodeUnfusedOp(const UnfusedOpKey& key) {
  static_assert(sizeof(float) == sizeof(uint32_t), "eps travels as its 32 bits");
  std::string out;
  out.reserve(kEncodedBytes);
  out.push_back(kEncodingVersion);
  PutU32(out, key.num_tokens);
  PutU32(out, key.hidden);
  out.push_back(static_cast<char>(key.dtype));
  out.push_back(static_cast<char>(key.pattern));
  uint32_t eps_bits = 0;
  std::memcpy(&eps_bits, &key.eps, sizeof(eps_bits));
  PutU32(out, eps_bits);
  out.push_back(key.symmetric ? 1 : 0);
  return out;
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
