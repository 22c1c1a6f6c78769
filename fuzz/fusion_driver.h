// The Fusion request driver shared by the fuzz target and the seed generator: a fresh Registry
// (fixed boot nonce, so generations are reproducible and seeds can name them) over a fake
// opener, fed a sequence of serialized arfuse.v1 requests. It goes through exactly the service's
// conversions (server/services/fusion/proto_convert.h) and validation (server/registry/
// validation.h) and the registry's bookkeeping, and never opens a real handle or shm object.
//
// Input format: records of [type: 1 byte][length: 2 bytes little-endian][request bytes].
//
// Oracles besides ASan/UBSan: every tensor of an op that resolves is written (outputs) or read
// (inputs) over its full extent, and each fake allocation is exactly the registered size, so a
// validation gap that lets a tensor leave its region is a heap-buffer-overflow. After every step
// the registry's totals (Admin.GetStats, the region gauges) match the live session's regions,
// and the totals observer was last told exactly those totals.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "arfuse/v1/fusion.pb.h"
#include "server/registry/opener.h"
#include "server/registry/registry.h"
#include "server/registry/validation.h"
#include "server/services/fusion/proto_convert.h"

namespace arfuse::fuzz {

enum RequestType : uint8_t {
  kRegister = 0,
  kUnregister = 1,
  kCreatePlan = 2,
  kDestroyPlan = 3,
  kExecute = 4,
  kListRegions = 5,
  kNewSession = 6,
  kSessionHello = 7,
  kNumRequestTypes = 8,
};

// Client memory stand-in: a heap block of exactly the claimed size (capped), 256-aligned.
class FuzzMapping final : public Mapping {
 public:
  explicit FuzzMapping(uint64_t size)
      : size_(size), base_(::operator new(size == 0 ? 1 : size, std::align_val_t(256))) {}
  ~FuzzMapping() override { ::operator delete(base_, std::align_val_t(256)); }
  void* base() const override { return base_; }
  uint64_t allocation_size() const override { return size_; }

 private:
  uint64_t size_;
  void* base_;
};

inline constexpr uint64_t kMaxFakeAllocation = 1u << 20;

class FuzzOpener final : public MemoryOpener {
 public:
  explicit FuzzOpener(MemoryKind kind) : kind_(kind) {}
  MemoryKind kind() const override { return kind_; }
  int32_t device_id() const override { return 0; }
  absl::StatusOr<std::unique_ptr<Mapping>> Open(const RegionSpec& spec) override {
    // The real openers re-check the name; do the same, and model a failed open.
    if (spec.kind == MemoryKind::kHostShm) {
      if (absl::Status st = ValidateShmName(spec.shm_name); !st.ok()) return st;
      if (spec.shm_name == "/fail") {
        return absl::InvalidArgumentError("host shared-memory object could not be opened");
      }
    }
    // The "real allocation": the claimed size up to 1 MiB; larger claims meet a 1 MiB
    // allocation and must be refused by CheckRegionSize.
    uint64_t size = spec.byte_size < kMaxFakeAllocation ? spec.byte_size : kMaxFakeAllocation;
    return std::unique_ptr<Mapping>(new FuzzMapping(size));
  }

 private:
  MemoryKind kind_;
};

inline RegistryLimits FuzzLimits() {
  RegistryLimits l;
  l.max_sessions = 4;
  l.max_regions_per_session = 8;
  l.max_bytes_per_session = 4u << 20;
  l.max_plans_per_session = 16;
  l.max_tokens = 4096;
  l.max_hidden = 1u << 16;
  return l;
}

inline constexpr uint64_t kFuzzBootNonce = 0x5eed5eed5eed5eedULL;

// Touches every tensor of a resolved op over its full extent.
inline void TouchTensors(const ResolvedOp& op) {
  const OpArgs& a = op.args();
  for (TensorRole role : RolesFor(op.shape().pattern)) {
    absl::StatusOr<uint64_t> bytes = RoleBytes(op.shape(), role, a.num_tokens);
    if (!bytes.ok()) __builtin_trap();  // resolved ops have representable sizes
    const void* p = nullptr;
    switch (role) {
      case TensorRole::kInput:
        p = a.input;
        break;
      case TensorRole::kOutput:
        p = a.output;
        break;
      case TensorRole::kResidualIn:
        p = a.residual_in;
        break;
      case TensorRole::kResidualOut:
        p = a.residual_out;
        break;
      case TensorRole::kNormOut:
        p = a.norm_out;
        break;
      case TensorRole::kGamma:
        p = a.gamma;
        break;
      case TensorRole::kQuantOut:
        p = a.quant_out;
        break;
      case TensorRole::kScale:
        p = a.scale;
        break;
    }
    if (p == nullptr) __builtin_trap();  // every role of the pattern must be placed
    if (IsOutputRole(role)) {
      std::memset(const_cast<void*>(p), 0x5a, *bytes);
    } else {
      volatile uint8_t sink = 0;
      const uint8_t* b = static_cast<const uint8_t*>(p);
      for (uint64_t i = 0; i < *bytes; i += 64) sink = sink + b[i];
      if (*bytes > 0) sink = sink + b[*bytes - 1];
      (void)sink;
    }
  }
}

class FusionDriver {
 public:
  explicit FusionDriver(MemoryKind kind = MemoryKind::kHostShm)
      : registry_(FuzzLimits(), std::make_unique<FuzzOpener>(kind), kFuzzBootNonce) {
    registry_.SetTotalsObserver([this](const RegistryTotals& t) { observed_ = t; });
    auto s = registry_.OpenSession("fuzz");
    session_ = s.ok() ? *s : 0;
  }

  // Traps unless the totals agree with the one live session (hello sessions close at once) and
  // with the observer's last report. Nothing runs concurrently, so both must be exact.
  void CheckTotals() {
    const RegistryTotals t = registry_.totals();
    if (!(t == observed_)) __builtin_trap();
    RegistryTotals want;
    auto list = registry_.ListRegions(session_);
    if (list.ok()) {
      want.sessions = 1;
      want.regions = list->size();
      for (const RegionInfo& r : *list) want.region_bytes += r.byte_size;
    }
    if (t.sessions != want.sessions || t.regions != want.regions ||
        t.region_bytes != want.region_bytes) {
      __builtin_trap();
    }
    if (t.sessions == 0 && t.plans != 0) __builtin_trap();
  }

  // One request. For registrations and plans, the id and generation it got (seeds use them).
  absl::Status Step(uint8_t type, const uint8_t* data, size_t size, uint64_t* id = nullptr,
                    uint64_t* generation = nullptr) {
    const RegistryLimits& limits = registry_.limits();
    switch (type % kNumRequestTypes) {
      case kRegister: {
        v1::RegisterRegionRequest req;
        if (!req.ParseFromArray(data, static_cast<int>(size))) return Unparsed();
        RegionSpec spec = ToRegionSpec(req);
        // The pure checks for both kinds a sidecar may serve.
        (void)ValidateRegionSpec(spec, MemoryKind::kCudaIpc, 0, limits);
        (void)ValidateRegionSpec(spec, MemoryKind::kHostShm, 0, limits);
        absl::Status valid = ValidateRegionSpec(spec, registry_.kind(), 0, limits);
        auto handle = registry_.RegisterRegion(session_, spec);
        // Whatever validation refuses, the registry must refuse too.
        if (!valid.ok() && handle.ok()) __builtin_trap();
        if (handle.ok()) {
          if (id) *id = handle->region_id;
          if (generation) *generation = handle->generation;
        }
        return handle.status();
      }
      case kUnregister: {
        v1::UnregisterRegionRequest req;
        if (!req.ParseFromArray(data, static_cast<int>(size))) return Unparsed();
        // No op is in flight between steps, so this never waits.
        return registry_.UnregisterRegion(session_, req.region_id(), req.generation(), absl::Now());
      }
      case kCreatePlan: {
        v1::CreatePlanRequest req;
        if (!req.ParseFromArray(data, static_cast<int>(size))) return Unparsed();
        OpRequest op = ToOpRequest(req.op());
        absl::StatusOr<OpShape> shape = ValidateOpShape(op, limits);
        auto plan = registry_.CreatePlan(session_, op);
        if (!shape.ok() && plan.ok()) __builtin_trap();
        if (plan.ok()) {
          if (id) *id = plan->plan_id;
          if (generation) *generation = plan->generation;
        }
        return plan.status();
      }
      case kDestroyPlan: {
        v1::DestroyPlanRequest req;
        if (!req.ParseFromArray(data, static_cast<int>(size))) return Unparsed();
        return registry_.DestroyPlan(session_, req.plan_id(), req.generation());
      }
      case kExecute: {
        v1::ExecuteRequest req;
        if (!req.ParseFromArray(data, static_cast<int>(size))) return Unparsed();
        absl::StatusOr<ResolvedOp> op = absl::InvalidArgumentError("set plan_id or op");
        switch (req.target_case()) {
          case v1::ExecuteRequest::kPlanId:
            op = registry_.ResolvePlan(session_, req.plan_id(), req.plan_generation(),
                                       req.num_tokens());
            break;
          case v1::ExecuteRequest::kOp:
            op = registry_.ResolveOp(session_, ToOpRequest(req.op()), req.num_tokens());
            break;
          case v1::ExecuteRequest::TARGET_NOT_SET:
            break;
        }
        if (!op.ok()) return op.status();
        if (op->args().num_tokens != req.num_tokens() || req.num_tokens() == 0) __builtin_trap();
        TouchTensors(*op);
        op->Release();
        return absl::OkStatus();
      }
      case kListRegions: {
        auto list = registry_.ListRegions(session_);
        if (list.ok()) {
          for (const RegionInfo& r : *list) {
            v1::RegionInfo out;
            ToRegionInfoProto(r, &out);
            if (r.in_flight != 0) __builtin_trap();  // nothing is in flight between steps
          }
        }
        return list.status();
      }
      case kNewSession: {
        // The client went away: everything it held is released.
        registry_.CloseSession(session_);
        auto s = registry_.OpenSession(std::string(reinterpret_cast<const char*>(data), size));
        session_ = s.ok() ? *s : 0;
        return s.status();
      }
      case kSessionHello: {
        v1::SessionRequest req;
        if (!req.ParseFromArray(data, static_cast<int>(size))) return Unparsed();
        auto s = registry_.OpenSession(req.client_name());
        if (s.ok()) registry_.CloseSession(*s);
        return s.status();
      }
    }
    return absl::OkStatus();
  }

  Registry& registry() { return registry_; }

 private:
  static absl::Status Unparsed() { return absl::InvalidArgumentError("unparseable"); }

  Registry registry_;
  uint64_t session_ = 0;
  RegistryTotals observed_;
};

inline int RunRecords(FusionDriver& driver, const uint8_t* data, size_t size);

// Runs one fuzz input (a sequence of records) against a fresh driver; returns records run.
inline int RunInput(const uint8_t* data, size_t size) {
  const int64_t mappings_before = OpenMappingCount();
  int steps = 0;
  {
    // The first record's high bit picks a sidecar serving CUDA IPC instead of host memory.
    FusionDriver driver(size > 0 && (data[0] & 0x80) ? MemoryKind::kCudaIpc : MemoryKind::kHostShm);
    steps = RunRecords(driver, data, size);
  }
  // Every mapping is closed once the registry (and with it the session) is gone.
  if (OpenMappingCount() != mappings_before) __builtin_trap();
  return steps;
}

inline int RunRecords(FusionDriver& driver, const uint8_t* data, size_t size) {
  int steps = 0;
  size_t pos = 0;
  while (pos + 3 <= size && steps < 64) {
    uint8_t type = data[pos];
    size_t len = data[pos + 1] | (size_t{data[pos + 2]} << 8);
    pos += 3;
    if (len > size - pos) len = size - pos;
    (void)driver.Step(type, data + pos, len);
    driver.CheckTotals();
    pos += len;
    ++steps;
  }
  return steps;
}

inline std::string Record(uint8_t type, const std::string& bytes) {
  std::string out;
  out.push_back(static_cast<char>(type));
  out.push_back(static_cast<char>(bytes.size() & 0xff));
  out.push_back(static_cast<char>((bytes.size() >> 8) & 0xff));
  return out + bytes;
}

}  // namespace arfuse::fuzz
