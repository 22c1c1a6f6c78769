// Fusion.Attach / Fusion.Detach: the in-stream plane's control path (docs/instream.md). The
// client library launches the sidecar's kernels in the client's own stream; these calls hand it
// the workspace (the attach blob and its descriptors) and take it back. Nothing here is on the
// per-op path.
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/version.h"
#include "kernels/instream/attach_abi.h"
#include "server/engine_api/instream_host.h"
#include "server/instream/attach_blob.h"
#include "server/instream/attach_fds.h"
#include "server/instream/op_counters.h"
#include "server/services/fusion/fusion_service.h"
#include "server/services/fusion/service_helpers.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

// How long an attach's descriptors wait on the fd channel for the client's pickup.
constexpr absl::Duration kOfferTtl = absl::Seconds(30);

// The client library's ABI versions, checked before anything is handed out: a client built for
// another launch layout would make the kernels read their arguments at other offsets.
absl::Status CheckClientAbi(const v1::AttachRequest& req) {
  if (req.attach_abi_version() != instream::kAttachAbiVersion ||
      req.launch_abi_version() != instream::kLaunchAbiVersion ||
      req.launch_args_bytes() != instream::kLaunchArgsBytes) {
    // Both releases are named: the fix is installing the matching pair.
    const std::string client = req.client_version().empty()
                                   ? std::string("of an unnamed release")
                                   : absl::CEscape(req.client_version().substr(0, 64));
    return absl::FailedPreconditionError(
        absl::StrCat("the client library ", client, " speaks attach ABI ", req.attach_abi_version(),
                     ", launch ABI ", req.launch_abi_version(), " (", req.launch_args_bytes(),
                     "-byte arguments); this sidecar (arfuse ", kVersion, ") needs attach ABI ",
                     instream::kAttachAbiVersion, ", launch ABI ", instream::kLaunchAbiVersion,
                     " (", instream::kLaunchArgsBytes,
                     "-byte arguments): use the client library of this sidecar's release"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FusionService::RefuseWhileAttached() const {
  const size_t n = instream_->size();
  if (n == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the workspace is attached in-stream (", n,
      " attachment(s)): ops run in the attached client's stream; detach it before using the "
      "eager or doorbell plane"));
}

void FusionService::RetireEndedAttachment(uint64_t attach_id) const {
  Engine* engine = engine_ ? engine_() : nullptr;
  InStreamHost* host = engine != nullptr ? engine->instream_host() : nullptr;
  if (host != nullptr && host->InStreamClientEnded(attach_id)) {
    spdlog::warn("event=instream_client_ended_mid_op action=poison_workspace");
  }
}

InStreamProbe FusionService::ProbeInStream() const {
  InStreamProbe p;
  Engine* engine = engine_ ? engine_() : nullptr;
  InStreamHost* host = engine != nullptr ? engine->instream_host() : nullptr;
  if (host == nullptr) return p;
  absl::StatusOr<InStreamCounters> c = host->InStreamStatus();
  if (!c.ok()) return p;
  p.ok = true;
  p.generation = c->generation;
  p.error = c->error;
  p.error_name = c->error_name;
  p.launches = c->launches;
  p.stale = c->stale;
  p.ops = c->ops;
  return p;
}

grpc::ServerUnaryReactor* FusionService::Attach(grpc::CallbackServerContext* ctx,
                                                const v1::AttachRequest* req,
                                                v1::AttachResponse* resp) {
  auto session = SessionOf(*ctx);
  if (!session.ok()) return FinishNow(ctx, session.status());
  if (absl::Status abi = CheckClientAbi(*req); !abi.ok()) return FinishNow(ctx, abi);
  if (req->hidden_size() > static_cast<int>(instream::kMaxAttachHiddens)) {
    return FinishNow(ctx, absl::InvalidArgumentError(
                              absl::StrCat("at most ", instream::kMaxAttachHiddens,
                                           " hidden sizes per attach, got ", req->hidden_size())));
  }
  // One plane per workspace: doorbell launches would interleave with the client's.
  if (const size_t doorbell_plans = doorbells_.size(); doorbell_plans != 0) {
    return FinishNow(ctx, absl::FailedPreconditionError(absl::StrCat(
                              "the workspace serves ", doorbell_plans,
                              " doorbell plan(s): destroy them before attaching in-stream")));
  }
  Engine* engine = engine_ ? engine_() : nullptr;
  if (engine == nullptr) return FinishNow(ctx, EngineUnavailable());
  if (engine->instream_host() == nullptr) {
    return FinishNow(ctx, absl::FailedPreconditionError(
                              "this sidecar's engine cannot hand its workspace to a client "
                              "library; use the doorbell or eager plane"));
  }
  std::vector<uint32_t> hiddens(req->hidden().begin(), req->hidden().end());
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const uint64_t sid = *session;
  // Loading and sizing the kernel image takes milliseconds the first time: a control thread.
  absl::Status queued = control_.Submit(
      [this, reactor, ctx, resp, sid, hiddens = std::move(hiddens)](bool cancelled) {
        if (cancelled) {
          reactor->Finish(ToGrpcStatus(absl::UnavailableError("sidecar is shutting down")));
          return;
        }
        Engine* engine = engine_ ? engine_() : nullptr;
        InStreamHost* host = engine != nullptr ? engine->instream_host() : nullptr;
        if (host == nullptr) {
          reactor->Finish(ToGrpcStatus(EngineUnavailable()));
          return;
        }
        absl::StatusOr<InStreamExport> exported = host->ExportInStream(hiddens);
        if (!exported.ok()) {
          reactor->Finish(ToGrpcStatus(exported.status()));
          return;
        }
        const uint64_t generation = exported->generation;
        // The client counts its ops in a page of its own (kernels/instream/op_counters.h), handed
        // out with the workspace's descriptors: a sidecar without an fd channel hands out none.
        // Held here until the offer duplicated its descriptor, whatever ends the attachment.
        std::shared_ptr<InStreamOpCounterPage> counters;
        if (options_.fd_tickets != nullptr && !options_.fd_socket.empty()) {
          absl::StatusOr<std::unique_ptr<InStreamOpCounterPage>> page =
              InStreamOpCounterPage::Create();
          if (!page.ok()) {
            reactor->Finish(ToGrpcStatus(page.status()));
            return;
          }
          counters = std::move(*page);
        }
        if (exported->device == instream::DeviceKind::kCuda) instream_->ExpectKernelCounts();
        absl::StatusOr<uint64_t> id = instream_->Add(sid, generation, counters);
        if (!id.ok()) {
          reactor->Finish(ToGrpcStatus(id.status()));
          return;
        }
        absl::StatusOr<std::string> blob =
            BuildAttachBlob(*exported, *id, counters != nullptr,
                            instream_->counter_slot(*id).value_or(
                                instream::kInStreamUnattributedSlot));
        absl::Status done = blob.status();
        if (done.ok()) {
          std::optional<SocketCredentials> caller;
          if (options_.callers != nullptr) caller = options_.callers->ForPeer(ctx->peer());
          const FdTicketScope scope = AttachTicketScope(sid, *id);
          absl::StatusOr<AttachFdOffer> offer =
              OfferAttachFds(*exported, options_.fd_tickets, options_.fd_socket, caller, kOfferTtl,
                             scope, counters != nullptr ? counters->fd() : -1);
          done = offer.status();
          if (offer.ok() && offer->count != 0) {
            // The session may have ended (and revoked its tickets) before this one existed: the
            // check follows the offer, so one of the two drops it.
            done = registry_.CheckSession(sid);
            if (!done.ok()) options_.fd_tickets->RevokeAttachment(scope.session, scope.attachment);
            resp->set_fd_ticket(offer->ticket);
            resp->set_fd_count(offer->count);
            resp->set_fd_socket(offer->socket);
          }
        }
        if (!done.ok()) {
          static_cast<void>(instream_->Remove(sid, *id));
          reactor->Finish(ToGrpcStatus(done));
          return;
        }
        resp->set_attach_id(*id);
        resp->set_generation(generation);
        resp->set_memory_kind(AttachMemoryKindName(*exported));
        resp->set_image_bytes(exported->image_bytes);
        *resp->mutable_attach_blob() = *std::move(blob);
        spdlog::info("event=instream_attached attach_id={} memory={} blob_bytes={}", *id,
                     resp->memory_kind(), resp->attach_blob().size());
        reactor->Finish(grpc::Status::OK);
      });
  if (!queued.ok()) reactor->Finish(ToGrpcStatus(queued));
  return reactor;
}

grpc::ServerUnaryReactor* FusionService::Detach(grpc::CallbackServerContext* ctx,
                                                const v1::DetachRequest* req,
                                                v1::DetachResponse* /*resp*/) {
  auto session = SessionOf(*ctx);
  if (!session.ok()) return FinishNow(ctx, session.status());
  absl::Status removed = instream_->Remove(*session, req->attach_id());
  // The attachment's descriptors not yet picked up go with it.
  if (removed.ok() && options_.fd_tickets != nullptr) {
    const FdTicketScope scope = AttachTicketScope(*session, req->attach_id());
    options_.fd_tickets->RevokeAttachment(scope.session, scope.attachment);
  }
  return FinishNow(ctx, removed);
}

FdTicketScope AttachTicketScope(uint64_t session, uint64_t attach_id) {
  return FdTicketScope{absl::StrCat(session), absl::StrCat(attach_id)};
}

}  // namespace arfuse
