#include "server/instream/attachments.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/random_id.h"
#include "spdlog/spdlog.h"

namespace arfuse {

InStreamAttachments::InStreamAttachments(Notify notify, Probe probe, absl::Duration interval)
    : notify_(std::move(notify)), probe_(std::move(probe)), interval_(interval) {
  watcher_ = std::thread([this] { Watch(); });
}

InStreamAttachments::~InStreamAttachments() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  watcher_.join();  // the thread waits at most one probe (a bounded copy) before it sees stop_
}

absl::StatusOr<uint64_t> InStreamAttachments::Add(uint64_t session, uint64_t generation,
                                                  std::shared_ptr<InStreamOpCounterPage> counters) {
  std::lock_guard<std::mutex> lock(mu_);
  if (draining_) {
    return absl::FailedPreconditionError(
        "the workspace is draining (backend switch or shutdown); attach again after it");
  }
  // An attach whose export raced a poisoning or a re-form: its workspace can run no op, and it
  // would miss the events already sent for it.
  if (generation < serving_generation_) {
    return absl::FailedPreconditionError(
        "the workspace was rebuilt while this attach was prepared; attach again");
  }
  if (generation != 0 && generation == poisoned_generation_) {
    return absl::FailedPreconditionError(absl::StrCat("the workspace is poisoned (",
                                                      poisoned_cause_,
                                                      "); attach again after the group re-forms"));
  }
  for (const auto& [id, e] : entries_) {
    if (e.session == session) {
      return absl::AlreadyExistsError(
          absl::StrCat("this session already holds attachment ", id, "; detach it first"));
    }
  }
  // Random, so that no attach id says anything about another session's.
  uint64_t id = 0;
  do {
    id = RandomNonZeroId();
  } while (entries_.contains(id));
  Entry entry;
  entry.session = session;
  entry.generation = generation;
  entry.counters = std::move(counters);
  for (uint32_t s = 0; s < instream::kInStreamAttachSlots; ++s) {
    if (slots_[s].holder == 0 && !slots_[s].retiring) {
      slots_[s].holder = id;
      entry.slot = s;
      break;
    }
  }
  if (entry.slot == instream::kInStreamUnattributedSlot) {
    spdlog::warn("event=instream_counter_slots_exhausted slots={} action=count_for_the_rank_only",
                 instream::kInStreamAttachSlots);
  }
  entries_[id] = std::move(entry);
  cv_.notify_all();  // the watcher starts probing
  return id;
}

absl::Status InStreamAttachments::Remove(uint64_t session, uint64_t attach_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(attach_id);
  // One answer whether the id is unknown, already detached or another session's.
  if (it == entries_.end() || it->second.session != session) {
    return absl::PermissionDeniedError(
        "the attachment is not held by this session (detached, drained, never made here, or its "
        "workspace was rebuilt): attach again");
  }
  EndLocked(it->second);
  entries_.erase(it);
  cv_.notify_all();
  return absl::OkStatus();
}

std::vector<uint64_t> InStreamAttachments::RemoveSession(uint64_t session) {
  std::vector<uint64_t> ended;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.session == session) {
      ended.push_back(it->first);
      EndLocked(it->second);
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
  cv_.notify_all();
  return ended;
}

void InStreamAttachments::Acknowledge(uint64_t session, uint64_t attach_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(attach_id);
  if (it != entries_.end() && it->second.session == session) {
    EndLocked(it->second);
    entries_.erase(it);
  }
  cv_.notify_all();
}

bool InStreamAttachments::Busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !entries_.empty();
}

size_t InStreamAttachments::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

uint64_t InStreamAttachments::launches() const {
  std::lock_guard<std::mutex> lock(mu_);
  return launches_base_ + last_launches_;
}

uint64_t InStreamAttachments::stale() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stale_base_ + last_stale_;
}

void InStreamAttachments::EndLocked(const Entry& e) {
  if (e.counters != nullptr) ops_ended_ += e.counters->Sample();
  if (e.slot < instream::kInStreamAttachSlots) {
    slots_[e.slot].holder = 0;
    slots_[e.slot].retiring = true;
  }
}

bool InStreamAttachments::AnyRetiringLocked() const { return RetiringMaskLocked() != 0; }

InStreamOpCounts InStreamAttachments::WithKernelFusedLocked(InStreamOpCounts c,
                                                            const InStreamOpCounts& fused) const {
  if (kernel_counts_) std::memcpy(c.fused, fused.fused, sizeof(c.fused));
  return c;
}

InStreamOpCounts InStreamAttachments::op_counts() {
  std::lock_guard<std::mutex> lock(mu_);
  InStreamOpCounts total = ops_ended_;
  for (const auto& [id, e] : entries_) {
    if (e.counters != nullptr) total += e.counters->Sample();
  }
  return WithKernelFusedLocked(total, kernel_total_);
}

std::optional<InStreamOpCounts> InStreamAttachments::op_counts(uint64_t attach_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(attach_id);
  if (it == entries_.end()) return std::nullopt;
  const Entry& e = it->second;
  if (e.counters == nullptr && !kernel_counts_) return std::nullopt;
  return WithKernelFusedLocked(e.counters != nullptr ? e.counters->Sample() : InStreamOpCounts{},
                               e.kernel);
}

std::optional<InStreamOpCounts> InStreamAttachments::library_op_counts(uint64_t attach_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(attach_id);
  if (it == entries_.end() || it->second.counters == nullptr) return std::nullopt;
  return it->second.counters->Sample();
}

std::optional<uint32_t> InStreamAttachments::counter_slot(uint64_t attach_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(attach_id);
  if (it == entries_.end()) return std::nullopt;
  return it->second.slot;
}

uint64_t InStreamAttachments::unattributed_launches() const {
  std::lock_guard<std::mutex> lock(mu_);
  return unattributed_;
}

bool InStreamAttachments::kernel_counted() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kernel_counts_;
}

void InStreamAttachments::ExpectKernelCounts() {
  std::lock_guard<std::mutex> lock(mu_);
  kernel_counts_ = true;
}

uint64_t InStreamAttachments::refused_kernel_reads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_kernel_reads_;
}

void InStreamAttachments::RecordDivergence(uint32_t rank, uint64_t ops,
                                           const std::string& reasons) {
  std::lock_guard<std::mutex> lock(mu_);
  ++divergence_.total;
  divergence_.last_rank = rank;
  divergence_.last_ops = ops;
  divergence_.last_reasons = reasons;
}

InStreamAttachments::DivergenceRecord InStreamAttachments::divergence() const {
  std::lock_guard<std::mutex> lock(mu_);
  return divergence_;
}

void InStreamAttachments::ApplyOpTableLocked(const instream::InStreamOpTable& table) {
  kernel_counts_ = true;
  for (uint32_t s = 0; s < instream::kInStreamCounterSlots; ++s) {
    Entry* holder = nullptr;
    if (s < instream::kInStreamAttachSlots && slots_[s].holder != 0) {
      auto it = entries_.find(slots_[s].holder);
      if (it != entries_.end()) holder = &it->second;
    }
    for (uint32_t pi = 0; pi < instream::kOpPatterns; ++pi) {
      for (uint32_t b = 0; b < instream::kOpTokenBuckets; ++b) {
        uint64_t& last = last_ops_.ops[s][pi][b];
        const uint64_t now = table.ops[s][pi][b];
        // The workspace is mapped writable by its clients: a slot that jumped (or went back) is
        // garbage, adds nothing, and is read from its new value on.
        uint64_t d = 0;
        if (!instream::OpCounterAdvance(last, now, &d)) ++refused_kernel_reads_;
        last = now;
        kernel_total_.fused[pi][b] += d;
        if (s == instream::kInStreamUnattributedSlot) unattributed_ += d;
        if (holder != nullptr) holder->kernel.fused[pi][b] += d;
      }
    }
  }
}

void InStreamAttachments::QueueLocked(uint64_t session, AttachEventData event) {
  queue_.push_back(Pending{session, std::move(event)});
  ++queued_;
  cv_.notify_all();
}

void InStreamAttachments::Poisoned(uint64_t generation, const std::string& cause) {
  std::lock_guard<std::mutex> lock(mu_);
  PoisonedLocked(generation, cause);
}

void InStreamAttachments::PoisonedLocked(uint64_t generation, const std::string& cause) {
  if (generation == 0 || generation < serving_generation_) return;  // gone already
  if (generation != poisoned_generation_) {
    poisoned_generation_ = generation;
    poisoned_cause_ = cause;
  }
  for (auto& [id, e] : entries_) {
    if (e.generation != generation || e.told_poisoned) continue;
    e.told_poisoned = true;
    QueueLocked(e.session, AttachEventData{AttachEventKind::kPoisoned, id,
                                           absl::StrCat(poisoned_cause_, "; the group re-forms")});
  }
}

void InStreamAttachments::Reinitialized(uint64_t generation) {
  std::lock_guard<std::mutex> lock(mu_);
  ReinitializedLocked(generation);
}

void InStreamAttachments::ReinitializedLocked(uint64_t generation) {
  serving_generation_ = std::max(serving_generation_, generation);
  // Attachments made for a workspace that is gone (the engine was replaced) end here; their
  // clients must attach again.
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.generation < serving_generation_) {
      QueueLocked(it->second.session, AttachEventData{AttachEventKind::kReinitialized, it->first,
                                                      "the workspace was rebuilt; attach again"});
      EndLocked(it->second);
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
  cv_.notify_all();  // a drain waiting for the table to empty
}

size_t InStreamAttachments::Drain(const std::string& reason, absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  draining_ = true;
  for (auto& [id, e] : entries_) {
    e.draining = true;
    QueueLocked(e.session, AttachEventData{AttachEventKind::kDrain, id, reason});
  }
  const uint64_t mine = queued_;
  cv_.wait_until(lock, absl::ToChronoTime(deadline), [this] { return entries_.empty(); });
  const size_t left = entries_.size();
  if (left != 0) {
    spdlog::warn("event=instream_drain_incomplete attachments={} action=abort_workspace", left);
  }
  for (const auto& [id, e] : entries_) EndLocked(e);
  entries_.clear();
  // Attaches stay refused until the drain's own events are out (delivery never blocks: each is
  // queued on its session's stream), so none of them reaches an attachment made after it.
  cv_.wait_until(lock, absl::ToChronoTime(std::max(deadline, absl::Now() + absl::Seconds(1))),
                 [this, mine] { return delivered_ >= mine || stop_; });
  draining_ = false;
  return left;
}

uint32_t InStreamAttachments::RetiringMaskLocked() const {
  static_assert(instream::kInStreamAttachSlots <= 32);
  uint32_t mask = 0;
  for (uint32_t s = 0; s < instream::kInStreamAttachSlots; ++s) {
    if (slots_[s].retiring) mask |= 1u << s;
  }
  return mask;
}

void InStreamAttachments::ApplyProbeLocked(const InStreamProbe& p, uint32_t retiring) {
  // Slots whose holder had ended when this probe started reading are free after it: what they
  // launched last is credited below (or was lost with a workspace that is gone). A slot whose
  // holder ended while the probe read waits for the next one.
  auto free_retired = [&] {
    for (uint32_t s = 0; s < instream::kInStreamAttachSlots; ++s) {
      if ((retiring >> s) & 1u) slots_[s].retiring = false;
    }
  };
  if (!p.ok) {
    free_retired();
    return;
  }
  if (p.generation != probed_generation_) {
    launches_base_ += last_launches_;
    stale_base_ += last_stale_;
    last_launches_ = last_stale_ = 0;
    // A new workspace's table starts zeroed (its initialization).
    last_ops_ = instream::InStreamOpTable{};
    probed_generation_ = p.generation;
  }
  last_launches_ = p.launches;
  last_stale_ = p.stale;
  if (p.ops.has_value()) ApplyOpTableLocked(*p.ops);
  free_retired();
  // The kernels' error word is sticky for the workspace's life, so a probe cannot miss it while
  // the workspace lives; the supervisor records the poisoning itself before it drops one.
  if (p.error != 0) {
    PoisonedLocked(p.generation, absl::StrCat("the workspace is poisoned by an in-stream op (",
                                              p.error_name, ")"));
  }
  ReinitializedLocked(p.generation);
}

void InStreamAttachments::Watch() {
  std::unique_lock<std::mutex> lock(mu_);
  absl::Time next_probe = absl::Now();
  while (!stop_) {
    if (!queue_.empty()) {
      // In order, one at a time, without the lock: notify_ may call back into this table.
      Pending next = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      notify_(next.session, next.event);
      lock.lock();
      ++delivered_;
      cv_.notify_all();
      continue;
    }
    // A retiring slot waits for one more probe (its holder's last launches) before it is free.
    if (entries_.empty() && !AnyRetiringLocked()) {
      cv_.wait(lock, [this] {
        return stop_ || !entries_.empty() || !queue_.empty() || AnyRetiringLocked();
      });
      continue;
    }
    if (absl::Now() >= next_probe) {
      const uint32_t retiring = RetiringMaskLocked();
      lock.unlock();
      const InStreamProbe p = probe_();
      lock.lock();
      if (stop_) break;
      ApplyProbeLocked(p, retiring);
      next_probe = absl::Now() + interval_;
      continue;
    }
    cv_.wait_until(lock, absl::ToChronoTime(next_probe),
                   [this] { return stop_ || !queue_.empty(); });
  }
}

}  // namespace arfuse
