// arfuse.v1.Admin: stats, drain, live backend switch, re-initialization. The daemon implements
// AdminControl; this layer only converts messages and keeps blocking work off gRPC's threads.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "arfuse/v1/admin.grpc.pb.h"
#include "server/metrics/metrics.h"
#include "server/registry/registry.h"

namespace arfuse {

class AdminControl {
 public:
  virtual ~AdminControl() = default;
  virtual v1::GetStatsResponse Stats() = 0;
  // Stops accepting ops and waits (bounded) for those in flight; returns how many were waited for.
  virtual absl::StatusOr<uint32_t> Drain(absl::Duration timeout) = 0;
  // Collective: every rank is asked for the same backend. Errors leave the previous backend
  // serving.
  virtual absl::StatusOr<v1::SetBackendResponse> SetBackend(
      const std::string& backend, const std::optional<std::string>& collective_id,
      absl::Time deadline) = 0;
  virtual absl::StatusOr<v1::ReinitializeResponse> Reinitialize(absl::Time deadline) = 0;
};

// The usage part of GetStats: sessions, regions, region_bytes and plans from the registry's
// totals (what the open sessions hold now), and the op counters (since the process started; ops
// that reached the engine, so requests refused by validation or while not serving are not
// counted; see OpTotals for fused and unfused). The daemon's Stats() calls it; the rest (state,
// backend, ...) is the daemon's own.
void FillUsageStats(const RegistryTotals& registry, const OpTotals& ops, v1::GetStatsResponse* out);

class AdminService final : public v1::Admin::CallbackService {
 public:
  // `default_deadline` applies to calls whose client sent none.
  AdminService(AdminControl* control, absl::Duration default_deadline);

  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx,
                                     const v1::GetStatsRequest* req,
                                     v1::GetStatsResponse* resp) override;
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* ctx, const v1::DrainRequest* req,
                                  v1::DrainResponse* resp) override;
  grpc::ServerUnaryReactor* SetBackend(grpc::CallbackServerContext* ctx,
                                       const v1::SetBackendRequest* req,
                                       v1::SetBackendResponse* resp) override;
  grpc::ServerUnaryReactor* Reinitialize(grpc::CallbackServerContext* ctx,
                                         const v1::ReinitializeRequest* req,
                                         v1::ReinitializeResponse* resp) override;

 private:
  absl::Time DeadlineOf(const grpc::CallbackServerContext& ctx) const;

  AdminControl* control_;
  absl::Duration default_deadline_;
};

}  // namespace arfuse
