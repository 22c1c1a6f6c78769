// The doorbell plans of the sidecar's sessions, as the Fusion service keeps them
// (docs/doorbell.md): each plan's grant from the engine's doorbell plane and the hold on the
// plan's regions, kept (mapped, counted in flight) until the plane confirmed that its kernels let
// go of them. A plan whose removal was not confirmed is parked: its regions stay mapped until the
// table is destroyed, rather than risk a write into memory the client reuses. CUDA-free, so the
// service builds and unit-tests without the toolkit; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/engine_api/doorbell_host.h"
#include "server/registry/registry.h"

namespace arfuse {

class DoorbellPlanTable {
 public:
  // One registered doorbell plan.
  struct Plan {
    Plan(uint64_t session, const PlanInfo& plan, ResolvedOp held)
        : session(session),
          plan_id(plan.plan_id),
          generation(plan.generation),
          max_tokens(plan.shape.max_tokens),
          hold(std::move(held)) {}
    const uint64_t session;
    const uint64_t plan_id;
    const uint64_t generation;
    const uint32_t max_tokens;
    // The plan's tensors at max_tokens; holds its regions.
    ResolvedOp hold;
    DoorbellGrant grant;
  };
  using Plans = std::vector<std::shared_ptr<Plan>>;
  // The doorbell plane that plans are removed from now, or null when there is none (no engine,
  // or one without a doorbell plane: the plane that held the plans is gone, and its kernels with
  // it).
  using HostGetter = std::function<DoorbellHost*()>;

  // `registry` (the plans' sessions) must outlive the table.
  DoorbellPlanTable(const Registry& registry, HostGetter host);
  DoorbellPlanTable(const DoorbellPlanTable&) = delete;
  DoorbellPlanTable& operator=(const DoorbellPlanTable&) = delete;

  // Registers `plan` with `host` (may wait until `deadline`: for the op running now and for the
  // plane's device memory) and files it under its session. FAILED_PRECONDITION when the session
  // ended meanwhile: the plan is removed again. On error the caller still owns the plan's
  // registry entry and hold.
  absl::Status Add(DoorbellHost& host, const std::shared_ptr<Plan>& plan, absl::Time deadline);

  // Takes the session's doorbell plans (all of them, or plan_id's) out of the table.
  Plans Take(uint64_t session, std::optional<uint64_t> plan_id);

  // Plans filed now (parked ones are not counted).
  size_t size() const;

  // Removes them from the current plane (may wait until `deadline`) and releases their regions;
  // plans whose removal was not confirmed are parked. Returns the first error.
  absl::Status Remove(const Plans& plans, absl::Time deadline);

 private:
  const Registry& registry_;
  const HostGetter host_;
  mutable std::mutex mu_;
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<Plan>> plans_;
  Plans parked_;
};

}  // namespace arfuse
