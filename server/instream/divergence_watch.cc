#include "server/instream/divergence_watch.h"

#include <utility>

#include "spdlog/spdlog.h"

namespace arfuse {

InStreamDivergenceWatch::InStreamDivergenceWatch(int world_size, InStreamAttachments* attachments,
                                                 Allgather allgather, OnDivergence on_divergence,
                                                 absl::Duration interval)
    : world_size_(world_size),
      attachments_(attachments),
      allgather_(std::move(allgather)),
      on_divergence_(std::move(on_divergence)),
      interval_(interval) {}

std::vector<DivergenceFinding> InStreamDivergenceWatch::Tick(absl::Time now) {
  if (world_size_ < 2 || now < next_) return {};
  next_ = now + interval_;
  const RankDecisions own = attachments_ != nullptr ? DecisionsOf(attachments_->op_counts())
                                                    : DecisionsOf(InStreamOpCounts{});
  absl::StatusOr<std::vector<std::string>> gathered =
      allgather_(EncodeRankDecisions(own), now + interval_ / 2);
  if (!gathered.ok()) {
    spdlog::debug("event=instream_counts_exchange_failed error=\"{}\"",
                  std::string(gathered.status().message()));
    return {};
  }
  std::vector<RankDecisions> ranks;
  ranks.reserve(gathered->size());
  for (const std::string& p : *gathered) ranks.push_back(DecodeRankDecisions(p));
  DivergenceStep step = ObserveDecisions(state_, ranks);
  state_ = std::move(step.next);
  for (const DivergenceFinding& f : step.findings) {
    const std::string reasons = DivergenceReasonsText(f);
    spdlog::error(
        "event=instream_divergence rank={} ops={} lead_rank={} top_declines=\"{}\" error=\"rank {} "
        "declined {} in-stream op(s) that rank {} fused: a rank that runs its own path while its "
        "peers wait in the fused kernel hangs them until the spin timeout\"",
        f.rank, f.ops, f.lead_rank, reasons, f.rank, f.ops, f.lead_rank);
    if (attachments_ != nullptr) attachments_->RecordDivergence(f.rank, f.ops, reasons);
    if (on_divergence_) on_divergence_(f);
  }
  return step.findings;
}

}  // namespace arfuse
