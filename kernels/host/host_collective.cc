#include "kernels/host/host_collective.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/host/reference_core.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ARFUSE_CPU_RELAX() _mm_pause()
#else
#define ARFUSE_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace arfuse::host {
namespace {

uint32_t FloatBitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

std::string Describe(const HostSlotDesc& d) {
  float eps;
  std::memcpy(&eps, &d.eps_bits, sizeof(eps));
  const Pattern p = static_cast<Pattern>(d.pattern);
  return plain::StrCat(PatternName(p), " ", DTypeName(static_cast<DType>(d.dtype)),
                       " tokens=", d.num_tokens, " hidden=", d.hidden, " eps=", eps,
                       TraitsOf(p).quant == QuantKind::kPerGroup
                           ? plain::StrCat(" scale_layout=", d.scale_layout)
                           : std::string());
}

HostOpResult Stale(std::string_view why) {
  return HostOpResult{
      plain::FailedPreconditionError(plain::StrCat("stale generation: attach again (", why, ")")),
      false, static_cast<uint32_t>(DeviceError::kStaleGeneration)};
}

// How long a wait took, for its message: "850us", "12.5ms", "2.01s".
std::string FormatWaited(std::chrono::steady_clock::duration d) {
  const double us = std::chrono::duration<double, std::micro>(d).count();
  if (us < 1000) return plain::StrCat(us, "us");
  if (us < 1e6) return plain::StrCat(us / 1e3, "ms");
  return plain::StrCat(us / 1e6, "s");
}

}  // namespace

// ---- HostWsMapping ----

plain::StatusOr<HostWsMapping> HostWsMapping::Map(int fd, size_t bytes) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return plain::FailedPreconditionError(
        plain::StrCat("the host workspace descriptor cannot be read: ", std::strerror(errno)));
  }
  if (static_cast<uint64_t>(st.st_size) != bytes) {
    return plain::FailedPreconditionError(
        plain::StrCat("the host workspace object has ", st.st_size, " bytes, expected ", bytes,
                      " (do all ranks run with the same options?)"));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return plain::ResourceExhaustedError(
        plain::StrCat("cannot map the host workspace (", bytes, " bytes): ", std::strerror(errno)));
  }
  return HostWsMapping(static_cast<uint8_t*>(p), bytes);
}

HostWsMapping::HostWsMapping(HostWsMapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

HostWsMapping& HostWsMapping::operator=(HostWsMapping&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) ::munmap(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

HostWsMapping::~HostWsMapping() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

// ---- the header ----

void InitHostWorkspace(uint8_t* base, int world_size, uint64_t generation, size_t slot_bytes) {
  auto* h = new (base) HostWsHeader{};
  h->magic = kHostWsMagic;
  h->layout_version = kHostWsLayoutVersion;
  h->world_size = static_cast<uint32_t>(world_size);
  h->generation = generation;
  h->slot_bytes = slot_bytes;
  h->total_bytes = HostWsTotalBytes(world_size, slot_bytes);
  h->abort_word.store(0, std::memory_order_relaxed);
  h->retired.store(0, std::memory_order_relaxed);
  h->abort_seq.store(0, std::memory_order_relaxed);
  h->error.store(0, std::memory_order_relaxed);
  auto* sync = reinterpret_cast<HostRankSync*>(base + sizeof(HostWsHeader));
  for (int r = 0; r < world_size; ++r) new (sync + r) HostRankSync{};
}

plain::Status CheckHostWorkspace(const uint8_t* base, int world_size, size_t slot_bytes,
                                 uint64_t generation) {
  const auto* h = reinterpret_cast<const HostWsHeader*>(base);
  if (h->magic != kHostWsMagic) {
    return plain::FailedPreconditionError("the host workspace's magic is not ARFSHFSW");
  }
  if (h->layout_version != kHostWsLayoutVersion) {
    return plain::FailedPreconditionError(plain::StrCat("the host workspace's layout_version is ",
                                                        h->layout_version, ", this build's is ",
                                                        kHostWsLayoutVersion));
  }
  if (h->world_size != static_cast<uint32_t>(world_size)) {
    return plain::FailedPreconditionError(plain::StrCat("the host workspace's world_size is ",
                                                        h->world_size, ", expected ", world_size));
  }
  if (h->slot_bytes != slot_bytes) {
    return plain::FailedPreconditionError(plain::StrCat("the host workspace's slot_bytes is ",
                                                        h->slot_bytes, ", expected ", slot_bytes));
  }
  if (h->total_bytes != HostWsTotalBytes(world_size, slot_bytes)) {
    return plain::FailedPreconditionError(plain::StrCat("the host workspace's total_bytes is ",
                                                        h->total_bytes, ", expected ",
                                                        HostWsTotalBytes(world_size, slot_bytes)));
  }
  if (h->generation != generation) {
    return plain::FailedPreconditionError(
        "stale generation: the host workspace belongs to another generation");
  }
  if (h->retired.load(std::memory_order_acquire) != 0) {
    return plain::FailedPreconditionError(
        "stale generation: the sidecar dropped this host workspace");
  }
  return plain::OkStatus();
}

void RetireHostWorkspace(uint8_t* base) {
  reinterpret_cast<HostWsHeader*>(base)->retired.store(1, std::memory_order_release);
}

void AbortHostWorkspace(uint8_t* base, int rank) {
  auto* h = reinterpret_cast<HostWsHeader*>(base);
  uint32_t none = 0;
  h->error.compare_exchange_strong(none, static_cast<uint32_t>(HostWsError::kHostAbort),
                                   std::memory_order_acq_rel);
  // abort_seq stays as it is: 0 (no op recorded) drops every op from now on.
  uint32_t expected = 0;
  h->abort_word.compare_exchange_strong(expected, static_cast<uint32_t>(rank) + 1,
                                        std::memory_order_acq_rel);
}

// ---- the collective ----

HostOpResult HostCollective::Run(const HostOpArgs& op, uint64_t generation,
                                 const HostWaitLimits& limits, bool client, HostCopy copy_input,
                                 uint64_t launcher, uint32_t program_key) {
  HostWsHeader* h = header();
  // A stale workspace is refused before anything is touched: its slots may belong to nobody.
  if (h->generation != generation) return Stale("the workspace was re-initialized");
  if (h->retired.load(std::memory_order_acquire) != 0) {
    return Stale("the sidecar dropped this workspace");
  }
  HostRankSync* mine = sync(rank_);
  // 0. Claim the next number. The launchers of a rank take turns, so an op claimed and not
  // finished while this one starts has lost its launcher (a client that died mid-op): what it
  // published must never be paired with anything, this op included.
  uint64_t claimed = mine->launch_seq.load(std::memory_order_acquire);
  if (claimed != mine->done_seq.load(std::memory_order_acquire)) {
    return Abandon(claimed,
                   "its launcher ended before the op completed (a client that died or "
                   "closed its session mid-op)");
  }
  // The launcher first: a sidecar that acquires the claim below sees who made it.
  mine->launcher.store(launcher, std::memory_order_relaxed);
  if (!mine->launch_seq.compare_exchange_strong(claimed, claimed + 1, std::memory_order_acq_rel)) {
    return HostOpResult{
        plain::FailedPreconditionError(plain::StrCat(
            "another op of rank ", rank_,
            " started at the same time: the ops of a rank must take turns (one launcher at a "
            "time)")),
        false, 0};
  }
  const uint64_t s = claimed + 1;
  HostOpResult r = RunClaimed(op, s, limits, copy_input, program_key);
  // Release: this rank is done with call s (read it, or gave up on it) and may reuse buffer b.
  mine->done_seq.store(s, std::memory_order_release);
  if (client && r.status.ok()) mine->client_ops.fetch_add(1, std::memory_order_relaxed);
  return r;
}

HostOpResult HostCollective::RunClaimed(const HostOpArgs& op, uint64_t s,
                                        const HostWaitLimits& limits, HostCopy copy_input,
                                        uint32_t program_key) {
  HostRankSync* mine = sync(rank_);
  const int b = static_cast<int>(s & 1);
  // A rank gave up on this op or an earlier one: drop it without touching the buffers, as every
  // rank does (ops before the one given up on still run: see DropsOpAfterAbort).
  if (std::optional<HostOpResult> dropped = DropIfGivenUp(s)) return *dropped;

  // 1. Re-arm: buffer b last held call s - 2; every rank must be done reading it.
  if (s > 2) {
    HostOpResult r =
        WaitAll([&](int q) { return sync(q)->done_seq.load(std::memory_order_acquire) >= s - 2; },
                limits, s, "finish reading the previous use of this buffer");
    if (!r.status.ok()) return r;
  }
  // 2. Publish this rank's input and what it runs.
  const size_t bytes = static_cast<size_t>(op.num_tokens) * op.hidden * DTypeSize(op.dtype);
  // The input may be memory another process can take away (a client's region): a rank whose
  // copy faults still publishes its slot, flagged, so that every rank drops the op alike and
  // stays in step.
  plain::Status input_read = plain::OkStatus();
  if (copy_input != nullptr) {
    input_read = copy_input(slot(b, rank_), op.input, bytes, "input");
  } else {
    std::memcpy(slot(b, rank_), op.input, bytes);
  }
  mine->desc[b] = HostSlotDesc{
      op.hidden,
      op.num_tokens,
      FloatBitsOf(op.eps),
      static_cast<uint8_t>(op.pattern),
      static_cast<uint8_t>(op.dtype),
      input_read.ok() ? uint8_t{0} : kHostSlotInputFaulted,
      TraitsOf(op.pattern).quant == QuantKind::kPerGroup ? op.scale_layout : uint8_t{0}};
  mine->program_key[b] = program_key;
  // Release: the slot bytes and desc above are visible to any rank that acquires seq s.
  mine->written_seq[b].store(s, std::memory_order_release);
  // 3. Wait for every rank's slot of this call.
  {
    HostOpResult r =
        WaitAll([&](int q) { return sync(q)->written_seq[b].load(std::memory_order_acquire) >= s; },
                limits, s, "arrive");
    if (!r.status.ok()) return r;
  }
  // 4. Confirm, then wait for every rank's confirmation before reading any slot. A slot of call s
  // is published by a launcher that is running call s; one that died after publishing never
  // confirms, and its slot is never read (it is retired when the workspace is poisoned).
  mine->ack_seq.store(s, std::memory_order_release);
  {
    HostOpResult r =
        WaitAll([&](int q) { return sync(q)->ack_seq.load(std::memory_order_acquire) >= s; },
                limits, s, "confirm that they saw every rank's input");
    if (!r.status.ok()) return r;
  }
  // A rank that gave up while this one waited may have seen this rank arrive; failing here
  // too keeps the outcome alike on every rank in all but the narrowest race.
  if (std::optional<HostOpResult> dropped = DropIfGivenUp(s)) return *dropped;
  // 5. Every rank must run the same op; a mismatch is refused alike on every rank, and the
  // buffer is still released below so the protocol stays in step.
  plain::Status ran = plain::OkStatus();
  for (int q = 0; q < world_size_ && ran.ok(); ++q) {
    if (sync(q)->desc[b].flags & kHostSlotInputFaulted) {
      ran = q == rank_ ? input_read
                       : plain::AbortedError(plain::StrCat(
                             "op ", s, ": rank ", q,
                             " could not read its client's input (the client's memory faulted); "
                             "every rank drops the op"));
    }
  }
  for (int q = 0; q < world_size_ && ran.ok(); ++q) {
    const HostSlotDesc& d = sync(q)->desc[b];
    const HostSlotDesc& m = mine->desc[b];
    if (std::memcmp(&d, &m, sizeof(d)) != 0) {
      ran = plain::InvalidArgumentError(plain::StrCat("ranks disagree on the op: rank ", q, " ran ",
                                                      Describe(d), " but rank ", rank_, " ran ",
                                                      Describe(m)));
    } else if (sync(q)->program_key[b] != program_key) {
      // The keys' values are not named: they are the programs' own.
      ran = plain::InvalidArgumentError(plain::StrCat(
          "ranks disagree on the op: rank ", q, "'s op comes from another program than rank ",
          rank_, "'s (their program keys differ); every rank drops it"));
    }
  }
  if (ran.ok()) {
    std::vector<const void*> inputs(world_size_);
    for (int q = 0; q < world_size_; ++q) inputs[q] = slot(b, q);
    CpuOpArgs a;
    a.pattern = op.pattern;
    a.dtype = op.dtype;
    a.world_size = world_size_;
    a.hidden = op.hidden;
    a.num_tokens = op.num_tokens;
    a.eps = op.eps;
    a.rank_inputs = inputs.data();
    a.output = op.output;
    a.residual_in = op.residual_in;
    a.residual_out = op.residual_out;
    a.norm_out = op.norm_out;
    a.gamma = op.gamma;
    a.quant_out = op.quant_out;
    a.scale = op.scale;
    a.scale_layout = op.scale_layout;
    ran = ReferenceFusedOpPlain(a);
  }
  return HostOpResult{std::move(ran), false, 0};
}

HostOpResult HostCollective::Abandon(uint64_t seq, std::string_view why) {
  // A launcher that confirmed seq saw every rank's input: the other ranks may complete that op
  // (their reads of its slot were paired with a live launcher), so only later ops are dropped.
  const bool confirmed = sync(rank_)->ack_seq.load(std::memory_order_acquire) >= seq;
  return Fail(plain::AbortedError(
                  plain::StrCat("op ", seq, " of rank ", rank_, " was abandoned: ", why,
                                "; the workspace is poisoned until every rank re-initializes")),
              confirmed ? seq + 1 : seq, HostWsError::kAbandoned);
}

bool HostCollective::RetireAbandoned(uint64_t launcher) {
  HostRankSync* mine = sync(rank_);
  // Acquire: the launcher stored with (before) the claim read here is the claim's.
  const uint64_t claimed = mine->launch_seq.load(std::memory_order_acquire);
  if (mine->launcher.load(std::memory_order_relaxed) != launcher) return false;
  if (claimed == mine->done_seq.load(std::memory_order_acquire)) return false;
  Abandon(claimed, "the attachment that launched it ended before the op completed");
  return true;
}

std::optional<HostOpResult> HostCollective::DropIfGivenUp(uint64_t seq) {
  HostWsHeader* h = header();
  const uint32_t w = h->abort_word.load(std::memory_order_acquire);
  if (!DropsOpAfterAbort(w, h->abort_seq.load(std::memory_order_acquire), seq)) {
    return std::nullopt;
  }
  return Fail(
      plain::AbortedError(plain::StrCat("op ", seq, ": rank ", w - 1, " gave up on this op; rank ",
                                        rank_, " drops it too")),
      seq, HostWsError::kPeerAbort);
}

// Polls until ready(q) holds for every rank q, or fails: the local abort flag, a peer's abort
// word, a retired workspace, or the deadline. Giving up poisons the workspace and raises the
// abort word so the peers stop waiting too.
template <typename Ready>
HostOpResult HostCollective::WaitAll(Ready ready, const HostWaitLimits& limits, uint64_t seq,
                                     const char* what) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  HostWsHeader* h = header();
  for (uint64_t iter = 0;; ++iter) {
    bool all = true;
    for (int q = 0; q < world_size_ && all; ++q) all = ready(q);
    if (all) return HostOpResult{plain::OkStatus(), false, 0};
    if (iter % 64 != 63) {
      ARFUSE_CPU_RELAX();
      continue;
    }
    auto missing = [&] {
      std::vector<int> m;
      for (int q = 0; q < world_size_; ++q) {
        if (!ready(q)) m.push_back(q);
      }
      return plain::StrJoin(m, ", ");
    };
    if (limits.local_abort != nullptr && limits.local_abort->load(std::memory_order_acquire)) {
      return Fail(
          plain::AbortedError(plain::StrCat("op ", seq, " aborted on rank ", rank_, " while ranks ",
                                            missing(), " had yet to ", what)),
          seq, HostWsError::kHostAbort);
    }
    if (h->retired.load(std::memory_order_acquire) != 0) {
      return Stale("the sidecar dropped this workspace while the op waited");
    }
    if (uint32_t w = h->abort_word.load(std::memory_order_acquire); w != 0) {
      return Fail(
          plain::AbortedError(plain::StrCat("op ", seq, ": rank ", w - 1, " gave up, so rank ",
                                            rank_, " stops waiting for ranks ", missing())),
          seq, HostWsError::kPeerAbort);
    }
    const Clock::time_point now = Clock::now();
    if (now >= limits.deadline) {
      return Fail(plain::DeadlineExceededError(plain::StrCat(
                      "op ", seq, ": ranks ", missing(), " did not ", what, " within ",
                      FormatWaited(now - start), " (",
                      limits.deadline_is_callers ? "the op's deadline" : "spin_timeout", ")")),
                  seq, HostWsError::kTimeout);
    }
    // Polling, not synchronization: on a loaded machine with more ranks than cores, a spinner
    // must leave the core to the rank it waits for.
    if (now - start > std::chrono::milliseconds(2)) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else {
      std::this_thread::yield();
    }
  }
}

// `seq`: the op this rank gives up on. The lowest one any rank gave up on, and the first error,
// are recorded before the abort word is raised (see HostWsHeader::abort_seq).
HostOpResult HostCollective::Fail(plain::Status s, uint64_t seq, HostWsError error) {
  HostWsHeader* h = header();
  uint64_t low = h->abort_seq.load(std::memory_order_acquire);
  while ((low == 0 || seq < low) &&
         !h->abort_seq.compare_exchange_weak(low, seq, std::memory_order_acq_rel)) {
  }
  uint32_t none = 0;
  h->error.compare_exchange_strong(none, static_cast<uint32_t>(error), std::memory_order_acq_rel);
  uint32_t expected = 0;
  h->abort_word.compare_exchange_strong(expected, static_cast<uint32_t>(rank_) + 1,
                                        std::memory_order_acq_rel);
  return HostOpResult{std::move(s), true, static_cast<uint32_t>(error)};
}

}  // namespace arfuse::host
