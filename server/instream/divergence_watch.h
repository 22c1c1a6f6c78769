// The sidecars' exchange of their ranks' in-stream counts (divergence.h says what is compared
// and why): every interval each rank's sidecar offers its rank's cumulative fused and declined
// counts over the peer channel's ALLGATHER, runs ObserveDecisions over what it gathered, and for
// every rank found diverging logs one ERROR, records it for GetWorkspaceInfo and calls the
// caller's hook (the metric). CUDA-free and gRPC-free: the exchange comes in as a function.
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
  // Every rank's payload, indexed by rank (the peer channel's Allgather under one tag, whose
  // k-th call on every rank meets the others' k-th). It must return by `deadline`.
  using Allgather = std::function<absl::StatusOr<std::vector<std::string>>(
      const std::string& payload, absl::Time deadline)>;
  using OnDivergence = std::function<void(const DivergenceFinding&)>;

  // `attachments` may be null (the rank then offers zero counts). Nothing runs for a group of
  // one rank.
  InStreamDivergenceWatch(int world_size, InStreamAttachments* attachments, Allgather allgather,
                          OnDivergence on_divergence,
                          absl::Duration interval = kInStreamDivergenceInterval);

  // Called by the group supervisor on every tick of its serving loop; one exchange every
  // interval, otherwise returns at once. An exchange waits at most half an interval for the
  // other ranks (their supervisors tick on the same schedule: each exchange ends at the same
  // moment on every rank); one that fails is skipped. Returns the findings of this call.
  std::vector<DivergenceFinding> Tick(absl::Time now);

 private:
  const int world_size_;
  InStreamAttachments* const attachments_;
  const Allgather allgather_;
  const OnDivergence on_divergence_;
  const absl::Duration interval_;
  absl::Time next_ = absl::InfinitePast();
  DivergenceState state_;
};

}  // namespace arfuse
