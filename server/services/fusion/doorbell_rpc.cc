// The doorbell plane's control path in the Fusion service (docs/doorbell.md): CreatePlan{doorbell:
// true} registers the plan with the engine's doorbell plane, and the end of a session removes its
// plans. The plans themselves are kept by DoorbellPlanTable (server/doorbell/plan_table.h).
// Nothing here is on the per-op path: the ring kernel and the serving launch meet in GPU memory.
#include <algorithm>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/doorbell/plan_table.h"
#include "server/services/fusion/fusion_service.h"
#include "server/services/fusion/proto_convert.h"
#include "server/services/fusion/service_helpers.h"
#include "spdlog/spdlog.h"

namespace arfuse {

DoorbellHost* FusionService::CurrentDoorbellHost() const {
  Engine* engine = engine_ ? engine_() : nullptr;
  return engine != nullptr ? engine->doorbell_host() : nullptr;
}

grpc::ServerUnaryReactor* FusionService::CreateDoorbellPlan(grpc::CallbackServerContext* ctx,
                                                            uint64_t session,
                                                            const v1::CreatePlanRequest* req,
                                                            v1::CreatePlanResponse* resp) {
  if (options_.device == MemoryKind::kHostShm) {
    return FinishNow(ctx, absl::FailedPreconditionError(
                              "the doorbell plane needs --device=cuda (this sidecar runs "
                              "--device=host, where the CPU implementation runs every op); "
                              "create the plan without doorbell and use Execute (eager plane)"));
  }
  if (absl::Status busy = RefuseWhileAttached(); !busy.ok()) return FinishNow(ctx, busy);
  Engine* engine = engine_ ? engine_() : nullptr;
  if (engine == nullptr) return FinishNow(ctx, EngineUnavailable());
  if (engine->doorbell_host() == nullptr) {
    return FinishNow(ctx, absl::FailedPreconditionError(
                              "this sidecar's engine has no doorbell plane; create the plan "
                              "without doorbell and use Execute (eager plane)"));
  }
  auto plan = registry_.CreatePlan(session, ToOpRequest(req->op()));
  if (!plan.ok()) return FinishNow(ctx, plan.status());
  // The plane's kernels write the plan's tensors until it is removed: its regions stay held.
  auto held =
      registry_.ResolvePlan(session, plan->plan_id, plan->generation, plan->shape.max_tokens);
  if (!held.ok()) {
    registry_.DestroyPlan(session, plan->plan_id, plan->generation).IgnoreError();
    return FinishNow(ctx, held.status());
  }
  auto entry = std::make_shared<DoorbellPlanTable::Plan>(session, *plan, std::move(*held));
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const absl::Time deadline = DeadlineOf(*ctx);
  // Registering may wait: for the op running now (the engine serves one at a time) and for the
  // plane's device memory.
  auto run = [this, reactor, resp, entry, deadline](bool cancelled) {
    absl::Status status;
    Engine* engine = nullptr;
    DoorbellHost* host = nullptr;
    if (cancelled) {
      status = absl::UnavailableError("sidecar is shutting down; the plan was not created");
    } else if (engine = engine_ ? engine_() : nullptr; engine == nullptr) {
      status = EngineUnavailable();
    } else if (host = engine->doorbell_host(); host == nullptr) {
      status = absl::FailedPreconditionError(
          "this sidecar's engine has no doorbell plane; use the eager plane (Execute)");
    } else {
      status = doorbells_.Add(*host, entry, deadline);
      if (status.ok()) {
        resp->set_plan_id(entry->plan_id);
        resp->set_generation(entry->generation);
        v1::Doorbell* d = resp->mutable_doorbell();
        d->set_ipc_handle(entry->grant.ipc_handle);
        d->set_offset(entry->grant.offset);
        d->set_request_value(entry->grant.request_value);
        d->set_complete_value(entry->grant.complete_value);
        d->set_reset_value(entry->grant.reset_value);
        resp->set_path(ToProtoPath(entry->grant.path_at_max));
        resp->set_reason(entry->grant.reason);
        spdlog::info("event=doorbell_plan_created plan={} slot={} max_tokens={}", entry->plan_id,
                     entry->grant.slot, entry->max_tokens);
      }
    }
    if (!status.ok()) {
      registry_.DestroyPlan(entry->session, entry->plan_id, entry->generation).IgnoreError();
      entry->hold.Release();
    }
    reactor->Finish(ToGrpcStatus(status));
  };
  absl::Status queued = control_.Submit(run);
  if (!queued.ok()) {
    registry_.DestroyPlan(session, entry->plan_id, entry->generation).IgnoreError();
    entry->hold.Release();
    reactor->Finish(ToGrpcStatus(queued));
  }
  return reactor;
}

void FusionService::EndSessionDoorbells(uint64_t session) {
  DoorbellPlanTable::Plans plans = doorbells_.Take(session, std::nullopt);
  if (plans.empty()) return;
  const absl::Time deadline = absl::Now() + options_.default_deadline;
  absl::Status queued = control_.Submit([this, plans, deadline](bool cancelled) {
    doorbells_
        .Remove(plans, cancelled ? std::min(deadline, absl::Now() + absl::Seconds(1)) : deadline)
        .IgnoreError();
  });
  // Shutting down or a full queue: remove now, briefly (this runs on a gRPC thread).
  if (!queued.ok()) {
    doorbells_.Remove(plans, std::min(deadline, absl::Now() + absl::Seconds(1))).IgnoreError();
  }
}

}  // namespace arfuse
