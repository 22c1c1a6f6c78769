// The doorbell plane's plan slots: a plan's checks, upload and removal, and what the active
// plans ask of the queued launches (one fused launch per kernel shape and algorithm, and the
// serving launch's in-place plans). The slots change only under the plane's lock, and every change
// kicks the queued waiters, whose slot mask is fixed at launch.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/cuda_device/cuda_status.h"
#include "server/doorbell/doorbell_plane.h"
#include "server/doorbell/scoped_device.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

using doorbell_internal::ScopedDevice;

bool SameLayout(const WorkspaceLayout& a, const WorkspaceLayout& b) {
  return a.control_offset == b.control_offset && a.lamport_offset == b.lamport_offset &&
         a.lamport_buffer_bytes == b.lamport_buffer_bytes &&
         a.lamport_slot_bytes == b.lamport_slot_bytes && a.scatter_offset == b.scatter_offset &&
         a.scatter_slot_bytes == b.scatter_slot_bytes && a.gather_offset == b.gather_offset &&
         a.total_bytes == b.total_bytes && a.max_tokens == b.max_tokens && a.hidden == b.hidden &&
         a.world_size == b.world_size && a.dtype == b.dtype;
}

// Plans whose fused launch is the same kernel with the same grid rule (allreduce_fusion.h): the
// indirect launch queued for one runs the other's ops, and the serving launch runs both in place.
// (World size and rank are the plane's, alike for every plan.)
bool SameLaunchShape(const FusionParams& a, const FusionParams& b) {
  return a.dtype == b.dtype && a.pattern == b.pattern && a.hidden == b.hidden &&
         a.sm_budget == b.sm_budget;
}

bool UsesOneShot(const DoorbellPlanOptions& o) { return o.twoshot_min_tokens > 1; }
bool UsesTwoShot(const DoorbellPlanOptions& o) { return o.twoshot_min_tokens <= o.max_tokens; }

}  // namespace

absl::StatusOr<DoorbellHandle> DoorbellPlane::AddPlan(const FusionParams& plan,
                                                      const DoorbellPlanOptions& plan_options) {
  ScopedDevice device(options_.device);
  // Validation first, without the lock or the device.
  if (!SameLayout(plan.layout, options_.layout)) {
    return absl::InvalidArgumentError(
        "doorbell plan's workspace layout differs from the plane's workspace");
  }
  if (plan.rank < 0 || plan.rank >= kMaxWorldSize ||
      plan.peer_workspace[plan.rank] != options_.local_workspace) {
    return absl::InvalidArgumentError(
        "doorbell plan's own workspace (peer_workspace[rank]) is not the plane's workspace");
  }
  if (!IsHiddenAligned(plan.hidden)) {
    return absl::InvalidArgumentError(
        absl::StrCat("doorbell plan ", contract::HiddenNotAligned(plan.hidden)));
  }
  DoorbellPlanOptions opts = plan_options;
  const uint32_t fit = contract::MaxTokensThatFit(options_.layout, plan.hidden);
  if (opts.max_tokens == 0) opts.max_tokens = fit;
  if (opts.max_tokens == 0 || opts.max_tokens > fit) {
    return absl::InvalidArgumentError(
        absl::StrCat("doorbell plan max_tokens ", opts.max_tokens, " at hidden ", plan.hidden,
                     " does not fit the workspace (at most ", fit, ")"));
  }
  for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
    if (algo == FusionAlgo::kOneShot ? !UsesOneShot(opts) : !UsesTwoShot(opts)) continue;
    FusionParams check = plan;
    check.num_tokens = opts.max_tokens;
    check.algo = algo;
    const char* why = nullptr;
    if (CheckFusionParams(check, &why) != cudaSuccess) {
      return absl::InvalidArgumentError(
          absl::StrCat("doorbell plan refused by the fused kernels (",
                       algo == FusionAlgo::kOneShot ? "one-shot" : "two-shot",
                       "): ", why != nullptr ? why : "invalid"));
    }
  }

  absl::MutexLock lock(&mu_);
  if (state_ == State::kStopped || state_ == State::kFailed) {
    return absl::FailedPreconditionError(
        absl::StrCat("doorbell plane is stopped: ", counters_.health.ToString()));
  }
  PumpLocked();  // may free retired slots
  uint32_t slot = kMaxDoorbellSlots;
  for (uint32_t i = 0; i < kMaxDoorbellSlots; ++i) {
    if (!plans_[i].active && !plans_[i].retiring) {
      slot = i;
      break;
    }
  }
  if (slot == kMaxDoorbellSlots) {
    return absl::ResourceExhaustedError(
        absl::StrCat("all ", kMaxDoorbellSlots, " doorbell slots are in use; destroy a plan"));
  }
  DoorbellPlanEntry entry{};
  entry.params = plan;
  entry.params.num_tokens = 0;
  entry.max_tokens = opts.max_tokens;
  entry.twoshot_min_tokens = opts.twoshot_min_tokens;
  *staging_ = entry;
  // The slot enters no waiter's mask before this upload and reset finished: a waiter never reads
  // a half-written entry, and the client gets an armed slot.
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(plan_table_ + slot, staging_, sizeof(entry),
                                              cudaMemcpyHostToDevice, side_stream_));
  ARFUSE_CUDA_RETURN_IF_ERROR(
      LaunchDoorbellResetSlots(reinterpret_cast<DoorbellSlot*>(block_), 1u << slot, side_stream_));
  ARFUSE_RETURN_IF_ERROR(WaitSideStream(absl::Now() + kSideStreamWait, "doorbell plan upload"));
  Plan& p = plans_[slot];
  p.active = true;
  p.params = entry.params;
  p.options = opts;
  p.retiring = false;
  RebuildSignaturesLocked();
  // Queued waiters do not know the new slot (their mask is fixed): send them away so that the
  // replacements serve it at once.
  KickLocked();
  PumpLocked();
  spdlog::info(
      "event=doorbell_plan_added slot={} hidden={} pattern={} max_tokens={} "
      "twoshot_min_tokens={}",
      slot, plan.hidden, PatternName(plan.pattern), opts.max_tokens, opts.twoshot_min_tokens);
  DoorbellHandle handle;
  handle.slot = slot;
  handle.ipc_handle = ipc_handle_;
  handle.offset = DoorbellSlotOffset(slot);
  return handle;
}

absl::Status DoorbellPlane::RemovePlan(uint32_t slot) {
  ScopedDevice device(options_.device);
  absl::MutexLock lock(&mu_);
  if (slot >= kMaxDoorbellSlots || !plans_[slot].active) {
    return absl::NotFoundError(absl::StrCat("no doorbell plan in slot ", slot));
  }
  Plan& p = plans_[slot];
  p.active = false;
  p.retiring = true;
  p.retire_after_seq = next_seq_;
  RebuildSignaturesLocked();
  KickLocked();
  // A client still ringing this slot stops polling (and does not ring again).
  const absl::Status st = CudaResultToStatus(
      LaunchDoorbellSetError(reinterpret_cast<DoorbellSlot*>(block_), 1u << slot,
                             static_cast<uint32_t>(DoorbellError::kStopped), side_stream_),
      "doorbell slot close", __FILE__, __LINE__);
  PumpLocked();
  spdlog::info("event=doorbell_plan_removed slot={}", slot);
  return st;
}

void DoorbellPlane::RebuildSignaturesLocked() {
  signatures_.clear();
  for (const Plan& p : plans_) {
    if (!p.active) continue;
    for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
      if (algo == FusionAlgo::kOneShot ? !UsesOneShot(p.options) : !UsesTwoShot(p.options)) {
        continue;
      }
      // The fused launch's kernel and grid depend on these (allreduce_fusion.h); plans that share
      // them share the launch.
      const bool known =
          std::any_of(signatures_.begin(), signatures_.end(), [&](const Signature& s) {
            return s.grid_template.algo == algo && SameLaunchShape(s.grid_template, p.params);
          });
      if (known) continue;
      Signature s;
      s.grid_template = p.params;
      s.grid_template.algo = algo;
      s.grid_template.num_tokens = 0;
      signatures_.push_back(s);
    }
  }
}

bool DoorbellPlane::ServeParamsLocked(DoorbellServeParams* sp) const {
  if (!options_.serve_in_place || options_.serve_blocks == 0) return false;
  // The lowest active slot that runs one-shot rings picks the shape; every active plan of the
  // same shape is served in place too.
  const Plan* first = nullptr;
  uint32_t mask = 0;
  uint32_t rows = 0;
  for (uint32_t i = 0; i < kMaxDoorbellSlots; ++i) {
    const Plan& p = plans_[i];
    if (!p.active || !UsesOneShot(p.options)) continue;
    if (first == nullptr) first = &p;
    if (!SameLaunchShape(p.params, first->params)) continue;
    mask |= 1u << i;
    // One-shot rings are below the two-shot threshold and within the maximum.
    rows = std::max(rows, std::min(p.options.max_tokens, p.options.twoshot_min_tokens - 1));
  }
  if (first == nullptr) return false;
  sp->inplace_template = first->params;
  sp->inplace_template.num_tokens = 0;
  sp->inplace_template.algo = FusionAlgo::kOneShot;
  sp->inplace_mask = mask;
  sp->max_blocks = std::max(1u, std::min(options_.serve_blocks, rows));
  return true;
}

}  // namespace arfuse
