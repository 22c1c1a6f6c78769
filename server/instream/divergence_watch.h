// The sidecars' exchange of their ranks' in-stream counts (divergence.h says what is compared
// and why): every interval each rank's sidecar offers its rank's cumulative fused and declined
// counts as its gossip on the peer channel (Exchange::SetGossip: carried by the link's
// heartbeats, never a collective, so it cannot line up differently with the group's votes and
// backend switches on different ranks, and nothing waits for a slow rank), reads every rank's
// latest counts back (Exchange::Gossip), runs ObserveDecisions over the table, and for every
// rank found diverging logs one ERROR, records it for GetWorkspaceInfo and calls the caller's
// hook (the metric). A rank's counts reach its peers up to about two heartbeat intervals late,
// and lateness alone is never a divergence: the counts are monotone in the op sequence, so a
// snapshot of a rank deciding alike that fused fewer ops than the leader's (earlier in the
// sequence) has declined no more than the leader's. CUDA-free and gRPC-free: the exchange comes
// in as functions.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/instream/attachments.h"
#include "server/instream/divergence.h"

namespace arfuse {

// How often the ranks exchange their counts: a divergence is reported within about two of these
// (it must hold in two exchanges in a row).
inline constexpr absl::Duration kInStreamDivergenceInterval = absl::Seconds(1);

class InStreamDivergenceWatch {
 public:
  // Offers this rank's payload (Exchange::SetGossip); returns at once.
  using Offer = std::function<void(std::string payload)>;
  // Every rank's latest payload, index = rank (Exchange::Gossip); returns at once.
  using Gathered = std::function<std::vector<std::string>()>;
  using OnDivergence = std::function<void(const DivergenceFinding&)>;

  // `attachments` may be null (the rank then offers zero counts). Nothing runs for a group of
  // one rank.
  InStreamDivergenceWatch(int world_size, InStreamAttachments* attachments, Offer offer,
                          Gathered gathered, OnDivergence on_divergence,
                          absl::Duration interval = kInStreamDivergenceInterval);

  // Called by the group supervisor on every tick of its serving loop; never blocks. Every
  // interval it offers this rank's counts and observes the gathered table once every rank's
  // counts are in it. Returns the findings.
  std::vector<DivergenceFinding> Tick(absl::Time now);

 private:
  const int world_size_;
  InStreamAttachments* const attachments_;
  const Offer offer_;
  const Gathered gathered_;
  const OnDivergence on_divergence_;
  const absl::Duration interval_;
  absl::Time next_ = absl::InfinitePast();
  DivergenceState state_;
};

}  // namespace arfuse
