// Worker threads for work a gRPC callback thread must not do: the fused op (one at a time per
// workspace, FIFO, bounded queue) and control calls that may wait (unregister drains ops in
// flight; opening an IPC handle can take milliseconds).
//
// RunInlineIfIdle lets the caller run a task on its own thread when nothing is queued and a
// worker slot is free: the common case of one client issuing ops one after another then costs no
// thread hand-off (a condition-variable wake-up and a reply sent from another thread, tens of
// microseconds on a loaded host). The inline task holds a worker slot, so ordering and the
// one-at-a-time limit are the same as for submitted tasks.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace arfuse {

class Executor {
 public:
  // A task gets `cancelled` = true when the executor shut down before it could run: it must then
  // end its RPC (UNAVAILABLE) without doing the work.
  using Task = std::function<void(bool cancelled)>;

  Executor(int threads, size_t max_queued);
  // Shutdown(), then joins: waits for the tasks running now, whose own deadlines bound them.
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // RESOURCE_EXHAUSTED when `max_queued` tasks already wait; UNAVAILABLE after Shutdown().
  absl::Status Submit(Task task);
  // Runs `task(false)` on the calling thread and returns true when the executor is idle (not
  // stopping, nothing queued, a worker slot free); otherwise returns false without running it
  // (the caller Submits it). Tasks submitted meanwhile wait for the inline one.
  bool RunInlineIfIdle(const Task& task);
  // Refuses new tasks and runs every queued one with cancelled = true. Never blocks on a task.
  void Shutdown();
  size_t queued() const;

 private:
  void Loop();

  const size_t max_queued_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  // Tasks running now (on workers or inline); at most threads_.size().
  size_t running_ = 0;
  size_t slots_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace arfuse
