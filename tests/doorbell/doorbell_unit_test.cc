// Host-side contract of the doorbell plane: the layouts shared with clients over IPC, the fixed
// handshake values, and the argument checks of every launcher, the plane and the client library,
// all of which refuse bad input before touching a device. Needs the CUDA toolkit to build, no
// GPU to run.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>

#include "client/ring/arfuse_ring.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/doorbell/doorbell.h"
#include "server/doorbell/doorbell_plane.h"
#include "server/doorbell/self_test.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;

TEST(DoorbellLayout, HotWordsSitOnTheirOwnLines) {
  EXPECT_EQ(sizeof(DoorbellSlot), 384u);
  EXPECT_EQ(alignof(DoorbellSlot), 128u);
  EXPECT_EQ(offsetof(DoorbellSlot, request), 0u);
  EXPECT_EQ(offsetof(DoorbellSlot, num_tokens), 4u);  // with request, on purpose
  EXPECT_EQ(offsetof(DoorbellSlot, complete), 128u);
  EXPECT_EQ(offsetof(DoorbellSlot, error), 256u);
  EXPECT_EQ(offsetof(DoorbellSlot, served), 260u);
  EXPECT_EQ(sizeof(DoorbellBlock), 32u * 384u);
  EXPECT_EQ(DoorbellSlotOffset(0), 0u);
  EXPECT_EQ(DoorbellSlotOffset(5), 5u * 384u);
  EXPECT_EQ(DoorbellSlotOffset(kMaxDoorbellSlots - 1) + sizeof(DoorbellSlot),
            sizeof(DoorbellBlock));
}

TEST(DoorbellLayout, DeviceRecordsKeepTheirSizes) {
  EXPECT_EQ(sizeof(DoorbellPlanEntry), 336u);
  EXPECT_EQ(offsetof(DoorbellPlanEntry, params), 0u);
  EXPECT_EQ(offsetof(DoorbellPlanEntry, max_tokens), sizeof(FusionParams));
  EXPECT_EQ(sizeof(DoorbellOp), 344u);
  EXPECT_EQ(offsetof(DoorbellOp, params), 0u);  // LaunchAllReduceFusionIndirect reads it there
  EXPECT_EQ(sizeof(DoorbellControl), 16u);
  EXPECT_EQ(sizeof(DoorbellReport), 32u);
  EXPECT_EQ(offsetof(DoorbellReport, served_in_place), 16u);
  EXPECT_EQ(sizeof(DoorbellWaitParams), 64u);
  EXPECT_EQ(sizeof(DoorbellServeState), 128u);   // zeroed by the host, one line
  EXPECT_EQ(sizeof(DoorbellServeParams), 432u);  // a kernel parameter
  EXPECT_EQ(sizeof(DoorbellTraceRecord), 80u);   // copied to the host as is
}

// The values travel to clients in CreatePlan's Doorbell message and are baked into captured
// graphs: changing one breaks every deployed client, so the numbers are spelled out here.
TEST(DoorbellLayout, HandshakeValuesAreFixed) {
  EXPECT_EQ(kDoorbellReset, 0u);  // a zeroed slot is armed
  EXPECT_EQ(kDoorbellRequest, 0x52494e47u);
  EXPECT_EQ(kDoorbellComplete, 0x444f4e45u);
  EXPECT_NE(kDoorbellRequest, kDoorbellComplete);
  // A ring from the slot's own GPU: another request value, never a completion or the reset.
  EXPECT_EQ(kDoorbellRequestLocal, 0x524e474cu);
  EXPECT_NE(kDoorbellRequestLocal, kDoorbellRequest);
  EXPECT_NE(kDoorbellRequestLocal, kDoorbellComplete);
  EXPECT_NE(kDoorbellRequestLocal, kDoorbellReset);
  EXPECT_EQ(offsetof(DoorbellSlot, owner_uuid), 2 * kDoorbellLineBytes + 8);  // the cold line
  DoorbellHandle h;
  EXPECT_EQ(h.request_value, kDoorbellRequest);
  EXPECT_EQ(h.complete_value, kDoorbellComplete);
  EXPECT_EQ(h.reset_value, kDoorbellReset);
  EXPECT_EQ(arfuse_doorbell_check_values(0x52494e47u, 0x444f4e45u, 0u), ARFUSE_RING_OK);
  EXPECT_EQ(arfuse_doorbell_check_values(1u, 0x444f4e45u, 0u), ARFUSE_RING_EVERSION);
  EXPECT_EQ(arfuse_doorbell_check_values(0x52494e47u, 0x444f4e45u, 7u), ARFUSE_RING_EVERSION);
}

TEST(DoorbellErrors, EveryCodeHasItsOwnDescription) {
  std::set<std::string> names;
  for (DoorbellError e :
       {DoorbellError::kNone, DoorbellError::kRingTimeout, DoorbellError::kRingTimeoutInFlight,
        DoorbellError::kStopped, DoorbellError::kBadTokenCount, DoorbellError::kDesynchronized}) {
    names.insert(DoorbellErrorName(static_cast<uint32_t>(e)));
  }
  for (FusionError f : {FusionError::kTimeout, FusionError::kHostAbort, FusionError::kPeerAbort,
                        FusionError::kPoisoned, FusionError::kOpMismatch}) {
    names.insert(DoorbellErrorName(static_cast<uint32_t>(DoorbellError::kFusionFailed) |
                                   static_cast<uint32_t>(f)));
  }
  EXPECT_EQ(names.size(), 11u);
  EXPECT_THAT(DoorbellErrorName(static_cast<uint32_t>(DoorbellError::kRingTimeout)),
              HasSubstr("did not run"));
  EXPECT_THAT(DoorbellErrorName(0x101), HasSubstr("peer did not arrive"));
  EXPECT_THAT(DoorbellErrorName(0x104), HasSubstr("poisoned"));
  EXPECT_THAT(DoorbellErrorName(0x105), HasSubstr("ranks disagree on the op"));
  EXPECT_STREQ(DoorbellErrorName(0x77), "unknown doorbell error");
  EXPECT_STREQ(arfuse_doorbell_error_name(4), DoorbellErrorName(4));
  EXPECT_STREQ(DoorbellOutcomeName(static_cast<uint32_t>(DoorbellOutcome::kIdle)), "idle");
  EXPECT_STREQ(DoorbellOutcomeName(99), "unknown");
}

DoorbellSlot* Misaligned() { return reinterpret_cast<DoorbellSlot*>(uintptr_t{0x10000} + 4); }
DoorbellSlot* Aligned() { return reinterpret_cast<DoorbellSlot*>(uintptr_t{0x10000}); }

TEST(DoorbellLaunch, RingRefusesBadArgumentsBeforeTheDevice) {
  const char* why = nullptr;
  EXPECT_EQ(CheckDoorbellRingArgs(nullptr, 1000, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("null"));
  EXPECT_EQ(CheckDoorbellRingArgs(Misaligned(), 1000, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("128-byte aligned"));
  EXPECT_EQ(CheckDoorbellRingArgs(Aligned(), 0, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("timeout is zero"));
  EXPECT_EQ(CheckDoorbellRingArgs(Aligned(), 1, &why), cudaSuccess);
  EXPECT_EQ(why, nullptr);
  // The launcher refuses the same without a launch (no GPU here: a launch would fail otherwise).
  EXPECT_EQ(LaunchDoorbellRing(nullptr, 1, 1000, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchDoorbellRing(Misaligned(), 1, 1000, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchDoorbellRing(Aligned(), 1, 0, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchDoorbellRing(Aligned(), 1, 1000, nullptr, static_cast<DoorbellScope>(7)),
            cudaErrorInvalidValue);
  // The scope check refuses missing arguments before any CUDA call.
  DoorbellScope scope = DoorbellScope::kDevice;
  const uint8_t uuid[16] = {};
  EXPECT_EQ(DoorbellRingScopeFor(nullptr, &scope), cudaErrorInvalidValue);
  EXPECT_EQ(DoorbellRingScopeFor(uuid, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(DoorbellRingScopeForSlot(nullptr, &scope), cudaErrorInvalidValue);
  EXPECT_EQ(DoorbellRingScopeForSlot(Aligned(), nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(scope, DoorbellScope::kDevice) << "untouched on a refused call";
}

DoorbellWaitParams GoodWait() {
  DoorbellWaitParams w{};
  w.slots = Aligned();
  w.plans = reinterpret_cast<const DoorbellPlanEntry*>(uintptr_t{0x20000});
  w.op = reinterpret_cast<DoorbellOp*>(uintptr_t{0x30000});
  w.control = reinterpret_cast<const DoorbellControl*>(uintptr_t{0x40000});
  w.idle_timeout_ns = 1000;
  w.slot_mask = 1;
  w.generation = 1;
  return w;
}

TEST(DoorbellLaunch, WaiterRefusesBadParamsBeforeTheDevice) {
  const char* why = nullptr;
  EXPECT_EQ(CheckDoorbellWaitParams(GoodWait(), &why), cudaSuccess);
  struct Case {
    void (*mutate)(DoorbellWaitParams&);
    const char* message;
  };
  const Case cases[] = {
      {[](DoorbellWaitParams& w) { w.slots = nullptr; }, "slots are null"},
      {[](DoorbellWaitParams& w) { w.slots = Misaligned(); }, "128-byte aligned"},
      {[](DoorbellWaitParams& w) { w.plans = nullptr; }, "plan table"},
      {[](DoorbellWaitParams& w) { w.op = nullptr; }, "op record"},
      {[](DoorbellWaitParams& w) { w.control = nullptr; }, "control words"},
      {[](DoorbellWaitParams& w) { w.idle_timeout_ns = 0; }, "idle timeout is zero"},
      {[](DoorbellWaitParams& w) { w.slot_mask = 0; }, "empty slot mask"},
  };
  for (const Case& c : cases) {
    DoorbellWaitParams w = GoodWait();
    c.mutate(w);
    EXPECT_EQ(CheckDoorbellWaitParams(w, &why), cudaErrorInvalidValue) << c.message;
    EXPECT_THAT(why, HasSubstr(c.message));
    EXPECT_EQ(LaunchDoorbellWait(w, nullptr), cudaErrorInvalidValue) << c.message;
  }
}

TEST(DoorbellLaunch, CompletionAndSlotKernelsRefuseBadParams) {
  const char* why = nullptr;
  DoorbellCompleteParams c{};
  EXPECT_EQ(CheckDoorbellCompleteParams(c, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("slots"));
  c.slots = Aligned();
  EXPECT_EQ(CheckDoorbellCompleteParams(c, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("op record"));
  c.op = reinterpret_cast<const DoorbellOp*>(uintptr_t{0x30000});
  c.report = reinterpret_cast<DoorbellReport*>(uintptr_t{0x50001});
  EXPECT_EQ(CheckDoorbellCompleteParams(c, &why), cudaErrorInvalidValue);
  EXPECT_THAT(why, HasSubstr("report"));
  c.report = nullptr;
  EXPECT_EQ(CheckDoorbellCompleteParams(c, &why), cudaSuccess);
  EXPECT_EQ(LaunchDoorbellComplete(DoorbellCompleteParams{}, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchDoorbellSetError(nullptr, 1, 3, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchDoorbellSetError(Aligned(), 1, 0, nullptr), cudaErrorInvalidValue);  // code 0
  EXPECT_EQ(LaunchDoorbellSetError(Aligned(), 0, 3, nullptr), cudaSuccess);  // nothing to do
  EXPECT_EQ(LaunchDoorbellResetSlots(Misaligned(), 1, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchDoorbellResetSlots(Aligned(), 0, nullptr), cudaSuccess);
}

FusionParams GoodTemplate() {
  FusionParams t{};
  t.layout = ComputeWorkspaceLayout(2, 64, 1024, DType::kBF16);
  t.hidden = 1024;
  t.rank = 0;
  t.world_size = 2;
  t.spin_timeout_ns = 1000;
  t.dtype = DType::kBF16;
  t.pattern = Pattern::kAllReduceResidualRmsNorm;
  t.algo = FusionAlgo::kOneShot;
  return t;
}

DoorbellServeParams GoodServe() {
  DoorbellServeParams sp{};
  sp.wait = GoodWait();
  sp.wait.slot_mask = 0x3;
  sp.inplace_template = GoodTemplate();
  sp.state = reinterpret_cast<DoorbellServeState*>(uintptr_t{0x60000});
  sp.inplace_mask = 0x1;
  sp.max_blocks = 32;
  return sp;
}

TEST(DoorbellLaunch, ServingLaunchRefusesBadParamsBeforeTheDevice) {
  const char* why = nullptr;
  EXPECT_EQ(CheckDoorbellServeParams(GoodServe(), &why), cudaSuccess);
  EXPECT_EQ(why, nullptr);
  struct Case {
    void (*mutate)(DoorbellServeParams&);
    const char* message;
  };
  const Case cases[] = {
      {[](DoorbellServeParams& sp) { sp.wait.idle_timeout_ns = 0; }, "idle timeout is zero"},
      {[](DoorbellServeParams& sp) { sp.state = nullptr; }, "serving state is null"},
      {[](DoorbellServeParams& sp) {
         sp.state = reinterpret_cast<DoorbellServeState*>(uintptr_t{0x60040});
       },
       "128-byte aligned"},
      {[](DoorbellServeParams& sp) {
         sp.report = reinterpret_cast<DoorbellReport*>(uintptr_t{0x50001});
       },
       "report is misaligned"},
      {[](DoorbellServeParams& sp) { sp.inplace_mask = 0; }, "in-place slot mask is empty"},
      {[](DoorbellServeParams& sp) { sp.inplace_mask = 0x4; }, "not within the waiter's"},
      {[](DoorbellServeParams& sp) { sp.max_blocks = 0; }, "max_blocks is 0"},
      {[](DoorbellServeParams& sp) {
         sp.trace = reinterpret_cast<DoorbellTraceRecord*>(uintptr_t{0x70000});
         sp.trace_ops = 0;
       },
       "trace has no records"},
      {[](DoorbellServeParams& sp) {
         sp.trace = reinterpret_cast<DoorbellTraceRecord*>(uintptr_t{0x70004});
         sp.trace_ops = 16;
       },
       "trace has no records or is misaligned"},
      {[](DoorbellServeParams& sp) { sp.inplace_template.world_size = 3; }, "combination"},
      {[](DoorbellServeParams& sp) { sp.inplace_template.hidden = 1028; },
       "hidden is not a positive multiple of 8"},
      {[](DoorbellServeParams& sp) { sp.inplace_template.spin_timeout_ns = 0; },
       "spin_timeout_ns is zero"},
  };
  for (const Case& c : cases) {
    DoorbellServeParams sp = GoodServe();
    c.mutate(sp);
    why = nullptr;
    EXPECT_EQ(CheckDoorbellServeParams(sp, &why), cudaErrorInvalidValue) << c.message;
    ASSERT_NE(why, nullptr) << c.message;
    EXPECT_THAT(why, HasSubstr(c.message));
    // The launcher refuses the same without touching the device (no GPU here).
    EXPECT_EQ(LaunchDoorbellServe(sp, nullptr), cudaErrorInvalidValue) << c.message;
  }
}

TEST(FusionIndirect, RefusesBadParamsPointerOrTemplateBeforeTheDevice) {
  const auto* params = reinterpret_cast<const FusionParams*>(uintptr_t{0x30000});
  EXPECT_EQ(LaunchAllReduceFusionIndirect(GoodTemplate(), nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchAllReduceFusionIndirect(
                GoodTemplate(), reinterpret_cast<const FusionParams*>(uintptr_t{0x30004}), nullptr),
            cudaErrorInvalidValue);
  FusionParams t = GoodTemplate();
  t.world_size = 3;
  EXPECT_EQ(LaunchAllReduceFusionIndirect(t, params, nullptr), cudaErrorInvalidValue);
  t = GoodTemplate();
  t.hidden = 1028;
  EXPECT_EQ(LaunchAllReduceFusionIndirect(t, params, nullptr), cudaErrorInvalidValue);
  t = GoodTemplate();
  t.dtype = DType::kFP16;  // not the workspace's dtype
  EXPECT_EQ(LaunchAllReduceFusionIndirect(t, params, nullptr), cudaErrorInvalidValue);
  t = GoodTemplate();
  t.spin_timeout_ns = 0;
  EXPECT_EQ(LaunchAllReduceFusionIndirect(t, params, nullptr), cudaErrorInvalidValue);
}

TEST(DoorbellPlaneOptions, CreateRefusesBadOptionsBeforeTheDevice) {
  int fake_workspace = 0;
  auto good = [&] {
    DoorbellPlaneOptions o;
    o.stream = reinterpret_cast<cudaStream_t>(uintptr_t{0x1000});
    o.local_workspace = &fake_workspace;
    o.layout = ComputeWorkspaceLayout(2, 64, 1024, DType::kBF16);
    return o;
  };
  struct Case {
    void (*mutate)(DoorbellPlaneOptions&);
    const char* message;
  };
  const Case cases[] = {
      {[](DoorbellPlaneOptions& o) { o.stream = nullptr; }, "engine's stream"},
      {[](DoorbellPlaneOptions& o) { o.local_workspace = nullptr; }, "workspace"},
      {[](DoorbellPlaneOptions& o) { o.layout = WorkspaceLayout{}; }, "workspace"},
      {[](DoorbellPlaneOptions& o) { o.device = -1; }, "device is negative"},
      {[](DoorbellPlaneOptions& o) { o.queue_depth = 0; }, "queue depth must be 1..64, got 0"},
      {[](DoorbellPlaneOptions& o) { o.queue_depth = 65; }, "got 65"},
      {[](DoorbellPlaneOptions& o) { o.idle_timeout = absl::ZeroDuration(); }, "idle timeout"},
      {[](DoorbellPlaneOptions& o) { o.poll_interval = absl::Seconds(1); }, "poll interval"},
      {[](DoorbellPlaneOptions& o) { o.max_poll_interval = absl::Microseconds(19); },
       "max poll interval must be in [poll interval, 100 ms]"},
      {[](DoorbellPlaneOptions& o) { o.max_poll_interval = absl::Milliseconds(101); },
       "max poll interval must be in [poll interval, 100 ms]"},
      {[](DoorbellPlaneOptions& o) {
         o.poll_interval = absl::Milliseconds(1);  // above the default max: both must move
       },
       "max poll interval"},
      {[](DoorbellPlaneOptions& o) { o.serve_blocks = kMaxDoorbellServeBlocks + 1; },
       "serving launch runs at most 128 blocks, got 129"},
      {[](DoorbellPlaneOptions& o) { o.trace_ops = kMaxDoorbellTraceOps + 1; },
       "trace holds at most 65536 ops, got 65537"},
  };
  for (const Case& c : cases) {
    DoorbellPlaneOptions o = good();
    c.mutate(o);
    auto plane = DoorbellPlane::Create(o);
    ASSERT_FALSE(plane.ok()) << c.message;
    EXPECT_EQ(plane.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(plane.status().message()), HasSubstr(c.message));
  }
}

TEST(DoorbellSelfTestOptions, RefusesBadOptionsBeforeTheDevice) {
  DoorbellSelfTestOptions o;
  o.ops = 0;
  EXPECT_EQ(RunDoorbellSelfTest(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = DoorbellSelfTestOptions{};
  o.hidden = 12;
  auto r = RunDoorbellSelfTest(o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("hidden 12"));
  o = DoorbellSelfTestOptions{};
  o.timeout = absl::ZeroDuration();
  EXPECT_EQ(RunDoorbellSelfTest(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RingLibrary, RefusesBadArgumentsWithCodesAndMessages) {
  alignas(128) static unsigned char fake_slot[384];
  void* slot = nullptr;
  unsigned char handle[64] = {};
  EXPECT_EQ(arfuse_open_doorbell(nullptr, 0, &slot), ARFUSE_RING_EINVAL);
  EXPECT_EQ(arfuse_open_doorbell(handle, 0, nullptr), ARFUSE_RING_EINVAL);
  EXPECT_EQ(arfuse_open_doorbell(handle, 100, &slot), ARFUSE_RING_EINVAL);  // not a slot offset
  EXPECT_EQ(arfuse_open_doorbell(handle, sizeof(DoorbellBlock), &slot), ARFUSE_RING_EINVAL);
  EXPECT_EQ(slot, nullptr);
  EXPECT_EQ(arfuse_ring(nullptr, nullptr, 1, 1000), ARFUSE_RING_EINVAL);
  EXPECT_EQ(arfuse_ring(nullptr, fake_slot + 4, 1, 1000), ARFUSE_RING_EINVAL);
  EXPECT_EQ(arfuse_ring(nullptr, fake_slot, 1, 0), ARFUSE_RING_EINVAL);
  uint32_t code = 0;
  EXPECT_EQ(arfuse_doorbell_error(nullptr, &code), ARFUSE_RING_EINVAL);
  EXPECT_EQ(arfuse_doorbell_error(fake_slot, nullptr), ARFUSE_RING_EINVAL);
  EXPECT_EQ(arfuse_doorbell_error(fake_slot, &code), ARFUSE_RING_ENOTOPEN);
  EXPECT_EQ(arfuse_close_doorbell(nullptr), ARFUSE_RING_EINVAL);
  EXPECT_EQ(arfuse_close_doorbell(fake_slot), ARFUSE_RING_ENOTOPEN);
  EXPECT_THAT(arfuse_ring_strerror(ARFUSE_RING_EINVAL), HasSubstr("invalid argument"));
  EXPECT_THAT(arfuse_ring_strerror(ARFUSE_RING_ENOTOPEN), HasSubstr("arfuse_open_doorbell"));
  EXPECT_THAT(arfuse_ring_strerror(ARFUSE_RING_EVERSION), HasSubstr("versions"));
  EXPECT_STREQ(arfuse_ring_strerror(ARFUSE_RING_OK), "ok");
  EXPECT_STREQ(arfuse_ring_strerror(static_cast<int>(cudaErrorInvalidValue)),
               cudaGetErrorString(cudaErrorInvalidValue));
  EXPECT_STREQ(arfuse_ring_strerror(-99), "unknown arfuse_ring error");
}

}  // namespace
}  // namespace arfuse
