// The in-stream plane's bookkeeping in the sidecar (docs/instream.md): which sessions hold an
// attachment to the workspace, and what each must be told. CUDA-free and gRPC-free; the Fusion
// service delivers the events on the sessions' streams.
//
// An attachment belongs to a session and ends with it (the client disconnected or died), with
// Detach, with a drain (backend switch, shutdown: the client acknowledges on its session stream)
// or when the workspace it was made for is gone (the engine was replaced after a poisoning:
// REINITIALIZED tells the client to attach again).
//
// Events are transitions, not samples: whoever sees a workspace change (the group supervisor
// before it drops a poisoned workspace, the watcher's probe of the kernels' error word, a drain)
// records it here, and each record queues its events at once, in the order the transitions
// happened. One thread delivers the queue in order, so a session always hears POISONED (with its
// reason) before the REINITIALIZED that follows it, however soon the group re-forms.
//
// While any attachment exists the workspace belongs to the in-stream plane: the sidecar runs no
// op of its own on it (Busy()), since its launches and the clients' would interleave in the
// kernels' per-workspace sequence.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/instream/op_counters.h"

namespace arfuse {

enum class AttachEventKind : uint8_t { kDrain = 1, kReinitialized = 2, kPoisoned = 3 };

struct AttachEventData {
  AttachEventKind kind = AttachEventKind::kDrain;
  uint64_t attach_id = 0;
  std::string reason;
};

// What the watcher samples from the engine: the generation of the workspace serving now, and its
// error word.
struct InStreamProbe {
  bool ok = false;  // false: no engine or no workspace right now
  uint64_t generation = 0;
  uint32_t error = 0;
  std::string error_name;
  uint64_t launches = 0;
  uint64_t stale = 0;
  // CUDA: the kernels' per-attachment launch counts (InStreamCounters::ops); absent in host mode.
  std::optional<instream::InStreamOpTable> ops;
};

class InStreamAttachments {
 public:
  // `notify` delivers an event to a session (called without the table's lock held, from the
  // delivery thread, one event at a time in the order they were queued). `probe` samples the
  // engine; it is called from that thread every `interval` while attachments exist.
  using Notify = std::function<void(uint64_t session, const AttachEventData& event)>;
  using Probe = std::function<InStreamProbe()>;
  InStreamAttachments(Notify notify, Probe probe, absl::Duration interval = absl::Milliseconds(50));
  ~InStreamAttachments();  // stops the thread (never waits for clients); undelivered events go
  InStreamAttachments(const InStreamAttachments&) = delete;
  InStreamAttachments& operator=(const InStreamAttachments&) = delete;

  // A new attachment of `session` to the workspace of `generation`, with a random 64-bit id.
  // ALREADY_EXISTS when the session holds one; FAILED_PRECONDITION while a drain is in progress,
  // for a workspace known to be poisoned (with the poisoning's reason) and for one already
  // replaced by a newer one. `counters` is the attachment's op counter page (null: none), read
  // for op_counts() while the attachment lives and once more when it ends. The attachment gets
  // a free slot of the kernels' launch counts (counter_slot()); when all kInStreamAttachSlots
  // are taken it shares kInStreamUnattributedSlot, whose launches count for the rank only.
  absl::StatusOr<uint64_t> Add(uint64_t session, uint64_t generation,
                               std::shared_ptr<InStreamOpCounterPage> counters = nullptr);
  // PERMISSION_DENIED for an id the session does not hold, the same whether another session
  // holds it or none does, and without the id.
  absl::Status Remove(uint64_t session, uint64_t attach_id);
  // The session ended: its attachment (if any) ends. Returns the ids that ended (the caller
  // retires an op the client left mid-way: InStreamHost::InStreamClientEnded).
  std::vector<uint64_t> RemoveSession(uint64_t session);
  // The client's SessionRequest.drained_attach_id.
  void Acknowledge(uint64_t session, uint64_t attach_id);

  // The workspace of `generation` is poisoned because of `cause`: every attachment made for it is
  // told POISONED once (the first cause recorded wins), and later attaches to it are refused.
  // Idempotent; never blocks.
  void Poisoned(uint64_t generation, const std::string& cause);
  // The workspace of `generation` serves now: every attachment made for an older one is told
  // REINITIALIZED (after any POISONED queued before) and ends, and later attaches to an older one
  // are refused. Never blocks.
  void Reinitialized(uint64_t generation);

  // Whether the workspace belongs to the in-stream plane now (an attachment exists).
  bool Busy() const;
  size_t size() const;

  // Asks every attachment to drain (DRAIN on its session, after the events queued before) and
  // waits until each acknowledged or its session ended, at most until `deadline`; new attachments
  // are refused meanwhile. Returns how many did not answer in time (their clients' launches end at
  // the workspace's abort, when the caller drops it). Every attachment is gone when it returns.
  size_t Drain(const std::string& reason, absl::Time deadline);

  // Sums of the kernels' counters as last probed, for metrics (monotonic across workspaces).
  uint64_t launches() const;
  uint64_t stale() const;

  // The in-stream ops of this rank (monotonic): declined ops from the clients' counter pages
  // (those of attachments that ended plus every live attachment's, each page read now; bounded
  // per attachment, see InStreamOpCounterPage::Sample). Fused ops, once a probe carried the
  // kernels' launch counts (CUDA), are every launch the kernels counted, graph replays and the
  // unattributed slot included; before that (host mode) the pages' fused counts.
  InStreamOpCounts op_counts();
  // One live attachment's counts: as above, with fused ops the kernels counted in its slot while
  // it held it. nullopt for an unknown id, or one with neither a page nor kernel counts.
  std::optional<InStreamOpCounts> op_counts(uint64_t attach_id);
  // What one live attachment's library decided (its page alone: on CUDA a captured op counts
  // once, however often its graph replays); nullopt for an unknown id or one without a page.
  std::optional<InStreamOpCounts> library_op_counts(uint64_t attach_id);
  // The attachment's slot of the kernels' launch counts; nullopt for an unknown id.
  std::optional<uint32_t> counter_slot(uint64_t attach_id) const;
  // Launches the kernels counted in kInStreamUnattributedSlot (an index out of range, or an
  // attachment that found no free slot), and slot reads refused as garbage (a slot that moved
  // by more than kMaxOpCounterDelta: the workspace is mapped writable by its clients).
  uint64_t unattributed_launches() const;
  // Whether fused counts are the kernels' (a CUDA attach or probe was seen).
  bool kernel_counted() const;
  // A CUDA workspace is being attached: fused ops are the kernels' counts from now on, also
  // before the first probe reads them (the pages' fused counts are never exported on CUDA).
  void ExpectKernelCounts();
  uint64_t refused_kernel_reads() const;

  // The sidecars' comparison of their ranks' decisions (server/instream/divergence.h): the last
  // divergence found and how many were, for GetWorkspaceInfo. Recorded by the watch that runs
  // the exchange.
  struct DivergenceRecord {
    uint64_t total = 0;
    uint32_t last_rank = 0;
    uint64_t last_ops = 0;
    std::string last_reasons;  // "other 3, dtype 1"
  };
  void RecordDivergence(uint32_t rank, uint64_t ops, const std::string& reasons);
  DivergenceRecord divergence() const;

 private:
  struct Entry {
    uint64_t session = 0;
    uint64_t generation = 0;
    bool draining = false;
    bool told_poisoned = false;
    std::shared_ptr<InStreamOpCounterPage> counters;
    uint32_t slot = instream::kInStreamUnattributedSlot;
    // Fused launches the kernels counted in `slot` while this attachment held it.
    InStreamOpCounts kernel;
  };
  // A slot of the kernels' launch counts: held by an attachment, or retiring (its holder ended;
  // the next probe credits what it launched last, then frees it, so that a new holder starts from
  // a fresh baseline and never inherits the previous one's launches).
  struct Slot {
    uint64_t holder = 0;  // attach id, 0: none
    bool retiring = false;
  };
  struct Pending {
    uint64_t session = 0;
    AttachEventData event;
  };
  // mu_ held: queues one event (delivered in queue order) and wakes the delivery thread.
  void QueueLocked(uint64_t session, AttachEventData event);
  void PoisonedLocked(uint64_t generation, const std::string& cause);
  void ReinitializedLocked(uint64_t generation);
  // The delivery thread: delivers the queue in order and probes every interval_ while
  // attachments exist.
  void Watch();
  // `retiring`: RetiringMaskLocked() as it was before the probe was read.
  void ApplyProbeLocked(const InStreamProbe& p, uint32_t retiring);
  uint32_t RetiringMaskLocked() const;
  // mu_ held: an attachment ends: its page is read a last time into ops_ended_.
  void EndLocked(const Entry& e);
  bool AnyRetiringLocked() const;
  // mu_ held: the probe's kernel counts since the last probe, per slot.
  void ApplyOpTableLocked(const instream::InStreamOpTable& table);
  // mu_ held: `c` with its fused counts replaced by `fused` when the kernels count (CUDA).
  InStreamOpCounts WithKernelFusedLocked(InStreamOpCounts c, const InStreamOpCounts& fused) const;

  const Notify notify_;
  const Probe probe_;
  const absl::Duration interval_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Entry> entries_;  // by attach id
  bool draining_ = false;
  bool stop_ = false;
  // Events not yet delivered, oldest first; `queued_` counts every event ever queued and
  // `delivered_` those handed to notify_ (a drain waits for its own).
  std::deque<Pending> queue_;
  uint64_t queued_ = 0, delivered_ = 0;
  // The newest poisoned workspace and why; the newest workspace known to serve (older ones are
  // gone). Generations only grow within a process.
  uint64_t poisoned_generation_ = 0;
  std::string poisoned_cause_;
  uint64_t serving_generation_ = 0;
  // Counters: those of workspaces gone, plus the last probe of the current one.
  uint64_t launches_base_ = 0, stale_base_ = 0, last_launches_ = 0, last_stale_ = 0;
  uint64_t probed_generation_ = 0;
  // Op counts of the attachments that ended.
  InStreamOpCounts ops_ended_;
  // The kernels' launch counts: the slots, the table as last probed (of probed_generation_'s
  // workspace), every launch counted so far (all slots), those of the unattributed slot.
  Slot slots_[instream::kInStreamAttachSlots];
  instream::InStreamOpTable last_ops_{};
  bool kernel_counts_ = false;  // a probe carried the table (CUDA)
  InStreamOpCounts kernel_total_;
  uint64_t unattributed_ = 0, refused_kernel_reads_ = 0;
  DivergenceRecord divergence_;
  std::thread watcher_;
};

}  // namespace arfuse
