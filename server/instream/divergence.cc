#include "server/instream/divergence.h"

#include <algorithm>
#include <charconv>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace arfuse {
namespace {

constexpr std::string_view kMagic = "isd1";

DivergenceState Rebased(const std::vector<RankDecisions>& now) {
  DivergenceState s;
  s.based = true;
  s.base = now;
  s.candidate.assign(now.size(), 0);
  return s;
}

}  // namespace

RankDecisions DecisionsOf(const InStreamOpCounts& counts) {
  RankDecisions d;
  d.valid = true;
  d.fused = counts.fused_total();
  d.declined = counts.declined_total();
  for (uint32_t r = 0; r < instream::kDeclineReasons; ++r)
    d.declined_by_reason[r] = counts.declined[r];
  return d;
}

std::string EncodeRankDecisions(const RankDecisions& d) {
  std::string out =
      absl::StrCat(absl::string_view(kMagic.data(), kMagic.size()), " ", d.fused, " ", d.declined);
  for (uint64_t v : d.declined_by_reason) absl::StrAppend(&out, " ", v);
  return out;
}

RankDecisions DecodeRankDecisions(std::string_view payload) {
  RankDecisions d;
  std::vector<std::string_view> words;
  for (absl::string_view w : absl::StrSplit(absl::string_view(payload.data(), payload.size()), ' '))
    words.emplace_back(w.data(), w.size());
  if (words.size() != 3 + instream::kDeclineReasons || words[0] != kMagic) return d;
  uint64_t values[2 + instream::kDeclineReasons];
  for (size_t i = 1; i < words.size(); ++i) {
    const std::string_view w = words[i];
    // Plain decimal only: no sign, no leading zeros beyond "0", no empty word.
    if (w.empty() || w.size() > 20 || (w.size() > 1 && w[0] == '0')) return d;
    uint64_t v = 0;
    const auto [end, ec] = std::from_chars(w.data(), w.data() + w.size(), v);
    if (ec != std::errc() || end != w.data() + w.size()) return d;
    values[i - 1] = v;
  }
  uint64_t sum = 0;
  for (uint32_t r = 0; r < instream::kDeclineReasons; ++r) {
    d.declined_by_reason[r] = values[2 + r];
    sum += values[2 + r];
  }
  if (sum != values[1]) return d;
  d.fused = values[0];
  d.declined = values[1];
  d.valid = true;
  return d;
}

std::string DivergenceReasonsText(const DivergenceFinding& f) {
  return absl::StrJoin(f.top_reasons, ", ", [](std::string* out, const auto& r) {
    absl::StrAppend(out, r.first, " ", r.second);
  });
}

DivergenceState ZeroBaseline(size_t ranks) {
  RankDecisions zero;
  zero.valid = true;
  return Rebased(std::vector<RankDecisions>(ranks, zero));
}

DivergenceStep ObserveDecisions(const DivergenceState& prev,
                                const std::vector<RankDecisions>& now) {
  DivergenceStep step;
  // One rank alone cannot disagree with anyone; garbage from any rank says nothing about the
  // others' agreement: start over.
  const bool comparable =
      now.size() >= 2 &&
      std::all_of(now.begin(), now.end(), [](const RankDecisions& d) { return d.valid; });
  if (!comparable) return step;  // next: not based
  if (!prev.based || prev.base.size() != now.size() || prev.candidate.size() != now.size()) {
    step.next = Rebased(now);
    return step;
  }
  const size_t n = now.size();
  std::vector<uint64_t> fused(n), declined(n);
  std::vector<std::vector<uint64_t>> reasons(n, std::vector<uint64_t>(instream::kDeclineReasons));
  for (size_t r = 0; r < n; ++r) {
    bool ok = instream::OpCounterAdvance(prev.base[r].fused, now[r].fused, &fused[r]) &&
              instream::OpCounterAdvance(prev.base[r].declined, now[r].declined, &declined[r]);
    for (uint32_t q = 0; ok && q < instream::kDeclineReasons; ++q) {
      ok = instream::OpCounterAdvance(prev.base[r].declined_by_reason[q],
                                      now[r].declined_by_reason[q], &reasons[r][q]);
    }
    // A count that went back (a restarted sidecar) or jumped: no common baseline any more.
    if (!ok) {
      step.next = Rebased(now);
      return step;
    }
  }
  size_t lead = 0;
  for (size_t r = 1; r < n; ++r) {
    if (fused[r] > fused[lead]) lead = r;
  }
  step.next = prev;
  for (size_t r = 0; r < n; ++r) {
    const uint64_t lag = fused[lead] - fused[r];
    const uint64_t excess = declined[r] > declined[lead] ? declined[r] - declined[lead] : 0;
    const uint64_t amount = std::min(lag, excess);
    if (amount > 0 && prev.candidate[r] > 0) {
      DivergenceFinding f;
      f.rank = static_cast<uint32_t>(r);
      f.ops = amount;
      f.lead_rank = static_cast<uint32_t>(lead);
      std::vector<uint32_t> order;
      for (uint32_t q = 0; q < instream::kDeclineReasons; ++q) {
        if (reasons[r][q] != 0) order.push_back(q);
      }
      std::stable_sort(order.begin(), order.end(),
                       [&](uint32_t a, uint32_t b) { return reasons[r][a] > reasons[r][b]; });
      for (size_t i = 0; i < order.size() && i < kDivergenceTopReasons; ++i) {
        f.top_reasons.emplace_back(instream::kDeclineReasonNames[order[i]], reasons[r][order[i]]);
      }
      step.findings.push_back(std::move(f));
    }
    step.next.candidate[r] = amount;
  }
  if (!step.findings.empty()) step.next = Rebased(now);
  return step;
}

}  // namespace arfuse
