#include "server/doorbell/doorbell_dispatch.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace arfuse {
namespace {

constexpr char kUseEager[] =
    "the doorbell plane runs only the fused kernels: use the eager plane (CreatePlan without "
    "doorbell, then Execute)";

std::string ShapeOf(const DispatchRequest& r) {
  return absl::StrCat(r.num_tokens, " tokens x ", r.hidden, " hidden ", DTypeName(r.dtype));
}

absl::StatusOr<DispatchChoice> ChooseAt(const DispatchTable& table, DispatchRequest req,
                                        uint32_t num_tokens) {
  req.num_tokens = num_tokens;
  return ChooseExecPath(table, req);
}

}  // namespace

absl::StatusOr<DoorbellDispatch> ChooseDoorbellDispatch(const DispatchTable& table,
                                                        const DispatchRequest& at_max) {
  const uint32_t max_tokens = at_max.num_tokens;
  if (max_tokens == 0) {
    return absl::InvalidArgumentError("a doorbell plan needs max_tokens > 0");
  }
  if (!at_max.fused_available) {
    return absl::FailedPreconditionError(
        absl::StrCat("this group has no usable fused workspace; ", kUseEager));
  }
  DoorbellDispatch d;
  switch (at_max.forced) {
    case ForcedPath::kUnfused:
      return absl::FailedPreconditionError(
          absl::StrCat("the engine's path is forced to unfused; ", kUseEager));
    case ForcedPath::kOneShot:
      d.reason = "doorbell plane: forced oneshot";
      return d;
    case ForcedPath::kTwoShot:
      if (!at_max.twoshot_available) {
        return absl::FailedPreconditionError(absl::StrCat(
            "forced path twoshot: the two-shot kernel cannot run this shape at world size ",
            at_max.world_size));
      }
      d.twoshot_min_tokens = 1;
      d.path_at_max = ExecPath::kTwoShot;
      d.reason = "doorbell plane: forced twoshot";
      return d;
    case ForcedPath::kAuto:
      break;
  }
  // The dispatcher's choice grows with the payload (one-shot, then two-shot, then unfused), so
  // a plan is fused at every token count when it is fused at its largest.
  absl::StatusOr<DispatchChoice> top = ChooseExecPath(table, at_max);
  if (!top.ok()) return top.status();
  if (top->path == ExecPath::kUnfused) {
    return absl::FailedPreconditionError(absl::StrCat("a plan of ", ShapeOf(at_max),
                                                      " runs unfused at max_tokens (", top->reason,
                                                      "); ", kUseEager, ", or lower max_tokens"));
  }
  d.path_at_max = top->path;
  if (top->path == ExecPath::kOneShot) {
    d.twoshot_min_tokens = kDoorbellNeverTwoShot;
    d.reason =
        absl::StrCat("doorbell plane: one-shot up to ", max_tokens, " tokens (", top->reason, ")");
  } else {
    // Smallest token count that runs two-shot: every count below it runs one-shot.
    uint32_t lo = 1, hi = max_tokens;  // path(hi) is two-shot
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2;
      absl::StatusOr<DispatchChoice> c = ChooseAt(table, at_max, mid);
      if (!c.ok()) return c.status();
      if (c->path == ExecPath::kTwoShot) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    d.twoshot_min_tokens = lo;
    d.reason = absl::StrCat(
        "doorbell plane: ", lo > 1 ? absl::StrCat("one-shot below ", lo, " tokens, ") : "",
        "two-shot from ", lo, " tokens (", top->reason, ")");
  }
  // What the table says must be what the device runs: one-shot below the threshold, two-shot
  // from it, nothing unfused (a table that is not monotone in the payload is refused).
  for (uint32_t n : {1u, d.twoshot_min_tokens - 1, d.twoshot_min_tokens, max_tokens}) {
    if (n == 0 || n > max_tokens) continue;
    absl::StatusOr<DispatchChoice> c = ChooseAt(table, at_max, n);
    if (!c.ok()) return c.status();
    const ExecPath want = n >= d.twoshot_min_tokens ? ExecPath::kTwoShot : ExecPath::kOneShot;
    if (c->path != want) {
      DispatchRequest at_n = at_max;
      at_n.num_tokens = n;
      return absl::FailedPreconditionError(absl::StrCat(
          "a plan of up to ", max_tokens,
          " tokens does not run one algorithm range per token "
          "count (",
          ShapeOf(at_n), ": ", ExecPathName(c->path), ", ", c->reason, "); ", kUseEager));
    }
  }
  return d;
}

uint32_t DoorbellServeBlocksFor(uint32_t requested, bool shares_gpu) {
  return shares_gpu ? std::min(requested, kSharedGpuDoorbellServeBlocks) : requested;
}

uint32_t SharedGpuSmBudget(int sms, int ranks, bool doorbell, uint32_t serve_blocks) {
  if (ranks < 1) ranks = 1;
  const int64_t per_rank = doorbell ? 2 + static_cast<int64_t>(serve_blocks) : 0;
  const int64_t reserved = doorbell ? per_rank * ranks + 2 : 0;
  return static_cast<uint32_t>(std::max<int64_t>(1, (sms - reserved) / ranks));
}

}  // namespace arfuse
