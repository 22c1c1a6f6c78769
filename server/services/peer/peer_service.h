// arfuse.v1.Peer over gRPC: a thin front of rank 0's Coordinator (the same one the peer
// channel's sockets feed), for peers that speak gRPC instead of the framed socket protocol.
//
// How the daemon serves it:
//   PeerService peer_service;                     // registered with the ServerBuilder up front
//   builder.RegisterService(&peer_service);
//   auto exchange = ConnectPeers(peer_options);   // rank 0 hosts the coordinator
//   if (exchange.ok() && (*exchange)->coordinator())
//     peer_service.SetCoordinator((*exchange)->coordinator());
// Until a coordinator is set (and on ranks other than 0) every call answers UNAVAILABLE naming
// why. Re-forming the group means SetCoordinator() with the new exchange's coordinator.
// Ranks that use gRPC have no connection whose close the coordinator could see: their loss is
// detected by deadlines (or Leave), while socket peers are detected at once.
#pragma once

#include <memory>
#include <mutex>

#include "absl/time/time.h"
#include "arfuse/v1/peer.grpc.pb.h"
#include "server/peers/coordinator.h"

namespace arfuse {

class PeerService final : public v1::Peer::CallbackService {
 public:
  // Applied to calls that arrive without a deadline.
  explicit PeerService(absl::Duration default_deadline = absl::Seconds(60));

  void SetCoordinator(std::shared_ptr<peers::Coordinator> coordinator);

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* context,
                                 const v1::JoinRequest* request,
                                 v1::JoinResponse* response) override;
  grpc::ServerUnaryReactor* Collective(grpc::CallbackServerContext* context,
                                       const v1::CollectiveRequest* request,
                                       v1::CollectiveResponse* response) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* context,
                                  const v1::LeaveRequest* request,
                                  v1::LeaveResponse* response) override;

 private:
  std::shared_ptr<peers::Coordinator> coordinator() const;
  absl::Time DeadlineOf(const grpc::CallbackServerContext& context) const;

  const absl::Duration default_deadline_;
  mutable std::mutex mu_;
  std::shared_ptr<peers::Coordinator> coordinator_;
};

}  // namespace arfuse
