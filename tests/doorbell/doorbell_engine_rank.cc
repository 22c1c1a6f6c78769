// One rank of the engine-level doorbell test (doorbell_engine_test, label gpu): joins the group
// with ConnectPeers, builds a CudaEngine (the daemon's engine, with its DoorbellPlane) and plays
// the wiring end to end from this process, the rank's "client" being a second stream here that
// replays captured graphs of the ring kernel (in-process: the plane's slot block is this
// process's own allocation). Every check failure prints "FAIL rank=R ..." and exits 1.
//   --rank --world --dir (peer socket directory) --group --spin_ms
//
// Phases (every rank in the same order; the exchange keeps them in step where it matters):
//   1. AddDoorbellPlan: the grant's values, and the algorithm threshold from the engine's table
//      (a test table with a two-shot range, so both algorithms run through the doorbell);
//   2. rings of 1..max_tokens tokens from captured graphs, new inputs every replay, checked
//      against the CPU reference and across ranks; a burst of back-to-back replays;
//   3. eager ops while the plan exists (the engine pauses the plane around them), then rings;
//   4. refusals: forced unfused (use the eager plane), too many tokens, an unknown grant;
//   5. a poisoned workspace (rank 1 does not ring): rank 0's ring ends with the fused error,
//      Initialize re-initializes in place, the slots are re-armed and the same graphs work;
//   6. RemoveDoorbellPlan: rings on the slot stop with kStopped; the engine is destroyed with a
//      plan registered (teardown must not hang).
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kernels/doorbell/doorbell.h"
#include "kernels/host/half_convert.h"
#include "kernels/host/reference_op.h"
#include "server/cuda_device/cuda_status.h"
#include "server/cuda_device/mps.h"
#include "server/cuda_engine/cuda_engine.h"
#include "server/peers/peer_exchange.h"
#include "tests/gpu/gpu_test_util.h"

namespace arfuse::testing {
namespace {

int g_rank = 0;

#define EXPECT_OR_RETURN(cond, ...)                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      return absl::InternalError(absl::StrCat("line ", __LINE__, ": ", __VA_ARGS__)); \
    }                                                                                 \
  } while (false)

constexpr uint32_t kHidden = 4096;
constexpr uint32_t kMaxTokens = 64;
constexpr uint64_t kRingTimeoutNs = 10'000'000'000ull;

int Bf16Distance(uint16_t a, uint16_t b) {
  auto ordinal = [](uint16_t v) {
    return (v & 0x8000) ? -static_cast<int>(v & 0x7fff) : static_cast<int>(v);
  };
  return std::abs(ordinal(a) - ordinal(b));
}

// One plan's tensors on this rank ([kMaxTokens, kHidden] bf16) and the client's graphs.
struct Plan {
  std::unique_ptr<DeviceBuffer> in, res_in, res_out, norm, gamma;
  std::vector<uint16_t> residual, gamma_host;
  OpArgs op;
  DoorbellGrant grant;
  DoorbellSlot* slot = nullptr;
  cudaStream_t stream = nullptr;
  std::map<uint32_t, cudaGraphExec_t> graphs;  // by token count
};

absl::Status Setup(Plan& p) {
  const size_t n = size_t{kMaxTokens} * kHidden;
  p.in = std::make_unique<DeviceBuffer>(n * 2);
  p.res_in = std::make_unique<DeviceBuffer>(n * 2);
  p.res_out = std::make_unique<DeviceBuffer>(n * 2);
  p.norm = std::make_unique<DeviceBuffer>(n * 2);
  p.gamma = std::make_unique<DeviceBuffer>(size_t{kHidden} * 2);
  p.residual = MakeBf16Input(InputKind::kRandom, 77, 1000, n);
  p.gamma_host = MakeBf16Input(InputKind::kRandom, 77, 2000, kHidden);
  ARFUSE_RETURN_IF_ERROR(p.res_in->Upload(p.residual));
  ARFUSE_RETURN_IF_ERROR(p.gamma->Upload(p.gamma_host));
  p.op.pattern = Pattern::kAllReduceResidualRmsNorm;
  p.op.dtype = DType::kBF16;
  p.op.hidden = kHidden;
  p.op.num_tokens = kMaxTokens;
  p.op.eps = 1e-6f;
  p.op.input = p.in->get();
  p.op.residual_in = p.res_in->get();
  p.op.residual_out = p.res_out->get();
  p.op.norm_out = p.norm->get();
  p.op.gamma = p.gamma->get();
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&p.stream, cudaStreamNonBlocking));
  return absl::OkStatus();
}

// The client's graph for `tokens`: one ring kernel.
absl::StatusOr<cudaGraphExec_t> GraphFor(Plan& p, uint32_t tokens) {
  auto it = p.graphs.find(tokens);
  if (it != p.graphs.end()) return it->second;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(p.stream, cudaStreamCaptureModeThreadLocal));
  const cudaError_t launched = LaunchDoorbellRing(p.slot, tokens, kRingTimeoutNs, p.stream);
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(p.stream, &graph));
  ARFUSE_CUDA_RETURN_IF_ERROR(launched);
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec, graph, 0));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaGraphDestroy(graph));
  p.graphs[tokens] = exec;
  return exec;
}

absl::StatusOr<uint32_t> SlotError(const Plan& p) {
  uint32_t code = 0;
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&code, &p.slot->error, sizeof(code), cudaMemcpyDeviceToHost, p.stream));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(p.stream));
  return code;
}

// Copies on the client's stream, which is then awaited. Not DeviceBuffer::Upload: its
// cudaDeviceSynchronize would also wait for the doorbell waiters queued on the engine's stream
// (each one until its idle timeout).
absl::Status Upload(Plan& p, void* dst, const std::vector<uint16_t>& host) {
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, host.data(), host.size() * 2, cudaMemcpyHostToDevice, p.stream));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(p.stream));
  return absl::OkStatus();
}
absl::StatusOr<std::vector<uint16_t>> Download(Plan& p, const void* src, size_t elements) {
  std::vector<uint16_t> host(elements);
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host.data(), src, elements * 2, cudaMemcpyDeviceToHost, p.stream));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(p.stream));
  return host;
}

// Every rank's input of `seed`; this rank's uploaded.
absl::StatusOr<std::vector<std::vector<uint16_t>>> NewInputs(Plan& p, int world, uint32_t seed) {
  std::vector<std::vector<uint16_t>> inputs;
  for (int r = 0; r < world; ++r) {
    inputs.push_back(MakeBf16Input(InputKind::kRandom, seed, r, size_t{kMaxTokens} * kHidden));
  }
  ARFUSE_RETURN_IF_ERROR(Upload(p, p.in->get(), inputs[g_rank]));
  return inputs;
}

// The first `tokens` rows against the CPU oracle, and against every other rank (bit-identical).
absl::Status Verify(Plan& p, Exchange& ex, const std::vector<std::vector<uint16_t>>& inputs,
                    uint32_t tokens, const std::string& tag) {
  const size_t n = size_t{tokens} * kHidden;
  std::vector<const void*> ptrs;
  for (const auto& in : inputs) ptrs.push_back(in.data());
  std::vector<uint16_t> want_res(n), want_norm(n);
  CpuOpArgs a;
  a.pattern = Pattern::kAllReduceResidualRmsNorm;
  a.dtype = DType::kBF16;
  a.world_size = ex.world_size();
  a.hidden = kHidden;
  a.num_tokens = tokens;
  a.eps = 1e-6f;
  a.rank_inputs = ptrs.data();
  a.residual_in = p.residual.data();
  a.residual_out = want_res.data();
  a.norm_out = want_norm.data();
  a.gamma = p.gamma_host.data();
  ARFUSE_RETURN_IF_ERROR(ReferenceFusedOp(a));
  ARFUSE_ASSIGN_OR_RETURN(std::vector<uint16_t> res, Download(p, p.res_out->get(), n));
  ARFUSE_ASSIGN_OR_RETURN(std::vector<uint16_t> norm, Download(p, p.norm->get(), n));
  for (size_t i = 0; i < n; ++i) {
    EXPECT_OR_RETURN(res[i] == want_res[i], tag, " tokens=", tokens, " residual_out[", i,
                     "]=", res[i], " want ", want_res[i]);
    EXPECT_OR_RETURN(Bf16Distance(norm[i], want_norm[i]) <= 2, tag, " tokens=", tokens,
                     " norm_out[", i, "]=", norm[i], " want ", want_norm[i]);
  }
  const uint64_t hash = HashWords(norm, HashWords(res));
  ARFUSE_ASSIGN_OR_RETURN(std::vector<std::string> hashes,
                          ex.Allgather(tag, absl::StrCat(hash), absl::Now() + absl::Seconds(60)));
  for (size_t r = 0; r < hashes.size(); ++r) {
    EXPECT_OR_RETURN(hashes[r] == hashes[0], tag, " rank ", r, " outputs differ from rank 0's");
  }
  return absl::OkStatus();
}

// One replay of the ring graph for `tokens` with new inputs, checked.
absl::Status RingAndVerify(Plan& p, Exchange& ex, uint32_t tokens, uint32_t seed,
                           const std::string& tag) {
  ARFUSE_ASSIGN_OR_RETURN(auto inputs, NewInputs(p, ex.world_size(), seed));
  ARFUSE_ASSIGN_OR_RETURN(cudaGraphExec_t exec, GraphFor(p, tokens));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, p.stream));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(p.stream));
  ARFUSE_ASSIGN_OR_RETURN(uint32_t err, SlotError(p));
  EXPECT_OR_RETURN(err == 0, tag, " tokens=", tokens, ": slot error ", DoorbellErrorName(err));
  return Verify(p, ex, inputs, tokens, tag);
}

absl::Status Barrier(Exchange& ex, const std::string& tag) {
  return ex.Barrier(tag, absl::Now() + absl::Seconds(60));
}

// A dispatch table with a two-shot range: one-shot up to 8 tokens of 4096 bf16 (64 KiB),
// two-shot above, for the architectures the GPU machines have.
DispatchTable TestTable() {
  absl::StatusOr<DispatchTable> t = DispatchTable::Parse(
      "sm=90 ws=2 oneshot_max=65536 twoshot_max=67108864 sym= source=doorbell_engine_test\n"
      "sm=100 ws=2 oneshot_max=65536 twoshot_max=67108864 sym= source=doorbell_engine_test\n");
  return t.ok() ? *t : DispatchTable::Published();
}

absl::Status Scenario(CudaEngine& engine, Exchange& ex, absl::Duration spin) {
  const int world = ex.world_size();
  Plan p;
  ARFUSE_RETURN_IF_ERROR(Setup(p));

  // 1. The plan and its grant.
  ARFUSE_ASSIGN_OR_RETURN(
      p.grant, engine.AddDoorbellPlan(p.op, kMaxTokens, absl::Now() + absl::Seconds(30)));
  EXPECT_OR_RETURN(p.grant.ipc_handle.size() == 64, "ipc handle of ", p.grant.ipc_handle.size(),
                   " bytes");
  EXPECT_OR_RETURN(p.grant.offset == DoorbellSlotOffset(p.grant.slot), "offset ", p.grant.offset);
  EXPECT_OR_RETURN(p.grant.request_value == kDoorbellRequest &&
                       p.grant.complete_value == kDoorbellComplete &&
                       p.grant.reset_value == kDoorbellReset,
                   "handshake values differ");
  EXPECT_OR_RETURN(p.grant.twoshot_min_tokens == 9, "twoshot_min_tokens ",
                   p.grant.twoshot_min_tokens, " want 9 (64 KiB one-shot limit): ", p.grant.reason);
  EXPECT_OR_RETURN(p.grant.path_at_max == ExecPath::kTwoShot, "path at max ",
                   ExecPathName(p.grant.path_at_max));
  p.slot = engine.doorbell_slot_for_testing(p.grant);
  EXPECT_OR_RETURN(p.slot != nullptr, "no slot for the grant");
  ARFUSE_CUDA_RETURN_IF_ERROR(PrepareDoorbellRing());

  // 2. Rings of several sizes (both algorithms), new inputs every time.
  uint32_t seed = 1;
  for (uint32_t tokens : {1u, 8u, 9u, 64u, 33u, 2u, 64u}) {
    for (int replay = 0; replay < 3; ++replay) {
      ARFUSE_RETURN_IF_ERROR(
          RingAndVerify(p, ex, tokens, ++seed, absl::StrCat("ring", tokens, "-", replay)));
    }
  }
  // A burst of back-to-back replays; the last one checked; then timing.
  {
    ARFUSE_ASSIGN_OR_RETURN(auto inputs, NewInputs(p, world, ++seed));
    ARFUSE_ASSIGN_OR_RETURN(cudaGraphExec_t exec, GraphFor(p, 8));
    cudaEvent_t start = nullptr, stop = nullptr;
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
    ARFUSE_RETURN_IF_ERROR(Barrier(ex, "burst-start"));
    constexpr int kBurst = 2000;
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventRecord(start, p.stream));
    for (int i = 0; i < kBurst; ++i) ARFUSE_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, p.stream));
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, p.stream));
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(p.stream));
    float ms = 0;
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    ARFUSE_ASSIGN_OR_RETURN(uint32_t err, SlotError(p));
    EXPECT_OR_RETURN(err == 0, "burst: slot error ", DoorbellErrorName(err));
    ARFUSE_RETURN_IF_ERROR(Verify(p, ex, inputs, 8, "burst"));
    ARFUSE_ASSIGN_OR_RETURN(DoorbellPlaneStatus st, engine.DoorbellStatus());
    std::fprintf(stderr, "rank=%d doorbell burst: %d rings of 8 tokens, %.2f us/op; served=%llu\n",
                 g_rank, kBurst, ms * 1e3 / kBurst, static_cast<unsigned long long>(st.served));
    EXPECT_OR_RETURN(st.health.ok(), "plane health ", st.health.ToString());
  }

  // 3. Eager ops while the plan exists: the engine pauses the plane around them.
  for (uint32_t tokens : {4u, 16u}) {
    ARFUSE_ASSIGN_OR_RETURN(auto inputs, NewInputs(p, world, ++seed));
    OpArgs op = p.op;
    op.num_tokens = tokens;
    ExecContext ctx;
    ctx.synchronous = true;
    ctx.deadline = absl::Now() + absl::Seconds(30);
    ARFUSE_ASSIGN_OR_RETURN(OpOutcome o, engine.Execute(op, ctx));
    EXPECT_OR_RETURN(o.path == (tokens >= 9 ? ExecPath::kTwoShot : ExecPath::kOneShot),
                     "eager path ", ExecPathName(o.path), " for ", tokens, " tokens");
    ARFUSE_RETURN_IF_ERROR(Verify(p, ex, inputs, tokens, absl::StrCat("eager", tokens)));
    ARFUSE_RETURN_IF_ERROR(RingAndVerify(p, ex, tokens, ++seed, absl::StrCat("after", tokens)));
  }

  // 4. Refusals (local: nothing reaches the peers).
  {
    engine.SetForcedPath(ForcedPath::kUnfused);
    absl::StatusOr<DoorbellGrant> g =
        engine.AddDoorbellPlan(p.op, kMaxTokens, absl::Now() + absl::Seconds(10));
    engine.SetForcedPath(ForcedPath::kAuto);
    EXPECT_OR_RETURN(absl::IsFailedPrecondition(g.status()) &&
                         absl::StrContains(g.status().message(), "use the eager plane"),
                     "forced unfused: got ", g.status().ToString());
    g = engine.AddDoorbellPlan(p.op, 513, absl::Now() + absl::Seconds(10));
    EXPECT_OR_RETURN(absl::IsInvalidArgument(g.status()), "513 tokens: got ",
                     g.status().ToString());
    DoorbellGrant unknown = p.grant;
    unknown.plane_id += 1000;
    ARFUSE_RETURN_IF_ERROR(engine.RemoveDoorbellPlan(unknown, absl::Now() + absl::Seconds(10)));
    ARFUSE_ASSIGN_OR_RETURN(DoorbellPlaneStatus st, engine.DoorbellStatus());
    EXPECT_OR_RETURN(st.plans == 1, "plans ", st.plans, " after refusals");
  }

  // 5. Poison: rank 1 does not ring; rank 0's op times out in the fused kernel.
  ARFUSE_RETURN_IF_ERROR(Barrier(ex, "poison"));
  if (world == 2) {
    if (g_rank == 0) {
      ARFUSE_ASSIGN_OR_RETURN(auto inputs, NewInputs(p, world, ++seed));
      ARFUSE_ASSIGN_OR_RETURN(cudaGraphExec_t exec, GraphFor(p, 4));
      ARFUSE_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, p.stream));
      ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(p.stream));
      ARFUSE_ASSIGN_OR_RETURN(uint32_t err, SlotError(p));
      EXPECT_OR_RETURN((err & ~0xffu) == static_cast<uint32_t>(DoorbellError::kFusionFailed),
                       "ring with a missing peer: slot error ", DoorbellErrorName(err));
    } else {
      // Seeds stay alike on every rank: each rank's oracle recomputes every rank's input.
      ++seed;
      absl::SleepFor(spin + absl::Seconds(2));
    }
    ARFUSE_RETURN_IF_ERROR(Barrier(ex, "poisoned"));
    if (g_rank == 0) {
      // Rank 0's workspace is poisoned: no new doorbell plan until it is re-initialized.
      EXPECT_OR_RETURN(engine.Status().state == WorkspaceState::kPoisoned,
                       "not poisoned: ", engine.Status().reason);
      absl::StatusOr<DoorbellGrant> g =
          engine.AddDoorbellPlan(p.op, 8, absl::Now() + absl::Seconds(10));
      EXPECT_OR_RETURN(absl::IsFailedPrecondition(g.status()),
                       "plan on a poisoned workspace: ", g.status().ToString());
    }
    // Re-initialize in place: the plan survives, its slot is re-armed.
    ARFUSE_RETURN_IF_ERROR(engine.Initialize(ex, absl::Now() + absl::Seconds(60)));
    EXPECT_OR_RETURN(engine.Status().state == WorkspaceState::kReady,
                     "not ready: ", engine.Status().reason);
    EXPECT_OR_RETURN(engine.doorbell_slot_for_testing(p.grant) == p.slot,
                     "the plan did not survive the in-place re-initialization");
    ARFUSE_ASSIGN_OR_RETURN(uint32_t err, SlotError(p));
    EXPECT_OR_RETURN(err == 0, "slot not re-armed: ", DoorbellErrorName(err));
    ARFUSE_ASSIGN_OR_RETURN(DoorbellPlaneStatus st, engine.DoorbellStatus());
    EXPECT_OR_RETURN(st.running && st.health.ok(), "plane after re-init: running=", st.running,
                     " health=", st.health.ToString());
    for (uint32_t tokens : {4u, 64u}) {
      ARFUSE_RETURN_IF_ERROR(RingAndVerify(p, ex, tokens, ++seed, absl::StrCat("reinit", tokens)));
    }
  }

  // 6. Removal: rings on the slot stop with kStopped and run nothing.
  ARFUSE_RETURN_IF_ERROR(Barrier(ex, "remove"));
  ARFUSE_RETURN_IF_ERROR(engine.RemoveDoorbellPlan(p.grant, absl::Now() + absl::Seconds(10)));
  {
    uint32_t err = 0;
    const absl::Time until = absl::Now() + absl::Seconds(2);
    do {
      ARFUSE_ASSIGN_OR_RETURN(err, SlotError(p));
    } while (err == 0 && absl::Now() < until);
    EXPECT_OR_RETURN(err == static_cast<uint32_t>(DoorbellError::kStopped), "removed slot: error ",
                     DoorbellErrorName(err));
    ARFUSE_ASSIGN_OR_RETURN(cudaGraphExec_t exec, GraphFor(p, 4));
    const absl::Time start = absl::Now();
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, p.stream));
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(p.stream));
    EXPECT_OR_RETURN(absl::Now() - start < absl::Seconds(2), "ring on a removed slot waited");
    ARFUSE_ASSIGN_OR_RETURN(DoorbellPlaneStatus st, engine.DoorbellStatus());
    EXPECT_OR_RETURN(st.plans == 0, "plans ", st.plans, " after removal");
  }
  // A plan left registered when the engine goes (the caller destroys it): teardown is bounded.
  ARFUSE_ASSIGN_OR_RETURN(DoorbellGrant left,
                          engine.AddDoorbellPlan(p.op, 8, absl::Now() + absl::Seconds(30)));
  static_cast<void>(left);
  ARFUSE_RETURN_IF_ERROR(Barrier(ex, "done"));
  for (auto& [tokens, exec] : p.graphs) cudaGraphExecDestroy(exec);
  cudaStreamDestroy(p.stream);
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  std::map<std::string, std::string> flags = {{"group", "doorbelltest"}, {"spin_ms", "2000"}};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    const size_t eq = a.find('=');
    if (a.rfind("--", 0) != 0 || eq == std::string::npos) {
      std::fprintf(stderr, "bad flag %s\n", a.c_str());
      return 2;
    }
    flags[a.substr(2, eq - 2)] = a.substr(eq + 1);
  }
  g_rank = std::stoi(flags["rank"]);
  const int world = std::stoi(flags["world"]);
  static_cast<void>(InitLogging("warn"));
  auto fail = [&](const absl::Status& s) {
    std::fprintf(stderr, "FAIL rank=%d: %s\n", g_rank, s.ToString().c_str());
    return 1;
  };
  int devices = 0;
  absl::Status counted = ARFUSE_CUDA_STATUS(cudaGetDeviceCount(&devices));
  if (!counted.ok() || devices == 0) return fail(absl::FailedPreconditionError("no CUDA device"));
  const int device = g_rank % devices;
  ARFUSE_CUDA_STATUS(cudaSetDevice(device)).IgnoreError();

  PeerOptions po;
  po.rank = g_rank;
  po.world_size = world;
  po.peer_dir = flags["dir"];
  po.group = flags["group"];
  po.timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<PeerExchange>> ex = ConnectPeers(po);
  if (!ex.ok()) return fail(ex.status());

  EngineOptions eo;
  eo.rank = g_rank;
  eo.world_size = world;
  eo.backend = "trtllm";
  eo.max_tokens = 512;
  eo.max_hidden = kHidden;
  eo.dtype = DType::kBF16;
  const absl::Duration spin = absl::Milliseconds(std::stoi(flags["spin_ms"]));
  eo.spin_timeout = spin;
  CudaEngineOptions co;
  co.device = device;
  co.table = TestTable();
  absl::Status result;
  {
    absl::StatusOr<std::unique_ptr<CudaEngine>> engine = MakeCudaEngine(eo, co);
    if (!engine.ok()) return fail(engine.status());
    absl::Status init = (*engine)->Initialize(**ex, absl::Now() + absl::Seconds(90));
    if (!init.ok()) return fail(init);
    const EngineStatus st = (*engine)->Status();
    std::fprintf(stderr, "rank=%d device=%d state=%d reason=\"%s\" shares_gpu=%d %s\n", g_rank,
                 device, static_cast<int>(st.state), st.reason.c_str(),
                 (*engine)->shares_gpu() ? 1 : 0, DetectMps().Describe().c_str());
    if (!st.fusion_enabled) {
      return fail(absl::FailedPreconditionError(absl::StrCat("fusion not enabled: ", st.reason)));
    }
    result = Scenario(**engine, **ex, spin);
    if (!result.ok()) return fail(result);
    const absl::Time start = absl::Now();
    engine->reset();
    if (absl::Now() - start > absl::Seconds(5)) {
      return fail(absl::InternalError(absl::StrCat("engine teardown with a doorbell plan took ",
                                                   absl::FormatDuration(absl::Now() - start))));
    }
  }
  std::fprintf(stderr, "PASS rank=%d\n", g_rank);
  return 0;
}

}  // namespace
}  // namespace arfuse::testing

int main(int argc, char** argv) { return arfuse::testing::Main(argc, argv); }
