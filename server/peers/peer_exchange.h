// The sidecars' peer channel: ConnectPeers() joins the group through rank 0's coordinator and
// returns an Exchange. Usable from any process; no gRPC server is needed.
//
// Discovery: on one node (nnodes == 1 and a peer directory), rank 0 listens on the Unix socket
// <peer_dir>/<group>-rank0.sock and every rank connects there (descriptors can travel). Across
// nodes every rank connects to rank 0's TCP address (AllgatherFd is then UNIMPLEMENTED), with
// mutual TLS when options.tls names certificates.
// docs/peers.md has the protocol and the failure behaviour.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/peers/coordinator.h"
#include "server/peers/exchange.h"
#include "server/peers/peer_tls.h"

namespace arfuse {

struct PeerOptions {
  int rank = 0;
  int world_size = 1;
  int nnodes = 1;
  // One node: the directory shared by the group's sidecars (Unix sockets live there).
  std::string peer_dir;
  // Several nodes (or no peer_dir): "host:port" where rank 0 listens and every rank connects.
  std::string rank0_address;
  // The TCP channel's mutual TLS (peer_tls.h): this rank's certificate and key and the group's
  // CA, read when the group forms. All empty: plain TCP, which authenticates nobody (arfused
  // always gives them for a group across nodes). Not used on the Unix-socket channel.
  peers::PeerTlsFiles tls;
  // Tells groups sharing a directory or port apart: [A-Za-z0-9_.-], 1..64 characters.
  std::string group = "arfuse";
  // How long the join waits for every rank (--peer-timeout).
  absl::Duration timeout = absl::Seconds(60);
  // Ranks with equal node ids share a node; empty: the host name.
  std::string node_id;
  // Liveness of this rank's link while no collective needs it (--peer-heartbeat-timeout): the
  // link's I/O thread sends a heartbeat every `heartbeat_interval`; the coordinator declares this
  // rank lost after `heartbeat_timeout` without a byte from it, and this rank declares rank 0 lost
  // after `heartbeat_timeout` without a byte from the coordinator. Either way LinkStatus() turns
  // UNAVAILABLE naming the rank. A zero timeout turns heartbeats off: a frozen peer (whose socket
  // stays open) is then noticed only by the deadline of a collective or an op.
  absl::Duration heartbeat_interval = absl::Seconds(1);
  absl::Duration heartbeat_timeout = absl::Seconds(5);
};

// The Unix socket path rank 0 listens on; INVALID_ARGUMENT when it exceeds the 107 bytes a
// sockaddr_un can hold.
absl::StatusOr<std::string> PeerSocketPath(const std::string& peer_dir, const std::string& group);

class PeerExchange : public Exchange {
 public:
  ~PeerExchange() override = default;
  virtual uint64_t epoch() const = 0;
  // Every rank's join information, index = rank.
  virtual const std::vector<peers::MemberInfo>& members() const = 0;
  // Rank 0 only (null elsewhere): the coordinator this process hosts.
  virtual std::shared_ptr<peers::Coordinator> coordinator() const = 0;
  // Rank 0 only: the bound TCP port (0 without TCP).
  virtual int tcp_port() const = 0;
};

// Collective: every rank calls it. Returns when the whole group has joined. Errors:
// INVALID_ARGUMENT (bad options, path too long, group mismatch, TLS files that do not load),
// FAILED_PRECONDITION (duplicate rank, a live coordinator already owns the path), UNAUTHENTICATED
// (TCP: rank 0 refused this rank's certificate, or its own did not verify, or one side runs
// without TLS), UNAVAILABLE naming the ranks that did not join (or rank 0 when its coordinator
// was never reachable) within options.timeout.
absl::StatusOr<std::unique_ptr<PeerExchange>> ConnectPeers(const PeerOptions& options);

}  // namespace arfuse
