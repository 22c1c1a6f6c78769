// libFuzzer: the text the sidecars exchange in the config vote (config::DecodeRankReport, an
// Allgather payload from a peer) and the flag-value parsers. Oracles besides ASan/UBSan: a
// report that decodes re-encodes to text that decodes to the same report; the consensus over
// decoded reports never crashes and never enables fusion when a rank reports a failure.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/fusion_config.h"

namespace {

using namespace arfuse::config;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<RankReport> r = DecodeRankReport(text);
  if (r.ok()) {
    absl::StatusOr<RankReport> again = DecodeRankReport(EncodeRankReport(*r));
    Check(again.ok() && *again == *r);
    RankReport r0 = *r, r1 = *r;
    r0.rank = 0;
    r1.rank = 1;
    absl::StatusOr<Decision> group = Consensus({r0, r1});
    if (group.ok() && !r0.failure.empty()) Check(!group->fusion_enabled);
    (void)Consensus({*r});
  }
  // The same bytes as flag values.
  (void)ParseCudaGraphMode(text);
  (void)ParseBackendFlag(text);
  (void)ParseSm(text);
  (void)ParsePositiveInt("--tp", text);
  (void)ParseBool("--x", text);
  // Every fusion flag's value as the command lines set it: what is taken reads back the same.
  for (const FusionFlagSpec& spec : FusionFlagTable()) {
    FusionFlags flags;
    if (!spec.Set(flags, text).ok()) continue;
    FusionFlags again;
    const std::optional<std::string> back = spec.Get(flags);
    Check(!back || (spec.Set(again, *back).ok() && spec.Get(again) == back));
  }
  return 0;
}
