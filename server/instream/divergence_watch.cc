#include "server/instream/divergence_watch.h"

#include <utility>

#include "spdlog/spdlog.h"

namespace arfuse {

InStreamDivergenceWatch::InStreamDivergenceWatch(int world_size, InStreamAttachments* attachments,
                                                 Offer offer, Gathered gathered,
                                                 OnDivergence on_divergence,
                                                 absl::Duration interval)
    : world_size_(world_size),
      attachments_(attachments),
      offer_(std::move(offer)),
      gathered_(std::move(gathered)),
      on_divergence_(std::move(on_divergence)),
      interval_(interval),
      state_(ZeroBaseline(world_size < 0 ? 0 : static_cast<size_t>(world_size))) {}

std::vector<DivergenceFinding> InStreamDivergenceWatch::Tick(absl::Time now) {
  if (world_size_ < 2 || now < next_) return {};
  next_ = now + interval_;
  const RankDecisions own = attachments_ != nullptr ? DecisionsOf(attachments_->op_counts())
                                                    : DecisionsOf(InStreamOpCounts{});
  offer_(EncodeRankDecisions(own));
  const std::vector<std::string> table = gathered_();
  // No echo yet (a group that just formed), or a rank rank 0 has not heard from since: wait for
  // it rather than take the gap as garbage, which would restart the baseline and could hide a
  // divergence that happened just before a re-formation.
  if (table.size() != static_cast<size_t>(world_size_)) return {};
  for (const std::string& p : table) {
    if (p.empty()) return {};
  }
  std::vector<RankDecisions> ranks;
  ranks.reserve(table.size());
  for (const std::string& p : table) ranks.push_back(DecodeRankDecisions(p));
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
