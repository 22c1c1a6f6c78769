// The doorbell plane on a real GPU, N ranks simulated in one process (tests/doorbell/
// doorbell_test_util.h): every rank has a DoorbellPlane on its sidecar stream, and a "client"
// stream that replays CUDA graphs of ring kernels. Outputs are checked against kernels/host's
// ReferenceFusedOp. Also the indirect fused launch the plane queues (kernels/allreduce_fusion).
// Run: ctest --test-dir <build> -L gpu -R Doorbell --output-on-failure
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/allreduce_fusion/fusion_control.h"
#include "kernels/doorbell/doorbell.h"
#include "server/doorbell/doorbell_plane.h"
#include "server/doorbell/doorbell_report.h"
#include "server/doorbell/self_test.h"
#include "tests/doorbell/doorbell_test_util.h"

namespace arfuse {
namespace {

using doorbell_test::DeviceBuffer;
using doorbell_test::GroupShape;
using doorbell_test::HostOp;
using doorbell_test::RankGroup;

#define CUDA_OK(expr)                                                          \
  do {                                                                         \
    const cudaError_t err_ = (expr);                                           \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (false)

constexpr uint64_t kRingTimeoutNs = 10'000'000'000ull;

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define REQUIRE_GPU()                                                                    \
  do {                                                                                   \
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device: GPU tests run on the GPU machines"; \
  } while (false)

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

DoorbellSlot ReadSlot(const DoorbellSlot* slot) {
  DoorbellSlot s;
  std::memset(&s, 0xff, sizeof(s));
  if (cudaMemcpy(&s, slot, sizeof(s), cudaMemcpyDeviceToHost) != cudaSuccess) cudaGetLastError();
  return s;
}

// Every rank's plane, and per plan the slot pointer of every rank.
class Planes {
 public:
  Planes(RankGroup& g, DoorbellPlaneOptions base) : g_(g) {
    int device = 0;
    cudaGetDevice(&device);
    for (int r = 0; r < g.world(); ++r) {
      DoorbellPlaneOptions o = base;
      o.device = device;
      o.stream = g.sidecar(r);
      o.local_workspace = g.workspace(r);
      o.layout = g.layout();
      o.host_abort = g.host_abort().device();
      auto plane = DoorbellPlane::Create(o);
      if (!plane.ok()) {
        error_ = plane.status();
        return;
      }
      planes_.push_back(std::move(*plane));
    }
  }

  absl::Status status() const { return error_; }
  DoorbellPlane& operator[](int r) { return *planes_[r]; }
  int world() const { return g_.world(); }

  // The same plan on every rank; returns the plan's index (its slot, the same on every rank).
  absl::StatusOr<uint32_t> AddPlan(uint32_t hidden, Pattern pattern, DoorbellPlanOptions opts) {
    uint32_t slot = 0;
    std::vector<DoorbellSlot*> ptrs;
    for (int r = 0; r < g_.world(); ++r) {
      auto h = planes_[r]->AddPlan(g_.Params(r, 0, FusionAlgo::kOneShot, pattern, hidden), opts);
      if (!h.ok()) return h.status();
      if (r > 0 && h->slot != slot) return absl::InternalError("ranks disagree on the slot");
      slot = h->slot;
      if (h->ipc_handle.size() != 64 || h->offset != DoorbellSlotOffset(slot)) {
        return absl::InternalError("bad doorbell handle");
      }
      ptrs.push_back(planes_[r]->slot_for_testing(slot));
    }
    slots_[slot] = ptrs;
    return slot;
  }
  DoorbellSlot* slot(uint32_t plan, int rank) { return slots_[plan][rank]; }

  // Rank r's plane status once `done` holds for it: the host thread counts an op (served,
  // failed, rejected) when it finds the op's launches ended (every poll interval), which can be
  // after the client's stream saw the completion. The last status read when the deadline passes.
  template <typename Predicate>
  DoorbellPlaneStatus AwaitStatus(int r, Predicate done, absl::Duration limit = absl::Seconds(5)) {
    const absl::Time deadline = absl::Now() + limit;
    DoorbellPlaneStatus s = planes_[r]->Status();
    while (!done(s) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
      s = planes_[r]->Status();
    }
    return s;
  }
  DoorbellPlaneStatus AwaitServed(int r, uint64_t served, absl::Duration limit = absl::Seconds(5)) {
    return AwaitStatus(
        r, [served](const DoorbellPlaneStatus& s) { return s.served >= served; }, limit);
  }

  absl::Status StartAll() {
    for (auto& p : planes_) {
      if (absl::Status st = p->Start(); !st.ok()) return st;
    }
    return absl::OkStatus();
  }

  // Every rank's client rings `plan` directly (no graph).
  cudaError_t RingAll(uint32_t plan, uint32_t tokens, uint64_t timeout_ns = kRingTimeoutNs) {
    for (int r = 0; r < g_.world(); ++r) {
      if (cudaError_t e = LaunchDoorbellRing(slot(plan, r), tokens, timeout_ns, g_.client(r)); e) {
        return e;
      }
    }
    return cudaSuccess;
  }

  // One graph per rank holding one ring per entry of `rings` (plan, tokens).
  absl::StatusOr<std::vector<cudaGraphExec_t>> Capture(
      const std::vector<std::pair<uint32_t, uint32_t>>& rings,
      DoorbellScope scope = DoorbellScope::kSystem) {
    std::vector<cudaGraphExec_t> execs;
    if (PrepareDoorbellRing() != cudaSuccess) return absl::InternalError("ring kernel load");
    for (int r = 0; r < g_.world(); ++r) {
      cudaStream_t s = g_.client(r);
      if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
        return absl::InternalError("capture begin");
      }
      cudaError_t launch = cudaSuccess;
      for (auto [plan, tokens] : rings) {
        if (launch == cudaSuccess)
          launch = LaunchDoorbellRing(slot(plan, r), tokens, kRingTimeoutNs, s, scope);
      }
      cudaGraph_t graph = nullptr;
      const cudaError_t end = cudaStreamEndCapture(s, &graph);
      if (launch != cudaSuccess || end != cudaSuccess) return absl::InternalError("capture");
      cudaGraphExec_t exec = nullptr;
      const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      if (inst != cudaSuccess) return absl::InternalError("instantiate");
      execs.push_back(exec);
      owned_.push_back(exec);
    }
    return execs;
  }

  ~Planes() {
    for (cudaGraphExec_t e : owned_) cudaGraphExecDestroy(e);
    // Every plane's stop word first: the ranks share this process's context, and a plane's
    // cudaFree waits for the whole device, so freeing rank 0's plane while rank 1's waiter still
    // idles (up to its idle timeout, then relaunched) would wait for that waiter, again and again.
    for (auto& plane : planes_) plane->Stop();
  }

  // Every rank's slot error for `plan` (0 everywhere when healthy).
  std::vector<uint32_t> SlotErrors(uint32_t plan) {
    std::vector<uint32_t> errors;
    for (int r = 0; r < g_.world(); ++r) errors.push_back(ReadSlot(slot(plan, r)).error);
    return errors;
  }

  // Rings `tokens` rows of fresh random data on `plan` (a norm plan of hidden 1024, bf16) from
  // every rank's client, waits for the clients, and checks the slots' error words and every
  // output against the CPU. "" when all is well, else what went wrong.
  std::string RingNormAndVerify(uint32_t plan, uint32_t tokens, std::mt19937& rng) {
    HostOp op(g_.world(), tokens, 1024, DType::kBF16);
    op.FillRandom(rng);
    if (absl::Status st = op.Upload(g_); !st.ok()) return st.ToString();
    if (cudaError_t e = RingAll(plan, tokens); e != cudaSuccess) return cudaGetErrorString(e);
    if (absl::Status st = g_.SyncClients(absl::Seconds(5)); !st.ok()) return st.ToString();
    for (uint32_t error : SlotErrors(plan)) {
      if (error != 0) return absl::StrCat("slot error word ", error);
    }
    return op.Verify(g_, Pattern::kAllReduceResidualRmsNorm);
  }

 private:
  RankGroup& g_;
  absl::Status error_;
  std::vector<std::unique_ptr<DoorbellPlane>> planes_;
  std::map<uint32_t, std::vector<DoorbellSlot*>> slots_;
  std::vector<cudaGraphExec_t> owned_;
};

DoorbellPlaneOptions FastOptions() {
  DoorbellPlaneOptions o;
  o.queue_depth = 8;
  o.idle_timeout = absl::Milliseconds(200);
  o.poll_interval = absl::Microseconds(10);
  return o;
}

// Replays graphs of captured rings thousands of times, inputs changing from replay to replay,
// token counts crossing the two-shot threshold; every replay is checked against the CPU. Then a
// burst of replays with no host synchronization at all.
class DoorbellReplay : public ::testing::TestWithParam<int> {};

TEST_P(DoorbellReplay, GraphReplayMatchesCpuThousandsOfTimes) {
  REQUIRE_GPU();
  const bool pdl = GetParam() == 1;
  const bool in_place = GetParam() == 2 || GetParam() == 4;
  // 3, 4: the rings come from the GPU that holds the slots (every simulated rank is on it), so
  // they ring kDoorbellRequestLocal and the op is ordered at GPU scope on both sides.
  const DoorbellScope scope = GetParam() >= 3 ? DoorbellScope::kDevice : DoorbellScope::kSystem;
  for (int world : {2, 4}) {
    SCOPED_TRACE(::testing::Message() << "world " << world << " programmatic launch " << pdl);
    RankGroup g(GroupShape{world, 64, 1024, DType::kBF16});
    ASSERT_TRUE(g.ok());
    ASSERT_TRUE(g.Init().ok());
    DoorbellPlaneOptions options = FastOptions();
    options.programmatic_launch = pdl;
    options.serve_in_place = in_place;
    Planes planes(g, options);
    ASSERT_TRUE(planes.status().ok()) << planes.status();
    DoorbellPlanOptions opts;
    opts.max_tokens = 64;
    opts.twoshot_min_tokens = 32;
    auto plan = planes.AddPlan(1024, Pattern::kAllReduceResidualRmsNorm, opts);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_TRUE(planes.StartAll().ok());
    if (scope == DoorbellScope::kDevice) {
      // What the client library does: the slot names this GPU, so rings here may use GPU scope.
      CUDA_OK(PrepareDoorbellRing());
      for (int r = 0; r < world; ++r) {
        DoorbellScope found = DoorbellScope::kSystem;
        CUDA_OK(DoorbellRingScopeForSlot(planes.slot(*plan, r), &found));
        ASSERT_EQ(found, DoorbellScope::kDevice) << "rank " << r;
      }
    }
    const uint32_t token_cycle[] = {1, 7, 31, 32, 64, 3};
    std::map<uint32_t, std::vector<cudaGraphExec_t>> execs;
    for (uint32_t t : token_cycle) {
      auto e = planes.Capture({{*plan, t}}, scope);
      ASSERT_TRUE(e.ok()) << e.status();
      execs[t] = *e;
    }
    std::mt19937 rng(world);
    const int verified = world == 2 ? 1200 : 600;
    for (int i = 0; i < verified; ++i) {
      const uint32_t t = token_cycle[i % 6];
      SCOPED_TRACE(::testing::Message() << "replay " << i << " tokens " << t);
      HostOp op(world, t, 1024, DType::kBF16);
      op.FillRandom(rng);
      ASSERT_TRUE(op.Upload(g).ok());
      for (int r = 0; r < world; ++r) CUDA_OK(cudaGraphLaunch(execs[t][r], g.client(r)));
      ASSERT_TRUE(g.SyncClients().ok());
      ASSERT_THAT(planes.SlotErrors(*plan), ::testing::Each(0u));
      const std::string diff = op.Verify(g, Pattern::kAllReduceResidualRmsNorm);
      ASSERT_EQ(diff, "");
    }
    // Burst: fixed inputs, 3000 replays back to back, then the last one is checked.
    HostOp op(world, 64, 1024, DType::kBF16);
    op.FillRandom(rng);
    ASSERT_TRUE(op.Upload(g).ok());
    const int burst = 3000;
    for (int i = 0; i < burst; ++i) {
      const uint32_t t = token_cycle[i % 6];
      for (int r = 0; r < world; ++r) CUDA_OK(cudaGraphLaunch(execs[t][r], g.client(r)));
    }
    ASSERT_TRUE(g.SyncClients(absl::Seconds(60)).ok());
    ASSERT_THAT(planes.SlotErrors(*plan), ::testing::Each(0u));
    const uint32_t last = token_cycle[(burst - 1) % 6];
    HostOp check(world, last, 1024, DType::kBF16);
    const size_t bytes = g.Bytes(last);
    for (int r = 0; r < world; ++r) {
      check.inputs[r].assign(op.inputs[r].begin(), op.inputs[r].begin() + bytes);
    }
    check.residual.assign(op.residual.begin(), op.residual.begin() + bytes);
    check.gamma = op.gamma;
    ASSERT_EQ(check.Verify(g, Pattern::kAllReduceResidualRmsNorm), "");
    for (int r = 0; r < world; ++r) {
      const DoorbellPlaneStatus s = planes.AwaitServed(r, verified + burst);
      EXPECT_TRUE(s.health.ok()) << s.health;
      EXPECT_EQ(s.served, static_cast<uint64_t>(verified + burst)) << "rank " << r;
      EXPECT_EQ(s.failed, 0u);
      // One-shot rings (4 of the 6 token counts) ran in place, and only then.
      if (in_place) {
        EXPECT_GT(s.served_in_place, 0u) << "rank " << r;
      } else {
        EXPECT_EQ(s.served_in_place, 0u) << "rank " << r;
      }
      EXPECT_EQ(ReadSlot(planes.slot(*plan, r)).served, static_cast<uint32_t>(verified + burst));
      EXPECT_EQ(g.ErrorWord(r), 0u);
    }
  }
}

// plain: waiter + fused launches + completion per ring; programmatic: the same with programmatic
// dependent launches; in_place: the serving launch runs the one-shot rings itself (the two-shot
// ones still go through the fused launch behind it).
std::string LaunchModeName(const ::testing::TestParamInfo<int>& info) {
  static const char* const kNames[] = {"plain", "programmatic", "in_place", "plain_device_scope",
                                       "in_place_device_scope"};
  return kNames[info.param];
}
INSTANTIATE_TEST_SUITE_P(Launch, DoorbellReplay, ::testing::Values(0, 1, 2, 3, 4), LaunchModeName);

// The scope check: the slot's owner UUID against the device of the ring's stream.
TEST(DoorbellGpu, RingScopeIsDeviceOnlyForTheSlotsOwnGpu) {
  REQUIRE_GPU();
  RankGroup g(GroupShape{2, 8, 1024, DType::kBF16});
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g.Init().ok());
  Planes planes(g, FastOptions());
  ASSERT_TRUE(planes.status().ok()) << planes.status();
  DoorbellPlanOptions opts;
  opts.max_tokens = 8;
  auto plan = planes.AddPlan(1024, Pattern::kAllReduceResidualRmsNorm, opts);
  ASSERT_TRUE(plan.ok()) << plan.status();
  DoorbellSlot owner = ReadSlot(planes.slot(*plan, 0));
  DoorbellScope scope = DoorbellScope::kSystem;
  CUDA_OK(PrepareDoorbellRing());
  CUDA_OK(cudaSetDevice(0));  // the ring runs on the current device
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  ASSERT_EQ(std::memcmp(owner.owner_uuid, prop.uuid.bytes, 16), 0);
  CUDA_OK(DoorbellRingScopeFor(owner.owner_uuid, &scope));
  EXPECT_EQ(scope, DoorbellScope::kDevice);
  // Another GPU's block (or an older sidecar's, all zeros): system scope.
  owner.owner_uuid[0] ^= 0xffu;
  CUDA_OK(DoorbellRingScopeFor(owner.owner_uuid, &scope));
  EXPECT_EQ(scope, DoorbellScope::kSystem);
  EXPECT_EQ(DoorbellRingScopeFor(nullptr, &scope), cudaErrorInvalidValue);
  EXPECT_EQ(DoorbellRingScopeFor(owner.owner_uuid, nullptr), cudaErrorInvalidValue);
  // From the slot itself: its own block's UUID, read from device memory.
  scope = DoorbellScope::kSystem;
  CUDA_OK(DoorbellRingScopeForSlot(planes.slot(*plan, 0), &scope));
  EXPECT_EQ(scope, DoorbellScope::kDevice);
}

// A client that never rings: waiters reach their deadline, consume nothing and are replaced; the
// plane still serves the next ring; teardown does not wait.
TEST(DoorbellGpu, NeverRingingClientLeavesTheWaiterIdle) {
  REQUIRE_GPU();
  RankGroup g(GroupShape{2, 16, 1024, DType::kBF16});
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g.Init().ok());
  DoorbellPlaneOptions o = FastOptions();
  o.idle_timeout = absl::Milliseconds(20);
  auto planes = std::make_unique<Planes>(g, o);
  ASSERT_TRUE(planes->status().ok());
  auto plan = planes->AddPlan(1024, Pattern::kAllReduceResidualRmsNorm, {16, 0xffffffffu});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(planes->StartAll().ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  for (int r = 0; r < 2; ++r) {
    const DoorbellPlaneStatus s = (*planes)[r].Status();
    EXPECT_TRUE(s.health.ok()) << s.health;
    EXPECT_TRUE(s.running);
    EXPECT_GE(s.idle, 5u) << "rank " << r << ": idle waiters were not replaced";
    EXPECT_EQ(s.served, 0u);
  }
  EXPECT_EQ(g.ErrorWord(0), 0u);
  std::mt19937 rng(3);
  ASSERT_EQ(planes->RingNormAndVerify(*plan, 9, rng), "");
  const auto start = std::chrono::steady_clock::now();
  planes.reset();
  EXPECT_LT(SecondsSince(start), 1.0) << "destroying idle planes waited";
  ASSERT_TRUE(g.SyncSidecars(absl::Seconds(2)).ok()) << "a waiter outlived its plane";
}

// Rank 0's client rings, rank 1's never does: rank 0's fused op spins on rank 1. The host abort
// word ends everything: rank 0's op fails (its ring returns with the error), rank 1's waiter
// leaves. Then the group recovers: pause, re-initialize, reset the slots, resume.
TEST(DoorbellGpu, AbortMakesEverythingExitAndTheGroupRecovers) {
  REQUIRE_GPU();
  GroupShape shape{2, 16, 1024, DType::kBF16};
  shape.spin_timeout_ns = 60'000'000'000ull;  // the deadline must not be what ends it
  RankGroup g(shape);
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g.Init().ok());
  DoorbellPlaneOptions o = FastOptions();
  o.idle_timeout = absl::Seconds(30);
  Planes planes(g, o);
  ASSERT_TRUE(planes.status().ok());
  auto plan = planes.AddPlan(1024, Pattern::kAllReduceResidualRmsNorm, {16, 0xffffffffu});
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(planes.StartAll().ok());
  const auto start = std::chrono::steady_clock::now();
  CUDA_OK(LaunchDoorbellRing(planes.slot(*plan, 0), 8, 60'000'000'000ull, g.client(0)));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(cudaStreamQuery(g.client(0)), cudaErrorNotReady) << "rank 0's op did not wait";
  g.host_abort().Set(1);
  ASSERT_TRUE(g.SyncClients(absl::Seconds(5)).ok());
  ASSERT_TRUE(g.SyncSidecars(absl::Seconds(5)).ok());
  EXPECT_LT(SecondsSince(start), 5.0);
  const uint32_t host_abort_failure = static_cast<uint32_t>(DoorbellError::kFusionFailed) |
                                      static_cast<uint32_t>(FusionError::kHostAbort);
  EXPECT_EQ(ReadSlot(planes.slot(*plan, 0)).error, host_abort_failure)
      << DoorbellErrorName(ReadSlot(planes.slot(*plan, 0)).error);
  EXPECT_EQ(g.ErrorWord(0), static_cast<uint32_t>(FusionError::kHostAbort));
  // Both host threads collect the finished launches.
  const DoorbellPlaneStatus s0 =
      planes.AwaitStatus(0, [](const DoorbellPlaneStatus& s) { return s.failed >= 1; });
  EXPECT_EQ(s0.health.code(), absl::StatusCode::kFailedPrecondition) << s0.health;
  EXPECT_EQ(s0.served, 1u);
  EXPECT_EQ(s0.failed, 1u);
  EXPECT_EQ(s0.last_error, host_abort_failure);
  const DoorbellPlaneStatus s1 =
      planes.AwaitStatus(1, [](const DoorbellPlaneStatus& s) { return !s.running; });
  EXPECT_EQ(s1.health.code(), absl::StatusCode::kAborted) << s1.health;
  EXPECT_FALSE(s1.running);
  // Rank 1's client rings now: its slot was closed with the failure, so it returns at once.
  CUDA_OK(LaunchDoorbellRing(planes.slot(*plan, 1), 8, 60'000'000'000ull, g.client(1)));
  ASSERT_TRUE(g.SyncClients(absl::Seconds(2)).ok());
  EXPECT_EQ(ReadSlot(planes.slot(*plan, 1)).error, host_abort_failure);

  // Recovery.
  g.host_abort().Set(0);
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(planes[r].Pause(absl::Now() + absl::Seconds(5)).ok());
  ASSERT_TRUE(g.Init().ok());
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(planes[r].ResetSlots(absl::Now() + absl::Seconds(5)).ok());
    ASSERT_TRUE(planes[r].Status().health.ok());
    ASSERT_TRUE(planes[r].Resume().ok());
  }
  std::mt19937 rng(11);
  ASSERT_EQ(planes.RingNormAndVerify(*plan, 16, rng), "");
}

// Stop while a client rings and nobody serves: the ring sees the slot closed, withdraws its
// request and returns, long before its own timeout.
TEST(DoorbellGpu, StopEndsARingInProgress) {
  REQUIRE_GPU();
  RankGroup g(GroupShape{2, 16, 1024, DType::kBF16});
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g.Init().ok());
  Planes planes(g, FastOptions());
  ASSERT_TRUE(planes.status().ok());
  auto plan = planes.AddPlan(1024, Pattern::kAllReduceResidualRmsNorm, {16, 0xffffffffu});
  ASSERT_TRUE(plan.ok());
  // Not started: nothing serves the ring.
  const auto start = std::chrono::steady_clock::now();
  CUDA_OK(LaunchDoorbellRing(planes.slot(*plan, 0), 4, 60'000'000'000ull, g.client(0)));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(cudaStreamQuery(g.client(0)), cudaErrorNotReady);
  planes[0].Stop();
  ASSERT_TRUE(g.SyncClients(absl::Seconds(5)).ok());
  EXPECT_LT(SecondsSince(start), 5.0);
  const DoorbellSlot s = ReadSlot(planes.slot(*plan, 0));
  EXPECT_EQ(s.error, static_cast<uint32_t>(DoorbellError::kStopped));
  EXPECT_EQ(s.request, kDoorbellReset) << "the ring did not withdraw its request";
  EXPECT_EQ(s.served, 0u);
  EXPECT_FALSE(planes[0].Status().health.ok());
  EXPECT_EQ(planes[0].Start().code(), absl::StatusCode::kFailedPrecondition);
}

// No sidecar serves the slot: the ring gives up at its timeout, withdraws, and records why;
// later rings (e.g. graph replays) do nothing until the sidecar resets the slot.
TEST(DoorbellGpu, RingTimesOutWithoutSidecarAndStaysQuiet) {
  REQUIRE_GPU();
  RankGroup g(GroupShape{2, 16, 1024, DType::kBF16});
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g.Init().ok());
  Planes planes(g, FastOptions());
  ASSERT_TRUE(planes.status().ok());
  auto plan = planes.AddPlan(1024, Pattern::kAllReduceResidualRmsNorm, {16, 0xffffffffu});
  ASSERT_TRUE(plan.ok());
  const auto start = std::chrono::steady_clock::now();
  CUDA_OK(LaunchDoorbellRing(planes.slot(*plan, 0), 4, 20'000'000ull, g.client(0)));
  ASSERT_TRUE(g.SyncClients(absl::Seconds(2)).ok());
  EXPECT_LT(SecondsSince(start), 1.0);
  DoorbellSlot s = ReadSlot(planes.slot(*plan, 0));
  EXPECT_EQ(s.error, static_cast<uint32_t>(DoorbellError::kRingTimeout));
  EXPECT_EQ(s.request, kDoorbellReset);
  EXPECT_EQ(s.complete, kDoorbellReset);
  // Sticky: a ring with a long timeout returns at once and rings nothing.
  const auto again = std::chrono::steady_clock::now();
  CUDA_OK(LaunchDoorbellRing(planes.slot(*plan, 0), 4, 60'000'000'000ull, g.client(0)));
  ASSERT_TRUE(g.SyncClients(absl::Seconds(2)).ok());
  EXPECT_LT(SecondsSince(again), 1.0);
  s = ReadSlot(planes.slot(*plan, 0));
  EXPECT_EQ(s.request, kDoorbellReset);
  EXPECT_EQ(s.error, static_cast<uint32_t>(DoorbellError::kRingTimeout));
  // The sidecar resets the slot (not started counts as paused) and serves it afterwards.
  for (int r = 0; r < 2; ++r)
    ASSERT_TRUE(planes[r].ResetSlots(absl::Now() + absl::Seconds(2)).ok());
  ASSERT_TRUE(planes.StartAll().ok());
  std::mt19937 rng(5);
  ASSERT_EQ(planes.RingNormAndVerify(*plan, 5, rng), "");
}

TEST(DoorbellGpu, TokenCountAbovePlanMaximumIsRejected) {
  REQUIRE_GPU();
  RankGroup g(GroupShape{2, 64, 1024, DType::kBF16});
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g.Init().ok());
  Planes planes(g, FastOptions());
  ASSERT_TRUE(planes.status().ok());
  auto plan = planes.AddPlan(1024, Pattern::kAllReduceResidualRmsNorm, {16, 0xffffffffu});
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(planes.StartAll().ok());
  CUDA_OK(planes.RingAll(*plan, 17));
  ASSERT_TRUE(g.SyncClients(absl::Seconds(5)).ok());
  EXPECT_THAT(planes.SlotErrors(*plan),
              ::testing::Each(static_cast<uint32_t>(DoorbellError::kBadTokenCount)));
  for (int r = 0; r < 2; ++r) {
    const DoorbellPlaneStatus s =
        planes.AwaitStatus(r, [](const DoorbellPlaneStatus& s) { return s.rejected >= 1; });
    EXPECT_EQ(s.rejected, 1u);
    EXPECT_EQ(s.served, 0u);
    EXPECT_TRUE(s.health.ok()) << "a rejected ring does not poison anything: " << s.health;
    EXPECT_EQ(g.ErrorWord(r), 0u);
  }
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(planes[r].Pause(absl::Now() + absl::Seconds(2)).ok());
    ASSERT_TRUE(planes[r].ResetSlots(absl::Now() + absl::Seconds(2)).ok());
    ASSERT_TRUE(planes[r].Resume().ok());
  }
  std::mt19937 rng(8);
  ASSERT_EQ(planes.RingNormAndVerify(*plan, 16, rng), "");
}

// The serving launch's trace (DoorbellPlaneOptions::trace_ops): one record per in-place op, its
// steps in order; a plane without a trace refuses to read or clear one.
TEST(DoorbellGpu, TraceRecordsTheInPlaceOps) {
  REQUIRE_GPU();
  RankGroup g(GroupShape{2, 8, 1024, DType::kBF16});
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g.Init().ok());
  {
    Planes untraced(g, FastOptions());
    ASSERT_TRUE(untraced.status().ok()) << untraced.status();
    auto read = untraced[0].ReadTrace();
    EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(read.status().message()), ::testing::HasSubstr("has no trace"));
    const absl::Status clear = untraced[0].ClearTrace();
    EXPECT_EQ(clear.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(clear.message()), ::testing::HasSubstr("has no trace"));
  }
  DoorbellPlaneOptions options = FastOptions();
  options.trace_ops = 64;
  Planes planes(g, options);
  ASSERT_TRUE(planes.status().ok()) << planes.status();
  auto plan = planes.AddPlan(1024, Pattern::kAllReduceResidualRmsNorm, {8, 0xffffffffu});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(planes.StartAll().ok());
  std::mt19937 rng(11);
  for (uint32_t t = 1; t <= 5; ++t) {
    ASSERT_EQ(planes.RingNormAndVerify(*plan, t, rng), "");
  }
  for (int r = 0; r < 2; ++r) {
    auto trace = planes[r].ReadTrace();
    ASSERT_TRUE(trace.ok()) << trace.status();
    ASSERT_EQ(trace->size(), 64u);
    bool saw_last = false;
    int written = 0;
    for (const DoorbellTraceRecord& rec : *trace) {
      if (rec.op == 0) continue;
      ++written;
      SCOPED_TRACE(::testing::Message() << "rank " << r << " op " << rec.op);
      // One SM's cycle counter: the steps of one op in order.
      EXPECT_LE(rec.taken, rec.announced);
      EXPECT_LE(rec.announced, rec.rows_done);
      EXPECT_LE(rec.rows_done, rec.all_done);
      EXPECT_LE(rec.all_done, rec.completed);
      EXPECT_LE(rec.taken_ns, rec.completed_ns);
      EXPECT_GE(rec.tokens, 1u);
      EXPECT_LE(rec.tokens, 5u);
      saw_last = saw_last || rec.tokens == 5;
    }
    // Every ring ran in place (one-shot, within the plan); a relaunch between rings restarts the
    // count, so at least the last op is there.
    EXPECT_GE(written, 1) << "rank " << r;
    EXPECT_TRUE(saw_last) << "rank " << r;
    ASSERT_TRUE(planes[r].ClearTrace().ok());
    auto cleared = planes[r].ReadTrace();
    ASSERT_TRUE(cleared.ok()) << cleared.status();
    for (const DoorbellTraceRecord& rec : *cleared) EXPECT_EQ(rec.op, 0u);
  }
}

TEST(DoorbellGpu, PlanValidationRefusesWhatTheKernelsWouldRefuse) {
  REQUIRE_GPU();
  RankGroup g(GroupShape{2, 64, 1024, DType::kBF16});
  ASSERT_TRUE(g.ok());
  Planes planes(g, FastOptions());
  ASSERT_TRUE(planes.status().ok());
  FusionParams p = g.Params(0, 0, FusionAlgo::kOneShot);
  auto too_many = planes[0].AddPlan(p, {65, 0xffffffffu});
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_many.status().message()), ::testing::HasSubstr("at most 64"));
  FusionParams other = g.Params(1, 0, FusionAlgo::kOneShot);  // rank 1's workspace
  EXPECT_EQ(planes[0].AddPlan(other, {}).status().code(), absl::StatusCode::kInvalidArgument);
  FusionParams no_gamma = p;
  no_gamma.gamma = nullptr;
  auto refused = planes[0].AddPlan(no_gamma, {});
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("gamma"));
  // Default max_tokens: what fits at this hidden (twice 64 at half the hidden).
  FusionParams half = g.Params(0, 0, FusionAlgo::kOneShot, Pattern::kAllReduceResidualRmsNorm, 512);
  auto h = planes[0].AddPlan(half, {});
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(planes[0].RemovePlan(h->slot).code(), absl::StatusCode::kOk);
  EXPECT_EQ(planes[0].RemovePlan(h->slot).code(), absl::StatusCode::kNotFound);
  // All slots taken.
  for (uint32_t i = 0; i < kMaxDoorbellSlots; ++i) ASSERT_TRUE(planes[0].AddPlan(p, {}).ok()) << i;
  EXPECT_EQ(planes[0].AddPlan(p, {}).status().code(), absl::StatusCode::kResourceExhausted);
}

// An eager op on the same stream: pause (queued waiters leave without consuming), launch, resume.
TEST(DoorbellGpu, PauseForAnEagerOpThenResume) {
  REQUIRE_GPU();
  RankGroup g(GroupShape{2, 32, 1024, DType::kBF16});
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g.Init().ok());
  Planes planes(g, FastOptions());
  ASSERT_TRUE(planes.status().ok());
  auto plan = planes.AddPlan(1024, Pattern::kAllReduceResidualRmsNorm, {32, 16});
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(planes.StartAll().ok());
  std::mt19937 rng(21);
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    const uint32_t t = 1 + round % 32;
    HostOp op(2, t, 1024, DType::kBF16);
    op.FillRandom(rng);
    ASSERT_TRUE(op.Upload(g).ok());
    CUDA_OK(planes.RingAll(*plan, t));
    ASSERT_TRUE(g.SyncClients(absl::Seconds(5)).ok());
    ASSERT_EQ(op.Verify(g, Pattern::kAllReduceResidualRmsNorm), "");
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(planes[r].Pause(absl::Now() + absl::Seconds(5)).ok());
    HostOp eager(2, 32 - t + 1, 1024, DType::kBF16);
    eager.FillRandom(rng);
    ASSERT_TRUE(eager.Upload(g).ok());
    const FusionAlgo algo = round % 2 == 0 ? FusionAlgo::kOneShot : FusionAlgo::kTwoShot;
    for (int r = 0; r < 2; ++r) {
      CUDA_OK(LaunchAllReduceFusion(g.Params(r, eager.tokens, algo), g.sidecar(r)));
    }
    ASSERT_TRUE(g.SyncSidecars(absl::Seconds(5)).ok());
    ASSERT_EQ(eager.Verify(g, Pattern::kAllReduceResidualRmsNorm), "");
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(planes[r].Resume().ok());
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(planes[r].Status().served, 20u);
    EXPECT_GE(planes[r].Status().kicked, 20u);
  }
}

// Two plans of different shapes and patterns on one workspace: one fused launch per shape queued
// behind every waiter; each launch runs only its own plan's ops.
TEST(DoorbellGpu, TwoPlansOfDifferentShapesShareThePipeline) {
  REQUIRE_GPU();
  RankGroup g(GroupShape{2, 64, 1024, DType::kBF16});
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g.Init().ok());
  Planes planes(g, FastOptions());
  ASSERT_TRUE(planes.status().ok());
  ASSERT_TRUE(planes.StartAll().ok());  // started before any plan: plans arrive while running
  auto norm = planes.AddPlan(1024, Pattern::kAllReduceResidualRmsNorm, {64, 0xffffffffu});
  ASSERT_TRUE(norm.ok());
  auto sum = planes.AddPlan(512, Pattern::kAllReduce, {128, 64});
  ASSERT_TRUE(sum.ok());
  ASSERT_NE(*norm, *sum);
  auto execs = planes.Capture({{*norm, 24}, {*sum, 100}});
  ASSERT_TRUE(execs.ok()) << execs.status();
  std::mt19937 rng(31);
  for (int i = 0; i < 200; ++i) {
    SCOPED_TRACE(::testing::Message() << "replay " << i);
    // The norm op reads input/residual_in rows of 1024; the sum op reads input rows of 512. They
    // share the input buffer, so give both the same bytes: the sum plan's 100 x 512 elements are
    // the first 50 rows of the norm plan's input.
    HostOp a(2, 24, 1024, DType::kBF16);
    a.FillRandom(rng);
    HostOp b(2, 100, 512, DType::kBF16);
    for (int r = 0; r < 2; ++r) {
      std::vector<uint8_t> big(g.Bytes(50));
      std::memcpy(big.data(), a.inputs[r].data(), a.inputs[r].size());
      for (size_t k = a.inputs[r].size(); k < big.size(); ++k)
        big[k] = static_cast<uint8_t>(rng() & 0x3f);
      a.inputs[r].assign(big.begin(), big.begin() + g.Bytes(24));
      b.inputs[r] = big;
      CUDA_OK(cudaMemcpy(g.input(r), big.data(), big.size(), cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(g.residual_in(r), a.residual.data(), a.residual.size(),
                         cudaMemcpyHostToDevice));
    }
    CUDA_OK(cudaMemcpy(g.gamma(), a.gamma.data(), a.gamma.size(), cudaMemcpyHostToDevice));
    for (int r = 0; r < 2; ++r) CUDA_OK(cudaGraphLaunch((*execs)[r], g.client(r)));
    ASSERT_TRUE(g.SyncClients(absl::Seconds(5)).ok());
    ASSERT_THAT(planes.SlotErrors(*norm), ::testing::Each(0u));
    ASSERT_THAT(planes.SlotErrors(*sum), ::testing::Each(0u));
    ASSERT_EQ(a.Verify(g, Pattern::kAllReduceResidualRmsNorm), "");
    ASSERT_EQ(b.Verify(g, Pattern::kAllReduce), "");
  }
  // Removing one plan while running leaves the other served.
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(planes[r].RemovePlan(*sum).ok());
  std::mt19937 rng2(32);
  HostOp c(2, 3, 1024, DType::kBF16);
  c.FillRandom(rng2);
  ASSERT_TRUE(c.Upload(g).ok());
  CUDA_OK(planes.RingAll(*norm, 3));
  ASSERT_TRUE(g.SyncClients(absl::Seconds(5)).ok());
  ASSERT_EQ(c.Verify(g, Pattern::kAllReduceResidualRmsNorm), "");
  EXPECT_THAT(planes.SlotErrors(*sum),
              ::testing::Each(static_cast<uint32_t>(DoorbellError::kStopped)));
}

// The plane's host thread polls only while it has something to poll for: started without plans,
// and again after its last plan is removed and the launches in flight ended, it sleeps (an idle
// sidecar used to wake every poll interval, 50 000 times a second by default); adding a plan
// wakes it, and the plan is served.
TEST(DoorbellGpu, WithoutPlansTheHostThreadSleeps) {
  REQUIRE_GPU();
  RankGroup g(GroupShape{2, 16, 1024, DType::kBF16});
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g.Init().ok());
  Planes planes(g, FastOptions());  // 10 us poll interval
  ASSERT_TRUE(planes.status().ok());
  ASSERT_TRUE(planes.StartAll().ok());
  auto polls_during = [&](int r, absl::Duration d) {
    const uint64_t before = planes[r].Status().host_polls;
    absl::SleepFor(d);
    return planes[r].Status().host_polls - before;
  };
  for (int r = 0; r < 2; ++r) {
    EXPECT_LE(polls_during(r, absl::Milliseconds(200)), 2u) << "rank " << r << ", no plan yet";
  }
  std::mt19937 rng(41);
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    auto plan = planes.AddPlan(1024, Pattern::kAllReduceResidualRmsNorm, {16, 0xffffffffu});
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(planes.RingNormAndVerify(*plan, 5, rng), "");
    // With a plan it polls (a serving launch is in flight).
    for (int r = 0; r < 2; ++r) {
      EXPECT_GE(polls_during(r, absl::Milliseconds(50)), 10u) << "rank " << r << ", one plan";
    }
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(planes[r].RemovePlan(*plan).ok());
    for (int r = 0; r < 2; ++r) {
      const DoorbellPlaneStatus s =
          planes.AwaitStatus(r, [](const DoorbellPlaneStatus& st) { return st.inflight == 0; });
      ASSERT_EQ(s.inflight, 0u) << "rank " << r << ": the kicked launch did not end";
      EXPECT_TRUE(s.health.ok()) << s.health;
      EXPECT_EQ(s.plans, 0u);
      EXPECT_LE(polls_during(r, absl::Milliseconds(200)), 2u) << "rank " << r << ", plan removed";
    }
  }
}

TEST(DoorbellGpu, WhileNothingIsConsumedTheHostThreadBacksOff) {
  REQUIRE_GPU();
  RankGroup g(GroupShape{2, 16, 1024, DType::kBF16});
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g.Init().ok());
  DoorbellPlaneOptions options = FastOptions();  // 10 us poll interval, queue depth 8
  options.max_poll_interval = absl::Microseconds(640);
  options.idle_timeout = absl::Seconds(5);  // the serving launch stays resident throughout
  Planes planes(g, options);
  ASSERT_TRUE(planes.status().ok()) << planes.status();
  ASSERT_TRUE(planes.StartAll().ok());
  auto plan = planes.AddPlan(1024, Pattern::kAllReduceResidualRmsNorm, {16, 0xffffffffu});
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::mt19937 rng(43);
  ASSERT_EQ(planes.RingNormAndVerify(*plan, 5, rng), "");
  // Resident between rings, the serving launch consumes no triple. A timed wait never ends before
  // its timeout unless kicked (nothing kicks here), so once backed off the thread looks at most
  // once per 640 us, plus the doublings on the way up (10 -> 640 us: 7). At its 10 us base it
  // would look 200 ms / 10 us = 20000 times (a few thousand with the kernel's timer slack).
  const absl::Duration window = absl::Milliseconds(200);
  const uint64_t ceiling = window / options.max_poll_interval + 8;
  for (int r = 0; r < 2; ++r) {
    const uint64_t before = planes[r].Status().host_polls;
    absl::SleepFor(window);
    const uint64_t polls = planes[r].Status().host_polls - before;
    EXPECT_LE(polls, ceiling) << "rank " << r;
    EXPECT_GE(polls, 20u) << "rank " << r << ": the thread must keep looking";
    std::printf("rank %d: %llu looks in %lld ms while resident\n", r,
                static_cast<unsigned long long>(polls),
                static_cast<long long>(absl::ToInt64Milliseconds(window)));
  }
  // After the quiet spell: in-place rings, then a plan added while the thread is backed off (its
  // kick must bring the replacements in at once: the new slot is in no queued waiter's mask),
  // then rings that each use up a triple (two-shot), more of them than the queue holds.
  for (int i = 0; i < 3; ++i) ASSERT_EQ(planes.RingNormAndVerify(*plan, 1 + i, rng), "");
  absl::SleepFor(absl::Milliseconds(20));
  auto twoshot = planes.AddPlan(1024, Pattern::kAllReduceResidualRmsNorm, {16, 1});
  ASSERT_TRUE(twoshot.ok()) << twoshot.status();
  uint64_t served_before[2];
  for (int r = 0; r < 2; ++r) served_before[r] = planes[r].Status().served;
  const int rings = 3 * static_cast<int>(options.queue_depth);
  for (int i = 0; i < rings; ++i) {
    SCOPED_TRACE(::testing::Message() << "two-shot ring " << i);
    ASSERT_EQ(planes.RingNormAndVerify(*twoshot, 2 + i % 15, rng), "");
    if (i % 8 == 7) absl::SleepFor(absl::Milliseconds(5));  // let the thread back off again
  }
  ASSERT_EQ(planes.RingNormAndVerify(*plan, 7, rng), "");
  for (int r = 0; r < 2; ++r) {
    const DoorbellPlaneStatus s = planes.AwaitServed(r, served_before[r] + rings + 1);
    EXPECT_EQ(s.served, served_before[r] + rings + 1) << "rank " << r;
    EXPECT_EQ(s.failed, 0u) << "rank " << r;
    EXPECT_TRUE(s.health.ok()) << s.health;
  }
}

TEST(DoorbellGpu, SelfTestMeasuresTheHop) {
  REQUIRE_GPU();
  for (bool pdl : {false, true}) {
    DoorbellSelfTestOptions o;
    cudaGetDevice(&o.device);
    o.programmatic_launch = pdl;
    auto report = RunDoorbellSelfTest(o);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(report->measured);
    EXPECT_GT(report->doorbell_us_per_op, 0.0);
    EXPECT_GT(report->inprocess_us_per_op, 0.0);
    EXPECT_LT(report->doorbell_us_per_op, 1000.0);
    std::printf("programmatic launch %d: %s\n", pdl ? 1 : 0,
                DescribeDoorbell(*report, true).c_str());
  }
}

// ---------------------------------------------------------------------------------------------
// The indirect fused launch (kernels/allreduce_fusion) on its own.

// Writes `p` into `dst` (device) and launches the indirect kernel with template `t`.
cudaError_t LaunchIndirect(const FusionParams& t, const FusionParams& p, FusionParams* dst,
                           cudaStream_t s) {
  if (cudaError_t e = cudaMemcpyAsync(dst, &p, sizeof(p), cudaMemcpyHostToDevice, s); e) return e;
  return LaunchAllReduceFusionIndirect(t, dst, s);
}

std::vector<uint8_t> Download(const void* p, size_t bytes) {
  std::vector<uint8_t> h(bytes);
  if (cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) h.clear();
  return h;
}

TEST(FusionIndirectGpu, MatchesTheByValueLaunchBitForBit) {
  REQUIRE_GPU();
  for (int world : {2, 4}) {
    for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
      for (Pattern pattern : {Pattern::kAllReduce, Pattern::kAllReduceResidualRmsNorm}) {
        SCOPED_TRACE(::testing::Message() << "world " << world << " algo " << static_cast<int>(algo)
                                          << " pattern " << PatternName(pattern));
        RankGroup g(GroupShape{world, 64, 2048, DType::kBF16});
        ASSERT_TRUE(g.ok());
        ASSERT_TRUE(g.Init().ok());
        std::vector<std::unique_ptr<DeviceBuffer>> dev_params;
        for (int r = 0; r < world; ++r) {
          dev_params.push_back(std::make_unique<DeviceBuffer>(sizeof(FusionParams)));
        }
        std::mt19937 rng(world * 10 + static_cast<int>(algo));
        for (uint32_t t : {1u, 13u, 64u}) {
          HostOp op(world, t, 2048, DType::kBF16);
          op.FillRandom(rng);
          ASSERT_TRUE(op.Upload(g).ok());
          for (int r = 0; r < world; ++r) {
            CUDA_OK(LaunchAllReduceFusion(g.Params(r, t, algo, pattern), g.sidecar(r)));
          }
          ASSERT_TRUE(g.SyncSidecars().ok());
          ASSERT_EQ(op.Verify(g, pattern), "");
          void* out = pattern == Pattern::kAllReduce ? g.output(0) : g.norm_out(0);
          const auto by_value = Download(out, g.Bytes(t));
          for (int r = 0; r < world; ++r) {
            CUDA_OK(cudaMemset(pattern == Pattern::kAllReduce ? g.output(r) : g.norm_out(r), 0,
                               g.Bytes(t)));
            CUDA_OK(LaunchIndirect(g.Params(r, 0, algo, pattern), g.Params(r, t, algo, pattern),
                                   static_cast<FusionParams*>(dev_params[r]->get()), g.sidecar(r)));
          }
          ASSERT_TRUE(g.SyncSidecars().ok());
          ASSERT_EQ(op.Verify(g, pattern), "");
          EXPECT_EQ(Download(out, g.Bytes(t)), by_value) << "tokens " << t;
          for (int r = 0; r < world; ++r) ASSERT_EQ(g.ErrorWord(r), 0u);
        }
      }
    }
  }
}

// Launches whose device params do not belong to them (no tokens, other algorithm, other shape)
// touch nothing: each rank may run any number of them between real ops, and the real ops still
// pair up. Also on a poisoned workspace (no abort is forwarded to the peers).
TEST(FusionIndirectGpu, LaunchesThatDoNotRunTouchNoProtocolState) {
  REQUIRE_GPU();
  const int world = 4;
  RankGroup g(GroupShape{world, 32, 1024, DType::kBF16});
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g.Init().ok());
  std::vector<std::unique_ptr<DeviceBuffer>> dev_params;
  for (int r = 0; r < world; ++r) {
    dev_params.push_back(std::make_unique<DeviceBuffer>(sizeof(FusionParams)));
  }
  std::mt19937 rng(77);
  for (int i = 0; i < 60; ++i) {
    SCOPED_TRACE(::testing::Message() << "op " << i);
    const uint32_t t = 1 + rng() % 32;
    const FusionAlgo algo = rng() % 2 ? FusionAlgo::kOneShot : FusionAlgo::kTwoShot;
    const FusionAlgo other =
        algo == FusionAlgo::kOneShot ? FusionAlgo::kTwoShot : FusionAlgo::kOneShot;
    HostOp op(world, t, 1024, DType::kBF16);
    op.FillRandom(rng);
    ASSERT_TRUE(op.Upload(g).ok());
    for (int r = 0; r < world; ++r) {
      auto* dst = static_cast<FusionParams*>(dev_params[r]->get());
      // A different number of skipped launches on every rank, before the real one.
      for (int k = 0; k < (r + i) % 4; ++k) {
        FusionParams idle = g.Params(r, 0, algo);
        CUDA_OK(LaunchIndirect(g.Params(r, 0, algo), idle, dst, g.sidecar(r)));
        CUDA_OK(LaunchIndirect(g.Params(r, 0, other), g.Params(r, t, algo), dst, g.sidecar(r)));
        FusionParams narrow = g.Params(r, t, algo, Pattern::kAllReduceResidualRmsNorm, 512);
        CUDA_OK(LaunchIndirect(g.Params(r, 0, algo), narrow, dst, g.sidecar(r)));
        FusionParams other_budget = g.Params(r, t, algo);
        other_budget.sm_budget += 1;
        CUDA_OK(LaunchIndirect(g.Params(r, 0, algo), other_budget, dst, g.sidecar(r)));
      }
      CUDA_OK(LaunchIndirect(g.Params(r, 0, algo), g.Params(r, t, algo), dst, g.sidecar(r)));
    }
    ASSERT_TRUE(g.SyncSidecars().ok());
    ASSERT_EQ(op.Verify(g, Pattern::kAllReduceResidualRmsNorm), "");
  }
  // The control block of a rank is unchanged by a skipped launch.
  const size_t control_bytes = sizeof(FusionControl);
  const auto before = Download(g.workspace(0), control_bytes);
  CUDA_OK(LaunchIndirect(g.Params(0, 0, FusionAlgo::kTwoShot), g.Params(0, 0, FusionAlgo::kTwoShot),
                         static_cast<FusionParams*>(dev_params[0]->get()), g.sidecar(0)));
  ASSERT_TRUE(g.SyncSidecars().ok());
  EXPECT_EQ(Download(g.workspace(0), control_bytes), before);
  // Poisoned rank 0: a skipped launch does not forward the abort to rank 1.
  const uint32_t timeout_code = static_cast<uint32_t>(FusionError::kTimeout);
  CUDA_OK(cudaMemcpy(WorkspaceErrorWord(g.workspace(0), g.layout()), &timeout_code, 4,
                     cudaMemcpyHostToDevice));
  CUDA_OK(LaunchIndirect(g.Params(0, 0, FusionAlgo::kOneShot), g.Params(0, 0, FusionAlgo::kOneShot),
                         static_cast<FusionParams*>(dev_params[0]->get()), g.sidecar(0)));
  ASSERT_TRUE(g.SyncSidecars().ok());
  uint32_t abort1 = 1;
  CUDA_OK(cudaMemcpy(&abort1, WorkspaceAbortWord(g.workspace(1), g.layout()), 4,
                     cudaMemcpyDeviceToHost));
  EXPECT_EQ(abort1, 0u);
}

}  // namespace
}  // namespace arfuse
