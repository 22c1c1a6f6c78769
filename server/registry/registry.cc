#include "server/registry/registry.h"

#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/random_id.h"
#include "common/status_macros.h"
#include "server/registry/validation.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace registry_internal {

struct Region {
  uint64_t id = 0;
  uint64_t generation = 0;
  std::string name;
  uint64_t byte_size = 0;
  MemoryKind kind = MemoryKind::kHostShm;
  std::unique_ptr<Mapping> mapping;
  // Guarded by State::mu.
  uint32_t in_flight = 0;
  bool unregistering = false;
};

struct Plan {
  uint64_t id = 0;
  uint64_t generation = 0;
  OpShape shape;
  OpRequest refs;
};

struct Session {
  // The registry's handle (a sequence number; it never leaves the sidecar, and doubles as the
  // session's name in logs). The token is what the client names it by, and is never logged.
  uint64_t id = 0;
  uint64_t log_seq = 0;
  std::string token;
  SessionOwner owner;
  std::string client_name;
  std::map<uint64_t, std::shared_ptr<Region>> regions;
  absl::flat_hash_map<std::string, uint64_t> region_names;
  uint64_t region_bytes = 0;
  std::map<uint64_t, Plan> plans;
  bool closed = false;
};

struct State {
  mutable std::mutex mu;
  std::condition_variable released;  // an op released its regions
  absl::flat_hash_map<uint64_t, std::shared_ptr<Session>> sessions;
  absl::flat_hash_map<std::string, uint64_t> tokens;  // token -> handle, for every open session
  uint64_t next_region_id = 1;
  uint64_t next_session_seq = 1;
  uint64_t counter = 0;
};

}  // namespace registry_internal

namespace {

using registry_internal::Plan;
using registry_internal::Region;
using registry_internal::Session;
using registry_internal::State;

// splitmix64's finalizer: a bijection on 64 bits, so distinct inputs give distinct outputs.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Fresh ids that are unique within this process (Mix is a bijection of a counter) and differ
// across restarts (the nonce). 0 is never returned: it means "none" on the wire.
uint64_t NextUnique(State& st, uint64_t nonce) {
  for (;;) {
    uint64_t v = Mix(nonce ^ Mix(++st.counter));
    if (v != 0) return v;
  }
}

// The answer to a call naming a session this registry does not hold.
absl::Status UnknownSessionError() {
  return absl::FailedPreconditionError(
      "unknown session (it ended, or the sidecar restarted): open a new Session stream");
}

// The one answer to a token that names no session of the caller: the same whether the token is
// malformed, unknown, ended or another owner's, so that it tells a guesser nothing.
absl::Status NotYourSessionError() {
  return absl::PermissionDeniedError(
      "arfuse-session names no open session of this caller: pass the session_token of a Session "
      "stream this caller opened (a session ends with its stream and with a sidecar restart)");
}

// The one answer to a plan id the session does not hold, whoever holds it.
absl::Status NotYourPlanError() {
  return absl::PermissionDeniedError(
      "the plan is not held by this session (destroyed, never created here, or its session "
      "ended): create the plan again");
}

// The session's plan `plan_id` when `generation` is its current one.
absl::StatusOr<Plan*> FindPlan(Session& s, uint64_t plan_id, uint64_t generation) {
  auto it = s.plans.find(plan_id);
  if (it == s.plans.end()) return NotYourPlanError();
  ARFUSE_RETURN_IF_ERROR(CheckGeneration(generation, it->second.generation,
                                         [&] { return absl::StrCat("plan ", plan_id); }));
  return &it->second;
}

// Where the kernel reads or writes the tensor of `role`: a pointer into its region's mapping,
// or null for a role the op's pattern does not use.
void* TensorPointer(TensorRole role, const std::vector<Placement>& placements,
                    const std::vector<std::shared_ptr<Region>>& regions) {
  for (size_t i = 0; i < placements.size(); ++i) {
    if (placements[i].role == role) {
      return static_cast<char*>(regions[i]->mapping->base()) + placements[i].offset;
    }
  }
  return nullptr;
}

}  // namespace

uint64_t RandomBootNonce() {
  std::random_device rd;
  for (;;) {
    uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    if (v != 0) return v;
  }
}

// ---- ResolvedOp ----

ResolvedOp::ResolvedOp(ResolvedOp&& o) noexcept
    : state_(std::move(o.state_)), held_(std::move(o.held_)), args_(o.args_), shape_(o.shape_) {
  o.held_.clear();
}

ResolvedOp& ResolvedOp::operator=(ResolvedOp&& o) noexcept {
  if (this != &o) {
    Release();
    state_ = std::move(o.state_);
    held_ = std::move(o.held_);
    o.held_.clear();
    args_ = o.args_;
    shape_ = o.shape_;
  }
  return *this;
}

ResolvedOp::~ResolvedOp() { Release(); }

void ResolvedOp::Release() {
  if (!state_ || held_.empty()) return;
  std::vector<std::shared_ptr<Region>> drop;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (auto& r : held_) --r->in_flight;
    drop.swap(held_);
  }
  state_->released.notify_all();
  // `drop` goes out of scope here, outside the lock: if it held the last reference (the region
  // was unregistered or its session ended meanwhile), the mapping closes now.
}

// ---- Registry ----

Registry::Registry(RegistryLimits limits, std::unique_ptr<MemoryOpener> opener, uint64_t boot_nonce)
    : limits_(limits),
      opener_(std::move(opener)),
      boot_nonce_(boot_nonce != 0 ? boot_nonce : RandomBootNonce()),
      state_(std::make_shared<State>()) {}

Registry::~Registry() {
  std::vector<std::shared_ptr<Session>> sessions;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (auto& [id, s] : state_->sessions) {
      s->closed = true;
      sessions.push_back(s);
    }
    state_->sessions.clear();
    state_->tokens.clear();
  }
}

MemoryKind Registry::kind() const { return opener_->kind(); }
int32_t Registry::device_id() const { return opener_->device_id(); }

size_t Registry::session_count() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->sessions.size();
}

RegistryTotals Registry::totals() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  // Summed on demand rather than kept as running counts: at most max_sessions entries, and the
  // per-session figures are the ones the caps already keep exact.
  RegistryTotals t;
  t.sessions = state_->sessions.size();
  for (const auto& [id, s] : state_->sessions) {
    t.regions += s->regions.size();
    t.region_bytes += s->region_bytes;
    t.plans += s->plans.size();
  }
  return t;
}

void Registry::SetTotalsObserver(TotalsObserver observer) {
  {
    std::lock_guard<std::mutex> lock(observer_mu_);
    observer_ = std::move(observer);
  }
  // The observer starts from the current totals, not from the next change.
  NotifyTotals();
}

void Registry::NotifyTotals() {
  // Holding observer_mu_ across reading the totals and the call orders the calls: whichever runs
  // last reads the totals after every change made so far, so a race between two changes never
  // leaves the observer with the older figures.
  std::lock_guard<std::mutex> lock(observer_mu_);
  if (!observer_) return;
  observer_(totals());
}

std::shared_ptr<Session> Registry::FindSessionLocked(uint64_t session_id) const {
  auto it = state_->sessions.find(session_id);
  if (it == state_->sessions.end()) return nullptr;
  return it->second;
}

absl::Status Registry::CheckSession(uint64_t session_id) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (FindSessionLocked(session_id) == nullptr) return UnknownSessionError();
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Registry::FindSession(absl::string_view token,
                                               const SessionOwner& caller) const {
  if (!IsWellFormedSessionToken(token)) return NotYourSessionError();
  std::lock_guard<std::mutex> lock(state_->mu);
  auto it = state_->tokens.find(token);
  if (it == state_->tokens.end()) return NotYourSessionError();
  std::shared_ptr<Session> s = FindSessionLocked(it->second);
  if (s == nullptr || !(s->owner == caller)) return NotYourSessionError();
  return s->id;
}

absl::StatusOr<uint64_t> Registry::OpenSession(const std::string& client_name) {
  ARFUSE_ASSIGN_OR_RETURN(OpenedSession s, OpenOwnedSession(client_name, SessionOwner{}));
  return s.id;
}

absl::StatusOr<OpenedSession> Registry::OpenOwnedSession(const std::string& client_name,
                                                         const SessionOwner& owner) {
  OpenedSession opened;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->sessions.size() >= limits_.max_sessions) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "too many sessions: the limit is ", limits_.max_sessions, "; close an idle client"));
    }
    auto s = std::make_shared<Session>();
    s->id = s->log_seq = state_->next_session_seq++;
    // 128 random bits collide with an open session's never in practice; the loop makes it never.
    do {
      s->token = NewSessionToken();
    } while (state_->tokens.contains(s->token));
    s->owner = owner;
    // Only a bounded, printable prefix is kept: it goes to logs.
    for (char c : client_name.substr(0, 64)) s->client_name += (c >= 0x20 && c < 0x7f) ? c : '?';
    state_->sessions[s->id] = s;
    state_->tokens[s->token] = s->id;
    spdlog::info("event=session_open session_seq={} client=\"{}\"", s->log_seq, s->client_name);
    opened = OpenedSession{s->id, s->token};
  }
  NotifyTotals();
  return opened;
}

void Registry::CloseSession(uint64_t session_id) {
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->sessions.find(session_id);
    if (it == state_->sessions.end()) return;
    s = std::move(it->second);
    state_->sessions.erase(it);
    state_->tokens.erase(s->token);
    s->closed = true;
  }
  // Wake unregisters waiting on this session's regions: their session is gone.
  state_->released.notify_all();
  spdlog::info("event=session_close session_seq={} regions={} plans={}", s->log_seq,
               s->regions.size(), s->plans.size());
  NotifyTotals();
  // Regions not in flight unmap here, outside the lock; the rest when their ops end.
}

absl::StatusOr<RegionHandle> Registry::RegisterRegion(uint64_t session_id, const RegionSpec& spec) {
  ARFUSE_RETURN_IF_ERROR(ValidateRegionSpec(spec, opener_->kind(), opener_->device_id(), limits_));
  {
    // Cheap checks first, so a client over its caps never makes us open anything.
    std::lock_guard<std::mutex> lock(state_->mu);
    std::shared_ptr<Session> s = FindSessionLocked(session_id);
    if (!s) return UnknownSessionError();
    if (s->region_names.contains(spec.name)) {
      return absl::AlreadyExistsError(
          "a region of this name is already registered in this "
          "session; unregister it first");
    }
    if (s->regions.size() >= limits_.max_regions_per_session) {
      return absl::ResourceExhaustedError(absl::StrCat("session has ", s->regions.size(),
                                                       " regions; the limit is ",
                                                       limits_.max_regions_per_session));
    }
    if (spec.byte_size > limits_.max_bytes_per_session - s->region_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("session would hold ", s->region_bytes, " + ", spec.byte_size,
                       " bytes of regions; the limit is ", limits_.max_bytes_per_session));
    }
  }
  // Opening may take a while (cudaIpcOpenMemHandle): never under the lock.
  ARFUSE_ASSIGN_OR_RETURN(std::unique_ptr<Mapping> mapping, opener_->Open(spec));
  ARFUSE_RETURN_IF_ERROR(CheckRegionSize(spec.byte_size, mapping->allocation_size()));
  if (reinterpret_cast<uintptr_t>(mapping->base()) % kTensorAlignment != 0) {
    return absl::InvalidArgumentError("region does not start on a 16-byte boundary");
  }

  auto region = std::make_shared<Region>();
  region->name = spec.name;
  region->byte_size = spec.byte_size;
  region->kind = *spec.kind;
  region->mapping = std::move(mapping);
  RegionHandle handle;
  {
    std::shared_ptr<Region> loser;  // closed outside the lock if the checks fail now
    std::lock_guard<std::mutex> lock(state_->mu);
    std::shared_ptr<Session> s = FindSessionLocked(session_id);
    // The session may have ended or raced another registration while the memory was opened.
    if (!s) {
      loser = std::move(region);
      return absl::FailedPreconditionError("session ended while the region was being opened");
    }
    if (s->region_names.contains(spec.name)) {
      loser = std::move(region);
      return absl::AlreadyExistsError(
          "a region of this name is already registered in this session; unregister it first");
    }
    if (s->regions.size() >= limits_.max_regions_per_session ||
        spec.byte_size > limits_.max_bytes_per_session - s->region_bytes) {
      loser = std::move(region);
      return absl::ResourceExhaustedError("session reached its region caps meanwhile");
    }
    region->id = state_->next_region_id++;
    region->generation = NextUnique(*state_, boot_nonce_);
    s->regions[region->id] = region;
    s->region_names[spec.name] = region->id;
    s->region_bytes += spec.byte_size;
    spdlog::info("event=region_register session_seq={} region={} bytes={} kind={}", s->log_seq,
                 region->id, region->byte_size, MemoryKindName(region->kind));
    handle = RegionHandle{region->id, region->generation};
  }
  NotifyTotals();
  return handle;
}

absl::Status Registry::UnregisterRegion(uint64_t session_id, uint64_t region_id,
                                        uint64_t generation, absl::Time deadline) {
  std::shared_ptr<Region> dropped;  // unmapped after the lock is released
  std::unique_lock<std::mutex> lock(state_->mu);
  std::shared_ptr<Session> s = FindSessionLocked(session_id);
  if (!s) return UnknownSessionError();
  auto it = s->regions.find(region_id);
  if (it == s->regions.end()) {
    return absl::NotFoundError(
        absl::StrCat("region ", region_id, " is not registered in this session"));
  }
  std::shared_ptr<Region> r = it->second;
  ARFUSE_RETURN_IF_ERROR(
      CheckGeneration(absl::StrCat("region ", region_id), generation, r->generation));
  if (r->unregistering) {
    return absl::AbortedError(
        absl::StrCat("region ", region_id, " is already being unregistered by another call"));
  }
  // New ops are refused from here on, so the wait below only drains what already started.
  r->unregistering = true;
  const auto until = absl::ToChronoTime(deadline);
  while (r->in_flight > 0 && !s->closed) {
    if (state_->released.wait_until(lock, until) == std::cv_status::timeout && r->in_flight > 0) {
      break;
    }
  }
  if (s->closed) return absl::OkStatus();  // the session's end released it meanwhile
  if (r->in_flight > 0) {
    r->unregistering = false;
    return absl::DeadlineExceededError(
        absl::StrCat("region ", region_id, " is still used by ", r->in_flight,
                     " op(s) in flight; it stays registered, try again"));
  }
  s->regions.erase(region_id);
  s->region_names.erase(r->name);
  s->region_bytes -= r->byte_size;
  spdlog::info("event=region_unregister session_seq={} region={}", s->log_seq, region_id);
  dropped = std::move(r);
  lock.unlock();
  NotifyTotals();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<RegionInfo>> Registry::ListRegions(uint64_t session_id) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  std::shared_ptr<Session> s = FindSessionLocked(session_id);
  if (!s) return UnknownSessionError();
  std::vector<RegionInfo> out;
  for (const auto& [id, r] : s->regions) {
    out.push_back(RegionInfo{r->id, r->generation, r->name, r->byte_size, r->kind, r->in_flight});
  }
  return out;
}

absl::StatusOr<PlanInfo> Registry::CreatePlan(uint64_t session_id, const OpRequest& op) {
  ARFUSE_ASSIGN_OR_RETURN(OpShape shape, ValidateOpShape(op, limits_));
  if (limits_.workspace) {
    ARFUSE_RETURN_IF_ERROR(CheckOpFitsWorkspace(shape, shape.max_tokens, *limits_.workspace));
  }
  PlanInfo info;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    std::shared_ptr<Session> s = FindSessionLocked(session_id);
    if (!s) return UnknownSessionError();
    if (s->plans.size() >= limits_.max_plans_per_session) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "session has ", s->plans.size(), " plans; the limit is ", limits_.max_plans_per_session));
    }
    // Resolving at max_tokens checks every tensor at its largest; the hold is released at once.
    ARFUSE_ASSIGN_OR_RETURN(ResolvedOp probe,
                            ResolveLocked(*s, shape, op, shape.max_tokens, /*from_plan=*/false));
    for (auto& r : probe.held_) --r->in_flight;
    probe.held_.clear();
    Plan plan;
    // Random, so that no plan id says anything about another session's.
    do {
      plan.id = RandomNonZeroId();
    } while (s->plans.contains(plan.id));
    plan.generation = NextUnique(*state_, boot_nonce_);
    plan.shape = shape;
    plan.refs = op;
    s->plans[plan.id] = plan;
    spdlog::info(
        "event=plan_create session_seq={} plan={} pattern={} dtype={} hidden={} "
        "max_tokens={}",
        s->log_seq, plan.id, PatternName(shape.pattern), DTypeName(shape.dtype), shape.hidden,
        shape.max_tokens);
    info = PlanInfo{plan.id, plan.generation, shape};
  }
  NotifyTotals();
  return info;
}

absl::Status Registry::DestroyPlan(uint64_t session_id, uint64_t plan_id, uint64_t generation) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    std::shared_ptr<Session> s = FindSessionLocked(session_id);
    if (!s) return UnknownSessionError();
    ARFUSE_RETURN_IF_ERROR(FindPlan(*s, plan_id, generation).status());
    s->plans.erase(plan_id);
  }
  NotifyTotals();
  return absl::OkStatus();
}

absl::StatusOr<ResolvedOp> Registry::ResolvePlan(uint64_t session_id, uint64_t plan_id,
                                                 uint64_t generation, uint32_t num_tokens) {
  std::lock_guard<std::mutex> lock(state_->mu);
  std::shared_ptr<Session> s = FindSessionLocked(session_id);
  if (!s) return UnknownSessionError();
  ARFUSE_ASSIGN_OR_RETURN(const Plan* plan, FindPlan(*s, plan_id, generation));
  ARFUSE_RETURN_IF_ERROR(CheckNumTokens(num_tokens, plan->shape.max_tokens));
  return ResolveLocked(*s, plan->shape, plan->refs, num_tokens, /*from_plan=*/true);
}

absl::StatusOr<ResolvedOp> Registry::ResolveOp(uint64_t session_id, const OpRequest& op,
                                               uint32_t num_tokens) {
  OpRequest sized = op;
  if (sized.max_tokens == 0) sized.max_tokens = num_tokens;
  if (num_tokens == 0) return absl::InvalidArgumentError("num_tokens must be > 0");
  ARFUSE_ASSIGN_OR_RETURN(OpShape shape, ValidateOpShape(sized, limits_));
  ARFUSE_RETURN_IF_ERROR(CheckNumTokens(num_tokens, shape.max_tokens));
  if (limits_.workspace) {
    ARFUSE_RETURN_IF_ERROR(CheckOpFitsWorkspace(shape, num_tokens, *limits_.workspace));
  }
  std::lock_guard<std::mutex> lock(state_->mu);
  std::shared_ptr<Session> s = FindSessionLocked(session_id);
  if (!s) return UnknownSessionError();
  return ResolveLocked(*s, shape, sized, num_tokens, /*from_plan=*/false);
}

absl::StatusOr<ResolvedOp> Registry::ResolveLocked(Session& session, const OpShape& shape,
                                                   const OpRequest& refs, uint32_t num_tokens,
                                                   bool from_plan) {
  std::vector<TensorRole> roles = RolesFor(shape.pattern);
  for (TensorRole role : OptionalRolesFor(shape.pattern)) {
    if (RefFor(refs, role).present) roles.push_back(role);
  }
  std::vector<Placement> placements;
  std::vector<std::shared_ptr<Region>> regions;
  placements.reserve(roles.size());
  regions.reserve(roles.size());
  for (TensorRole role : roles) {
    const TensorRef& ref = RefFor(refs, role);
    const char* rn = TensorRoleName(role);
    auto it = session.regions.find(ref.region_id);
    if (it == session.regions.end()) {
      if (from_plan) {
        return absl::FailedPreconditionError(
            absl::StrCat(rn, ": region ", ref.region_id,
                         " of this plan was unregistered; create the plan again"));
      }
      return absl::NotFoundError(
          absl::StrCat(rn, ": region ", ref.region_id, " is not registered in this session"));
    }
    const std::shared_ptr<Region>& r = it->second;
    ARFUSE_RETURN_IF_ERROR(CheckGeneration(ref.generation, r->generation, [&] {
      return absl::StrCat(rn, ": region ", ref.region_id);
    }));
    if (r->unregistering) {
      return absl::FailedPreconditionError(
          absl::StrCat(rn, ": region ", ref.region_id, " is being unregistered"));
    }
    ARFUSE_ASSIGN_OR_RETURN(uint64_t bytes, RoleBytes(shape, role, num_tokens));
    ARFUSE_RETURN_IF_ERROR(CheckTensorRange(rn, ref.offset, bytes, r->byte_size));
    // Memory the client can still shrink is measured again before each op (an op on a shrunk
    // object is refused here rather than faulting in the engine).
    if (absl::Status intact = r->mapping->CheckIntact(r->byte_size); !intact.ok()) {
      return absl::Status(intact.code(),
                          absl::StrCat(rn, ": region ", ref.region_id, ": ", intact.message()));
    }
    placements.push_back(Placement{role, r->id, ref.offset, bytes});
    regions.push_back(r);
  }
  ARFUSE_RETURN_IF_ERROR(CheckNoForbiddenOverlap(shape.pattern, placements));

  ResolvedOp op;
  op.state_ = state_;
  op.shape_ = shape;
  op.args_.pattern = shape.pattern;
  op.args_.dtype = shape.dtype;
  op.args_.hidden = shape.hidden;
  op.args_.num_tokens = num_tokens;
  op.args_.eps = shape.eps;
  op.args_.input = TensorPointer(TensorRole::kInput, placements, regions);
  op.args_.output = TensorPointer(TensorRole::kOutput, placements, regions);
  op.args_.residual_in = TensorPointer(TensorRole::kResidualIn, placements, regions);
  op.args_.residual_out = TensorPointer(TensorRole::kResidualOut, placements, regions);
  op.args_.norm_out = TensorPointer(TensorRole::kNormOut, placements, regions);
  op.args_.gamma = TensorPointer(TensorRole::kGamma, placements, regions);
  op.args_.quant_out = TensorPointer(TensorRole::kQuantOut, placements, regions);
  op.args_.scale = TensorPointer(TensorRole::kScale, placements, regions);
  op.args_.scale_layout = shape.scale_layout;
  // One hold per distinct region: in_flight counts ops, not tensors.
  for (const auto& r : regions) {
    bool seen = false;
    for (const auto& h : op.held_) seen = seen || h == r;
    if (seen) continue;
    ++r->in_flight;
    op.held_.push_back(r);
  }
  return op;
}

}  // namespace arfuse
