// The engine the Fusion service sees: a stable front over the group's current engine, which the
// daemon can drain, swap (backend switch, re-initialization after a poisoning) and resume while
// the Fusion service keeps one pointer. Ops arriving while it is drained or empty are refused
// with UNAVAILABLE (retry the call), never queued without bound.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "server/engine_api/doorbell_host.h"
#include "server/engine_api/engine.h"
#include "server/engine_api/instream_host.h"

namespace arfuse {

// The doorbell plane is forwarded too: AddDoorbellPlan passes the gate like an op (UNAVAILABLE
// while closed or empty, FAILED_PRECONDITION when the engine has no doorbell plane);
// RemoveDoorbellPlan reaches the engine even while the gate is closed (a client leaving while
// the group re-forms), and is OK when there is no engine (its plane went with it).
// The in-stream plane likewise: ExportInStream passes the gate like an op; InStreamStatus and
// AbortInStream and InStreamClientEnded reach the engine whenever there is one.
class GatedEngine final : public Engine, public DoorbellHost, public InStreamHost {
 public:
  GatedEngine() = default;

  // Not used: the daemon initializes the inner engine before installing it.
  absl::Status Initialize(Exchange& exchange, absl::Time deadline) override;
  absl::StatusOr<OpOutcome> Execute(const OpArgs& op, const ExecContext& ctx) override;

  // Called after every op that reached an engine (metrics); set before ops run.
  using OpObserver =
      std::function<void(const OpArgs&, const absl::StatusOr<OpOutcome>&, absl::Duration elapsed)>;
  void SetOpObserver(OpObserver observer) { observer_ = std::move(observer); }
  void Abort() override;
  EngineStatus Status() const override;
  DoorbellHost* doorbell_host() override { return this; }

  absl::StatusOr<DoorbellGrant> AddDoorbellPlan(const OpArgs& op_template, uint32_t max_tokens,
                                                absl::Time deadline) override;
  absl::Status RemoveDoorbellPlan(const DoorbellGrant& grant, absl::Time deadline) override;

  InStreamHost* instream_host() override { return this; }
  absl::StatusOr<InStreamExport> ExportInStream(const std::vector<uint32_t>& hiddens) override;
  absl::StatusOr<InStreamCounters> InStreamStatus() override;
  void AbortInStream() override;
  bool InStreamClientEnded(uint64_t attach_id) override;

  // Refuses new ops; waits until none is in flight or `deadline`. Returns how many ops were in
  // flight when the drain began; DEADLINE_EXCEEDED when some are still running at the deadline
  // (the gate stays closed).
  absl::StatusOr<uint32_t> Drain(absl::Time deadline);
  // Opens the gate again.
  void Resume();
  // What ops refused while the gate is closed or empty are told after "not serving ops: " (and
  // Status().reason while empty), e.g. why the group is re-forming. Drain and Swap(nullptr) set
  // their own; call after them.
  void SetClosedReason(std::string reason);
  // Installs `engine` (may be null) and returns the previous one. The gate must be drained:
  // FAILED_PRECONDITION while ops are in flight (the previous engine stays). The gate stays as it
  // was (closed after Drain) until Resume.
  //
  // Status() reports the engine's generation plus `generation_base`. Every engine the daemon
  // builds counts its generations from 1, so the daemon passes the highest generation any rank
  // has served: the generation clients see keeps growing across re-forms and backend switches,
  // and an op stamped with one from before is refused as stale.
  absl::StatusOr<std::unique_ptr<Engine>> Swap(std::unique_ptr<Engine> engine,
                                               uint64_t generation_base = 0);
  // The inner engine's status, for readiness checks; kInitializing when empty.
  bool has_engine() const;
  uint64_t ops_in_flight() const;

 private:
  // Runs `fn` on the inner engine's in-stream host with the engine held (in_flight_), so it
  // cannot be swapped meanwhile. `gated`: refused while the gate is closed.
  template <typename R, typename Fn>
  R WithInStreamHost(bool gated, Fn fn);

  OpObserver observer_;
  mutable std::mutex mu_;
  std::condition_variable idle_;
  std::unique_ptr<Engine> inner_;
  uint64_t generation_base_ = 0;
  bool open_ = false;
  uint64_t in_flight_ = 0;
  std::string closed_reason_ = "the group is initializing";
};

// The generation base a re-formed group counts on from: the highest of this rank's own served
// generation and every rank's offer (decimal, one per rank, index = rank). FAILED_PRECONDITION
// naming the rank for an offer that is not a number (every rank sees the same offers, so every
// rank refuses alike).
absl::StatusOr<uint64_t> AgreedGenerationBase(uint64_t own, const std::vector<std::string>& offers);

}  // namespace arfuse
