#include "server/collective/dispatch_table.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace arfuse {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * 1024;

std::string Key(int sm, int ws) { return absl::StrCat("sm=", sm, " world_size=", ws); }

bool InRanges(const std::vector<ByteRange>& ranges, uint64_t bytes) {
  for (const ByteRange& r : ranges) {
    if (bytes >= r.lo && bytes < r.hi) return true;
  }
  return false;
}

DispatchChoice Unfused(const DispatchRequest& req, const DispatchEntry* entry, uint64_t bytes,
                       std::string reason) {
  DispatchChoice c;
  c.path = ExecPath::kUnfused;
  c.nccl_symmetric =
      req.nccl_symmetric_available && entry != nullptr && InRanges(entry->nccl_symmetric, bytes);
  c.reason = std::move(reason);
  return c;
}

}  // namespace

absl::StatusOr<ForcedPath> ParseForcedPath(absl::string_view name) {
  if (name == "auto") return ForcedPath::kAuto;
  if (name == "oneshot") return ForcedPath::kOneShot;
  if (name == "twoshot") return ForcedPath::kTwoShot;
  if (name == "unfused") return ForcedPath::kUnfused;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown path \"", name, "\" (expected auto, oneshot, twoshot or unfused)"));
}

const char* ForcedPathName(ForcedPath p) {
  switch (p) {
    case ForcedPath::kAuto:
      return "auto";
    case ForcedPath::kOneShot:
      return "oneshot";
    case ForcedPath::kTwoShot:
      return "twoshot";
    case ForcedPath::kUnfused:
      return "unfused";
  }
  return "unknown";
}

uint64_t PayloadBytes(uint32_t num_tokens, uint32_t hidden, DType dtype) {
  return static_cast<uint64_t>(num_tokens) * hidden * DTypeSize(dtype);
}

DispatchTable DispatchTable::Published() {
  DispatchTable t;
  // NCCL symmetric kernels + add-RMSNorm on 2x and 4x H200 (arfuse-bench kernels,
  // docs/performance.md): faster below 64 KiB and at 1.75-8 MiB, slower elsewhere, at both world
  // sizes; at TP8 only the small-payload win is assumed (anchor-figures.md).
  const std::vector<ByteRange> sym_measured = {{0, 64 * kKiB}, {1536 * kKiB, 8 * kMiB + 1}};
  const std::vector<ByteRange> sym_small = {{0, 16 * kKiB + 1}};
  // SM90 TP2, measured on 2x H200 (docs/performance.md, "2x H200"): our one-shot beats
  // the best unfused path at every shape from 8 KiB to 32 MiB (0.44-0.72x) and the two-shot
  // everywhere, so one-shot up to the largest payload measured and no two-shot range.
  // SM90 TP4, measured on 4x H200 (docs/performance.md, "4x H200"): the one-shot is the
  // fastest path up to 1 MiB (within 0.2 us of NCCL symmetric at 14-16 KiB), the two-shot above
  // it up to 32 MiB (0.78-0.94x the best unfused path; at 1.75 MiB 2% behind NCCL symmetric).
  // TP8: vLLM's SM90 one-shot gate (0.5 MiB) until measured.
  const char* sm90_tp2 =
      "measured: arfuse-bench kernels --world=2, 2x H200 NV18 (docs/performance.md)";
  const char* sm90_tp4 =
      "measured: arfuse-bench kernels --world=4, 4x H200 NV18 (docs/performance.md)";
  const char* sm90 = "published: vLLM SM90 one-shot/fusion gates; H200 TP2 anchor (FlashInfer)";
  static_cast<void>(t.Add({90, 2, 32 * kMiB, 0, sym_measured, sm90_tp2}));
  static_cast<void>(t.Add({90, 4, 1 * kMiB, 32 * kMiB, sym_measured, sm90_tp4}));
  static_cast<void>(t.Add({90, 8, 512 * kKiB, 0, sym_small, sm90}));
  // SM100: vLLM fusion gates {2: 64, 4: 32, 8: 1} MiB; FlashInfer's B200 one-shot heuristic
  // (T*H*2*ws*itemsize / MiB vs {2: 512, 4: 64, 8: 42}) gives the one-shot share of each gate.
  const char* sm100 = "published: vLLM SM100 fusion gates; FlashInfer B200 one-shot heuristic";
  static_cast<void>(t.Add({100, 2, 64 * kMiB, 0, sym_small, sm100}));
  static_cast<void>(t.Add({100, 4, 8 * kMiB, 32 * kMiB, sym_small, sm100}));
  static_cast<void>(t.Add({100, 8, 1 * kMiB, 0, sym_small, sm100}));
  // TP16, the kernels' largest world size (kMaxWorldSize): not measured. A one-shot rank stores
  // its payload into 16 peers and reads 16 slots, so the one-shot share shrinks with the world
  // size: SM90 follows vLLM's SM90 one-shot gates, which quarter from TP4 to TP8 (2 MiB, 0.5
  // MiB), one step further; SM100 halves its TP8 limit. No two-shot range until a measurement
  // shows it beats the unfused path (TP8 lists none either).
  const char* sm90_tp16 =
      "carried over: vLLM SM90 one-shot gates extended from TP8 (quarter per doubling); not "
      "measured";
  const char* sm100_tp16 = "carried over: SM100 TP8 one-shot limit halved; not measured";
  static_cast<void>(t.Add({90, 16, 128 * kKiB, 0, sym_small, sm90_tp16}));
  static_cast<void>(t.Add({100, 16, 512 * kKiB, 0, sym_small, sm100_tp16}));
  return t;
}

absl::Status DispatchTable::Add(DispatchEntry e) {
  if (e.sm <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dispatch entry: sm must be positive, got ", e.sm));
  }
  if (!IsSupportedWorldSize(e.world_size)) {
    return absl::InvalidArgumentError(absl::StrCat("dispatch entry: world size ", e.world_size,
                                                   " is not supported (2, 4, 8 or 16)"));
  }
  if (e.twoshot_max_bytes != 0 && e.twoshot_max_bytes <= e.oneshot_max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dispatch entry ", Key(e.sm, e.world_size), ": twoshot_max (", e.twoshot_max_bytes,
        ") must be 0 or above oneshot_max (", e.oneshot_max_bytes, ")"));
  }
  for (const ByteRange& r : e.nccl_symmetric) {
    if (r.hi <= r.lo) {
      return absl::InvalidArgumentError(absl::StrCat("dispatch entry ", Key(e.sm, e.world_size),
                                                     ": empty or reversed symmetric range ", r.lo,
                                                     "-", r.hi));
    }
  }
  for (const DispatchEntry& existing : entries_) {
    if (existing.sm == e.sm && existing.world_size == e.world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("dispatch entry ", Key(e.sm, e.world_size), " is listed twice"));
    }
  }
  entries_.push_back(std::move(e));
  return absl::OkStatus();
}

const DispatchEntry* DispatchTable::Find(int sm, int world_size) const {
  for (const DispatchEntry& e : entries_) {
    if (e.sm == sm && e.world_size == world_size) return &e;
  }
  const int family = sm / 10 * 10;
  for (const DispatchEntry& e : entries_) {
    if (e.sm == family && e.world_size == world_size) return &e;
  }
  return nullptr;
}

absl::StatusOr<DispatchTable> DispatchTable::Parse(absl::string_view text) {
  DispatchTable table;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    const size_t hash = line.find('#');
    if (hash != absl::string_view::npos) line = line.substr(0, hash);
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("dispatch table line ", line_no, ": ", why));
    };
    DispatchEntry e;
    bool have_sm = false, have_ws = false, have_one = false, have_two = false;
    absl::string_view rest = line;
    while (!rest.empty()) {
      rest = absl::StripLeadingAsciiWhitespace(rest);
      if (absl::ConsumePrefix(&rest, "source=")) {
        e.source = std::string(absl::StripAsciiWhitespace(rest));
        break;
      }
      const size_t space = rest.find(' ');
      absl::string_view field = rest.substr(0, space);
      rest = space == absl::string_view::npos ? absl::string_view() : rest.substr(space + 1);
      const size_t eq = field.find('=');
      if (eq == absl::string_view::npos)
        return bad(absl::StrCat("expected key=value, got \"", field, "\""));
      absl::string_view key = field.substr(0, eq);
      absl::string_view value = field.substr(eq + 1);
      if (key == "sm") {
        if (!absl::SimpleAtoi(value, &e.sm)) return bad("sm is not a number");
        have_sm = true;
      } else if (key == "ws") {
        if (!absl::SimpleAtoi(value, &e.world_size)) return bad("ws is not a number");
        have_ws = true;
      } else if (key == "oneshot_max") {
        if (!absl::SimpleAtoi(value, &e.oneshot_max_bytes))
          return bad("oneshot_max is not a number");
        have_one = true;
      } else if (key == "twoshot_max") {
        if (!absl::SimpleAtoi(value, &e.twoshot_max_bytes))
          return bad("twoshot_max is not a number");
        have_two = true;
      } else if (key == "sym") {
        if (value.empty()) continue;
        for (absl::string_view range : absl::StrSplit(value, ',')) {
          std::pair<absl::string_view, absl::string_view> lohi = absl::StrSplit(range, '-');
          ByteRange r;
          if (!absl::SimpleAtoi(lohi.first, &r.lo) || !absl::SimpleAtoi(lohi.second, &r.hi)) {
            return bad(absl::StrCat("symmetric range \"", range, "\" is not LO-HI"));
          }
          e.nccl_symmetric.push_back(r);
        }
      } else {
        return bad(absl::StrCat("unknown key \"", key, "\""));
      }
    }
    if (!have_sm || !have_ws || !have_one || !have_two) {
      return bad("needs sm, ws, oneshot_max and twoshot_max");
    }
    absl::Status added = table.Add(std::move(e));
    if (!added.ok()) return bad(added.message());
  }
  return table;
}

std::string DispatchTable::Serialize() const {
  std::string out;
  for (const DispatchEntry& e : entries_) {
    std::vector<std::string> ranges;
    for (const ByteRange& r : e.nccl_symmetric) ranges.push_back(absl::StrCat(r.lo, "-", r.hi));
    absl::StrAppend(&out, "sm=", e.sm, " ws=", e.world_size, " oneshot_max=", e.oneshot_max_bytes,
                    " twoshot_max=", e.twoshot_max_bytes, " sym=", absl::StrJoin(ranges, ","));
    if (!e.source.empty()) absl::StrAppend(&out, " source=", e.source);
    absl::StrAppend(&out, "\n");
  }
  return out;
}

absl::StatusOr<DispatchChoice> ChooseExecPath(const DispatchTable& table,
                                              const DispatchRequest& req) {
  const uint64_t bytes = PayloadBytes(req.num_tokens, req.hidden, req.dtype);
  const DispatchEntry* entry = table.Find(req.sm, req.world_size);
  switch (req.forced) {
    case ForcedPath::kOneShot:
      if (!req.fused_available) {
        return absl::FailedPreconditionError(
            "forced path oneshot: no fused workspace on this group");
      }
      return DispatchChoice{ExecPath::kOneShot, false, "forced oneshot"};
    case ForcedPath::kTwoShot:
      if (!req.fused_available) {
        return absl::FailedPreconditionError(
            "forced path twoshot: no fused workspace on this group");
      }
      if (!req.twoshot_available) {
        return absl::FailedPreconditionError(
            absl::StrCat("forced path twoshot: the two-shot kernel cannot run ", req.num_tokens,
                         " tokens at world size ", req.world_size));
      }
      return DispatchChoice{ExecPath::kTwoShot, false, "forced twoshot"};
    case ForcedPath::kUnfused:
      if (!req.nccl_available) {
        return absl::FailedPreconditionError(
            "forced path unfused: no NCCL communicator on this group");
      }
      return Unfused(req, entry, bytes, "forced unfused");
    case ForcedPath::kAuto:
      break;
  }
  if (!req.fused_available) {
    if (!req.nccl_available) {
      return absl::FailedPreconditionError(
          "no path can run: no fused workspace and no NCCL communicator on this group");
    }
    return Unfused(req, entry, bytes, "no fused workspace");
  }
  if (!req.nccl_available) {
    // Nothing to compare against (e.g. ranks share one GPU, where NCCL refuses to run): the fused
    // kernels are the only path, whatever the table says.
    if (entry != nullptr && bytes > entry->oneshot_max_bytes && req.twoshot_available &&
        entry->twoshot_max_bytes != 0) {
      return DispatchChoice{ExecPath::kTwoShot, false, "no NCCL communicator; two-shot range"};
    }
    return DispatchChoice{ExecPath::kOneShot, false, "no NCCL communicator; fused only"};
  }
  if (entry == nullptr) {
    return Unfused(req, entry, bytes,
                   absl::StrCat("no thresholds for ", Key(req.sm, req.world_size)));
  }
  if (bytes <= entry->oneshot_max_bytes) {
    return DispatchChoice{
        ExecPath::kOneShot, false,
        absl::StrCat("payload ", bytes, " <= oneshot_max ", entry->oneshot_max_bytes)};
  }
  if (bytes <= entry->twoshot_max_bytes) {
    if (req.twoshot_available) {
      return DispatchChoice{
          ExecPath::kTwoShot, false,
          absl::StrCat("payload ", bytes, " <= twoshot_max ", entry->twoshot_max_bytes)};
    }
    return Unfused(req, entry, bytes,
                   "two-shot range but the two-shot kernel cannot run this shape");
  }
  return Unfused(
      req, entry, bytes,
      absl::StrCat("payload ", bytes, " above the fused limits for ", Key(req.sm, req.world_size)));
}

}  // namespace arfuse
