// arfuse.v1.Fusion: sessions, regions, plans and the eager data plane.
//
// Threads: every handler validates and answers on the gRPC callback thread without blocking,
// except work that may wait, which goes to a worker: the fused op to the op executor (one op in
// flight per workspace, FIFO, bounded queue; a full queue is refused with RESOURCE_EXHAUSTED),
// and register/unregister to the control executor (opening an IPC handle, draining ops in
// flight). Every accepted call ends in exactly one status before its deadline (the client's, or
// options.default_deadline when it sent none).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "arfuse/v1/fusion.grpc.pb.h"
#include "server/engine/engine.h"
#include "server/registry/opener.h"
#include "server/registry/registry.h"
#include "server/services/fusion/event_ipc.h"
#include "server/services/fusion/executor.h"

namespace arfuse {

struct FusionServiceOptions {
  // kHostShm for --device=host, kCudaIpc for --device=cuda.
  MemoryKind device = MemoryKind::kHostShm;
  int32_t device_id = 0;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint32_t nnodes = 1;
  RegistryLimits limits;
  // Applied to every call whose client sent no deadline.
  absl::Duration default_deadline = absl::Seconds(30);
  // Ops waiting for the workspace beyond the one running.
  size_t max_queued_ops = 64;
  // Reported by GetWorkspaceInfo (the workspace's capacity and the device).
  uint32_t max_tokens = 2048;
  uint32_t max_hidden = 8192;
  DType dtype = DType::kBF16;
  uint32_t sm = 0;
  bool mps_detected = false;
};

class FusionService final : public v1::Fusion::CallbackService {
 public:
  // Returns the engine, or null while the daemon is still initializing it (calls that need it
  // answer UNAVAILABLE). The daemon keeps the engine alive until Shutdown() returned.
  using EngineGetter = std::function<Engine*()>;

  // Picks the memory opener (host shm, or CUDA IPC) and the event IPC (CUDA only) for
  // options.device. UNIMPLEMENTED for kCudaIpc in a build without CUDA.
  static absl::StatusOr<std::unique_ptr<FusionService>> Create(FusionServiceOptions options,
                                                               EngineGetter engine);

  // For tests: explicit opener (must serve options.device) and event IPC (null: none).
  FusionService(FusionServiceOptions options, EngineGetter engine,
                std::unique_ptr<MemoryOpener> opener, std::unique_ptr<EventIpc> events,
                uint64_t boot_nonce = 0);
  ~FusionService() override;

  // Refuses new ops and control calls (UNAVAILABLE) and ends queued ones with UNAVAILABLE. Call
  // before grpc::Server::Shutdown. Waits only for the op running now, bounded by its deadline.
  void Shutdown();

  Registry& registry() { return registry_; }
  // Ops waiting behind the one running (tests, metrics).
  size_t queued_ops() const { return ops_.queued(); }
  const FusionServiceOptions& options() const { return options_; }

  grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse>* Session(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterRegionRequest* req,
                                           v1::RegisterRegionResponse* resp) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* ctx,
                                             const v1::UnregisterRegionRequest* req,
                                             v1::UnregisterRegionResponse* resp) override;
  grpc::ServerUnaryReactor* ListRegions(grpc::CallbackServerContext* ctx,
                                        const v1::ListRegionsRequest* req,
                                        v1::ListRegionsResponse* resp) override;
  grpc::ServerUnaryReactor* CreatePlan(grpc::CallbackServerContext* ctx,
                                       const v1::CreatePlanRequest* req,
                                       v1::CreatePlanResponse* resp) override;
  grpc::ServerUnaryReactor* DestroyPlan(grpc::CallbackServerContext* ctx,
                                        const v1::DestroyPlanRequest* req,
                                        v1::DestroyPlanResponse* resp) override;
  grpc::ServerUnaryReactor* Execute(grpc::CallbackServerContext* ctx,
                                    const v1::ExecuteRequest* req,
                                    v1::ExecuteResponse* resp) override;
  grpc::ServerUnaryReactor* GetWorkspaceInfo(grpc::CallbackServerContext* ctx,
                                             const v1::GetWorkspaceInfoRequest* req,
                                             v1::GetWorkspaceInfoResponse* resp) override;

 private:
  class SessionReactor;

  // The call's deadline: the client's, or now + default_deadline when it sent none.
  absl::Time DeadlineOf(const grpc::CallbackServerContext& ctx) const;
  // API version, then the `arfuse-session` metadata, then the session itself.
  absl::StatusOr<uint64_t> SessionOf(const grpc::CallbackServerContext& ctx) const;

  const FusionServiceOptions options_;
  const EngineGetter engine_;
  const std::unique_ptr<EventIpc> events_;
  Registry registry_;
  Executor ops_;
  Executor control_;
};

// The metadata key carrying the session id (decimal) on every call after Session.
inline constexpr char kSessionMetadataKey[] = "arfuse-session";

}  // namespace arfuse
