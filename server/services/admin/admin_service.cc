#include "server/services/admin/admin_service.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/services/common/grpc_status.h"

namespace arfuse {
namespace {

// Drain, SetBackend and Reinitialize wait on peers and ops: they run on their own thread, never
// on a gRPC callback thread, and finish the reactor when done (bounded by the call's deadline).
template <typename Fn>
grpc::ServerUnaryReactor* RunBlocking(grpc::CallbackServerContext* ctx, Fn fn) {
  auto* reactor = ctx->DefaultReactor();
  if (absl::Status st = CheckClientApiVersion(*ctx); !st.ok()) {
    reactor->Finish(ToGrpcStatus(st));
    return reactor;
  }
  std::thread([reactor, fn = std::move(fn)]() mutable {
    reactor->Finish(ToGrpcStatus(fn()));
  }).detach();
  return reactor;
}

// GetStats' counts of sessions, regions and plans are uint32 on the wire; the registry's caps
// keep them far below, but a wrapped count would read as a small, plausible number.
uint32_t Saturate32(uint64_t v) {
  return static_cast<uint32_t>(std::min<uint64_t>(v, std::numeric_limits<uint32_t>::max()));
}

}  // namespace

void FillUsageStats(const RegistryTotals& registry, const OpTotals& ops,
                    v1::GetStatsResponse* out) {
  out->set_sessions(Saturate32(registry.sessions));
  out->set_regions(Saturate32(registry.regions));
  out->set_region_bytes(registry.region_bytes);
  out->set_plans(Saturate32(registry.plans));
  out->set_ops_ok(ops.ok);
  out->set_ops_failed(ops.failed);
  out->set_ops_fused(ops.fused);
  out->set_ops_unfused(ops.unfused);
  out->set_bytes_reduced(ops.bytes_reduced);
}

AdminService::AdminService(AdminControl* control, absl::Duration default_deadline)
    : control_(control), default_deadline_(default_deadline) {}

absl::Time AdminService::DeadlineOf(const grpc::CallbackServerContext& ctx) const {
  const absl::Time now = absl::Now();
  absl::Time client = absl::FromChrono(ctx.deadline());
  absl::Time fallback = now + default_deadline_;
  absl::Time deadline = client < fallback ? client : fallback;
  // Finish a little before the client gives up, so it gets our reason (which ranks are missing)
  // rather than its own DEADLINE_EXCEEDED.
  absl::Duration margin = std::min(absl::Seconds(1), (deadline - now) / 5);
  return deadline - margin;
}

grpc::ServerUnaryReactor* AdminService::GetStats(grpc::CallbackServerContext* ctx,
                                                 const v1::GetStatsRequest* /*req*/,
                                                 v1::GetStatsResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  absl::Status st = CheckClientApiVersion(*ctx);
  if (st.ok()) *resp = control_->Stats();
  reactor->Finish(ToGrpcStatus(st));
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::Drain(grpc::CallbackServerContext* ctx,
                                              const v1::DrainRequest* req,
                                              v1::DrainResponse* resp) {
  absl::Duration timeout =
      req->has_timeout_ms() ? absl::Milliseconds(req->timeout_ms()) : absl::Seconds(10);
  absl::Duration left = DeadlineOf(*ctx) - absl::Now();
  if (left < timeout) timeout = left;
  return RunBlocking(ctx, [this, timeout, resp]() -> absl::Status {
    absl::StatusOr<uint32_t> waited = control_->Drain(timeout);
    if (!waited.ok()) return waited.status();
    resp->set_ops_waited(*waited);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminService::SetBackend(grpc::CallbackServerContext* ctx,
                                                   const v1::SetBackendRequest* req,
                                                   v1::SetBackendResponse* resp) {
  const std::string backend = req->backend();
  std::optional<std::string> id;
  if (req->has_collective_id()) id = req->collective_id();
  absl::Time deadline = DeadlineOf(*ctx);
  // RunBlocking checks the API version first: a client of another major gets
  // FAILED_PRECONDITION whatever backend it named.
  return RunBlocking(ctx, [this, backend, id, deadline, resp]() -> absl::Status {
    if (backend != "auto" && backend != "trtllm" && backend != "mnnvl" && backend != "none") {
      return absl::InvalidArgumentError(absl::StrCat("unknown backend \"", backend.substr(0, 32),
                                                     "\": expected auto, trtllm, mnnvl or none"));
    }
    if (id && (id->empty() || id->size() > 64 ||
               id->find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                     "0123456789_-") != std::string::npos)) {
      return absl::InvalidArgumentError(
          "collective_id must be 1-64 characters of A-Z, a-z, 0-9, '_' and '-'");
    }
    auto result = control_->SetBackend(backend, id, deadline);
    if (!result.ok()) return result.status();
    *resp = *std::move(result);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminService::Reinitialize(grpc::CallbackServerContext* ctx,
                                                     const v1::ReinitializeRequest* /*req*/,
                                                     v1::ReinitializeResponse* resp) {
  absl::Time deadline = DeadlineOf(*ctx);
  return RunBlocking(ctx, [this, deadline, resp]() -> absl::Status {
    auto result = control_->Reinitialize(deadline);
    if (!result.ok()) return result.status();
    *resp = *std::move(result);
    return absl::OkStatus();
  });
}

}  // namespace arfuse
