// arfuse.v1.Fusion: sessions, regions, plans and the eager data plane.
//
// Threads: every handler validates and answers on the gRPC callback thread without blocking,
// except work that may wait, which goes to a worker: the fused op to the op executor (one op in
// flight per workspace, FIFO, bounded queue; a full queue is refused with RESOURCE_EXHAUSTED),
// and register/unregister to the control executor (opening an IPC handle, draining ops in
// flight). Every accepted call ends in exactly one status before its deadline (the client's, or
// options.default_deadline when it sent none).
//
// The eager plane's fast path: an op that finds the op executor idle (nothing running, nothing
// queued) runs on the callback thread that received it and replies from there, with no thread
// hand-off (a worker wake-up and a reply sent from another thread cost tens of microseconds per
// op, more when cores are idle in deep sleep states, against a ~70 us gRPC round trip). It holds
// the executor's only slot meanwhile, so ops arriving during it queue behind it as before: at
// most one callback thread is ever held by an op, for as long as the op may take (bounded by its
// deadline: the CUDA enqueue takes microseconds; a synchronous or host-mode op waits for its
// peers).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "arfuse/v1/fusion.grpc.pb.h"
#include "common/log.h"
#include "server/doorbell/plan_table.h"
#include "server/engine_api/doorbell_host.h"
#include "server/engine_api/engine.h"
#include "server/fdpass/caller_credentials.h"
#include "server/fdpass/ticket_broker.h"
#include "server/instream/attachments.h"
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
  // The daemon's doorbell self-test (docs/doorbell.md): us per op over in-process; 0 when not
  // measured.
  double doorbell_hop_us = 0;
  // Who makes each call (the daemon's Unix listener records every connection's credentials).
  // Null: nobody is known, and host memory is not registered (docs/security.md). Not owned.
  const CallerCredentials* callers = nullptr;
  // The fd channel's tickets, which RegisterRegion's host_fd claims. Null: host_fd is refused.
  // Not owned.
  FdTicketBroker* fd_tickets = nullptr;
  // The fd channel's path, for the in-stream plane's attach (its descriptors are offered there
  // under fd_tickets); empty: none.
  std::string fd_socket;
};

// What an attach's fd ticket belongs to (FdTicketBroker): it dies with that attachment's Detach
// and with the session's end.
FdTicketScope AttachTicketScope(uint64_t session, uint64_t attach_id);

// The in-stream clients' op counts as GetWorkspaceInfo reports them: fused series and decline
// reasons with a nonzero count, the reasons largest first.
void FillInStreamOps(const InStreamOpCounts& counts, v1::InStreamOps* out);

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

  // Shutdown begins: ends every open Session stream with UNAVAILABLE ("sidecar shutting down")
  // and answers new sessions and session-bound calls the same way. Ops already accepted (running
  // or queued) are left to finish. Never blocks. Call before grpc::Server::Shutdown, which
  // otherwise waits its whole deadline for Session streams: clients hold them open for as long
  // as they are connected.
  void BeginShutdown();

  // BeginShutdown, then refuses new ops and control calls (UNAVAILABLE) and ends queued ones with
  // UNAVAILABLE. Never blocks: the op running now ends by its own deadline.
  void Shutdown();

  Registry& registry() { return registry_; }
  // Session streams not yet done (shutdown waits for the ones BeginShutdown ended).
  size_t open_sessions() const;
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
  grpc::ServerUnaryReactor* Execute(grpc::CallbackServerContext* ctx, const v1::ExecuteRequest* req,
                                    v1::ExecuteResponse* resp) override;
  grpc::ServerUnaryReactor* GetWorkspaceInfo(grpc::CallbackServerContext* ctx,
                                             const v1::GetWorkspaceInfoRequest* req,
                                             v1::GetWorkspaceInfoResponse* resp) override;
  grpc::ServerUnaryReactor* Attach(grpc::CallbackServerContext* ctx, const v1::AttachRequest* req,
                                   v1::AttachResponse* resp) override;
  grpc::ServerUnaryReactor* Detach(grpc::CallbackServerContext* ctx, const v1::DetachRequest* req,
                                   v1::DetachResponse* resp) override;

  // The in-stream plane's attachments (docs/instream.md).
  InStreamAttachments& instream() { return *instream_; }
  // Asks every attached client to stop launching on the workspace and waits for their answers
  // (bounded): before a backend switch drops the workspace, and at shutdown. Returns how many
  // did not answer (their launches end at the workspace's abort).
  size_t DrainInStream(const std::string& reason, absl::Time deadline) {
    return instream_->Drain(reason, deadline);
  }

 private:
  class SessionReactor;

  // The call's deadline: the client's, or now + default_deadline when it sent none.
  absl::Time DeadlineOf(const grpc::CallbackServerContext& ctx) const;
  // API version, then the `arfuse-session` metadata, then the session itself: the handle of the
  // session it names when the caller (OwnerOf) is the one that opened it, else PERMISSION_DENIED
  // (Registry::FindSession).
  absl::StatusOr<uint64_t> SessionOf(const grpc::CallbackServerContext& ctx) const;
  // Who makes the call: the uid of its Unix connection (options.callers) and the identity its
  // client certificate proved (TCP with mutual TLS: the certificate's subject).
  SessionOwner OwnerOf(const grpc::ServerContextBase& ctx) const;
  // The caller's side of RegisterRegion: who calls, and the descriptor a host_fd ticket names.
  absl::Status ResolveCaller(const grpc::CallbackServerContext& ctx, RegionSpec& spec) const;

  // Open Session streams, so that BeginShutdown can end them. TrackSession is false once
  // shutdown began (the stream is refused).
  bool TrackSession(SessionReactor* reactor);
  void UntrackSession(SessionReactor* reactor);
  // Sends an in-stream event on the session's stream (dropped when the session is gone).
  void NotifySession(uint64_t session, const AttachEventData& event);
  // FAILED_PRECONDITION while clients launch in-stream on the workspace: the sidecar's own ops
  // (eager, doorbell) would interleave with theirs in the kernels' sequence.
  absl::Status RefuseWhileAttached() const;
  // An attachment ended with its session: the engine retires an op it left half done.
  void RetireEndedAttachment(uint64_t attach_id) const;
  // The watcher's sample of the engine (InStreamAttachments::Probe).
  InStreamProbe ProbeInStream() const;

  // ---- doorbell plane (docs/doorbell.md): doorbell_rpc.cc; the plans: server/doorbell ----
  // The engine's doorbell plane now, or null (no engine, or one without a doorbell plane).
  DoorbellHost* CurrentDoorbellHost() const;
  // CreatePlan{doorbell: true}: registers the plan with the engine's doorbell plane on a
  // control thread and answers with the Doorbell message.
  grpc::ServerUnaryReactor* CreateDoorbellPlan(grpc::CallbackServerContext* ctx, uint64_t session,
                                               const v1::CreatePlanRequest* req,
                                               v1::CreatePlanResponse* resp);
  // Session end: removes the session's doorbell plans on a control thread.
  void EndSessionDoorbells(uint64_t session);

  const FusionServiceOptions options_;
  const EngineGetter engine_;
  const std::unique_ptr<EventIpc> events_;
  Registry registry_;
  // A failed Execute is logged (code and message; messages never carry handles or pointers) at
  // most once a second per status code, with the count of those held back.
  LogRateLimiter execute_failures_{absl::Seconds(1)};
  std::atomic<bool> shutting_down_{false};
  mutable std::mutex sessions_mu_;
  std::set<SessionReactor*> sessions_;  // not owned: each deletes itself after OnDone
  // Declared before the executors, so that it outlives their threads.
  DoorbellPlanTable doorbells_;
  Executor ops_;
  Executor control_;
  // Last: its watcher thread calls back into the members above.
  std::unique_ptr<InStreamAttachments> instream_;
};

// The metadata key carrying the session token (SessionResponse.session_token, 32 lowercase hex
// characters) on every call after Session.
inline constexpr char kSessionMetadataKey[] = "arfuse-session";

}  // namespace arfuse
