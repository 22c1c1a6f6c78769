#include "server/daemon/group_supervisor.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "server/daemon/device_startup.h"
#include "server/instream/divergence_watch.h"
#include "server/peers/exchange.h"
#include "server/peers/local_exchange.h"
#include "server/peers/peer_exchange.h"
#include "server/services/config/config_service.h"
#include "server/services/fusion/fusion_service.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

v1::WorkspaceState ToProtoState(WorkspaceState s) {
  return static_cast<v1::WorkspaceState>(static_cast<int>(s));
}

}  // namespace

GroupSupervisor::GroupSupervisor(GroupSupervisorContext context)
    : context_(std::move(context)),
      options_(*context_.options),
      gate_(*context_.gate),
      metrics_(*context_.metrics),
      flags_(context_.flags) {}

GroupSupervisor::~GroupSupervisor() {
  Stop();
  if (thread_.joinable()) thread_.detach();
}

void GroupSupervisor::Start() {
  thread_ = std::thread([this] { Supervise(); });
}

void GroupSupervisor::Stop() {
  std::lock_guard<std::mutex> lock(mu_);
  stop_requested_ = true;
  cv_.notify_all();
}

bool GroupSupervisor::StopRequested() {
  std::lock_guard<std::mutex> lock(mu_);
  return stop_requested_;
}

void GroupSupervisor::WaitFor(absl::Duration d) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, absl::ToChronoNanoseconds(d),
               [this] { return stop_requested_ || reinit_requested_.load(); });
}

absl::StatusOr<config::Decision> GroupSupervisor::Decided() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  if (!decided_) {
    return absl::UnavailableError(
        absl::StrCat("the group has not decided yet: ", not_ready_reason_));
  }
  return decision_;
}

void GroupSupervisor::LabelOp(bool ok, OpSample* sample) const {
  std::lock_guard<std::mutex> lock(state_mu_);
  sample->backend = decided_ ? decision_.backend : "none";
  sample->reason = !ok                                    ? "error"
                   : decided_ && decision_.fusion_enabled ? "dispatch"
                                                          : "fusion_disabled";
}

void GroupSupervisor::Publish(const config::Decision& decision, bool ready) {
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    decision_ = decision;
    decided_ = true;
    not_ready_reason_ = ready ? "" : not_ready_reason_;
  }
  metrics_.SetBackend(decision.backend, decision.fusion_enabled);
  SetReadiness(ready);
}

absl::StatusOr<std::unique_ptr<Engine>> GroupSupervisor::BuildEngine(
    const config::Decision& decision, absl::Time deadline) {
  ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, MakeDeviceEngine(options_, decision));
  // Collective: builds the workspace and votes, so all ranks fuse or none do.
  ARFUSE_RETURN_IF_ERROR(engine->Initialize(*exchange_, deadline));
  return engine;
}

absl::Status GroupSupervisor::FormGroup() {
  const absl::Time join_deadline = absl::Now() + absl::Seconds(options_.peer_timeout_s);
  if (options_.world_size == 1) {
    exchange_ = std::move(LocalExchangeGroup::Create(1)[0]);
  } else {
    PeerOptions po;
    po.rank = options_.rank;
    po.world_size = options_.world_size;
    po.nnodes = options_.nnodes;
    po.peer_dir = options_.peer_dir.empty()
                      ? std::filesystem::path(options_.socket).parent_path().string()
                      : options_.peer_dir;
    po.rank0_address = options_.peer_addr;
    // Read again at every formation, so a renewed certificate counts from the next one on.
    if (!options_.peer_addr.empty()) po.tls = options_.peer_tls_files();
    po.group = options_.group;
    po.timeout = absl::Seconds(options_.peer_timeout_s);
    // A frozen peer keeps its connection open: heartbeats let the watch below notice it while no
    // op runs. Five per timeout, so a late one or two are no loss.
    po.heartbeat_timeout = absl::Seconds(options_.peer_heartbeat_timeout_s);
    po.heartbeat_interval = po.heartbeat_timeout / 5;
    ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<PeerExchange> peers, ConnectPeers(po));
    exchange_ = std::move(peers);
  }
  metrics_.SetPeersReady(options_.world_size);
  spdlog::info("event=group_joined rank={} world_size={}", options_.rank, options_.world_size);

  // Every rank decides alike: each resolves locally, then the group takes one decision (or none
  // for all, with every dissenting rank's reason).
  config::RankReport report;
  report.rank = options_.rank;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    report.flags = flags_;
  }
  report.topology = context_.topology;
  if (report.topology.sm == 0) {
    // Host mode without --sm: there is no GPU architecture to resolve a backend for.
    config::Decision none;
    none.rules = report.flags.rules;
    none.reasons.push_back(kNoGpuArchitectureReason);
    report.decision = none;
  } else {
    absl::StatusOr<config::Decision> local = config::ResolveBackend(report.flags, report.topology);
    if (local.ok()) {
      report.decision = *local;
    } else {
      report.failure = std::string(local.status().message());
    }
  }
  ARFUSE_ASSIGN_OR_RETURN(
      std::vector<std::string> payloads,
      exchange_->Allgather("config-vote", config::EncodeRankReport(report), join_deadline));
  std::vector<config::RankReport> reports;
  for (const auto& p : payloads) {
    ARFUSE_ASSIGN_OR_RETURN(config::RankReport r, config::DecodeRankReport(p));
    reports.push_back(std::move(r));
  }
  ARFUSE_ASSIGN_OR_RETURN(config::Decision decision, config::Consensus(reports));
  for (const auto& w : decision.warnings) spdlog::warn("event=config_warning warning=\"{}\"", w);
  LogNoticesOncePerProcess(decision);
  spdlog::info("event=config_decided backend={} fusion_enabled={} reasons=\"{}\"", decision.backend,
               decision.fusion_enabled, absl::StrJoin(decision.reasons, "; "));

  ARFUSE_ASSIGN_OR_RETURN(const uint64_t generation_base, AgreeGenerationBase(join_deadline));
  ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, BuildEngine(decision, join_deadline));
  EngineStatus es = engine->Status();
  if (!es.fusion_enabled && decision.fusion_enabled) {
    // The workspace vote turned fusion off on every rank: report it with the engine's reason.
    decision.fusion_enabled = false;
    decision.reasons.push_back(es.reason);
  }
  metrics_.SetWorkspaceBytes(es.workspace_bytes);
  ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<Engine> previous,
                          gate_.Swap(std::move(engine), generation_base));
  previous.reset();
  const uint64_t generation = generation_base + es.generation;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    served_generation_ = std::max(served_generation_, generation);
  }
  metrics_.SetGeneration(generation);
  gate_.Resume();
  Publish(decision, true);
  if (decision.fusion_enabled) {
    spdlog::info("event=ready backend={} fusion_enabled=true generation={} workspace_bytes={}",
                 es.backend, generation, es.workspace_bytes);
  } else {
    // Every fused call of a client now answers "unavailable" (allreduce_fusion returns None):
    // say why where the user looks first.
    spdlog::warn(
        "event=ready backend={} fusion_enabled=false generation={} workspace_bytes={} "
        "reasons=\"{}\"",
        es.backend, generation, es.workspace_bytes, absl::StrJoin(decision.reasons, "; "));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> GroupSupervisor::AgreeGenerationBase(absl::Time deadline) {
  // Every engine counts its generations from 1, so without this a re-formed group would hand out
  // generation 1 again and an op stamped before the re-form would pass as current. Every rank
  // offers the highest generation it has served (0 for a process that just started, such as a
  // restarted peer) and all take the maximum: the ranks agree, and the generation only grows.
  uint64_t served = 0;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    served = served_generation_;
  }
  ARFUSE_ASSIGN_OR_RETURN(
      std::vector<std::string> offered,
      exchange_->Allgather("workspace-generation", absl::StrCat(served), deadline));
  return AgreedGenerationBase(served, offered);
}

bool GroupSupervisor::StopOnLostDevice() {
  const absl::Status lost = DeviceLost(options_);
  if (lost.ok()) return false;
  spdlog::critical("event=sticky_device_error error=\"{}\"", lost.message());
  SetReadiness(false);
  // The orderly shutdown may itself wait on the device (freeing memory synchronizes with a
  // kernel that never ends): the process exits at the latest this long after the grace period,
  // whatever blocks.
  constexpr double kLostDeviceExitSlackS = 5;
  const auto overdue = std::chrono::milliseconds(
      static_cast<int64_t>((options_.grace_period_s + kLostDeviceExitSlackS) * 1e3));
  std::thread([overdue] {
    std::this_thread::sleep_for(overdue);
    spdlog::critical("event=shutdown_overdue action=exit code=1");
    spdlog::default_logger()->flush();
    std::fflush(nullptr);
    std::_Exit(1);
  }).detach();
  context_.exit_for_restart("sticky CUDA error");
  return true;
}

void GroupSupervisor::Supervise() {
  // This thread's device: DeviceLost() inspects the current device's context.
  UseDeviceOnThisThread(options_);
  // The in-stream workspace the last re-form dropped (0: none yet), and the one serving now.
  uint64_t dropped_instream = 0;
  auto instream_generation = [this]() -> uint64_t {
    absl::StatusOr<InStreamCounters> c = gate_.InStreamStatus();
    return c.ok() ? c->generation : 0;
  };
  // The ranks compare their in-stream decisions while the group serves, over the peer link's
  // gossip (divergence_watch.h); the watch outlives re-formations, so its baseline restarts only
  // when a rank's counts do. Only this thread replaces exchange_, so the calls need no lock.
  InStreamDivergenceWatch divergence(
      options_.world_size, context_.fusion != nullptr ? &context_.fusion->instream() : nullptr,
      [this](std::string payload) {
        if (exchange_ != nullptr) exchange_->SetGossip(std::move(payload));
      },
      [this]() { return exchange_ != nullptr ? exchange_->Gossip() : std::vector<std::string>{}; },
      [this](const DivergenceFinding& f) { metrics_.IncInStreamDivergence(f.rank); });
  while (!StopRequested()) {
    reinit_requested_ = false;
    absl::Status formed = FormGroup();
    if (formed.ok() && context_.fusion != nullptr) {
      // Attachments to the dropped workspace hear REINITIALIZED now, after the POISONED queued
      // before it was dropped (generations only grow, so the dropped one's successor is newer).
      const uint64_t serving =
          std::max(instream_generation(), dropped_instream == 0 ? 0 : dropped_instream + 1);
      if (serving != 0) context_.fusion->instream().Reinitialized(serving);
    }
    if (!formed.ok()) {
      {
        std::lock_guard<std::mutex> lock(state_mu_);
        not_ready_reason_ = std::string(formed.message());
      }
      SetReadiness(false);
      spdlog::warn("event=group_not_ready error=\"{}\"", formed.message());
      exchange_.reset();
      // Forming the group failed on a device this process cannot use (engine creation, say): no
      // retry here can succeed, exit for a restart.
      if (StopOnLostDevice()) break;
      WaitFor(absl::Seconds(1));
      continue;
    }
    // Serving. Watch for a poisoned workspace (a peer died or stalled mid-op), a lost peer link
    // (a peer died or froze, or the group was re-formed without this rank, while no op ran) or a
    // request to re-initialize; each re-forms the group, which also waits for a restarted peer.
    absl::Status link = absl::OkStatus();
    while (!StopRequested() && !reinit_requested_) {
      if (StopOnLostDevice()) break;
      if (gate_.Status().state == WorkspaceState::kPoisoned) {
        std::lock_guard<std::mutex> lock(state_mu_);
        ++poisonings_;
        not_ready_reason_ = "workspace poisoned; re-forming the group";
        break;
      }
      // A non-blocking look at what the peer link's own thread found (a closed connection, or a
      // peer silent for --peer-heartbeat-timeout): the 50 ms tick adds little to how long an idle
      // group serves with a member gone or frozen.
      link = exchange_->LinkStatus();
      if (!link.ok()) {
        // The workspace is shared with a rank that is gone: as unusable as a poisoned one, and
        // counted as a poisoning (a peer fault), whether or not an op was running.
        std::lock_guard<std::mutex> lock(state_mu_);
        ++poisonings_;
        not_ready_reason_ =
            absl::StrCat("peer link lost (", link.message(), "); re-forming the group");
        break;
      }
      if (context_.fusion != nullptr) {
        InStreamAttachments& a = context_.fusion->instream();
        metrics_.SetInStream(a.size(), a.launches(), a.stale());
        metrics_.SetInStreamOps(a.op_counts());
      }
      divergence.Tick(absl::Now());
      WaitFor(absl::Milliseconds(50));
    }
    if (StopRequested()) break;
    const bool poisoned = gate_.Status().state == WorkspaceState::kPoisoned;
    std::string cause = "a re-initialization request";
    if (poisoned) {
      cause = "a poisoned workspace";
      metrics_.IncPoisonings();
      spdlog::warn("event=group_reform reason=poisoned");
    } else if (!link.ok()) {
      cause = absl::StrCat("a lost peer link (", link.message(), ")");
      metrics_.IncPoisonings();
      spdlog::warn("event=group_reform reason=peer_lost error=\"{}\"", link.message());
    } else {
      spdlog::warn("event=group_reform reason=requested");
    }
    // Recorded while the workspace and its error word still exist, so that the attached clients
    // hear POISONED with its cause however soon the group re-forms.
    dropped_instream = instream_generation();
    if (context_.fusion != nullptr && (poisoned || !link.ok())) {
      context_.fusion->instream().Poisoned(
          dropped_instream,
          poisoned ? gate_.Status().reason : absl::StrCat("peer link lost (", link.message(), ")"));
    }
    SetReadiness(false);
    // The group is gone until it re-forms: no rank counts as joined meanwhile.
    metrics_.SetPeersReady(0);
    gate_.Abort();
    (void)gate_.Drain(absl::Now() + absl::Seconds(options_.grace_period_s));
    // An op still in flight must end before its engine, and the exchange an unfused op agrees
    // over, go. Every op's waits are bounded (the spin timeout; an unfused op's two agreement
    // steps), so this ends.
    absl::StatusOr<std::unique_ptr<Engine>> dropped = gate_.Swap(nullptr);
    while (!dropped.ok()) {
      spdlog::warn("event=group_reform_waits_for_op error=\"{}\"", dropped.status().message());
      (void)gate_.Drain(absl::Now() + absl::Seconds(1));
      dropped = gate_.Swap(nullptr);
    }
    dropped->reset();
    // Dropping the engine may have found an NCCL kernel that can never finish (its peer died
    // after agreeing to the op): only a restart frees the device.
    if (StopOnLostDevice()) break;
    // Ops refused until the group serves again say why (UNAVAILABLE: retry).
    gate_.SetClosedReason(absl::StrCat("the group is re-forming after ", cause));
    exchange_.reset();
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      ++reinitializations_;
      admin_exchange_diverged_ = false;  // a new epoch starts every tag's count afresh
    }
    metrics_.IncReinitializations();
  }
}

v1::GetStatsResponse GroupSupervisor::Stats() {
  v1::GetStatsResponse out;
  EngineStatus es = gate_.Status();
  std::lock_guard<std::mutex> lock(state_mu_);
  out.set_state(ToProtoState(es.state));
  out.set_backend(decided_ ? decision_.backend : "none");
  out.set_poisonings(poisonings_);
  out.set_reinitializations(reinitializations_);
  FillUsageStats(context_.fusion->registry().totals(), metrics_.op_totals(), &out);
  out.set_uptime_seconds(
      static_cast<uint64_t>(absl::ToInt64Seconds(absl::Now() - context_.started)));
  out.set_version(kVersion);
  return out;
}

absl::StatusOr<uint32_t> GroupSupervisor::Drain(absl::Duration timeout) {
  std::lock_guard<std::mutex> admin(admin_mu_);
  SetReadiness(false);
  return gate_.Drain(absl::Now() + timeout);
}

absl::StatusOr<v1::ReinitializeResponse> GroupSupervisor::Reinitialize(absl::Time deadline) {
  std::lock_guard<std::mutex> admin(admin_mu_);
  uint64_t before;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    before = reinitializations_;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    reinit_requested_ = true;
    cv_.notify_all();
  }
  // Done when the group has re-formed and serves again (every rank must be asked, or be
  // re-forming after a poisoning, for that to happen).
  while (absl::Now() < deadline) {
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      if (reinitializations_ > before && context_.serving()) {
        v1::ReinitializeResponse out;
        EngineStatus es = gate_.Status();
        out.set_generation(es.generation);
        out.set_state(ToProtoState(es.state));
        return out;
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(
      "re-initialization did not complete before the deadline (every rank must re-initialize)");
}

absl::StatusOr<v1::SetBackendResponse> GroupSupervisor::SetBackend(
    const std::string& backend, const std::optional<std::string>& collective_id,
    absl::Time deadline) {
  std::lock_guard<std::mutex> admin(admin_mu_);
  config::Decision previous;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (!decided_ || exchange_ == nullptr || !context_.serving()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the group is not serving; backend unchanged (", not_ready_reason_, ")"));
    }
    previous = decision_;
    if (admin_exchange_diverged_ && !collective_id) {
      return absl::FailedPreconditionError(
          "an earlier collective admin call did not complete on every rank; run `arfusectl "
          "reinitialize` on every rank first; backend unchanged");
    }
    ++backend_switches_;
  }
  // The rank's own flags with the backend replaced: the rule set, the architecture, DP attention
  // and the MoE all-to-all backend still apply.
  config::FusionFlags flags = flags_;
  flags.backend.reset();
  flags.enable_deprecated = false;
  flags.enforce_disable = false;
  if (backend == "none") {
    flags.enforce_disable = true;
  } else {
    flags.backend = backend;
  }
  // Every rank is asked for the same backend; the vote refuses the switch when they disagree or
  // when any rank cannot build it, and the previous backend keeps serving.
  config::RankReport report;
  report.rank = options_.rank;
  report.flags = flags;
  report.topology = context_.topology;
  absl::StatusOr<config::Decision> local = config::ResolveBackend(flags, report.topology);
  if (local.ok()) {
    report.decision = *local;
  } else {
    report.failure = std::string(local.status().message());
  }
  // The exchange matches calls by tag and count. With a collective id the tag is used once, so a
  // call that failed on this rank alone leaves nothing a later switch could pair with. Without
  // one, the k-th "set-backend" of every rank meet, and a call that fails on one rank only leaves
  // the counts apart until the group re-forms.
  const std::string tag =
      collective_id ? absl::StrCat("set-backend/", *collective_id) : std::string("set-backend");
  absl::StatusOr<std::vector<std::string>> gathered =
      exchange_->Allgather(tag, config::EncodeRankReport(report), deadline);
  if (!gathered.ok()) {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (!collective_id) admin_exchange_diverged_ = true;
    // ABORTED, not the exchange's DEADLINE_EXCEEDED: the sidecar answered, before the caller's
    // deadline, that the switch did not happen because other ranks were not asked in time.
    return absl::AbortedError(
        absl::StrCat("backend switch vote failed (every rank of the group must be asked at once, "
                     "e.g. arfusectl set-backend --all): ",
                     gathered.status().message(), "; backend unchanged: ", previous.backend));
  }
  std::vector<std::string> payloads = *std::move(gathered);
  std::vector<config::RankReport> reports;
  std::vector<std::string> disagreements;
  for (const auto& p : payloads) {
    ARFUSE_ASSIGN_OR_RETURN(config::RankReport r, config::DecodeRankReport(p));
    if (!(r.flags == flags)) {
      disagreements.push_back(absl::StrCat(
          "rank ", r.rank, " asked for ",
          r.flags.enforce_disable ? std::string("none") : r.flags.backend.value_or("unset")));
    }
    reports.push_back(std::move(r));
  }
  if (!disagreements.empty()) {
    return absl::AbortedError(absl::StrCat("ranks disagree on the backend (",
                                           absl::StrJoin(disagreements, "; "),
                                           "); backend unchanged: ", previous.backend));
  }
  ARFUSE_ASSIGN_OR_RETURN(config::Decision decision, config::Consensus(reports));
  LogNoticesOncePerProcess(decision);
  if (backend != "none" && !decision.fusion_enabled) {
    // Agreeing on a backend that cannot fuse here is refused rather than silently unfused.
    // Every rank reaches this same answer from the same reports, so none builds an engine.
    return absl::FailedPreconditionError(absl::StrCat(
        "backend ", backend, " is not feasible: ", absl::StrJoin(decision.reasons, "; "),
        "; backend unchanged: ", previous.backend));
  }
  absl::StatusOr<std::unique_ptr<Engine>> built = BuildEngine(decision, deadline);
  std::string failure = built.ok() ? "" : std::string(built.status().message());
  absl::StatusOr<VoteResult> voted = exchange_->Vote(tag + "-built", built.ok(), failure, deadline);
  if (!voted.ok()) {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (!collective_id) admin_exchange_diverged_ = true;
    return voted.status();
  }
  const VoteResult& vote = *voted;
  if (!vote.all_yes) {
    return absl::AbortedError(absl::StrCat("the new backend could not be built on every rank (",
                                           absl::StrJoin(vote.reasons, "; "),
                                           "); backend unchanged: ", previous.backend));
  }
  // Swap: drain the old engine's ops, install the new one, serve again. Clients launching
  // in-stream on the old workspace stop first (they answer on their session streams); any that
  // do not answer in time see the old workspace's abort when it is dropped.
  SetReadiness(false);
  if (context_.fusion != nullptr) {
    context_.fusion->DrainInStream(absl::StrCat("backend switch to ", decision.backend),
                                   absl::Now() + absl::Seconds(options_.grace_period_s));
  }
  absl::StatusOr<uint32_t> drained =
      gate_.Drain(absl::Now() + absl::Seconds(options_.grace_period_s));
  if (!drained.ok()) {
    gate_.Resume();
    SetReadiness(true);
    return drained.status();
  }
  // The new engine counts generations from 1 again: continue from the one served so far (the
  // same on every rank, as the group formed with one agreed base and switches together).
  uint64_t generation_base = 0;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    generation_base = served_generation_;
  }
  ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<Engine> old,
                          gate_.Swap(*std::move(built), generation_base));
  old.reset();
  gate_.Resume();
  EngineStatus es = gate_.Status();
  metrics_.SetWorkspaceBytes(es.workspace_bytes);
  {
    // A group that re-forms later (after a poisoning) keeps the switched backend.
    std::lock_guard<std::mutex> lock(state_mu_);
    flags_ = flags;
    served_generation_ = std::max(served_generation_, es.generation);
  }
  metrics_.SetGeneration(es.generation);
  Publish(decision, true);
  spdlog::info("event=backend_switched from={} to={} fusion_enabled={} generation={}",
               previous.backend, decision.backend, decision.fusion_enabled, es.generation);
  v1::SetBackendResponse out;
  out.set_previous_backend(previous.backend);
  out.set_backend(decision.backend);
  out.set_fusion_enabled(decision.fusion_enabled);
  for (const auto& r : decision.reasons) out.add_reasons(r);
  out.set_generation(es.generation);
  return out;
}

}  // namespace arfuse
