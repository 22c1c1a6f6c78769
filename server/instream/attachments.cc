#include "server/instream/attachments.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/core/random_id.h"
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
  watcher_.join();  // the watcher waits at most one probe (a bounded copy) before it sees stop_
}

absl::StatusOr<uint64_t> InStreamAttachments::Add(uint64_t session, uint64_t generation) {
  std::lock_guard<std::mutex> lock(mu_);
  if (draining_) {
    return absl::FailedPreconditionError(
        "the workspace is draining (backend switch or shutdown); attach again after it");
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
  entries_[id] = Entry{session, generation, false};
  poisoned_reported_ = false;
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
  entries_.erase(it);
  cv_.notify_all();
  return absl::OkStatus();
}

void InStreamAttachments::RemoveSession(uint64_t session) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    it = it->second.session == session ? entries_.erase(it) : std::next(it);
  }
  cv_.notify_all();
}

void InStreamAttachments::Acknowledge(uint64_t session, uint64_t attach_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(attach_id);
  if (it != entries_.end() && it->second.session == session) entries_.erase(it);
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

size_t InStreamAttachments::Drain(const std::string& reason, absl::Time deadline) {
  std::vector<std::pair<uint64_t, AttachEventData>> events;
  {
    std::lock_guard<std::mutex> lock(mu_);
    draining_ = true;
    for (auto& [id, e] : entries_) {
      e.draining = true;
      events.push_back({e.session, AttachEventData{AttachEventKind::kDrain, id, reason}});
    }
  }
  Deliver(std::move(events));
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, absl::ToChronoTime(deadline), [this] { return entries_.empty(); });
  const size_t left = entries_.size();
  if (left != 0) {
    spdlog::warn("event=instream_drain_incomplete attachments={} action=abort_workspace", left);
  }
  entries_.clear();
  draining_ = false;
  return left;
}

void InStreamAttachments::Deliver(std::vector<std::pair<uint64_t, AttachEventData>> events) {
  for (const auto& [session, event] : events) notify_(session, event);
}

void InStreamAttachments::Watch() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (entries_.empty()) {
      cv_.wait(lock, [this] { return stop_ || !entries_.empty(); });
      continue;
    }
    lock.unlock();
    const InStreamProbe p = probe_();
    lock.lock();
    if (stop_) break;
    std::vector<std::pair<uint64_t, AttachEventData>> events;
    if (p.ok) {
      if (p.generation != probed_generation_) {
        launches_base_ += last_launches_;
        stale_base_ += last_stale_;
        last_launches_ = last_stale_ = 0;
        probed_generation_ = p.generation;
      }
      last_launches_ = p.launches;
      last_stale_ = p.stale;
    }
    // Attachments made for a workspace that is gone (the engine was replaced) end here; their
    // clients must attach again.
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (p.ok && it->second.generation != p.generation) {
        events.push_back(
            {it->second.session, AttachEventData{AttachEventKind::kReinitialized, it->first,
                                                 "the workspace was rebuilt; attach again"}});
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
    if (p.ok && p.error != 0 && !poisoned_reported_) {
      poisoned_reported_ = true;
      for (const auto& [id, e] : entries_) {
        events.push_back(
            {e.session, AttachEventData{AttachEventKind::kPoisoned, id,
                                        absl::StrCat("the workspace is poisoned (", p.error_name,
                                                     "); the group re-forms")}});
      }
    }
    if (!events.empty()) {
      lock.unlock();
      Deliver(std::move(events));
      lock.lock();
    }
    cv_.wait_for(lock, absl::ToChronoNanoseconds(interval_), [this] { return stop_; });
  }
}

}  // namespace arfuse
