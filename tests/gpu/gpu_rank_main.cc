// One rank of a multi-process GPU test, started (exec'd) by gpu_multiproc_test. Joins the group
// with ConnectPeers, builds a CudaEngine and runs one scenario; every check failure prints a
// "FAIL rank=R ..." line on stderr and the process exits 1. Flags are --key=value:
//   --rank --world --dir (peer socket directory) --group --backend (trtllm|mnnvl|none)
//   --vmm (auto|posix_fd|fabric) --scenario (correctness|graph|timeout|nccl|nccl_timeout|
//   nccl_stuck) --spin_ms
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kernels/host/half_convert.h"
#include "kernels/host/reference_op.h"
#include "server/collective/op_agreement.h"
#include "server/cuda_device/cuda_status.h"
#include "server/cuda_device/device_error.h"
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

// Ordinal distance between two bf16 bit patterns (adjacent representable values are 1 apart).
int Bf16Distance(uint16_t a, uint16_t b) {
  auto ordinal = [](uint16_t v) {
    return (v & 0x8000) ? -static_cast<int>(v & 0x7fff) : static_cast<int>(v);
  };
  return std::abs(ordinal(a) - ordinal(b));
}

struct Case {
  uint32_t tokens;
  uint32_t hidden;
  Pattern pattern;
  InputKind kind;
  uint32_t seed;
};

std::string Describe(const Case& c) {
  return absl::StrCat("tokens=", c.tokens, " hidden=", c.hidden,
                      " pattern=", PatternName(c.pattern), " kind=", static_cast<int>(c.kind),
                      " seed=", c.seed);
}

// Buffers of one case on this rank, plus the expected outputs from the CPU oracle.
struct CaseData {
  size_t n = 0;
  std::vector<std::vector<uint16_t>> inputs;  // every rank's input
  std::vector<uint16_t> residual, gamma;
  std::vector<uint16_t> want_out, want_res, want_norm;
  Fp64Result exact;
  std::unique_ptr<DeviceBuffer> d_in, d_res_in, d_res_out, d_norm, d_gamma, d_out;
  OpArgs op;
};

absl::Status PrepareInputs(const Case& c, int world, CaseData& d) {
  d.n = static_cast<size_t>(c.tokens) * c.hidden;
  d.inputs.clear();
  for (int r = 0; r < world; ++r) d.inputs.push_back(MakeBf16Input(c.kind, c.seed, r, d.n));
  d.residual = MakeBf16Input(InputKind::kRandom, c.seed, 1000, d.n);
  d.gamma = MakeBf16Input(InputKind::kRandom, c.seed, 2000, c.hidden);
  std::vector<const void*> ptrs;
  for (auto& in : d.inputs) ptrs.push_back(in.data());
  CpuOpArgs a;
  a.pattern = c.pattern;
  a.dtype = DType::kBF16;
  a.world_size = world;
  a.hidden = c.hidden;
  a.num_tokens = c.tokens;
  a.eps = 1e-6f;
  a.rank_inputs = ptrs.data();
  d.want_out.assign(d.n, 0);
  d.want_res.assign(d.n, 0);
  d.want_norm.assign(d.n, 0);
  if (c.pattern == Pattern::kAllReduce) {
    a.output = d.want_out.data();
  } else {
    a.residual_in = d.residual.data();
    a.residual_out = d.want_res.data();
    a.norm_out = d.want_norm.data();
    a.gamma = d.gamma.data();
  }
  ARFUSE_RETURN_IF_ERROR(ReferenceFusedOp(a));
  ARFUSE_RETURN_IF_ERROR(ReferenceFusedOpFp64(a, &d.exact));
  return absl::OkStatus();
}

absl::Status AllocateAndUpload(const Case& c, CaseData& d) {
  const size_t bytes = d.n * 2;
  d.d_in = std::make_unique<DeviceBuffer>(bytes);
  d.d_res_in = std::make_unique<DeviceBuffer>(bytes);
  d.d_res_out = std::make_unique<DeviceBuffer>(bytes);
  d.d_norm = std::make_unique<DeviceBuffer>(bytes);
  d.d_gamma = std::make_unique<DeviceBuffer>(static_cast<size_t>(c.hidden) * 2);
  d.d_out = std::make_unique<DeviceBuffer>(bytes);
  ARFUSE_RETURN_IF_ERROR(d.d_in->Upload(d.inputs[g_rank]));
  ARFUSE_RETURN_IF_ERROR(d.d_res_in->Upload(d.residual));
  ARFUSE_RETURN_IF_ERROR(d.d_gamma->Upload(d.gamma));
  d.op = OpArgs();
  d.op.pattern = c.pattern;
  d.op.dtype = DType::kBF16;
  d.op.hidden = c.hidden;
  d.op.num_tokens = c.tokens;
  d.op.eps = 1e-6f;
  d.op.input = d.d_in->get();
  d.op.output = d.d_out->get();
  d.op.residual_in = d.d_res_in->get();
  d.op.residual_out = d.d_res_out->get();
  d.op.norm_out = d.d_norm->get();
  d.op.gamma = d.d_gamma->get();
  return absl::OkStatus();
}

// A synchronous op's context with `timeout` from now.
ExecContext SyncContext(absl::Duration timeout) {
  ExecContext ctx;
  ctx.synchronous = true;
  ctx.deadline = absl::Now() + timeout;
  return ctx;
}

// Compares this rank's outputs with the oracle and every other rank's outputs.
absl::Status Verify(const Case& c, CaseData& d, Exchange& ex, const std::string& tag) {
  uint64_t hash = 0;
  if (c.pattern == Pattern::kAllReduce) {
    ARFUSE_ASSIGN_OR_RETURN(std::vector<uint16_t> out, d.d_out->Download(d.n));
    for (size_t i = 0; i < d.n; ++i) {
      EXPECT_OR_RETURN(out[i] == d.want_out[i], Describe(c), " output[", i, "]=", out[i], " want ",
                       d.want_out[i], " (bit-exact vs CPU oracle)");
      const double e = d.exact.out[i];
      EXPECT_OR_RETURN(std::fabs(Bf16BitsToFloat(out[i]) - e) <= 0.02 * std::fabs(e) + 0.05,
                       Describe(c), " output[", i, "] far from fp64 reference");
    }
    hash = HashWords(out);
  } else {
    ARFUSE_ASSIGN_OR_RETURN(std::vector<uint16_t> res, d.d_res_out->Download(d.n));
    ARFUSE_ASSIGN_OR_RETURN(std::vector<uint16_t> norm, d.d_norm->Download(d.n));
    for (size_t i = 0; i < d.n; ++i) {
      EXPECT_OR_RETURN(res[i] == d.want_res[i], Describe(c), " residual_out[", i, "]=", res[i],
                       " want ", d.want_res[i], " (bit-exact vs CPU oracle)");
      EXPECT_OR_RETURN(Bf16Distance(norm[i], d.want_norm[i]) <= 2, Describe(c), " norm_out[", i,
                       "]=", norm[i], " want ", d.want_norm[i], " (within 2 bf16 ulp)");
      const double e = d.exact.norm_out[i];
      EXPECT_OR_RETURN(std::fabs(Bf16BitsToFloat(norm[i]) - e) <= 0.03 * std::fabs(e) + 0.1,
                       Describe(c), " norm_out[", i, "]=", Bf16BitsToFloat(norm[i]),
                       " far from fp64 ", e);
    }
    hash = HashWords(norm, HashWords(res));
  }
  ARFUSE_ASSIGN_OR_RETURN(std::vector<std::string> hashes,
                          ex.Allgather(tag, absl::StrCat(hash), absl::Now() + absl::Seconds(60)));
  for (size_t r = 0; r < hashes.size(); ++r) {
    EXPECT_OR_RETURN(hashes[r] == hashes[0], Describe(c), " rank ", r,
                     " outputs differ from rank 0's (not bit-identical)");
  }
  return absl::OkStatus();
}

absl::Status RunCase(CudaEngine& engine, Exchange& ex, const Case& c, const std::string& tag,
                     ExecPath want_path) {
  CaseData d;
  ARFUSE_RETURN_IF_ERROR(PrepareInputs(c, ex.world_size(), d));
  ARFUSE_RETURN_IF_ERROR(AllocateAndUpload(c, d));
  ExecContext ctx = SyncContext(absl::Seconds(30));
  ARFUSE_ASSIGN_OR_RETURN(OpOutcome outcome, engine.Execute(d.op, ctx));
  EXPECT_OR_RETURN(outcome.path == want_path, Describe(c), " ran ", ExecPathName(outcome.path),
                   " want ", ExecPathName(want_path));
  return Verify(c, d, ex, tag);
}

absl::Status Correctness(CudaEngine& engine, Exchange& ex) {
  const std::vector<std::pair<uint32_t, uint32_t>> shapes = {
      {1, 4096}, {7, 1024}, {64, 4096}, {3, 8}, {33, 2048}, {512, 4096}, {2, 4096}};
  int k = 0;
  for (ForcedPath algo : {ForcedPath::kOneShot, ForcedPath::kTwoShot}) {
    engine.SetForcedPath(algo);
    const ExecPath want = algo == ForcedPath::kOneShot ? ExecPath::kOneShot : ExecPath::kTwoShot;
    // Shapes shrink and grow within one workspace.
    for (auto [t, h] : shapes) {
      for (InputKind kind :
           {InputKind::kRandom, InputKind::kIntegers, InputKind::kZerosAndSubnormals}) {
        if (t * h > 64 * 4096 && kind != InputKind::kRandom) continue;
        Case c{t, h, Pattern::kAllReduceResidualRmsNorm, kind, static_cast<uint32_t>(++k)};
        ARFUSE_RETURN_IF_ERROR(RunCase(engine, ex, c, absl::StrCat("case", k), want));
      }
      Case c{t, h, Pattern::kAllReduce, InputKind::kIntegers, static_cast<uint32_t>(++k)};
      ARFUSE_RETURN_IF_ERROR(RunCase(engine, ex, c, absl::StrCat("case", k), want));
    }
  }

  // Calls the workspace cannot take are refused without running.
  engine.SetForcedPath(ForcedPath::kAuto);
  {
    Case c{1, 4096, Pattern::kAllReduceResidualRmsNorm, InputKind::kRandom, 99};
    CaseData d;
    ARFUSE_RETURN_IF_ERROR(PrepareInputs(c, ex.world_size(), d));
    ARFUSE_RETURN_IF_ERROR(AllocateAndUpload(c, d));
    ExecContext ctx = SyncContext(absl::Seconds(10));
    OpArgs too_big = d.op;
    too_big.num_tokens = 513;  // capacity is 512 x 4096
    absl::StatusOr<OpOutcome> r = engine.Execute(too_big, ctx);
    EXPECT_OR_RETURN(absl::IsInvalidArgument(r.status()) &&
                         absl::StrContains(r.status().message(), "does not fit the workspace"),
                     "oversized op: got ", r.status().ToString());
    OpArgs wide = d.op;
    wide.hidden = 8192;
    wide.num_tokens = 1;
    r = engine.Execute(wide, ctx);
    EXPECT_OR_RETURN(absl::IsInvalidArgument(r.status()) &&
                         absl::StrContains(r.status().message(), "does not fit the workspace"),
                     "too-wide op: got ", r.status().ToString());
    OpArgs fp16 = d.op;
    fp16.dtype = DType::kFP16;
    r = engine.Execute(fp16, ctx);
    EXPECT_OR_RETURN(absl::IsInvalidArgument(r.status()) &&
                         absl::StrContains(r.status().message(), "does not match"),
                     "fp16 op: got ", r.status().ToString());
    OpArgs odd = d.op;
    odd.hidden = 12;
    r = engine.Execute(odd, ctx);
    EXPECT_OR_RETURN(absl::IsInvalidArgument(r.status()) &&
                         absl::StrContains(r.status().message(), "multiple of 8"),
                     "hidden 12: got ", r.status().ToString());
    OpArgs no_gamma = d.op;
    no_gamma.gamma = nullptr;
    r = engine.Execute(no_gamma, ctx);
    EXPECT_OR_RETURN(
        absl::IsInvalidArgument(r.status()) && absl::StrContains(r.status().message(), "gamma"),
        "missing gamma: got ", r.status().ToString());
  }

  // Thousands of back-to-back ops, enqueued without waiting; the last one is checked.
  for (ForcedPath algo : {ForcedPath::kOneShot, ForcedPath::kTwoShot}) {
    engine.SetForcedPath(algo);
    Case c{8, 4096, Pattern::kAllReduceResidualRmsNorm, InputKind::kRandom, 500};
    CaseData d;
    ARFUSE_RETURN_IF_ERROR(PrepareInputs(c, ex.world_size(), d));
    ARFUSE_RETURN_IF_ERROR(AllocateAndUpload(c, d));
    ExecContext ctx;
    ctx.deadline = absl::Now() + absl::Seconds(60);
    const int iterations = algo == ForcedPath::kOneShot ? 3000 : 1000;
    for (int i = 0; i < iterations; ++i) {
      ARFUSE_ASSIGN_OR_RETURN(OpOutcome o, engine.Execute(d.op, ctx));
      static_cast<void>(o);
    }
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(engine.stream()));
    EXPECT_OR_RETURN(engine.Status().state == WorkspaceState::kReady, "engine not ready after ",
                     iterations, " ops: ", engine.Status().reason);
    ARFUSE_RETURN_IF_ERROR(Verify(c, d, ex, absl::StrCat("stress", static_cast<int>(algo))));
  }
  return absl::OkStatus();
}

absl::Status Graph(CudaEngine& engine, Exchange& ex) {
  int k = 0;
  for (ForcedPath algo : {ForcedPath::kOneShot, ForcedPath::kTwoShot}) {
    engine.SetForcedPath(algo);
    Case c{16, 4096, Pattern::kAllReduceResidualRmsNorm, InputKind::kRandom, 700};
    CaseData d;
    ARFUSE_RETURN_IF_ERROR(PrepareInputs(c, ex.world_size(), d));
    ARFUSE_RETURN_IF_ERROR(AllocateAndUpload(c, d));
    cudaStream_t s = engine.stream();
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    ExecContext ctx;
    ctx.deadline = absl::Now() + absl::Seconds(30);
    absl::StatusOr<OpOutcome> captured = engine.Execute(d.op, ctx);
    absl::Status ended = ARFUSE_CUDA_STATUS(cudaStreamEndCapture(s, &graph));
    ARFUSE_RETURN_IF_ERROR(captured.status());
    ARFUSE_RETURN_IF_ERROR(ended);
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec, graph, 0));
    // Inputs change between replays; every replay must see the new inputs.
    for (int replay = 0; replay < 4; ++replay) {
      c.seed = 700 + replay;
      c.kind = replay % 2 == 0 ? InputKind::kRandom : InputKind::kZerosAndSubnormals;
      ARFUSE_RETURN_IF_ERROR(PrepareInputs(c, ex.world_size(), d));
      ARFUSE_RETURN_IF_ERROR(d.d_in->Upload(d.inputs[g_rank]));
      ARFUSE_RETURN_IF_ERROR(d.d_res_in->Upload(d.residual));
      ARFUSE_RETURN_IF_ERROR(d.d_gamma->Upload(d.gamma));
      ARFUSE_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, s));
      ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
      ARFUSE_RETURN_IF_ERROR(Verify(c, d, ex, absl::StrCat("graph", ++k)));
    }
    for (int replay = 0; replay < 500; ++replay)
      ARFUSE_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, s));
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    ARFUSE_RETURN_IF_ERROR(Verify(c, d, ex, absl::StrCat("graph", ++k)));
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaGraphExecDestroy(exec));
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaGraphDestroy(graph));
  }
  return absl::OkStatus();
}

// On a rank whose peer (the last rank) never calls: the op fails within the spin timeout with a
// status `expected` accepts and that asks for a re-initialization, the engine is poisoned, and
// the next op is refused (FAILED_PRECONDITION) until every rank re-initializes.
absl::Status ExpectMissingRankPoisons(CudaEngine& engine, Exchange& ex, const Case& c,
                                      absl::Duration spin, const char* label,
                                      const std::function<bool(const absl::Status&)>& expected) {
  CaseData d;
  ARFUSE_RETURN_IF_ERROR(PrepareInputs(c, ex.world_size(), d));
  ARFUSE_RETURN_IF_ERROR(AllocateAndUpload(c, d));
  ExecContext ctx = SyncContext(spin + absl::Seconds(20));
  const absl::Time start = absl::Now();
  absl::StatusOr<OpOutcome> r = engine.Execute(d.op, ctx);
  const absl::Duration took = absl::Now() - start;
  EXPECT_OR_RETURN(expected(r.status()) && absl::StrContains(r.status().message(), "re-initialize"),
                   "op with a missing rank: got ", r.status().ToString());
  EXPECT_OR_RETURN(took < spin + absl::Seconds(3), "error took ", absl::FormatDuration(took),
                   " with a spin timeout of ", absl::FormatDuration(spin));
  EXPECT_OR_RETURN(engine.Status().state == WorkspaceState::kPoisoned,
                   "engine not poisoned after a missing rank");
  r = engine.Execute(d.op, ctx);
  EXPECT_OR_RETURN(absl::IsFailedPrecondition(r.status()) &&
                       absl::StrContains(r.status().message(), "re-initialize"),
                   "op on a poisoned engine: got ", r.status().ToString());
  std::fprintf(stderr, "rank=%d %s=%lld status=%s\n", ex.rank(), label,
               static_cast<long long>(absl::ToInt64Milliseconds(took)),
               r.status().ToString().c_str());
  return absl::OkStatus();
}

// Every rank meets at `tag` (the missing rank too, late), re-initializes, and finds a new
// generation in `want`.
absl::Status ReinitializeAll(CudaEngine& engine, Exchange& ex, const std::string& tag,
                             absl::Duration spin, uint64_t gen_before, WorkspaceState want) {
  ARFUSE_RETURN_IF_ERROR(ex.Barrier(tag, absl::Now() + spin + absl::Seconds(60)));
  ARFUSE_RETURN_IF_ERROR(engine.Initialize(ex, absl::Now() + absl::Seconds(60)));
  EXPECT_OR_RETURN(engine.Status().generation > gen_before, "generation did not bump");
  EXPECT_OR_RETURN(engine.Status().state == want, "state ", static_cast<int>(engine.Status().state),
                   " after re-init: ", engine.Status().reason);
  return absl::OkStatus();
}

absl::Status Timeout(CudaEngine& engine, Exchange& ex, absl::Duration spin) {
  const int missing = ex.world_size() - 1;
  engine.SetForcedPath(ForcedPath::kOneShot);
  Case c{4, 4096, Pattern::kAllReduceResidualRmsNorm, InputKind::kRandom, 900};
  ARFUSE_RETURN_IF_ERROR(RunCase(engine, ex, c, "before", ExecPath::kOneShot));
  const uint64_t gen_before = engine.Status().generation;
  if (ex.rank() != missing) {
    ARFUSE_RETURN_IF_ERROR(ExpectMissingRankPoisons(
        engine, ex, c, spin, "timeout_error_ms",
        [](const absl::Status& s) { return absl::IsDeadlineExceeded(s) || absl::IsAborted(s); }));
  }
  // The missing rank arrives late: after the others gave up.
  ARFUSE_RETURN_IF_ERROR(
      ReinitializeAll(engine, ex, "after_timeout", spin, gen_before, WorkspaceState::kReady));
  Case after{4, 4096, Pattern::kAllReduceResidualRmsNorm, InputKind::kRandom, 950};
  ARFUSE_RETURN_IF_ERROR(RunCase(engine, ex, after, "after_timeout_op", ExecPath::kOneShot));

  // The host abort word: rank 0 aborts its own spin long before the spin timeout.
  const uint64_t gen_abort = engine.Status().generation;
  if (ex.rank() != missing) {
    CaseData d;
    ARFUSE_RETURN_IF_ERROR(PrepareInputs(c, ex.world_size(), d));
    ARFUSE_RETURN_IF_ERROR(AllocateAndUpload(c, d));
    ExecContext ctx = SyncContext(spin + absl::Seconds(20));
    std::thread aborter;
    if (ex.rank() == 0) {
      aborter = std::thread([&engine, spin] {
        absl::SleepFor(spin / 5);
        engine.Abort();
      });
    }
    const absl::Time start = absl::Now();
    absl::StatusOr<OpOutcome> r = engine.Execute(d.op, ctx);
    const absl::Duration took = absl::Now() - start;
    if (aborter.joinable()) aborter.join();
    if (ex.rank() == 0) {
      EXPECT_OR_RETURN(absl::IsAborted(r.status()) &&
                           absl::StrContains(r.status().message(), "aborted on this rank"),
                       "aborted op: got ", r.status().ToString());
      EXPECT_OR_RETURN(took < spin, "abort took ", absl::FormatDuration(took),
                       ", not before the spin timeout");
    } else {
      EXPECT_OR_RETURN(absl::IsAborted(r.status()) || absl::IsDeadlineExceeded(r.status()),
                       "op beside an aborted rank: got ", r.status().ToString());
    }
  }
  ARFUSE_RETURN_IF_ERROR(ex.Barrier("after_abort", absl::Now() + spin + absl::Seconds(60)));
  ARFUSE_RETURN_IF_ERROR(engine.Initialize(ex, absl::Now() + absl::Seconds(60)));
  EXPECT_OR_RETURN(engine.Status().generation > gen_abort, "generation did not bump after abort");
  for (uint32_t seed = 901; seed < 904; ++seed) {
    Case again{4, 4096, Pattern::kAllReduceResidualRmsNorm, InputKind::kRandom, seed};
    ARFUSE_RETURN_IF_ERROR(
        RunCase(engine, ex, again, absl::StrCat("after", seed), ExecPath::kOneShot));
  }
  return absl::OkStatus();
}

// The NCCL unfused path (NCCL allreduce + our add-RMSNorm; the symmetric window where the
// dispatch table picks it) at 8 KiB, 512 KiB and 4 MiB, both patterns. With backend "none" the
// engine has no fused workspace (state UNFUSED; forcing the one-shot is refused); with a fused
// backend the unfused path is forced, so one engine runs both and they must agree with the CPU
// oracle alike. NCCL needs one GPU per rank.
absl::Status NcclUnfused(CudaEngine& engine, Exchange& ex, bool fused_backend) {
  EXPECT_OR_RETURN(engine.nccl_available(), "NCCL unavailable at world size ", ex.world_size(),
                   ": ", engine.Status().reason);
  if (fused_backend) {
    engine.SetForcedPath(ForcedPath::kUnfused);
  } else {
    EXPECT_OR_RETURN(engine.Status().state == WorkspaceState::kUnfused, "state is not unfused");
  }
  std::fprintf(stderr, "rank=%d nccl_symmetric=%d\n", ex.rank(),
               engine.nccl_symmetric_available() ? 1 : 0);
  int k = 0;
  for (auto [t, h] :
       std::vector<std::pair<uint32_t, uint32_t>>{{1, 4096}, {64, 4096}, {512, 4096}}) {
    for (Pattern p : {Pattern::kAllReduceResidualRmsNorm, Pattern::kAllReduce}) {
      Case c{t, h, p, InputKind::kRandom, static_cast<uint32_t>(300 + ++k)};
      ARFUSE_RETURN_IF_ERROR(RunCase(engine, ex, c, absl::StrCat("nccl", k), ExecPath::kUnfused));
    }
  }
  // Back-to-back ops enqueued without waiting, each agreed across the ranks first; the last one
  // is checked. Then what the agreement adds: the peer channel's allgather round trip.
  {
    Case c{8, 4096, Pattern::kAllReduceResidualRmsNorm, InputKind::kRandom, 350};
    CaseData d;
    ARFUSE_RETURN_IF_ERROR(PrepareInputs(c, ex.world_size(), d));
    ARFUSE_RETURN_IF_ERROR(AllocateAndUpload(c, d));
    ExecContext ctx;
    ctx.deadline = absl::Now() + absl::Seconds(60);
    const absl::Time start = absl::Now();
    for (int i = 0; i < 2000; ++i) {
      ARFUSE_ASSIGN_OR_RETURN(OpOutcome o, engine.Execute(d.op, ctx));
      EXPECT_OR_RETURN(o.path == ExecPath::kUnfused, "async op ran ", ExecPathName(o.path));
    }
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(engine.stream()));
    const absl::Duration took = absl::Now() - start;
    ARFUSE_RETURN_IF_ERROR(Verify(c, d, ex, "nccl_async"));
    std::vector<double> us;
    for (int i = 0; i < 400; ++i) {
      const absl::Time t0 = absl::Now();
      ARFUSE_RETURN_IF_ERROR(ex.Allgather("rtt", "x", absl::Now() + absl::Seconds(10)).status());
      us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
    }
    std::sort(us.begin(), us.end());
    std::fprintf(stderr,
                 "rank=%d nccl_async_ops=2000 per_op_us=%.1f agreement_rtt_us p50=%.1f p99=%.1f\n",
                 ex.rank(), absl::ToDoubleMicroseconds(took) / 2000, us[us.size() / 2],
                 us[us.size() * 99 / 100]);
  }
  engine.SetForcedPath(ForcedPath::kOneShot);
  Case c{1, 4096, Pattern::kAllReduceResidualRmsNorm, InputKind::kRandom, 1};
  absl::Status forced = RunCase(engine, ex, c, "forced", ExecPath::kOneShot);
  if (fused_backend) {
    ARFUSE_RETURN_IF_ERROR(forced);
  } else {
    EXPECT_OR_RETURN(absl::IsFailedPrecondition(forced) &&
                         absl::StrContains(forced.message(), "no fused workspace"),
                     "forced oneshot without a workspace: got ", forced.ToString());
  }
  return absl::OkStatus();
}

// The NCCL path's bounds (op_agreement.h): ranks asked for different ops of one element count
// (racing clients) are refused alike and serve on; a rank that never calls makes the others fail
// within the spin timeout, poisoned, and the group serves again after a re-initialization.
absl::Status NcclMissingRank(CudaEngine& engine, Exchange& ex, absl::Duration spin) {
  EXPECT_OR_RETURN(engine.nccl_available(), "NCCL unavailable: ", engine.Status().reason);
  const int missing = ex.world_size() - 1;
  Case c{4, 4096, Pattern::kAllReduceResidualRmsNorm, InputKind::kRandom, 910};
  ARFUSE_RETURN_IF_ERROR(RunCase(engine, ex, c, "nccl_before", ExecPath::kUnfused));
  {
    // NCCL itself would sum 4 x 4096 with 8 x 2048 without complaint.
    Case mine{ex.rank() == 0 ? 4u : 8u, ex.rank() == 0 ? 4096u : 2048u,
              Pattern::kAllReduceResidualRmsNorm, InputKind::kRandom, 911};
    CaseData d;
    ARFUSE_RETURN_IF_ERROR(PrepareInputs(mine, ex.world_size(), d));
    ARFUSE_RETURN_IF_ERROR(AllocateAndUpload(mine, d));
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemset(d.d_norm->get(), 0, d.n * 2));
    ExecContext ctx = SyncContext(absl::Seconds(30));
    absl::StatusOr<OpOutcome> r = engine.Execute(d.op, ctx);
    EXPECT_OR_RETURN(absl::IsInvalidArgument(r.status()) &&
                         absl::StrContains(r.status().message(), "ranks disagree on the op"),
                     "ops of one element count and other shapes: got ", r.status().ToString());
    EXPECT_OR_RETURN(engine.Status().state == WorkspaceState::kUnfused,
                     "not serving after a refused pair: ", engine.Status().reason);
    ARFUSE_ASSIGN_OR_RETURN(std::vector<uint16_t> norm, d.d_norm->Download(d.n));
    for (size_t i = 0; i < d.n; ++i) {
      EXPECT_OR_RETURN(norm[i] == 0, "a refused op wrote norm_out[", i, "]");
    }
  }
  Case again{4, 4096, Pattern::kAllReduceResidualRmsNorm, InputKind::kRandom, 912};
  ARFUSE_RETURN_IF_ERROR(RunCase(engine, ex, again, "nccl_after_refusal", ExecPath::kUnfused));

  const uint64_t gen_before = engine.Status().generation;
  if (ex.rank() != missing) {
    ARFUSE_RETURN_IF_ERROR(ExpectMissingRankPoisons(
        engine, ex, c, spin, "nccl_timeout_error_ms", [](const absl::Status& s) {
          return absl::IsDeadlineExceeded(s) &&
                 absl::StrContains(s.message(), "did not agree on the unfused op");
        }));
  }
  ARFUSE_RETURN_IF_ERROR(ReinitializeAll(engine, ex, "nccl_after_timeout", spin, gen_before,
                                         WorkspaceState::kUnfused));
  for (uint32_t seed = 920; seed < 923; ++seed) {
    Case after{4, 4096, Pattern::kAllReduceResidualRmsNorm, InputKind::kRandom, seed};
    ARFUSE_RETURN_IF_ERROR(
        RunCase(engine, ex, after, absl::StrCat("nccl_after", seed), ExecPath::kUnfused));
  }
  return absl::OkStatus();
}

// A peer that agreed to an op and never ran it (it died or froze in between): this rank's NCCL
// kernel can never finish. The op fails at its deadline and poisons the engine; destroying the
// engine (in Main) must return within the spin timeout and mark the device wedged, so a daemon
// exits.
absl::Status NcclAgreedButNeverRun(CudaEngine& engine, Exchange& ex) {
  EXPECT_OR_RETURN(engine.nccl_available(), "NCCL unavailable: ", engine.Status().reason);
  Case c{4, 4096, Pattern::kAllReduceResidualRmsNorm, InputKind::kRandom, 930};
  ARFUSE_RETURN_IF_ERROR(RunCase(engine, ex, c, "stuck_before", ExecPath::kUnfused));
  ARFUSE_ASSIGN_OR_RETURN(DispatchChoice choice, engine.Choose(c.tokens, c.hidden, DType::kBF16));
  if (ex.rank() == 0) {
    // Never freed: cudaFree synchronizes with the device, and the kernel below never ends.
    CaseData& d = *new CaseData;
    ARFUSE_RETURN_IF_ERROR(PrepareInputs(c, ex.world_size(), d));
    ARFUSE_RETURN_IF_ERROR(AllocateAndUpload(c, d));
    ExecContext ctx = SyncContext(absl::Seconds(3));
    absl::StatusOr<OpOutcome> r = engine.Execute(d.op, ctx);
    EXPECT_OR_RETURN(absl::IsDeadlineExceeded(r.status()) &&
                         absl::StrContains(r.status().message(), "although every rank agreed"),
                     "agreed op its peer never ran: got ", r.status().ToString());
    EXPECT_OR_RETURN(engine.Status().state == WorkspaceState::kPoisoned,
                     "engine not poisoned after an agreed op that never finished");
  } else {
    // Stands in for a sidecar that agreed, confirmed and then died before its enqueue: the same
    // steps under the same tags.
    UnfusedOpKey key;
    key.num_tokens = c.tokens;
    key.hidden = c.hidden;
    key.dtype = DType::kBF16;
    key.pattern = c.pattern;
    key.eps = 1e-6f;
    key.symmetric = choice.nccl_symmetric;
    AgreementDeadlines deadlines;
    deadlines.arrive_by = absl::Now() + absl::Seconds(30);
    ARFUSE_RETURN_IF_ERROR(AgreeOnUnfusedOp(ex, engine.Status().generation, key, deadlines));
  }
  return ex.Barrier("stuck_after", absl::Now() + absl::Seconds(60));
}

int Main(int argc, char** argv) {
  std::map<std::string, std::string> flags = {
      {"group", "gputest"}, {"backend", "trtllm"}, {"vmm", "posix_fd"}, {"spin_ms", "2000"}};
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
  const std::string scenario = flags["scenario"];
  static_cast<void>(InitLogging("warn"));
  auto fail = [&](const absl::Status& s) {
    std::fprintf(stderr, "FAIL rank=%d scenario=%s backend=%s: %s\n", g_rank, scenario.c_str(),
                 flags["backend"].c_str(), s.ToString().c_str());
    return 1;
  };
  int devices = 0;
  absl::Status counted = ARFUSE_CUDA_STATUS(cudaGetDeviceCount(&devices));
  if (!counted.ok() || devices == 0) return fail(absl::FailedPreconditionError("no CUDA device"));
  const int device = g_rank % devices;

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
  eo.backend = flags["backend"];
  eo.max_tokens = 512;
  eo.max_hidden = 4096;
  eo.dtype = DType::kBF16;
  const absl::Duration spin = absl::Milliseconds(std::stoi(flags["spin_ms"]));
  eo.spin_timeout = spin;
  CudaEngineOptions co;
  co.device = device;
  absl::StatusOr<VmmHandleType> vmm = ParseVmmHandleType(flags["vmm"]);
  if (!vmm.ok()) return fail(vmm.status());
  co.vmm_handle = *vmm;
  absl::StatusOr<std::unique_ptr<CudaEngine>> engine = MakeCudaEngine(eo, co);
  if (!engine.ok()) return fail(engine.status());
  absl::Status init = (*engine)->Initialize(**ex, absl::Now() + absl::Seconds(90));
  if (!init.ok()) return fail(init);
  const EngineStatus st = (*engine)->Status();
  std::fprintf(stderr, "rank=%d device=%d state=%d workspace_bytes=%llu reason=\"%s\" %s\n", g_rank,
               device, static_cast<int>(st.state),
               static_cast<unsigned long long>(st.workspace_bytes), st.reason.c_str(),
               DetectMps().Describe().c_str());
  if (eo.backend != "none" && !st.fusion_enabled) {
    return fail(absl::FailedPreconditionError(absl::StrCat("fusion not enabled: ", st.reason)));
  }
  absl::Status result;
  if (scenario == "correctness") {
    result = Correctness(**engine, **ex);
  } else if (scenario == "graph") {
    result = Graph(**engine, **ex);
  } else if (scenario == "timeout") {
    result = Timeout(**engine, **ex, spin);
  } else if (scenario == "nccl") {
    result = NcclUnfused(**engine, **ex, eo.backend != "none");
  } else if (scenario == "nccl_timeout") {
    result = NcclMissingRank(**engine, **ex, spin);
  } else if (scenario == "nccl_stuck") {
    result = NcclAgreedButNeverRun(**engine, **ex);
    if (result.ok()) {
      const absl::Time start = absl::Now();
      engine->reset();
      const absl::Duration took = absl::Now() - start;
      const absl::Status health = DeviceHealth();
      std::fprintf(stderr, "rank=%d engine_destroyed_ms=%lld device_health=%s\n", g_rank,
                   static_cast<long long>(absl::ToInt64Milliseconds(took)),
                   health.ToString().c_str());
      if (took > absl::Seconds(5)) {
        result = absl::InternalError(
            absl::StrCat("destroying the engine took ", absl::FormatDuration(took)));
      } else if (g_rank == 0 && !(IsStickyDeviceError(health) &&
                                  absl::StrContains(health.message(), "cannot finish"))) {
        result = absl::InternalError(absl::StrCat("device not marked wedged: ", health.ToString()));
      } else if (g_rank != 0 && !health.ok()) {
        result = absl::InternalError(absl::StrCat("healthy rank marked: ", health.ToString()));
      }
      if (g_rank == 0) {
        // As arfused does once its device is wedged: exit without running destructors (freeing
        // anything would wait for the kernel); the exit ends the kernel.
        if (!result.ok()) return fail(result);
        std::fprintf(stderr, "PASS rank=%d scenario=%s backend=%s\n", g_rank, scenario.c_str(),
                     eo.backend.c_str());
        std::fflush(nullptr);
        std::_Exit(0);
      }
    }
  } else {
    result = absl::InvalidArgumentError(absl::StrCat("unknown scenario ", scenario));
  }
  if (!result.ok()) return fail(result);
  std::fprintf(stderr, "PASS rank=%d scenario=%s backend=%s\n", g_rank, scenario.c_str(),
               eo.backend.c_str());
  return 0;
}

}  // namespace
}  // namespace arfuse::testing

int main(int argc, char** argv) { return arfuse::testing::Main(argc, argv); }
