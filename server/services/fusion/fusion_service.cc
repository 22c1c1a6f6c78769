#include "server/services/fusion/fusion_service.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/auth_context.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "kernels/common/op_types.h"
#include "server/registry/openers.h"
#include "server/services/common/grpc_status.h"
#include "server/services/fusion/event_ipc_factory.h"
#include "server/services/fusion/proto_convert.h"
#include "server/services/fusion/service_helpers.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

absl::Status ShuttingDown() {
  return absl::UnavailableError(
      "sidecar shutting down: the session is closed; open a new session once the sidecar is back");
}

}  // namespace

// ---- construction ----

absl::StatusOr<std::unique_ptr<FusionService>> FusionService::Create(FusionServiceOptions options,
                                                                     EngineGetter engine) {
  ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<MemoryOpener> opener,
                          MakeMemoryOpener(options.device, options.device_id));
  ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<EventIpc> events,
                          MakeEventIpc(options.device, options.device_id));
  return std::make_unique<FusionService>(std::move(options), std::move(engine), std::move(opener),
                                         std::move(events));
}

namespace {

// The registry refuses, at CreatePlan, ops the workspace can never serve (OUT_OF_RANGE).
RegistryLimits LimitsOf(const FusionServiceOptions& options) {
  RegistryLimits limits = options.limits;
  limits.workspace = WorkspaceCapacity{options.max_tokens, options.max_hidden, options.dtype};
  return limits;
}

}  // namespace

FusionService::FusionService(FusionServiceOptions options, EngineGetter engine,
                             std::unique_ptr<MemoryOpener> opener, std::unique_ptr<EventIpc> events,
                             uint64_t boot_nonce)
    : options_(std::move(options)),
      engine_(std::move(engine)),
      events_(std::move(events)),
      registry_(LimitsOf(options_), std::move(opener), boot_nonce),
      doorbells_(registry_, [this] { return CurrentDoorbellHost(); }),
      // One op thread: one op in flight per workspace, in arrival order.
      ops_(1, options_.max_queued_ops),
      // Two control threads, so one unregister draining a long op does not stall every
      // registration behind it.
      control_(2, 256),
      instream_(std::make_unique<InStreamAttachments>(
          [this](uint64_t session, const AttachEventData& e) { NotifySession(session, e); },
          [this] { return ProbeInStream(); })) {}

FusionService::~FusionService() {
  Shutdown();
  instream_.reset();  // stops the watcher before the members it calls back into go
}

void FusionService::Shutdown() {
  BeginShutdown();
  ops_.Shutdown();
  control_.Shutdown();
}

// ---- helpers ----

absl::Time FusionService::DeadlineOf(const grpc::CallbackServerContext& ctx) const {
  const auto client = ctx.deadline();
  const absl::Time now = absl::Now();
  // gRPC reports "no deadline" as a time point decades away; anything past a day counts as none.
  absl::Time deadline = client > std::chrono::system_clock::now() + std::chrono::hours(24)
                            ? now + options_.default_deadline
                            : absl::FromChrono(client);
  // Work stops a little before the call's deadline, so that the client receives our specific
  // status (which op, which peer) rather than a bare DEADLINE_EXCEEDED of its own.
  absl::Duration margin = std::min(absl::Milliseconds(100), (deadline - now) / 5);
  if (margin > absl::ZeroDuration()) deadline -= margin;
  return deadline;
}

absl::StatusOr<uint64_t> FusionService::SessionOf(const grpc::CallbackServerContext& ctx) const {
  ARFUSE_RETURN_IF_ERROR(CheckClientApiVersion(ctx));
  // Sessions were ended at shutdown: say why rather than "unknown session".
  if (shutting_down_.load(std::memory_order_acquire)) return ShuttingDown();
  const auto& md = ctx.client_metadata();
  auto it = md.find(kSessionMetadataKey);
  if (it == md.end()) {
    return absl::FailedPreconditionError(
        "no session: open a Fusion.Session stream first and pass its session_token in the "
        "arfuse-session metadata");
  }
  return registry_.FindSession(absl::string_view(it->second.data(), it->second.size()),
                               OwnerOf(ctx));
}

SessionOwner FusionService::OwnerOf(const grpc::ServerContextBase& ctx) const {
  SessionOwner owner;
  // While the call is in progress its connection is open, so ctx.peer() names it (and only it).
  if (options_.callers != nullptr) {
    if (std::optional<SocketCredentials> c = options_.callers->ForPeer(ctx.peer())) {
      owner.uid = c->uid;
    }
  }
  // Over TCP the sidecar requires and verifies a client certificate (--listen): the identity is
  // its subject, which the CA vouched for. Unix connections are not authenticated this way.
  std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    std::vector<grpc::string_ref> subject =
        auth->FindPropertyValues(GRPC_X509_SUBJECT_PROPERTY_NAME);
    if (subject.empty()) subject = auth->GetPeerIdentity();
    owner.identity = "x509:";
    for (const grpc::string_ref& v : subject) {
      owner.identity.append(v.data(), v.size());
      owner.identity.push_back('\n');
    }
  }
  return owner;
}

// ---- Session ----

class FusionService::SessionReactor final
    : public grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse> {
 public:
  SessionReactor(FusionService* service, grpc::CallbackServerContext* ctx)
      : service_(service), owner_(service->OwnerOf(*ctx)) {
    absl::Status version = CheckClientApiVersion(*ctx);
    if (!version.ok()) {
      RequestFinish(version);
      return;
    }
    if (!service_->TrackSession(this)) {
      RequestFinish(ShuttingDown());
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The client half-closed, disconnected or was cancelled: the session ends.
      RequestFinish(absl::OkStatus());
      return;
    }
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Ending already (the service is shutting down): no more reads or writes.
      if (finish_requested_) return;
      first = !opened_;
    }
    if (first) {
      auto opened = service_->registry_.OpenOwnedSession(request_.client_name(), owner_);
      if (!opened.ok()) {
        RequestFinish(opened.status());
        return;
      }
      const FusionServiceOptions& o = service_->options_;
      response_.set_session_token(opened->token);
      response_.mutable_server_api()->set_major(kApiMajor);
      response_.mutable_server_api()->set_minor(kApiMinor);
      response_.set_device(static_cast<v1::DeviceKind>(o.device));
      response_.set_rank(o.rank);
      response_.set_world_size(o.world_size);
      {
        std::lock_guard<std::mutex> lock(mu_);
        opened_ = true;
        session_id_ = opened->id;
        // Shutdown asked to finish meanwhile: OnDone closes the session just opened.
        if (finish_requested_) return;
        // Set before StartWrite, so a finish requested from another thread waits for the write.
        write_pending_ = true;
      }
      StartWrite(&response_);
    } else if (request_.drained_attach_id() != 0) {
      // The client finished its in-stream launches after a DRAIN event.
      uint64_t id = 0;
      {
        std::lock_guard<std::mutex> lock(mu_);
        id = session_id_;
      }
      service_->instream_->Acknowledge(id, request_.drained_attach_id());
    }
    // Reading on is how later messages (drain answers) and the end of the stream are noticed.
    StartRead(&request_);
  }

  // Queues an in-stream event for this session's stream (one write in flight at a time).
  void SendEvent(const AttachEventData& event) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!opened_ || finish_requested_) return;
      v1::SessionResponse message;
      v1::AttachEvent* e = message.mutable_event();
      e->set_kind(static_cast<v1::AttachEvent::Kind>(event.kind));
      e->set_attach_id(event.attach_id);
      e->set_reason(event.reason);
      events_.push_back(std::move(message));
      if (write_pending_) return;  // OnWriteDone sends it
      write_pending_ = true;
      writing_ = std::move(events_.front());
      events_.pop_front();
    }
    StartWrite(&writing_);
  }

  uint64_t session_id() {
    std::lock_guard<std::mutex> lock(mu_);
    return opened_ ? session_id_ : 0;
  }

  void OnWriteDone(bool ok) override {
    absl::Status pending;
    bool finish = false;
    bool next = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      write_pending_ = false;
      if (ok && !finish_requested_ && !events_.empty()) {
        write_pending_ = true;
        next = true;
        writing_ = std::move(events_.front());
        events_.pop_front();
      } else if (finish_requested_ && !finished_) {
        finished_ = true;
        finish = true;
        pending = finish_status_;
      }
    }
    if (next) StartWrite(&writing_);
    if (finish) Finish(ToGrpcStatus(pending));
    // A failed write means the stream is gone; the failed read that follows ends it.
  }

  void OnDone() override {
    // First, so that BeginShutdown takes no new reference to a stream that is done.
    service_->UntrackSession(this);
    uint64_t id = 0;
    bool opened = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      opened = opened_;
      id = session_id_;
    }
    if (opened) {
      // An attachment that ends with its session (no Detach) may leave an op it launched half
      // done: the engine retires it before any peer's op can pair with it.
      for (uint64_t attach_id : service_->instream_->RemoveSession(id)) {
        service_->RetireEndedAttachment(attach_id);
      }
      service_->registry_.CloseSession(id);
      // After CloseSession: an Attach that offers later sees the session gone and revokes.
      if (FdTicketBroker* tickets = service_->options_.fd_tickets) {
        tickets->RevokeSession(AttachTicketScope(id, 0).session);
      }
      service_->EndSessionDoorbells(id);
    }
    Unref();
  }

  // BeginShutdown holds a reference while it finishes the stream from its own thread, so that an
  // OnDone running meanwhile does not delete the reactor under it.
  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  // Finish exactly once, and never while a write is outstanding. Safe from any thread; a no-op
  // once the stream is finishing.
  void RequestFinish(const absl::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finish_requested_) return;
      finish_requested_ = true;
      finish_status_ = status;
      if (write_pending_) return;  // OnWriteDone finishes
      finished_ = true;
    }
    Finish(ToGrpcStatus(status));
  }

 private:
  FusionService* const service_;
  // Who opened the stream: only its calls reach the session.
  const SessionOwner owner_;
  // One for the stream (dropped in OnDone), one per BeginShutdown in progress.
  std::atomic<int> refs_{1};
  v1::SessionRequest request_;
  v1::SessionResponse response_;
  // In-stream events waiting for the stream, and the one being written (guarded by mu_).
  std::deque<v1::SessionResponse> events_;
  v1::SessionResponse writing_;
  std::mutex mu_;
  bool opened_ = false;
  uint64_t session_id_ = 0;
  bool write_pending_ = false;
  bool finish_requested_ = false;
  bool finished_ = false;
  absl::Status finish_status_;
};

grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse>* FusionService::Session(
    grpc::CallbackServerContext* ctx) {
  return new SessionReactor(this, ctx);
}

bool FusionService::TrackSession(SessionReactor* reactor) {
  std::lock_guard<std::mutex> lock(sessions_mu_);
  if (shutting_down_.load(std::memory_order_acquire)) return false;
  sessions_.insert(reactor);
  return true;
}

size_t FusionService::open_sessions() const {
  std::lock_guard<std::mutex> lock(sessions_mu_);
  return sessions_.size();
}

void FusionService::UntrackSession(SessionReactor* reactor) {
  std::lock_guard<std::mutex> lock(sessions_mu_);
  sessions_.erase(reactor);
}

void FusionService::NotifySession(uint64_t session, const AttachEventData& event) {
  SessionReactor* target = nullptr;
  {
    std::lock_guard<std::mutex> lock(sessions_mu_);
    for (SessionReactor* r : sessions_) {
      if (r->session_id() == session) {
        r->Ref();
        target = r;
        break;
      }
    }
  }
  if (target == nullptr) return;
  target->SendEvent(event);
  target->Unref();
}

void FusionService::BeginShutdown() {
  std::vector<SessionReactor*> open;
  {
    std::lock_guard<std::mutex> lock(sessions_mu_);
    if (shutting_down_.exchange(true, std::memory_order_acq_rel)) return;
    for (SessionReactor* r : sessions_) {
      r->Ref();
      open.push_back(r);
    }
  }
  // Outside the lock: Finish hands the stream back to gRPC, which may call OnDone on another
  // thread (and OnDone takes sessions_mu_).
  for (SessionReactor* r : open) {
    r->RequestFinish(ShuttingDown());
    r->Unref();
  }
  if (!open.empty()) spdlog::info("event=sessions_ended_for_shutdown sessions={}", open.size());
}

// ---- regions ----

absl::Status FusionService::ResolveCaller(const grpc::CallbackServerContext& ctx,
                                          RegionSpec& spec) const {
  if (options_.callers != nullptr) spec.caller = options_.callers->ForPeer(ctx.peer());
  if (!spec.host_by_fd || options_.device != MemoryKind::kHostShm) return absl::OkStatus();
  if (options_.fd_tickets == nullptr) {
    return absl::FailedPreconditionError("host_fd: this sidecar serves no fd channel");
  }
  if (!spec.caller.has_value()) {
    return absl::PermissionDeniedError(
        "host_fd: a descriptor is claimed only over the sidecar's Unix socket, where it knows the "
        "caller's credentials");
  }
  // The ticket is bound to the uid that deposited it: only that user's calls may claim it.
  ARFUSE_ASSIGN_OR_RETURN(std::vector<UniqueFd> fds,
                          options_.fd_tickets->Claim(spec.fd_ticket, spec.caller->uid));
  if (fds.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("host_fd: the ticket holds ", fds.size(),
                                                   " descriptors; a region takes exactly one"));
  }
  spec.host_fd = std::make_shared<const UniqueFd>(std::move(fds.front()));
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* FusionService::RegisterRegion(grpc::CallbackServerContext* ctx,
                                                        const v1::RegisterRegionRequest* req,
                                                        v1::RegisterRegionResponse* resp) {
  auto session = SessionOf(*ctx);
  if (!session.ok()) return FinishNow(ctx, session.status());
  RegionSpec spec = ToRegionSpec(*req);
  // While the call is in progress its connection is open, so ctx->peer() names it (and only it).
  absl::Status caller = ResolveCaller(*ctx, spec);
  if (!caller.ok()) return FinishNow(ctx, caller);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  uint64_t sid = *session;
  absl::Status queued = control_.Submit([this, reactor, resp, sid, spec](bool cancelled) {
    if (cancelled) {
      reactor->Finish(ToGrpcStatus(absl::UnavailableError("sidecar is shutting down")));
      return;
    }
    auto handle = registry_.RegisterRegion(sid, spec);
    if (handle.ok()) {
      resp->set_region_id(handle->region_id);
      resp->set_generation(handle->generation);
    }
    reactor->Finish(ToGrpcStatus(handle.status()));
  });
  if (!queued.ok()) reactor->Finish(ToGrpcStatus(queued));
  return reactor;
}

grpc::ServerUnaryReactor* FusionService::UnregisterRegion(grpc::CallbackServerContext* ctx,
                                                          const v1::UnregisterRegionRequest* req,
                                                          v1::UnregisterRegionResponse* /*resp*/) {
  auto session = SessionOf(*ctx);
  if (!session.ok()) return FinishNow(ctx, session.status());
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  uint64_t sid = *session, id = req->region_id(), gen = req->generation();
  absl::Time deadline = DeadlineOf(*ctx);
  absl::Status queued = control_.Submit([this, reactor, sid, id, gen, deadline](bool cancelled) {
    if (cancelled) {
      reactor->Finish(ToGrpcStatus(absl::UnavailableError("sidecar is shutting down")));
      return;
    }
    reactor->Finish(ToGrpcStatus(registry_.UnregisterRegion(sid, id, gen, deadline)));
  });
  if (!queued.ok()) reactor->Finish(ToGrpcStatus(queued));
  return reactor;
}

grpc::ServerUnaryReactor* FusionService::ListRegions(grpc::CallbackServerContext* ctx,
                                                     const v1::ListRegionsRequest* /*req*/,
                                                     v1::ListRegionsResponse* resp) {
  auto session = SessionOf(*ctx);
  if (!session.ok()) return FinishNow(ctx, session.status());
  auto regions = registry_.ListRegions(*session);
  if (!regions.ok()) return FinishNow(ctx, regions.status());
  for (const RegionInfo& r : *regions) ToRegionInfoProto(r, resp->add_regions());
  return FinishNow(ctx, absl::OkStatus());
}

// ---- plans ----

grpc::ServerUnaryReactor* FusionService::CreatePlan(grpc::CallbackServerContext* ctx,
                                                    const v1::CreatePlanRequest* req,
                                                    v1::CreatePlanResponse* resp) {
  auto session = SessionOf(*ctx);
  if (!session.ok()) return FinishNow(ctx, session.status());
  if (!req->has_op()) return FinishNow(ctx, absl::InvalidArgumentError("op is missing"));
  if (req->doorbell()) return CreateDoorbellPlan(ctx, *session, req, resp);
  auto plan = registry_.CreatePlan(*session, ToOpRequest(req->op()));
  if (!plan.ok()) return FinishNow(ctx, plan.status());
  resp->set_plan_id(plan->plan_id);
  resp->set_generation(plan->generation);
  Engine* engine = engine_ ? engine_() : nullptr;
  if (options_.device == MemoryKind::kHostShm) {
    resp->set_path(v1::EXEC_PATH_HOST);
    resp->set_reason("host mode: the CPU implementation runs every op");
  } else if (engine == nullptr) {
    resp->set_path(v1::EXEC_PATH_UNSPECIFIED);
    resp->set_reason("engine initializing: the path is decided per op");
  } else {
    EngineStatus st = engine->Status();
    if (!st.fusion_enabled) {
      resp->set_path(v1::EXEC_PATH_UNFUSED);
      resp->set_reason(absl::StrCat("fusion disabled: ", st.reason));
    } else {
      resp->set_path(v1::EXEC_PATH_UNSPECIFIED);
      resp->set_reason(absl::StrCat("backend ", st.backend,
                                    ": one-shot or two-shot is picked per op by payload size"));
    }
  }
  return FinishNow(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* FusionService::DestroyPlan(grpc::CallbackServerContext* ctx,
                                                     const v1::DestroyPlanRequest* req,
                                                     v1::DestroyPlanResponse* /*resp*/) {
  auto session = SessionOf(*ctx);
  if (!session.ok()) return FinishNow(ctx, session.status());
  absl::Status destroyed = registry_.DestroyPlan(*session, req->plan_id(), req->generation());
  if (!destroyed.ok()) return FinishNow(ctx, destroyed);
  // A doorbell plan answers once the engine's kernels let go of its memory.
  DoorbellPlanTable::Plans doorbell = doorbells_.Take(*session, req->plan_id());
  if (doorbell.empty()) return FinishNow(ctx, absl::OkStatus());
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const absl::Time deadline = DeadlineOf(*ctx);
  absl::Status queued = control_.Submit([this, reactor, doorbell, deadline](bool cancelled) {
    reactor->Finish(ToGrpcStatus(doorbells_.Remove(
        doorbell, cancelled ? std::min(deadline, absl::Now() + absl::Seconds(1)) : deadline)));
  });
  if (!queued.ok()) reactor->Finish(ToGrpcStatus(doorbells_.Remove(doorbell, deadline)));
  return reactor;
}

// ---- GetWorkspaceInfo ----

void FillInStreamOps(const InStreamOpCounts& c, v1::InStreamOps* out) {
  out->set_fused_total(c.fused_total());
  out->set_declined_total(c.declined_total());
  for (uint32_t p = 0; p < instream::kOpPatterns; ++p) {
    for (uint32_t b = 0; b < instream::kOpTokenBuckets; ++b) {
      if (c.fused[p][b] == 0) continue;
      v1::InStreamOps::Fused* f = out->add_fused();
      f->set_pattern(PatternName(static_cast<Pattern>(p + 1)));
      f->set_tokens(instream::kOpTokenBucketNames[b]);
      f->set_count(c.fused[p][b]);
    }
  }
  std::vector<uint32_t> reasons;
  for (uint32_t r = 0; r < instream::kDeclineReasons; ++r) {
    if (c.declined[r] != 0) reasons.push_back(r);
  }
  std::stable_sort(reasons.begin(), reasons.end(),
                   [&c](uint32_t a, uint32_t b) { return c.declined[a] > c.declined[b]; });
  for (uint32_t r : reasons) {
    v1::InStreamOps::Declined* d = out->add_declined();
    d->set_reason(instream::kDeclineReasonNames[r]);
    d->set_count(c.declined[r]);
  }
}

grpc::ServerUnaryReactor* FusionService::GetWorkspaceInfo(grpc::CallbackServerContext* ctx,
                                                          const v1::GetWorkspaceInfoRequest*,
                                                          v1::GetWorkspaceInfoResponse* resp) {
  absl::Status version = CheckClientApiVersion(*ctx);
  if (!version.ok()) return FinishNow(ctx, version);
  resp->set_rank(options_.rank);
  resp->set_world_size(options_.world_size);
  resp->set_nnodes(options_.nnodes);
  resp->set_max_tokens(options_.max_tokens);
  resp->set_hidden(options_.max_hidden);
  resp->set_dtype(static_cast<v1::DType>(options_.dtype));
  resp->set_device(static_cast<v1::DeviceKind>(options_.device));
  resp->set_mps_detected(options_.mps_detected);
  resp->set_doorbell_hop_us(options_.doorbell_hop_us);
  resp->set_sm(options_.sm);
  FillInStreamOps(instream_->op_counts(), resp->mutable_instream_ops());
  resp->mutable_instream_ops()->set_kernel_counted(instream_->kernel_counted());
  const InStreamAttachments::DivergenceRecord divergence = instream_->divergence();
  v1::InStreamDivergence* d = resp->mutable_instream_divergence();
  d->set_total(divergence.total);
  d->set_last_rank(divergence.last_rank);
  d->set_last_ops(divergence.last_ops);
  d->set_last_reasons(divergence.last_reasons);
  Engine* engine = engine_ ? engine_() : nullptr;
  if (engine == nullptr) {
    resp->set_backend("none");
    resp->set_state(v1::WORKSPACE_STATE_INITIALIZING);
    resp->set_reason("engine initializing");
    return FinishNow(ctx, absl::OkStatus());
  }
  EngineStatus st = engine->Status();
  resp->set_backend(st.backend);
  resp->set_fusion_enabled(st.fusion_enabled);
  resp->set_reason(st.reason);
  resp->set_state(static_cast<v1::WorkspaceState>(st.state));
  resp->set_generation(st.generation);
  resp->set_workspace_bytes(st.workspace_bytes);
  return FinishNow(ctx, absl::OkStatus());
}

}  // namespace arfuse
