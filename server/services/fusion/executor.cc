#include "server/services/fusion/executor.h"

#include "absl/strings/str_cat.h"

namespace arfuse {

Executor::Executor(int threads, size_t max_queued)
    : max_queued_(max_queued), slots_(static_cast<size_t>(threads)) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

Executor::~Executor() {
  Shutdown();
  for (auto& t : threads_) t.join();
}

absl::Status Executor::Submit(Task task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("sidecar is shutting down");
    if (queue_.size() >= max_queued_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          queue_.size(), " ops already wait for this workspace; retry later"));
    }
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
  return absl::OkStatus();
}

void Executor::Shutdown() {
  std::deque<Task> drained;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    drained.swap(queue_);
  }
  cv_.notify_all();
  // Every accepted task ends its RPC exactly once, even when it never runs.
  for (auto& t : drained) t(/*cancelled=*/true);
}

bool Executor::RunInlineIfIdle(const Task& task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || !queue_.empty() || running_ >= slots_) return false;
    ++running_;
  }
  task(/*cancelled=*/false);
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    --running_;
    wake = !queue_.empty();
  }
  // A task queued while this one ran waited for the slot: a worker takes it now.
  if (wake) cv_.notify_one();
  return true;
}

size_t Executor::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

void Executor::Loop() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || (!queue_.empty() && running_ < slots_); });
      if (queue_.empty()) return;  // stopping (Shutdown drained the queue)
      task = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    task(/*cancelled=*/false);
    bool more = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      --running_;
      more = !queue_.empty();
    }
    // Another worker may be waiting for the slot this task held.
    if (more) cv_.notify_one();
  }
}

}  // namespace arfuse
