// Fusion.Execute: the eager plane (docs/api.md, "Plans and the eager plane"). One RPC per op:
// the registry resolves the plan or op to pointers, the op executor serializes the ops (one in
// flight per workspace, run inline when the executor is idle: fusion_service.h), the event IPC
// orders the op after the client's producer and the client's consumer after the op, and the
// engine's Execute runs it.
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/services/fusion/fusion_service.h"
#include "server/services/fusion/proto_convert.h"
#include "server/services/fusion/service_helpers.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

// Why an op failed is what an operator needs when a group misbehaves (a rank whose client never
// gets an op in, a peer that keeps timing out): warning level, rate-limited per code.
void LogExecuteFailure(LogRateLimiter& limiter, const absl::Status& status) {
  const std::string code = absl::StatusCodeToString(status.code());
  uint64_t held_back = 0;
  if (!limiter.Allow(code, absl::Now(), &held_back)) return;
  spdlog::warn("event=execute_failed code={} held_back={} message=\"{}\"", code, held_back,
               std::string(status.message()));
}

}  // namespace

grpc::ServerUnaryReactor* FusionService::Execute(grpc::CallbackServerContext* ctx,
                                                 const v1::ExecuteRequest* req,
                                                 v1::ExecuteResponse* resp) {
  auto finish_failed = [&](const absl::Status& s) {
    LogExecuteFailure(execute_failures_, s);
    return FinishNow(ctx, s);
  };
  auto session = SessionOf(*ctx);
  if (!session.ok()) return finish_failed(session.status());
  if (absl::Status busy = RefuseWhileAttached(); !busy.ok()) return finish_failed(busy);
  Engine* engine = engine_ ? engine_() : nullptr;
  if (engine == nullptr) return finish_failed(EngineUnavailable());
  if (!req->wait_event().empty() && events_ == nullptr) {
    return finish_failed(
        absl::InvalidArgumentError("wait_event is only for --device=cuda; this sidecar runs host "
                                   "mode, where ops complete before the reply"));
  }
  if (!req->wait_event().empty() && req->wait_event().size() != kCudaIpcHandleBytes) {
    return finish_failed(
        absl::InvalidArgumentError(absl::StrCat("wait_event must be exactly ", kCudaIpcHandleBytes,
                                                " bytes, got ", req->wait_event().size())));
  }
  if (req->workspace_generation() != 0) {
    uint64_t current = engine->Status().generation;
    if (req->workspace_generation() != current) {
      return finish_failed(absl::FailedPreconditionError(
          "workspace: stale generation (the workspace was re-initialized "
          "since); read GetWorkspaceInfo and retry"));
    }
  }
  absl::StatusOr<ResolvedOp> resolved;
  switch (req->target_case()) {
    case v1::ExecuteRequest::kPlanId:
      resolved = registry_.ResolvePlan(*session, req->plan_id(), req->plan_generation(),
                                       req->num_tokens());
      break;
    case v1::ExecuteRequest::kOp:
      resolved = registry_.ResolveOp(*session, ToOpRequest(req->op()), req->num_tokens());
      break;
    case v1::ExecuteRequest::TARGET_NOT_SET:
      resolved = absl::InvalidArgumentError("set plan_id or op");
      break;
  }
  if (!resolved.ok()) return finish_failed(resolved.status());

  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const absl::Time deadline = DeadlineOf(*ctx);
  // std::function needs a copyable callable: the op's hold on its regions travels in a
  // shared_ptr and is released right after the engine returns.
  auto op = std::make_shared<ResolvedOp>(std::move(*resolved));
  std::string wait_handle = req->wait_event();
  const bool synchronous = req->synchronous() || options_.device == MemoryKind::kHostShm;
  Executor::Task task = [this, reactor, resp, op, deadline, wait_handle,
                         synchronous](bool cancelled) {
    absl::Status status;
    if (cancelled) {
      status = absl::UnavailableError("sidecar is shutting down; the op did not run");
    } else if (absl::Now() >= deadline) {
      status = absl::DeadlineExceededError(
          "the op waited for the workspace past its deadline and did not run");
    } else if (Engine* engine = engine_ ? engine_() : nullptr; engine == nullptr) {
      status = EngineUnavailable();
    } else {
      std::unique_ptr<OpEvents> events;
      if (events_ != nullptr) {
        auto prepared = events_->Prepare(wait_handle);
        status = prepared.status();
        if (prepared.ok()) events = std::move(*prepared);
      }
      if (status.ok()) {
        ExecContext ec;
        ec.deadline = deadline;
        ec.synchronous = synchronous;
        if (events) {
          ec.wait_event = events->wait_event();
          ec.done_event = events->done_event();
        }
        absl::StatusOr<OpOutcome> outcome = engine->Execute(op->args(), ec);
        status = outcome.status();
        if (outcome.ok()) {
          resp->set_path(ToProtoPath(outcome->path));
          resp->set_reason(outcome->reason);
          if (events && !synchronous) resp->set_done_event(events->done_handle());
          resp->set_workspace_generation(engine->Status().generation);
        }
      }
    }
    // Release before replying: a client that unregisters right after the reply must not wait.
    op->Release();
    if (!status.ok()) LogExecuteFailure(execute_failures_, status);
    reactor->Finish(ToGrpcStatus(status));
  };
  // Nothing running or waiting: run here and reply from this thread (header: the fast path).
  if (ops_.RunInlineIfIdle(task)) return reactor;
  absl::Status queued = ops_.Submit(std::move(task));
  if (!queued.ok()) {
    op->Release();
    LogExecuteFailure(execute_failures_, queued);
    reactor->Finish(ToGrpcStatus(queued));
  }
  return reactor;
}

}  // namespace arfuse
