#include "server/host/host_engine.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cpu/reference_op.h"
#include "server/core/status_macros.h"
#include "server/host/guarded_copy.h"
#include "server/host/host_workspace.h"
#include "server/peers/exchange.h"
#include "spdlog/spdlog.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ARFUSE_CPU_RELAX() _mm_pause()
#else
#define ARFUSE_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace arfuse {
namespace {

using host::HostRankSync;
using host::HostSlotDesc;
using host::HostWsHeader;

// RAII owner of one shared-memory mapping. munmap never blocks.
class ShmMapping {
 public:
  static absl::StatusOr<std::unique_ptr<ShmMapping>> Create(const std::string& name, size_t bytes) {
    int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create host workspace shm: ", strerror(errno)));
    }
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      int e = errno;
      ::close(fd);
      ::shm_unlink(name.c_str());
      return absl::FailedPreconditionError(
          absl::StrCat("cannot size host workspace to ", bytes, " bytes: ", strerror(e)));
    }
    return Map(fd, bytes);
  }

  static absl::StatusOr<std::unique_ptr<ShmMapping>> Open(const std::string& name,
                                                          size_t expected_bytes) {
    int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot open rank 0's host workspace: ", strerror(errno),
                       " (ranks of a host-mode group must share one node and user)"));
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != expected_bytes) {
      ::close(fd);
      return absl::FailedPreconditionError(
          absl::StrCat("rank 0's host workspace has ", st.st_size, " bytes, expected ",
                       expected_bytes, " (do all ranks run with the same options?)"));
    }
    return Map(fd, expected_bytes);
  }

  ~ShmMapping() { ::munmap(data_, size_); }
  uint8_t* data() const { return static_cast<uint8_t*>(data_); }
  size_t size() const { return size_; }

 private:
  ShmMapping(void* data, size_t size) : data_(data), size_(size) {}
  static absl::StatusOr<std::unique_ptr<ShmMapping>> Map(int fd, size_t bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = errno;
    ::close(fd);  // the mapping keeps the object alive
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot map the host workspace (", bytes, " bytes): ", strerror(e)));
    }
    return std::unique_ptr<ShmMapping>(new ShmMapping(p, bytes));
  }
  void* data_;
  size_t size_;
};

std::string RankList(const std::vector<int>& ranks) { return absl::StrJoin(ranks, ", "); }

uint32_t FloatBitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

class HostEngine final : public Engine {
 public:
  explicit HostEngine(const EngineOptions& options)
      : options_(options),
        slot_bytes_(host::AlignUp(
            static_cast<size_t>(options.max_tokens) * options.max_hidden * DTypeSize(options.dtype),
            host::kHostWsSlotAlign)) {}

  ~HostEngine() override { Abort(); }

  absl::Status Initialize(Exchange& exchange, absl::Time deadline) override {
    std::lock_guard<std::mutex> op_lock(op_mu_);  // no op runs while the workspace changes
    SetState(WorkspaceState::kInitializing, "initializing the host workspace");
    mapping_.reset();
    header_ = nullptr;

    // Local checks first; a rank that fails them still takes part in every collective below
    // (with a "no" vote), so its peers hear why instead of hanging.
    std::string local_problem;
    if (exchange.world_size() != options_.world_size || exchange.rank() != options_.rank) {
      local_problem = absl::StrCat("engine is rank ", options_.rank, " of ", options_.world_size,
                                   " but the peer group says rank ", exchange.rank(), " of ",
                                   exchange.world_size());
    } else if (exchange.nnodes() != 1) {
      local_problem = absl::StrCat("host mode needs one node (shared memory); the group spans ",
                                   exchange.nnodes());
    }

    // Every rank agrees on the new generation: one more than the highest any rank has seen.
    auto gathered =
        exchange.Allgather("host_engine/generation", absl::StrCat(generation_), deadline);
    if (!gathered.ok()) {
      SetState(WorkspaceState::kInitializing, std::string(gathered.status().message()));
      return gathered.status();
    }
    const std::vector<std::string>& gens = *gathered;
    uint64_t next_gen = generation_;
    for (const auto& g : gens) {
      uint64_t v = 0;
      if (absl::SimpleAtoi(g, &v)) next_gen = std::max(next_gen, v);
    }
    ++next_gen;

    const size_t total = host::HostWsTotalBytes(options_.world_size, slot_bytes_);
    std::string name;
    std::unique_ptr<ShmMapping> mapping;
    if (options_.rank == 0 && local_problem.empty()) {
      std::random_device rd;
      name = absl::StrCat("/arfuse-host-", ::getpid(), "-", next_gen, "-", rd());
      auto m = ShmMapping::Create(name, total);
      if (m.ok()) {
        mapping = std::move(*m);
        auto* h = new (mapping->data()) HostWsHeader{};
        h->magic = host::kHostWsMagic;
        h->layout_version = host::kHostWsLayoutVersion;
        h->world_size = static_cast<uint32_t>(options_.world_size);
        h->generation = next_gen;
        h->slot_bytes = slot_bytes_;
        h->total_bytes = total;
        h->abort_word.store(0, std::memory_order_relaxed);
        h->abort_seq.store(0, std::memory_order_relaxed);
        for (int r = 0; r < options_.world_size; ++r) new (Sync(mapping->data(), r)) HostRankSync{};
      } else {
        local_problem = std::string(m.status().message());
        name.clear();
      }
    }
    // The exchange's release/acquire (a socket round trip or a mutex) orders rank 0's header
    // initialization before any other rank maps and reads it.
    auto names = exchange.Allgather("host_engine/workspace", name, deadline);
    if (!names.ok()) {
      if (!name.empty()) ::shm_unlink(name.c_str());
      SetState(WorkspaceState::kInitializing, std::string(names.status().message()));
      return names.status();
    }
    if (options_.rank != 0 && local_problem.empty()) {
      const std::string& rank0_name = (*names)[0];
      if (rank0_name.empty()) {
        local_problem = "rank 0 could not create the workspace";
      } else {
        auto m = ShmMapping::Open(rank0_name, total);
        if (!m.ok()) {
          local_problem = std::string(m.status().message());
        } else {
          mapping = std::move(*m);
          auto* h = reinterpret_cast<HostWsHeader*>(mapping->data());
          if (h->magic != host::kHostWsMagic || h->layout_version != host::kHostWsLayoutVersion ||
              h->world_size != static_cast<uint32_t>(options_.world_size) ||
              h->slot_bytes != slot_bytes_ || h->generation != next_gen) {
            local_problem = "rank 0's host workspace does not match this rank's layout";
            mapping.reset();
          }
        }
      }
    }
    auto vote = exchange.Vote("host_engine/mapped", local_problem.empty(), local_problem, deadline);
    // Once every rank has voted, every rank that could map it has: the name can go.
    if (!name.empty()) ::shm_unlink(name.c_str());
    if (!vote.ok()) {
      SetState(WorkspaceState::kInitializing, std::string(vote.status().message()));
      return vote.status();
    }
    if (!vote->all_yes) {
      std::string why = absl::StrJoin(vote->reasons, "; ");
      SetState(WorkspaceState::kInitializing, why);
      spdlog::warn("event=host_workspace_failed rank={} generation={} reasons=\"{}\"",
                   options_.rank, next_gen, why);
      return absl::FailedPreconditionError(absl::StrCat("host workspace not built: ", why));
    }
    mapping_ = std::move(mapping);
    header_ = reinterpret_cast<HostWsHeader*>(mapping_->data());
    seq_ = 0;
    abort_.store(false, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      generation_ = next_gen;
      state_ = WorkspaceState::kReady;
      reason_ = "host shared-memory workspace ready";
    }
    spdlog::info("event=host_workspace_ready rank={} world_size={} generation={} bytes={}",
                 options_.rank, options_.world_size, next_gen, total);
    return absl::OkStatus();
  }

  absl::StatusOr<OpOutcome> Execute(const OpArgs& op, const ExecContext& ctx) override {
    // One op in flight: a second caller waits its turn, but never past its own deadline.
    std::unique_lock<std::timed_mutex> lock(exec_mu_, std::defer_lock);
    if (!lock.try_lock_until(absl::ToChronoTime(ctx.deadline))) {
      return absl::DeadlineExceededError(
          "another op held the host workspace until this op's deadline");
    }
    std::lock_guard<std::mutex> op_lock(op_mu_);
    {
      std::lock_guard<std::mutex> s(state_mu_);
      if (state_ == WorkspaceState::kPoisoned) {
        return absl::FailedPreconditionError(
            absl::StrCat("host workspace is poisoned (", reason_,
                         "); every rank must re-initialize (generation ", generation_, ")"));
      }
      if (state_ != WorkspaceState::kReady || header_ == nullptr) {
        return absl::UnavailableError(absl::StrCat("host workspace is not initialized: ", reason_));
      }
    }
    ARFUSE_RETURN_IF_ERROR(Validate(op));

    const uint64_t s = ++seq_;
    const int b = static_cast<int>(s & 1);
    const int world = options_.world_size;
    const absl::Time deadline = std::min(ctx.deadline, absl::Now() + options_.spin_timeout);
    const bool by_ctx = ctx.deadline <= absl::Now() + options_.spin_timeout;
    uint8_t* base = mapping_->data();

    // 1. Re-arm: buffer b last held call s - 2; every rank must be done reading it.
    if (s > 2) {
      ARFUSE_RETURN_IF_ERROR(SpinAll(
          [&](int q) { return Sync(base, q)->done_seq.load(std::memory_order_acquire) >= s - 2; },
          deadline, by_ctx, s, "finish reading the previous use of this buffer"));
    }
    // 2. Publish this rank's input and what it runs.
    HostRankSync* mine = Sync(base, options_.rank);
    const size_t bytes = static_cast<size_t>(op.num_tokens) * op.hidden * DTypeSize(op.dtype);
    // The input is client memory (guarded_copy.h). A rank whose client's memory faults still
    // publishes its slot, flagged, so that every rank drops the op alike and stays in step.
    const absl::Status input_read =
        GuardedCopy(Slot(base, b, options_.rank), op.input, bytes, "input");
    mine->desc[b] = HostSlotDesc{op.hidden,
                                 op.num_tokens,
                                 FloatBitsOf(op.eps),
                                 static_cast<uint8_t>(op.pattern),
                                 static_cast<uint8_t>(op.dtype),
                                 input_read.ok() ? uint16_t{0} : host::kHostSlotInputFaulted};
    // Release: the slot bytes and desc above are visible to any rank that acquires seq s.
    mine->written_seq[b].store(s, std::memory_order_release);
    // 3. Wait for every rank's slot of this call.
    ARFUSE_RETURN_IF_ERROR(SpinAll(
        [&](int q) { return Sync(base, q)->written_seq[b].load(std::memory_order_acquire) >= s; },
        deadline, by_ctx, s, "arrive"));
    // A rank that gave up while this one waited may have seen this rank arrive; failing here
    // too keeps the outcome alike on every rank in all but the narrowest race.
    if (uint32_t w = header_->abort_word.load(std::memory_order_acquire);
        host::DropsOpAfterAbort(w, header_->abort_seq.load(std::memory_order_acquire), s)) {
      return Fail(
          absl::AbortedError(absl::StrCat("op ", s, ": rank ", w - 1, " gave up on this op; rank ",
                                          options_.rank, " drops it too")),
          s);
    }
    // 4. Every rank must run the same op; a mismatch is refused alike on every rank, and the
    // buffer is still released below so the protocol stays in step.
    absl::Status agreed = absl::OkStatus();
    for (int q = 0; q < world && agreed.ok(); ++q) {
      if (Sync(base, q)->desc[b].flags & host::kHostSlotInputFaulted) {
        agreed = q == options_.rank
                     ? input_read
                     : absl::AbortedError(absl::StrCat(
                           "op ", s, ": rank ", q,
                           " could not read its client's input (the client's memory faulted); "
                           "every rank drops the op"));
      }
    }
    for (int q = 0; q < world && agreed.ok(); ++q) {
      const HostSlotDesc& d = Sync(base, q)->desc[b];
      const HostSlotDesc& m = mine->desc[b];
      if (std::memcmp(&d, &m, sizeof(d)) != 0) {
        agreed = absl::InvalidArgumentError(absl::StrCat("ranks disagree on the op: rank ", q,
                                                         " ran ", Describe(d), " but rank ",
                                                         options_.rank, " ran ", Describe(m)));
      }
    }
    absl::Status ran = agreed;
    if (agreed.ok()) {
      std::vector<const void*> inputs(world);
      for (int q = 0; q < world; ++q) inputs[q] = Slot(base, b, q);
      ran = RunOnStaging(op, inputs.data(), bytes);
    }
    // 5. Release: this rank is done reading buffer b for call s.
    mine->done_seq.store(s, std::memory_order_release);
    if (!ran.ok()) return ran;
    return OpOutcome{ExecPath::kHost, "host shared-memory workspace, CPU implementation"};
  }

  void Abort() override { abort_.store(true, std::memory_order_release); }

  EngineStatus Status() const override {
    std::lock_guard<std::mutex> lock(state_mu_);
    EngineStatus s;
    s.state = state_;
    s.generation = generation_;
    // The group's decided backend (the CPU implementation stands in for its kernels); "none"
    // when the config service turned fusion off, so clients see the same answer as Negotiate.
    s.backend = options_.backend;
    s.fusion_enabled = state_ == WorkspaceState::kReady && options_.backend != "none";
    s.reason = reason_;
    s.workspace_bytes = state_ == WorkspaceState::kInitializing
                            ? 0
                            : host::HostWsTotalBytes(options_.world_size, slot_bytes_);
    return s;
  }

 private:
  static HostRankSync* Sync(uint8_t* base, int rank) {
    return reinterpret_cast<HostRankSync*>(base + sizeof(HostWsHeader)) + rank;
  }
  uint8_t* Slot(uint8_t* base, int buffer, int rank) const {
    return base + host::HostWsDataOffset(options_.world_size) +
           (static_cast<size_t>(buffer) * options_.world_size + rank) * slot_bytes_;
  }

  // The CPU op reads residual_in and gamma and writes its outputs in client memory: it runs on
  // private copies, and the copies in and out are guarded (guarded_copy.h), so a client whose
  // memory faults gets an error for this op on this rank and the daemon goes on. The ranks'
  // inputs are in the workspace. `bytes`: one [num_tokens, hidden] tensor.
  absl::Status RunOnStaging(const OpArgs& op, const void* const* rank_inputs, size_t bytes) {
    const size_t gamma_bytes = static_cast<size_t>(op.hidden) * DTypeSize(op.dtype);
    CpuOpArgs a;
    a.pattern = op.pattern;
    a.dtype = op.dtype;
    a.world_size = options_.world_size;
    a.hidden = op.hidden;
    a.num_tokens = op.num_tokens;
    a.eps = op.eps;
    a.rank_inputs = rank_inputs;
    if (op.pattern == Pattern::kAllReduce) {
      staging_out_.resize(bytes);
      a.output = staging_out_.data();
      ARFUSE_RETURN_IF_ERROR(ReferenceFusedOp(a));
      return GuardedCopy(op.output, staging_out_.data(), bytes, "output");
    }
    staging_in_.resize(bytes);
    staging_gamma_.resize(gamma_bytes);
    staging_out_.resize(bytes);
    staging_norm_.resize(bytes);
    ARFUSE_RETURN_IF_ERROR(GuardedCopy(staging_in_.data(), op.residual_in, bytes, "residual_in"));
    ARFUSE_RETURN_IF_ERROR(GuardedCopy(staging_gamma_.data(), op.gamma, gamma_bytes, "gamma"));
    a.residual_in = staging_in_.data();
    a.gamma = staging_gamma_.data();
    a.residual_out = staging_out_.data();
    a.norm_out = staging_norm_.data();
    ARFUSE_RETURN_IF_ERROR(ReferenceFusedOp(a));
    ARFUSE_RETURN_IF_ERROR(
        GuardedCopy(op.residual_out, staging_out_.data(), bytes, "residual_out"));
    return GuardedCopy(op.norm_out, staging_norm_.data(), bytes, "norm_out");
  }

  static std::string Describe(const HostSlotDesc& d) {
    float eps;
    std::memcpy(&eps, &d.eps_bits, sizeof(eps));
    return absl::StrCat(PatternName(static_cast<Pattern>(d.pattern)), " ",
                        DTypeName(static_cast<DType>(d.dtype)), " tokens=", d.num_tokens,
                        " hidden=", d.hidden, " eps=", eps);
  }

  absl::Status Validate(const OpArgs& op) const {
    if (op.pattern != Pattern::kAllReduce && op.pattern != Pattern::kAllReduceResidualRmsNorm) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown pattern ", static_cast<int>(op.pattern)));
    }
    if (op.dtype != DType::kBF16 && op.dtype != DType::kFP16 && op.dtype != DType::kFP32) {
      return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", static_cast<int>(op.dtype)));
    }
    if (op.hidden == 0 || op.hidden % kHiddenMultiple != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("hidden ", op.hidden, " must be a positive multiple of ", kHiddenMultiple));
    }
    if (op.hidden > options_.max_hidden) {
      return absl::InvalidArgumentError(absl::StrCat(
          "hidden ", op.hidden, " exceeds the workspace's max_hidden ", options_.max_hidden));
    }
    const uint64_t bytes = uint64_t{op.num_tokens} * op.hidden * DTypeSize(op.dtype);
    const uint64_t cap =
        uint64_t{options_.max_tokens} * options_.max_hidden * DTypeSize(options_.dtype);
    if (bytes > cap) {
      return absl::InvalidArgumentError(
          absl::StrCat("op of ", op.num_tokens, " tokens x ", op.hidden, " hidden ",
                       DTypeName(op.dtype), " (", bytes, " bytes) exceeds the workspace slot of ",
                       cap, " bytes (max_tokens ", options_.max_tokens, " x max_hidden ",
                       options_.max_hidden, " ", DTypeName(options_.dtype), ")"));
    }
    if (!std::isfinite(op.eps) || op.eps < 0) {
      return absl::InvalidArgumentError("eps must be finite and non-negative");
    }
    if (op.input == nullptr) return absl::InvalidArgumentError("input is missing");
    if (op.pattern == Pattern::kAllReduce) {
      if (op.output == nullptr) return absl::InvalidArgumentError("allreduce needs an output");
    } else {
      if (op.residual_in == nullptr) {
        return absl::InvalidArgumentError("allreduce_residual_rmsnorm needs residual_in");
      }
      if (op.residual_out == nullptr) {
        return absl::InvalidArgumentError("allreduce_residual_rmsnorm needs residual_out");
      }
      if (op.norm_out == nullptr) {
        return absl::InvalidArgumentError("allreduce_residual_rmsnorm needs norm_out");
      }
      if (op.gamma == nullptr) {
        return absl::InvalidArgumentError("allreduce_residual_rmsnorm needs gamma");
      }
    }
    return absl::OkStatus();
  }

  // Polls until ready(q) holds for every rank q, or fails: the local abort flag (Abort()), a
  // peer's abort word, or the deadline. Failure poisons the workspace and raises the abort word
  // so the peers stop waiting too.
  template <typename Ready>
  absl::Status SpinAll(Ready ready, absl::Time deadline, bool by_ctx, uint64_t seq,
                       const char* what) {
    const int world = options_.world_size;
    const absl::Time start = absl::Now();
    for (uint64_t iter = 0;; ++iter) {
      bool all = true;
      for (int q = 0; q < world && all; ++q) all = ready(q);
      if (all) return absl::OkStatus();
      if (iter % 64 == 63) {
        auto missing = [&] {
          std::vector<int> m;
          for (int q = 0; q < world; ++q) {
            if (!ready(q)) m.push_back(q);
          }
          return RankList(m);
        };
        if (abort_.load(std::memory_order_acquire)) {
          return Fail(
              absl::AbortedError(absl::StrCat("op ", seq, " aborted on rank ", options_.rank,
                                              " while ranks ", missing(), " had yet to ", what)),
              seq);
        }
        uint32_t w = header_->abort_word.load(std::memory_order_acquire);
        if (w != 0) {
          return Fail(absl::AbortedError(absl::StrCat("op ", seq, ": rank ", w - 1,
                                                      " gave up, so rank ", options_.rank,
                                                      " stops waiting for ranks ", missing())),
                      seq);
        }
        absl::Time now = absl::Now();
        if (now >= deadline) {
          return Fail(absl::DeadlineExceededError(
                          absl::StrCat("op ", seq, ": ranks ", missing(), " did not ", what,
                                       " within ", absl::FormatDuration(now - start), " (",
                                       by_ctx ? "the op's deadline" : "spin_timeout", ")")),
                      seq);
        }
        // Polling, not synchronization: on a loaded machine with more ranks than cores, a
        // spinner must leave the core to the rank it waits for.
        if (now - start > absl::Milliseconds(2)) {
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        } else {
          std::this_thread::yield();
        }
      } else {
        ARFUSE_CPU_RELAX();
      }
    }
  }

  // `seq`: the op this rank gives up on. The lowest one any rank gave up on is recorded before
  // the abort word is raised (see HostWsHeader::abort_seq).
  absl::Status Fail(absl::Status s, uint64_t seq) {
    uint64_t low = header_->abort_seq.load(std::memory_order_acquire);
    while ((low == 0 || seq < low) &&
           !header_->abort_seq.compare_exchange_weak(low, seq, std::memory_order_acq_rel)) {
    }
    uint32_t expected = 0;
    header_->abort_word.compare_exchange_strong(expected, static_cast<uint32_t>(options_.rank) + 1,
                                                std::memory_order_acq_rel);
    SetState(WorkspaceState::kPoisoned, std::string(s.message()));
    spdlog::error("event=host_workspace_poisoned rank={} generation={} code={} reason=\"{}\"",
                  options_.rank, generation_, absl::StatusCodeToString(s.code()),
                  std::string(s.message()));
    return s;
  }

  void SetState(WorkspaceState st, std::string reason) {
    std::lock_guard<std::mutex> lock(state_mu_);
    state_ = st;
    reason_ = std::move(reason);
  }

  const EngineOptions options_;
  const size_t slot_bytes_;
  std::timed_mutex exec_mu_;  // callers queue here, bounded by their deadline
  std::mutex op_mu_;          // the workspace: Initialize and Execute
  std::unique_ptr<ShmMapping> mapping_;
  // RunOnStaging's private copies of client tensors (guarded by exec_mu_: one op at a time).
  std::vector<uint8_t> staging_in_, staging_gamma_, staging_out_, staging_norm_;
  HostWsHeader* header_ = nullptr;
  uint64_t seq_ = 0;
  std::atomic<bool> abort_{false};
  mutable std::mutex state_mu_;
  WorkspaceState state_ = WorkspaceState::kInitializing;
  uint64_t generation_ = 0;
  std::string reason_ = "not initialized";
};

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> MakeHostEngine(const EngineOptions& options) {
  if (options.world_size < 1 || options.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat("world_size ", options.world_size,
                                                   " is out of range [1, ", kMaxWorldSize, "]"));
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", options.rank, " is out of range for world_size ", options.world_size));
  }
  if (options.dtype != DType::kBF16 && options.dtype != DType::kFP16 &&
      options.dtype != DType::kFP32) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown workspace dtype ", static_cast<int>(options.dtype)));
  }
  if (options.max_tokens == 0 || options.max_hidden == 0 ||
      options.max_hidden % kHiddenMultiple != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "workspace capacity max_tokens ", options.max_tokens, " x max_hidden ", options.max_hidden,
        " must be positive with max_hidden a multiple of ", kHiddenMultiple));
  }
  // 1 GiB per slot is far beyond any decode or prefill chunk; it guards against overflow and
  // against a typo mapping all of /dev/shm.
  const uint64_t slot =
      uint64_t{options.max_tokens} * options.max_hidden * DTypeSize(options.dtype);
  if (slot > (uint64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("workspace slot of ", slot, " bytes exceeds the 1 GiB limit of host mode"));
  }
  if (options.spin_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("spin_timeout must be positive");
  }
  return std::unique_ptr<Engine>(new HostEngine(options));
}

}  // namespace arfuse
