// Which path runs one op: fused one-shot, fused two-shot, or the unfused NCCL path (and there,
// regular or symmetric-window NCCL). Pure logic, no CUDA: one table of byte thresholds per
// (architecture, world size), so it unit-tests in CI and the multi-GPU benchmark can replace the
// published starting points with measured ones (Parse/Serialize).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/common/op_types.h"
#include "server/engine_api/engine.h"

namespace arfuse {

// A forced choice for tests and benchmarks; kAuto uses the table.
enum class ForcedPath : uint8_t { kAuto = 0, kOneShot = 1, kTwoShot = 2, kUnfused = 3 };

// "auto", "oneshot", "twoshot", "unfused"; INVALID_ARGUMENT otherwise.
absl::StatusOr<ForcedPath> ParseForcedPath(absl::string_view name);
const char* ForcedPathName(ForcedPath p);

// Half-open byte range [lo, hi).
struct ByteRange {
  uint64_t lo = 0;
  uint64_t hi = 0;
};

// Thresholds compare against the payload: num_tokens * hidden * dtype size of one rank's input.
struct DispatchEntry {
  int sm = 0;  // compute capability as major*10 + minor: 90, 100, 103
  int world_size = 0;
  // payload <= oneshot_max_bytes runs one-shot (0: never).
  uint64_t oneshot_max_bytes = 0;
  // oneshot_max_bytes < payload <= twoshot_max_bytes runs two-shot (<= oneshot_max: never).
  // Above both, the unfused path runs: a fused path measured slower is never listed.
  uint64_t twoshot_max_bytes = 0;
  // Unfused payloads in these ranges use NCCL symmetric windows, others regular NCCL.
  std::vector<ByteRange> nccl_symmetric;
  // Where the numbers come from (a measurement command or a published source).
  std::string source;
};

class DispatchTable {
 public:
  DispatchTable() = default;

  // The published starting points (reference/anchors-flashinfer-sglang.md §6, anchor-figures.md):
  // SM90 from vLLM's one-shot/fusion gates and our H200 TP2/TP4 runs; SM100 from vLLM's fusion
  // gates and FlashInfer's B200 one-shot heuristic. Every world size the kernels support (2, 4,
  // 8, 16) has a row per family, so a group the config fuses finds thresholds; each entry's
  // source says whether it was measured or carried over (docs/config.md).
  static DispatchTable Published();

  // One entry per line: `sm=90 ws=2 oneshot_max=N twoshot_max=N sym=LO-HI,LO-HI source=TEXT`
  // (bytes; `sym=` may be empty; `source=` takes the rest of the line; `#` starts a comment).
  // INVALID_ARGUMENT naming the line on any error.
  static absl::StatusOr<DispatchTable> Parse(absl::string_view text);
  std::string Serialize() const;

  // INVALID_ARGUMENT for an unsupported world size, a non-positive sm, an empty or reversed
  // range, a two-shot limit below the one-shot limit (other than 0), or a duplicate key.
  absl::Status Add(DispatchEntry entry);

  // Exact (sm, world_size) first, then the family (sm rounded down to a multiple of 10).
  const DispatchEntry* Find(int sm, int world_size) const;

  const std::vector<DispatchEntry>& entries() const { return entries_; }

 private:
  std::vector<DispatchEntry> entries_;
};

struct DispatchRequest {
  int sm = 0;
  int world_size = 1;
  uint32_t num_tokens = 0;
  uint32_t hidden = 0;
  DType dtype = DType::kBF16;
  // What this rank's engine can run now (every rank decides alike: these come from votes).
  bool fused_available = false;
  bool twoshot_available = false;  // kernel constraint, e.g. num_tokens >= world_size
  bool nccl_available = false;
  bool nccl_symmetric_available = false;
  ForcedPath forced = ForcedPath::kAuto;
};

struct DispatchChoice {
  ExecPath path = ExecPath::kUnfused;
  bool nccl_symmetric = false;  // only for kUnfused
  std::string reason;
};

uint64_t PayloadBytes(uint32_t num_tokens, uint32_t hidden, DType dtype);

// FAILED_PRECONDITION when a forced path is unavailable or nothing can run; the message says
// which and why.
absl::StatusOr<DispatchChoice> ChooseExecPath(const DispatchTable& table,
                                              const DispatchRequest& request);

}  // namespace arfuse
