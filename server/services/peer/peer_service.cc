#include "server/services/peer/peer_service.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "server/services/common/grpc_status.h"

namespace arfuse {
namespace {

// Participant ids for gRPC joins live far above the socket server's connection ids.
std::atomic<uint64_t> next_grpc_participant{uint64_t{1} << 62};

absl::Status NoCoordinator() {
  return absl::UnavailableError(
      "this sidecar does not host the peer coordinator (rank 0 does, once its group forms)");
}

}  // namespace

PeerService::PeerService(absl::Duration default_deadline) : default_deadline_(default_deadline) {}

void PeerService::SetCoordinator(std::shared_ptr<peers::Coordinator> coordinator) {
  std::lock_guard<std::mutex> lock(mu_);
  coordinator_ = std::move(coordinator);
}

std::shared_ptr<peers::Coordinator> PeerService::coordinator() const {
  std::lock_guard<std::mutex> lock(mu_);
  return coordinator_;
}

absl::Time PeerService::DeadlineOf(const grpc::CallbackServerContext& context) const {
  absl::Time d = absl::FromChrono(context.deadline());
  absl::Time fallback = absl::Now() + default_deadline_;
  // Answer a little before the caller's own deadline so it hears which ranks were missing.
  absl::Duration left = d - absl::Now();
  if (left < default_deadline_) return d - std::min(left / 10, absl::Milliseconds(50));
  return fallback;
}

grpc::ServerUnaryReactor* PeerService::Join(grpc::CallbackServerContext* context,
                                            const v1::JoinRequest* request,
                                            v1::JoinResponse* response) {
  auto* reactor = context->DefaultReactor();
  absl::Status version = CheckClientApiVersion(*context);
  if (!version.ok()) {
    reactor->Finish(ToGrpcStatus(version));
    return reactor;
  }
  auto coord = coordinator();
  if (!coord) {
    reactor->Finish(ToGrpcStatus(NoCoordinator()));
    return reactor;
  }
  if (request->has_api() && request->api().major() != 1) {
    reactor->Finish(ToGrpcStatus(absl::FailedPreconditionError(
        absl::StrCat("peer API version ", request->api().major(), ".", request->api().minor(),
                     " is not supported by this coordinator (1.x)"))));
    return reactor;
  }
  peers::MemberInfo info;
  info.rank = static_cast<int>(request->rank());
  info.world_size = static_cast<int>(request->world_size());
  info.nnodes = static_cast<int>(request->nnodes());
  info.group = coord->group();  // the gRPC request has no group: the service fronts one group
  info.node_id = request->node_id();
  info.build_version = request->build_version();
  coord->Join(next_grpc_participant++, info, DeadlineOf(*context),
              [reactor, response](peers::JoinResult r) {
                if (r.status.ok()) {
                  response->set_epoch(r.epoch);
                  for (const auto& m : r.members) {
                    auto* j = response->add_members();
                    j->set_rank(m.rank);
                    j->set_world_size(m.world_size);
                    j->set_nnodes(m.nnodes);
                    j->set_node_id(m.node_id);
                    j->set_build_version(m.build_version);
                  }
                }
                reactor->Finish(ToGrpcStatus(r.status));
              });
  return reactor;
}

grpc::ServerUnaryReactor* PeerService::Collective(grpc::CallbackServerContext* context,
                                                  const v1::CollectiveRequest* request,
                                                  v1::CollectiveResponse* response) {
  auto* reactor = context->DefaultReactor();
  absl::Status version = CheckClientApiVersion(*context);
  if (!version.ok()) {
    reactor->Finish(ToGrpcStatus(version));
    return reactor;
  }
  auto coord = coordinator();
  if (!coord) {
    reactor->Finish(ToGrpcStatus(NoCoordinator()));
    return reactor;
  }
  peers::Contribution c;
  switch (request->kind()) {
    case v1::COLLECTIVE_KIND_ALLGATHER:
      c.kind = peers::CollectiveKind::kAllgather;
      break;
    case v1::COLLECTIVE_KIND_BARRIER:
      c.kind = peers::CollectiveKind::kBarrier;
      break;
    case v1::COLLECTIVE_KIND_VOTE:
      c.kind = peers::CollectiveKind::kVote;
      break;
    default:
      reactor->Finish(ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "collective kind ", static_cast<int>(request->kind()),
          " is not one of ALLGATHER, BARRIER, VOTE (descriptors travel over the Unix socket)"))));
      return reactor;
  }
  c.tag = request->tag();
  c.epoch = request->epoch();
  c.rank = static_cast<int>(request->rank());
  c.payload = request->payload();
  c.yes = request->yes();
  c.reason = request->reason();
  c.deadline = DeadlineOf(*context);
  // Participant 0: gRPC calls are not tied to the connection that joined.
  coord->Contribute(0, std::move(c), [reactor, response](peers::CollectiveResult r) {
    if (r.status.ok()) {
      for (auto& p : r.payloads) response->add_payloads(p);
      response->set_all_yes(r.all_yes);
      for (auto& reason : r.reasons) response->add_reasons(reason);
    }
    reactor->Finish(ToGrpcStatus(r.status));
  });
  return reactor;
}

grpc::ServerUnaryReactor* PeerService::Leave(grpc::CallbackServerContext* context,
                                             const v1::LeaveRequest* request,
                                             v1::LeaveResponse* /*response*/) {
  auto* reactor = context->DefaultReactor();
  absl::Status version = CheckClientApiVersion(*context);
  if (!version.ok()) {
    reactor->Finish(ToGrpcStatus(version));
    return reactor;
  }
  auto coord = coordinator();
  if (!coord) {
    reactor->Finish(ToGrpcStatus(NoCoordinator()));
    return reactor;
  }
  if (request->epoch() != coord->epoch()) {
    reactor->Finish(ToGrpcStatus(absl::AbortedError(absl::StrCat(
        "stale epoch ", request->epoch(), " (group is at epoch ", coord->epoch(), ")"))));
    return reactor;
  }
  coord->RankGone(static_cast<int>(request->rank()),
                  absl::StrCat("left: ", request->reason().substr(0, 200)));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace arfuse
