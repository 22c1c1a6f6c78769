#include "server/host/host_engine.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/fd/unique_fd.h"
#include "common/status_macros.h"
#include "kernels/common/plain_status_absl.h"
#include "kernels/contract/op_contract.h"
#include "kernels/host/host_collective.h"
#include "kernels/instream/attach_abi.h"
#include "server/engine_api/instream_host.h"
#include "server/host/guarded_copy.h"
#include "server/host/op_staging.h"
#include "server/peers/exchange.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

// The group's host workspace object as this rank holds it: the descriptor (kept open so that
// attached clients can be handed a duplicate) and the mapping. Closing and munmap never block.
struct HostWsObject {
  UniqueFd fd;
  host::HostWsMapping mapping;
};

// The workspace object: a memfd sealed against shrinking and growing, so that no process holding
// it (a peer sidecar, an attached client) can take pages away under the others' mappings (a
// shrunk object would fault every process that maps it). It has no name: it reaches the other
// ranks over the peer channel (SCM_RIGHTS) and clients over the fd channel.
absl::StatusOr<HostWsObject> CreateSealedWorkspace(size_t bytes) {
  UniqueFd fd(::memfd_create("arfuse-host-workspace", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create the host workspace (memfd_create): ", strerror(errno)));
  }
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot size the host workspace to ", bytes, " bytes: ", strerror(errno)));
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot seal the host workspace: ", strerror(errno)));
  }
  ARFUSE_ASSIGN_OR_RETURN(host::HostWsMapping m, ToAbsl(host::HostWsMapping::Map(fd.get(), bytes)));
  return HostWsObject{std::move(fd), std::move(m)};
}

// Rank 0's workspace as another rank received it: it must be sealed the way rank 0 seals it.
absl::StatusOr<HostWsObject> MapReceivedWorkspace(UniqueFd fd, size_t expected_bytes) {
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  constexpr int kWanted = F_SEAL_SHRINK | F_SEAL_GROW;
  if (seals < 0 || (seals & kWanted) != kWanted) {
    return absl::FailedPreconditionError(
        "rank 0's host workspace is not a memfd sealed against shrinking and growing");
  }
  auto m = host::HostWsMapping::Map(fd.get(), expected_bytes);
  if (!m.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(m.status().code()),
                        absl::StrCat("rank 0's ", m.status().message()));
  }
  return HostWsObject{std::move(fd), std::move(*m)};
}

// FusionAlgo::kOneShot (kernels/allreduce_fusion/allreduce_fusion.h, which needs the CUDA
// headers): the host collective is the one algorithm of host mode.
constexpr uint8_t kOneShotAlgo = 1;

// The newest workspace generation any host engine of this process built. A new engine (the
// group re-formed) continues from it, so a generation, and the attach blobs that carry it, is
// unique in the process across engines, as the CUDA workspaces' are: a client can ask for a
// workspace newer than the one that failed.
std::atomic<uint64_t> g_last_host_generation{0};

class HostEngine final : public Engine, public InStreamHost {
 public:
  explicit HostEngine(const EngineOptions& options)
      : options_(options),
        slot_bytes_(host::HostWsSlotBytes(options.max_tokens, options.max_hidden, options.dtype)),
        generation_(g_last_host_generation.load()) {}

  ~HostEngine() override {
    Abort();
    // Clients attached to this generation stop at their next op instead of waiting for a rank
    // that is gone.
    std::lock_guard<std::mutex> lock(state_mu_);
    if (ws_.mapping.valid()) host::RetireHostWorkspace(ws_.mapping.data());
  }

  absl::Status Initialize(Exchange& exchange, absl::Time deadline) override {
    std::lock_guard<std::mutex> op_lock(op_mu_);  // no op runs while the workspace changes
    {
      // The old generation is dropped: clients still attached to it get a stale generation.
      std::lock_guard<std::mutex> lock(state_mu_);
      if (ws_.mapping.valid()) host::RetireHostWorkspace(ws_.mapping.data());
      ws_ = HostWsObject{};
      state_ = WorkspaceState::kInitializing;
      reason_ = "initializing the host workspace";
    }

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
        exchange.Allgather("host_engine/generation", absl::StrCat(generation()), deadline);
    if (!gathered.ok()) {
      SetState(WorkspaceState::kInitializing, std::string(gathered.status().message()));
      return gathered.status();
    }
    const std::vector<std::string>& gens = *gathered;
    uint64_t next_gen = generation();
    for (const auto& g : gens) {
      uint64_t v = 0;
      if (absl::SimpleAtoi(g, &v)) next_gen = std::max(next_gen, v);
    }
    ++next_gen;

    const size_t total = host::HostWsTotalBytes(options_.world_size, slot_bytes_);
    HostWsObject ws;
    if (options_.rank == 0 && local_problem.empty()) {
      auto created = CreateSealedWorkspace(total);
      if (created.ok()) {
        ws = std::move(*created);
        host::InitHostWorkspace(ws.mapping.data(), options_.world_size, next_gen, slot_bytes_);
      } else {
        local_problem = std::string(created.status().message());
      }
    }
    // Whether rank 0 made one, then the object itself (SCM_RIGHTS; a rank without one sends a
    // placeholder). The exchange's release/acquire (a socket round trip or a mutex) orders rank
    // 0's header initialization before any other rank maps and reads it.
    auto made = exchange.Allgather("host_engine/workspace",
                                   ws.fd.valid() ? std::string("1") : std::string(), deadline);
    if (!made.ok()) {
      SetState(WorkspaceState::kInitializing, std::string(made.status().message()));
      return made.status();
    }
    UniqueFd placeholder(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    auto fds = exchange.AllgatherFd("host_engine/workspace_fd",
                                    ws.fd.valid() ? ws.fd.get() : placeholder.get(), deadline);
    if (!fds.ok()) {
      SetState(WorkspaceState::kInitializing, std::string(fds.status().message()));
      return fds.status();
    }
    std::vector<UniqueFd> received;
    for (int fd : *fds) received.emplace_back(fd);
    if (options_.rank != 0 && local_problem.empty()) {
      if ((*made)[0].empty()) {
        local_problem = "rank 0 could not create the workspace";
      } else {
        auto opened = MapReceivedWorkspace(std::move(received[0]), total);
        if (!opened.ok()) {
          local_problem = std::string(opened.status().message());
        } else if (plain::Status match = host::CheckHostWorkspace(
                       opened->mapping.data(), options_.world_size, slot_bytes_, next_gen);
                   !match.ok()) {
          local_problem = absl::StrCat(
              "rank 0's host workspace does not match this rank's layout (", match.message(), ")");
        } else {
          ws = std::move(*opened);
        }
      }
    }
    auto vote = exchange.Vote("host_engine/mapped", local_problem.empty(), local_problem, deadline);
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
    abort_.store(false, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      ws_ = std::move(ws);
      generation_ = next_gen;
      uint64_t last = g_last_host_generation.load();
      while (last < next_gen && !g_last_host_generation.compare_exchange_weak(last, next_gen)) {
      }
      state_ = WorkspaceState::kReady;
      reason_ = options_.backend != "none" ? std::string("host shared-memory workspace ready")
                : options_.unfused_reason.empty()
                    ? std::string("fusion off (backend none)")
                    : absl::StrCat("fusion off: ", options_.unfused_reason);
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
    uint64_t generation = 0;
    {
      std::lock_guard<std::mutex> s(state_mu_);
      if (state_ == WorkspaceState::kPoisoned) {
        return absl::FailedPreconditionError(
            absl::StrCat("host workspace is poisoned (", reason_,
                         "); every rank must re-initialize (generation ", generation_, ")"));
      }
      if (state_ != WorkspaceState::kReady || !ws_.mapping.valid()) {
        return absl::UnavailableError(absl::StrCat("host workspace is not initialized: ", reason_));
      }
      generation = generation_;
    }
    ARFUSE_RETURN_IF_ERROR(Validate(op));

    host::HostWaitLimits limits;
    // The collective waits on the monotonic clock: the wait budget is carried over from now.
    const absl::Time now = absl::Now();
    const absl::Duration budget =
        std::max(std::min(ctx.deadline - now, options_.spin_timeout), absl::ZeroDuration());
    limits.deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(budget);
    limits.deadline_is_callers = ctx.deadline <= now + options_.spin_timeout;
    limits.local_abort = &abort_;
    // op_mu_ keeps Initialize from replacing the mapping while the op runs.
    host::HostCollective collective(ws_.mapping.data(), options_.rank, options_.world_size,
                                    slot_bytes_);
    // Client memory (residual_in, gamma, the outputs) is read and written through private copies,
    // and the input through a guarded copy into the slot (guarded_copy.h): a client that shrinks
    // its region under the op gets an error for this op, and the daemon goes on.
    // A rank whose client memory faults still takes part (on its private copies), so its peers
    // complete the op; it alone fails it, after.
    OpArgs staged = op;
    const absl::Status staged_in = staging_.In(op, &staged);
    host::HostOpResult r =
        collective.Run(staged, generation, limits, /*client=*/false,
                       [](void* to, const void* from, size_t n, const char* what) {
                         return FromAbsl(GuardedCopy(to, from, n, what));
                       });
    if (r.poisoned) {
      SetState(WorkspaceState::kPoisoned, std::string(r.status.message()));
      spdlog::error("event=host_workspace_poisoned rank={} generation={} code={} reason=\"{}\"",
                    options_.rank, generation, plain::StatusCodeName(r.status.code()),
                    std::string(r.status.message()));
    }
    if (!r.status.ok()) return ToAbsl(r.status);
    ARFUSE_RETURN_IF_ERROR(staged_in);
    ARFUSE_RETURN_IF_ERROR(staging_.Out(op));
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
    s.fusion_enabled = FusionEnabledLocked();
    s.reason = reason_;
    // An attached client's op that failed (a peer that never came, an abort) leaves its mark in
    // the shared header only: the workspace is as unusable as after a failed op of our own, and
    // the supervisor re-forms the group on it.
    if (const uint32_t error = InStreamErrorLocked(); state_ == WorkspaceState::kReady && error) {
      s.state = WorkspaceState::kPoisoned;
      s.fusion_enabled = false;
      s.reason = absl::StrCat("host workspace poisoned by an in-stream op (",
                              host::HostWsErrorName(error), ")");
    }
    s.workspace_bytes = state_ == WorkspaceState::kInitializing
                            ? 0
                            : host::HostWsTotalBytes(options_.world_size, slot_bytes_);
    return s;
  }

  InStreamHost* instream_host() override { return this; }

  // ---- InStreamHost ----

  absl::StatusOr<InStreamExport> ExportInStream(const std::vector<uint32_t>& hiddens) override {
    ARFUSE_ASSIGN_OR_RETURN(std::vector<uint32_t> wanted, AttachHiddens(hiddens));
    InStreamExport e;
    e.device = instream::DeviceKind::kHost;
    e.rank = static_cast<uint32_t>(options_.rank);
    e.world_size = static_cast<uint32_t>(options_.world_size);
    e.spin_timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(options_.spin_timeout));
    e.dtype = options_.dtype;
    // One algorithm on the host: every op that fits the slot runs (the client calls it one-shot).
    const uint64_t capacity =
        uint64_t{options_.max_tokens} * options_.max_hidden * DTypeSize(options_.dtype);
    e.oneshot_max_bytes = capacity;
    e.twoshot_max_bytes = capacity;
    e.max_tokens = options_.max_tokens;
    e.hidden = options_.max_hidden;
    e.host_slot_bytes = slot_bytes_;
    // Every pattern the host collective runs: the FP8 ones take bf16 or fp16 input, so a bf16
    // or fp16 workspace lists them too (contract::CheckPattern refuses them at fp32 anyway).
    const bool fp8 = options_.dtype == DType::kBF16 || options_.dtype == DType::kFP16;
    for (uint32_t h : wanted) {
      for (int p = 1; p <= (fp8 ? kMaxPattern : 2); ++p) {
        instream::KernelEntry k{};
        k.hidden = h;
        k.pattern = static_cast<uint8_t>(p);
        k.algo = kOneShotAlgo;
        k.dtype = static_cast<uint8_t>(options_.dtype);
        e.entries.push_back(k);  // no function: the client runs kernels/host/host_collective
      }
    }
    const uint64_t total = host::HostWsTotalBytes(options_.world_size, slot_bytes_);
    e.ranks.resize(static_cast<size_t>(options_.world_size));
    for (InStreamRankMemory& m : e.ranks) {
      m.kind = instream::MemoryKind::kHostShm;
      m.bytes = total;
    }
    std::lock_guard<std::mutex> lock(state_mu_);
    if (state_ == WorkspaceState::kPoisoned) {
      return absl::FailedPreconditionError(absl::StrCat(
          "host workspace is poisoned (", reason_, "); attach after every rank re-initialized"));
    }
    if (const uint32_t error = InStreamErrorLocked(); error != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("host workspace is poisoned by an in-stream op (",
                       host::HostWsErrorName(error), "); attach after every rank re-initialized"));
    }
    if (state_ != WorkspaceState::kReady || !ws_.fd.valid()) {
      return absl::UnavailableError(absl::StrCat("host workspace is not initialized: ", reason_));
    }
    if (!FusionEnabledLocked()) {
      return absl::FailedPreconditionError(
          "fusion is off for this group (backend none): there is nothing to attach to");
    }
    // The group's one object: this rank's descriptor stands for every rank.
    UniqueFd dup(::fcntl(ws_.fd.get(), F_DUPFD_CLOEXEC, 0));
    if (!dup.valid()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot duplicate the host workspace descriptor: ", strerror(errno)));
    }
    e.ranks[static_cast<size_t>(options_.rank)].fd = std::move(dup);
    e.generation = generation_;
    return e;
  }

  absl::StatusOr<InStreamCounters> InStreamStatus() override {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (!ws_.mapping.valid()) {
      return absl::UnavailableError(absl::StrCat("host workspace is not initialized: ", reason_));
    }
    host::HostCollective view(ws_.mapping.data(), options_.rank, options_.world_size, slot_bytes_);
    InStreamCounters c;
    c.generation = generation_;  // what ExportInStream handed out for this workspace
    c.launches = view.sync(options_.rank)->client_ops.load(std::memory_order_relaxed);
    // A stale client op touches nothing, not even a counter: there is none to report.
    c.stale = 0;
    c.error = view.header()->error.load(std::memory_order_acquire);
    if (c.error != 0) c.error_name = host::HostWsErrorName(c.error);
    return c;
  }

  void AbortInStream() override {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (!ws_.mapping.valid()) return;
    host::AbortHostWorkspace(ws_.mapping.data(), options_.rank);
    if (state_ == WorkspaceState::kReady) {
      state_ = WorkspaceState::kPoisoned;
      reason_ = "the sidecar aborted the in-stream plane";
    }
  }

  bool InStreamClientEnded(uint64_t attach_id) override {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (!ws_.mapping.valid()) return false;
    // A client's ops run in its own thread, synchronously: once its session is gone (the process
    // exited, or closed the session), an op it claimed and did not finish never will. Retiring it
    // poisons the workspace, so a peer waiting for its confirmation stops at once and no later op
    // pairs with its slot; Status() then reports the poisoning and the group re-forms.
    host::HostCollective view(ws_.mapping.data(), options_.rank, options_.world_size, slot_bytes_);
    if (!view.RetireAbandoned(attach_id)) return false;
    spdlog::error(
        "event=host_workspace_poisoned rank={} generation={} reason=\"an attached client ended "
        "mid-op (abandoned)\"",
        options_.rank, generation_);
    return true;
  }

 private:
  // The shared header's error word (0 while no op failed), under state_mu_.
  uint32_t InStreamErrorLocked() const {
    if (!ws_.mapping.valid()) return 0;
    host::HostCollective view(ws_.mapping.data(), options_.rank, options_.world_size, slot_bytes_);
    return view.header()->error.load(std::memory_order_acquire);
  }

  // The hidden sizes an attach gets entries for: the workspace's when none are asked for.
  absl::StatusOr<std::vector<uint32_t>> AttachHiddens(const std::vector<uint32_t>& asked) const {
    if (asked.empty()) return std::vector<uint32_t>{options_.max_hidden};
    if (asked.size() > instream::kMaxAttachHiddens) {
      return absl::InvalidArgumentError(absl::StrCat("an attach takes at most ",
                                                     instream::kMaxAttachHiddens,
                                                     " hidden sizes, not ", asked.size()));
    }
    std::vector<uint32_t> out;
    for (uint32_t h : asked) {
      ARFUSE_RETURN_IF_ERROR(ToAbsl(contract::CheckOp(contract::OpShape{options_.dtype, h, 0},
                                                      Capacity(), contract::OpVoice::kEngine)));
      if (std::find(out.begin(), out.end(), h) == out.end()) out.push_back(h);
    }
    return out;
  }

  // The host workspace's slot: max_tokens x max_hidden elements of the workspace's dtype, as
  // bytes (an op of another dtype fits when its bytes do).
  contract::WorkspaceCapacity Capacity() const {
    return contract::WorkspaceCapacity{options_.max_tokens, options_.max_hidden, options_.dtype,
                                       /*byte_slot=*/true};
  }

  bool FusionEnabledLocked() const {
    return state_ == WorkspaceState::kReady && options_.backend != "none";
  }

  uint64_t generation() const {
    std::lock_guard<std::mutex> lock(state_mu_);
    return generation_;
  }

  absl::Status Validate(const OpArgs& op) const {
    if (!TraitsOf(op.pattern).valid) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown pattern ", static_cast<int>(op.pattern)));
    }
    if (op.dtype != DType::kBF16 && op.dtype != DType::kFP16 && op.dtype != DType::kFP32) {
      return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", static_cast<int>(op.dtype)));
    }
    ARFUSE_RETURN_IF_ERROR(
        ToAbsl(contract::CheckOp(contract::ShapeOf(op), Capacity(), contract::OpVoice::kEngine)));
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
      const PatternTraits traits = TraitsOf(op.pattern);
      const bool quantized = traits.quant != QuantKind::kNone;
      if (op.norm_out == nullptr && traits.norm_out_required) {
        return absl::InvalidArgumentError("allreduce_residual_rmsnorm needs norm_out");
      }
      if (op.gamma == nullptr) {
        return absl::InvalidArgumentError("allreduce_residual_rmsnorm needs gamma");
      }
      if (quantized && (op.quant_out == nullptr || op.scale == nullptr)) {
        return absl::InvalidArgumentError(
            absl::StrCat(PatternName(op.pattern), " needs quant_out and scale"));
      }
    }
    return absl::OkStatus();
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
  // The private copies of the op's client tensors (guarded by exec_mu_: one op at a time).
  OpStaging staging_;
  std::atomic<bool> abort_{false};
  // state_, generation_, reason_ and ws_ (replaced only under op_mu_ too, so Execute may use
  // ws_ with op_mu_ alone).
  mutable std::mutex state_mu_;
  HostWsObject ws_;
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
  if (options.max_tokens == 0 || !IsHiddenAligned(options.max_hidden)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "workspace capacity max_tokens ", options.max_tokens, " x max_hidden ", options.max_hidden,
        " must be positive with max_hidden a multiple of ", kHiddenMultiple));
  }
  // 1 GiB per slot is far beyond any decode or prefill chunk; it guards against overflow and
  // against a typo mapping all of /dev/shm.
  const uint64_t slot = contract::CapacityBytes(
      contract::WorkspaceCapacity{options.max_tokens, options.max_hidden, options.dtype, true});
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
