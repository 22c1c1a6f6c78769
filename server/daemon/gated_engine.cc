#include "server/daemon/gated_engine.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace arfuse {

absl::Status GatedEngine::Initialize(Exchange& /*exchange*/, absl::Time /*deadline*/) {
  return absl::FailedPreconditionError("the daemon initializes engines before installing them");
}

absl::StatusOr<OpOutcome> GatedEngine::Execute(const OpArgs& op, const ExecContext& ctx) {
  Engine* engine = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_ || inner_ == nullptr) {
      return absl::UnavailableError(absl::StrCat("not serving ops: ", closed_reason_));
    }
    engine = inner_.get();
    ++in_flight_;
  }
  // The inner engine cannot be swapped while in_flight_ > 0 (Swap requires a drained gate).
  const absl::Time start = absl::Now();
  absl::StatusOr<OpOutcome> result = engine->Execute(op, ctx);
  if (observer_) observer_(op, result, absl::Now() - start);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--in_flight_ == 0) idle_.notify_all();
  }
  return result;
}

absl::StatusOr<DoorbellGrant> GatedEngine::AddDoorbellPlan(const OpArgs& op_template,
                                                           uint32_t max_tokens,
                                                           absl::Time deadline) {
  DoorbellHost* host = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_ || inner_ == nullptr) {
      return absl::UnavailableError(absl::StrCat("not serving: ", closed_reason_));
    }
    host = inner_->doorbell_host();
    if (host == nullptr) {
      return absl::FailedPreconditionError(
          "this sidecar's engine has no doorbell plane (the doorbell plane needs --device=cuda): "
          "use the eager plane (Execute)");
    }
    ++in_flight_;
  }
  // As for Execute: the inner engine cannot be swapped while in_flight_ > 0.
  absl::StatusOr<DoorbellGrant> result = host->AddDoorbellPlan(op_template, max_tokens, deadline);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--in_flight_ == 0) idle_.notify_all();
  }
  return result;
}

absl::Status GatedEngine::RemoveDoorbellPlan(const DoorbellGrant& grant, absl::Time deadline) {
  DoorbellHost* host = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // No engine: the plane that held the plan is gone with its engine.
    if (inner_ == nullptr) return absl::OkStatus();
    host = inner_->doorbell_host();
    if (host == nullptr) return absl::OkStatus();
    ++in_flight_;
  }
  absl::Status result = host->RemoveDoorbellPlan(grant, deadline);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--in_flight_ == 0) idle_.notify_all();
  }
  return result;
}

template <typename R, typename Fn>
R GatedEngine::WithInStreamHost(bool gated, Fn fn) {
  InStreamHost* host = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (inner_ == nullptr || (gated && !open_)) {
      return absl::UnavailableError(absl::StrCat("not serving: ", closed_reason_));
    }
    host = inner_->instream_host();
    if (host == nullptr) {
      return absl::FailedPreconditionError(
          "this sidecar's engine cannot hand its workspace to a client library");
    }
    ++in_flight_;
  }
  R result = fn(*host);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--in_flight_ == 0) idle_.notify_all();
  }
  return result;
}

absl::StatusOr<InStreamExport> GatedEngine::ExportInStream(const std::vector<uint32_t>& hiddens) {
  // The export's generation is the workspace's own (what its kernels check), unique in the
  // process across engines: a re-formed group's workspace never matches an older attachment.
  return WithInStreamHost<absl::StatusOr<InStreamExport>>(
      true, [&](InStreamHost& host) { return host.ExportInStream(hiddens); });
}

absl::StatusOr<InStreamCounters> GatedEngine::InStreamStatus() {
  return WithInStreamHost<absl::StatusOr<InStreamCounters>>(
      false, [](InStreamHost& host) { return host.InStreamStatus(); });
}

void GatedEngine::AbortInStream() {
  std::lock_guard<std::mutex> lock(mu_);
  if (inner_ != nullptr && inner_->instream_host() != nullptr) {
    inner_->instream_host()->AbortInStream();
  }
}

bool GatedEngine::InStreamClientEnded(uint64_t attach_id) {
  std::lock_guard<std::mutex> lock(mu_);
  return inner_ != nullptr && inner_->instream_host() != nullptr &&
         inner_->instream_host()->InStreamClientEnded(attach_id);
}

void GatedEngine::Abort() {
  std::lock_guard<std::mutex> lock(mu_);
  if (inner_ != nullptr) inner_->Abort();
}

EngineStatus GatedEngine::Status() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (inner_ == nullptr) {
    EngineStatus status;
    status.state = WorkspaceState::kInitializing;
    status.reason = closed_reason_;
    return status;
  }
  EngineStatus status = inner_->Status();
  status.generation += generation_base_;
  if (!open_ && status.state != WorkspaceState::kPoisoned) status.state = WorkspaceState::kDraining;
  return status;
}

absl::StatusOr<uint32_t> GatedEngine::Drain(absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  open_ = false;
  closed_reason_ = "draining";
  uint32_t waited = static_cast<uint32_t>(in_flight_);
  while (in_flight_ > 0) {
    if (idle_.wait_until(lock, absl::ToChronoTime(deadline)) == std::cv_status::timeout &&
        in_flight_ > 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("drain timed out with ", in_flight_, " op(s) still in flight"));
    }
  }
  return waited;
}

void GatedEngine::Resume() {
  std::lock_guard<std::mutex> lock(mu_);
  open_ = inner_ != nullptr;
}

void GatedEngine::SetClosedReason(std::string reason) {
  std::lock_guard<std::mutex> lock(mu_);
  closed_reason_ = std::move(reason);
}

absl::StatusOr<std::unique_ptr<Engine>> GatedEngine::Swap(std::unique_ptr<Engine> engine,
                                                          uint64_t generation_base) {
  std::lock_guard<std::mutex> lock(mu_);
  // An op still in flight would run on a destroyed engine.
  if (in_flight_ > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot swap the engine with ", in_flight_, " op(s) in flight"));
  }
  std::swap(inner_, engine);
  generation_base_ = inner_ == nullptr ? 0 : generation_base;
  if (inner_ == nullptr) closed_reason_ = "the group is re-forming";
  return engine;
}

bool GatedEngine::has_engine() const {
  std::lock_guard<std::mutex> lock(mu_);
  return inner_ != nullptr;
}

uint64_t GatedEngine::ops_in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_;
}

absl::StatusOr<uint64_t> AgreedGenerationBase(uint64_t own,
                                              const std::vector<std::string>& offers) {
  uint64_t base = own;
  for (size_t r = 0; r < offers.size(); ++r) {
    uint64_t v = 0;
    if (!absl::SimpleAtoi(offers[r], &v)) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", r, " offered a malformed workspace generation \"",
                       absl::CHexEscape(offers[r].substr(0, 32)),
                       "\" when the group formed: do all ranks run the same arfused build?"));
    }
    base = std::max(base, v);
  }
  return base;
}

}  // namespace arfuse
