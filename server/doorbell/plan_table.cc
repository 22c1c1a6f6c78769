#include "server/doorbell/plan_table.h"

#include <string>

#include "spdlog/spdlog.h"

namespace arfuse {

DoorbellPlanTable::DoorbellPlanTable(const Registry& registry, HostGetter host)
    : registry_(registry), host_(std::move(host)) {}

absl::Status DoorbellPlanTable::Add(DoorbellHost& host, const std::shared_ptr<Plan>& plan,
                                    absl::Time deadline) {
  absl::StatusOr<DoorbellGrant> grant =
      host.AddDoorbellPlan(plan->hold.args(), plan->max_tokens, deadline);
  if (!grant.ok()) return grant.status();
  plan->grant = *std::move(grant);
  bool session_open = false;
  {
    // A session that ended meanwhile has had its doorbell plans taken already.
    std::lock_guard<std::mutex> lock(mu_);
    session_open = registry_.CheckSession(plan->session).ok();
    if (session_open) plans_[{plan->session, plan->plan_id}] = plan;
  }
  if (!session_open) {
    Remove({plan}, deadline).IgnoreError();
    return absl::FailedPreconditionError("the session ended; the plan was removed");
  }
  return absl::OkStatus();
}

DoorbellPlanTable::Plans DoorbellPlanTable::Take(uint64_t session,
                                                 std::optional<uint64_t> plan_id) {
  Plans out;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.lower_bound({session, plan_id.value_or(0)});
  while (it != plans_.end() && it->first.first == session &&
         (!plan_id.has_value() || it->first.second == *plan_id)) {
    out.push_back(std::move(it->second));
    it = plans_.erase(it);
  }
  return out;
}

size_t DoorbellPlanTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return plans_.size();
}

absl::Status DoorbellPlanTable::Remove(const Plans& plans, absl::Time deadline) {
  absl::Status first;
  for (const std::shared_ptr<Plan>& p : plans) {
    DoorbellHost* host = host_ ? host_() : nullptr;
    // No engine or no plane: the plane that held the plan is gone, and its kernels with it.
    absl::Status removed =
        host != nullptr ? host->RemoveDoorbellPlan(p->grant, deadline) : absl::OkStatus();
    if (removed.ok()) {
      p->hold.Release();
      spdlog::info("event=doorbell_plan_removed plan={} slot={}", p->plan_id, p->grant.slot);
      continue;
    }
    // The plane's kernels may still use the memory: keep it mapped rather than risk a write
    // into memory the client reuses.
    spdlog::warn("event=doorbell_plan_parked plan={} slot={} error=\"{}\"", p->plan_id,
                 p->grant.slot, std::string(removed.message()));
    {
      std::lock_guard<std::mutex> lock(mu_);
      parked_.push_back(p);
    }
    if (first.ok()) first = removed;
  }
  return first;
}

}  // namespace arfuse
