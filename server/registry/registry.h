// The region registry: sessions own regions (opened client memory) and plans (validated ops over
// regions). Thread-safe; every call holds one mutex briefly and never waits, except
// UnregisterRegion, which waits for ops in flight up to its deadline.
//
// Lifetimes: a region's mapping is shared between the session that registered it and every op in
// flight that uses it (ResolvedOp). Unregister and session end drop the session's reference; the
// mapping closes when the last op using it ends, on that op's thread, so neither path blocks on
// an op while holding a lock.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/engine_api/engine.h"
#include "server/registry/opener.h"
#include "server/registry/types.h"

namespace arfuse {

struct RegionHandle {
  uint64_t region_id = 0;
  uint64_t generation = 0;
};

struct RegionInfo {
  uint64_t region_id = 0;
  uint64_t generation = 0;
  std::string name;
  uint64_t byte_size = 0;
  MemoryKind kind = MemoryKind::kHostShm;
  uint32_t in_flight = 0;
};

// Who opened a session: the uid the kernel reported for the caller's connection (the Unix
// sockets), and the identity its certificate proved (TCP with mutual TLS). Only calls from the
// same owner reach the session. An owner with neither (a server that knows nobody, as in some
// in-process tests) is matched only by another such caller: the token is then all there is.
struct SessionOwner {
  std::optional<uint32_t> uid;
  std::string identity;

  friend bool operator==(const SessionOwner&, const SessionOwner&) = default;
};

// A session as its client sees it: the token it passes on every call (SessionResponse's
// session_token), and the registry's own handle for it, which never leaves the sidecar.
struct OpenedSession {
  uint64_t id = 0;
  std::string token;
};

struct PlanInfo {
  uint64_t plan_id = 0;
  uint64_t generation = 0;
  OpShape shape;
};

// What every open session holds together (Admin.GetStats, the metrics gauges). A region counts
// from its registration until its unregistration or its session's end, even while ops in flight
// still keep its mapping open.
struct RegistryTotals {
  uint64_t sessions = 0;
  uint64_t regions = 0;
  uint64_t region_bytes = 0;
  uint64_t plans = 0;

  friend bool operator==(const RegistryTotals&, const RegistryTotals&) = default;
};

namespace registry_internal {
struct State;
struct Region;
struct Session;
}  // namespace registry_internal

// An op whose tensors are resolved to pointers in this process. While it lives, its regions count
// it as in flight: unregister waits for it and the mappings stay open. Move-only.
class ResolvedOp {
 public:
  ResolvedOp(ResolvedOp&&) noexcept;
  ResolvedOp& operator=(ResolvedOp&&) noexcept;
  ResolvedOp(const ResolvedOp&) = delete;
  ResolvedOp& operator=(const ResolvedOp&) = delete;
  ~ResolvedOp();

  const OpArgs& args() const { return args_; }
  const OpShape& shape() const { return shape_; }
  // Ends the in-flight hold early (idempotent); the destructor does the same.
  void Release();

 private:
  friend class Registry;
  ResolvedOp() = default;
  std::shared_ptr<registry_internal::State> state_;
  std::vector<std::shared_ptr<registry_internal::Region>> held_;
  OpArgs args_;
  OpShape shape_;
};

class Registry {
 public:
  // `opener` decides which memory this registry accepts (its kind and device). `boot_nonce`
  // seeds generations so they differ across restarts; 0 draws a random one.
  Registry(RegistryLimits limits, std::unique_ptr<MemoryOpener> opener, uint64_t boot_nonce = 0);
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // A new session of `owner`, with a token of 128 random bits from the kernel (random_id.h).
  // RESOURCE_EXHAUSTED beyond limits.max_sessions.
  absl::StatusOr<OpenedSession> OpenOwnedSession(const std::string& client_name,
                                                 const SessionOwner& owner);
  // OpenOwnedSession for an owner nobody knows; the session's handle.
  absl::StatusOr<uint64_t> OpenSession(const std::string& client_name);
  // The handle of the session `token` names when `caller` opened it. Everything else (a token
  // that is malformed, unknown, ended, or another owner's) is the same PERMISSION_DENIED, whose
  // message says nothing about the token or whether any session has it.
  absl::StatusOr<uint64_t> FindSession(absl::string_view token, const SessionOwner& caller) const;
  // Releases every region and plan of the session. Never blocks; unknown ids are ignored (a
  // stream may end twice: cancel, then done).
  void CloseSession(uint64_t session_id);
  // FAILED_PRECONDITION when the session (by handle) is unknown or ended.
  absl::Status CheckSession(uint64_t session_id) const;

  absl::StatusOr<RegionHandle> RegisterRegion(uint64_t session_id, const RegionSpec& spec);
  // Waits until no op uses the region, up to `deadline`; on timeout the region stays registered
  // and DEADLINE_EXCEEDED says how many ops still use it.
  absl::Status UnregisterRegion(uint64_t session_id, uint64_t region_id, uint64_t generation,
                                absl::Time deadline);
  absl::StatusOr<std::vector<RegionInfo>> ListRegions(uint64_t session_id) const;

  absl::StatusOr<PlanInfo> CreatePlan(uint64_t session_id, const OpRequest& op);
  // A plan id the session does not hold (destroyed, never made, another session's) is
  // PERMISSION_DENIED, the same for all of them and without the id; plan ids are 64 random bits.
  absl::Status DestroyPlan(uint64_t session_id, uint64_t plan_id, uint64_t generation);

  // Resolves a plan (or an explicit op) for `num_tokens` tokens to pointers, holding its regions
  // in flight until the ResolvedOp is released. An explicit op with max_tokens 0 is sized by
  // num_tokens.
  absl::StatusOr<ResolvedOp> ResolvePlan(uint64_t session_id, uint64_t plan_id, uint64_t generation,
                                         uint32_t num_tokens);
  absl::StatusOr<ResolvedOp> ResolveOp(uint64_t session_id, const OpRequest& op,
                                       uint32_t num_tokens);

  MemoryKind kind() const;
  int32_t device_id() const;
  const RegistryLimits& limits() const { return limits_; }
  size_t session_count() const;
  RegistryTotals totals() const;

  // Told the totals after every change to them (session open and end, region register and
  // unregister, plan create and destroy), and once right away when set. Calls never overlap, and
  // each reports the totals as they are when it runs, so the last call always leaves an observer
  // with the current totals even when changes race. Runs on the thread that made the change,
  // outside the registry's lock; it must be quick and must not change the registry (that would
  // deadlock). An empty function removes the observer.
  using TotalsObserver = std::function<void(const RegistryTotals&)>;
  void SetTotalsObserver(TotalsObserver observer);

 private:
  using Session = registry_internal::Session;
  std::shared_ptr<Session> FindSessionLocked(uint64_t session_id) const;
  absl::StatusOr<ResolvedOp> ResolveLocked(Session& session, const OpShape& shape,
                                           const OpRequest& refs, uint32_t num_tokens,
                                           bool from_plan);
  // Reports the current totals to the observer, if any. Never called with state_->mu held.
  void NotifyTotals();

  const RegistryLimits limits_;
  const std::unique_ptr<MemoryOpener> opener_;
  const uint64_t boot_nonce_;
  std::shared_ptr<registry_internal::State> state_;
  // Taken before state_->mu, never while holding it.
  std::mutex observer_mu_;
  TotalsObserver observer_;
};

// 64 random bits from the OS (std::random_device), never 0.
uint64_t RandomBootNonce();

}  // namespace arfuse
