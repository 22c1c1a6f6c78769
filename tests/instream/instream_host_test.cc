// libarfuse_client's host mode end to end: ranks attached through arfuse_attach with blobs from
// the blob builder, over a host workspace made by kernels/host/host_collective or by real host
// engines (ExportInStream), as threads of this process or as two processes. Results against the
// CPU reference bit for bit; turns with the host engine; stale generation after a
// re-initialization; a peer that never arrives; the sidecar's abort; a client killed mid-op
// (its op is never paired with anyone's later op, on either rank, in-stream or eager, with the
// peer early or late).
#include "server/engine_api/instream_host.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/instream/arfuse_client.hpp"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/host/reference_op.h"
#include "kernels/quant/fp8_format.h"
#include "server/host/host_engine.h"
#include "server/instream/attach_blob.h"
#include "server/instream/attachments.h"
#include "server/instream/op_counters.h"
#include "server/metrics/metrics.h"
#include "server/peers/local_exchange.h"
#include "tests/instream/instream_test_util.h"

namespace arfuse::instream {
namespace {

using testing::AttachBlob;
using testing::AttachResult;
using testing::Blob;
using ::testing::HasSubstr;
using testing::HostExport;
using testing::RankTensors;
using testing::TestHostWorkspace;

void OnRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> t;
  for (int r = 0; r < n; ++r) t.emplace_back(fn, r);
  for (auto& x : t) x.join();
}

struct Ctxs {
  std::vector<arfuse_ctx*> ctx;
  ~Ctxs() {
    for (arfuse_ctx* c : ctx) arfuse_detach(c);
  }
};

int RunOp(arfuse_ctx* ctx, Pattern p, DType dt, uint32_t tokens, uint32_t hidden, RankTensors& t) {
  if (p == Pattern::kAllReduce) {
    return arfuse_fused_allreduce(ctx, nullptr, t.input(), t.output(), tokens, hidden,
                                  static_cast<int>(dt));
  }
  return arfuse_fused_allreduce_residual_rmsnorm(ctx, nullptr, t.input(), t.residual_in(),
                                                 t.residual_out(), t.norm_out(), t.gamma(), tokens,
                                                 hidden, static_cast<int>(dt), 1e-5f);
}

// Every rank's outputs equal the reference's, byte for byte.
void ExpectReference(Pattern p, DType dt, uint32_t tokens, uint32_t hidden,
                     std::vector<RankTensors>& ranks, int call) {
  RankTensors want(dt, 0, call, tokens, hidden);
  testing::Reference(p, dt, tokens, hidden, ranks, want);
  for (size_t r = 0; r < ranks.size(); ++r) {
    const size_t n = ranks[r].tensor_bytes;
    if (p == Pattern::kAllReduce) {
      ASSERT_EQ(ranks[r].bytes(4, n), want.bytes(4, n)) << "call " << call << " rank " << r;
    } else {
      ASSERT_EQ(ranks[r].bytes(2, n), want.bytes(2, n)) << "call " << call << " rank " << r;
      ASSERT_EQ(ranks[r].bytes(3, n), want.bytes(3, n)) << "call " << call << " rank " << r;
    }
  }
}

struct Case {
  int world;
  DType dtype;
  Pattern pattern;
};

class InStreamHostResults : public ::testing::TestWithParam<Case> {};

TEST_P(InStreamHostResults, MatchTheCpuReferenceBitForBitOnEveryRankCallAfterCall) {
  const Case c = GetParam();
  auto ws = TestHostWorkspace::Create(c.world, 16, 256, c.dtype, 1);
  ASSERT_TRUE(ws.ok()) << ws.status();
  std::vector<uint32_t> hiddens;
  for (uint32_t h = 32; h <= 256; h += 32) hiddens.push_back(h);
  Ctxs ctxs;
  for (int r = 0; r < c.world; ++r) {
    AttachResult a = AttachBlob(Blob(HostExport(**ws, r, hiddens)), {(*ws)->fd.get()});
    ASSERT_EQ(a.rc, ARFUSE_OK) << a.message;
    ctxs.ctx.push_back(a.ctx);
  }
  for (int call = 0; call < 24; ++call) {
    const uint32_t tokens = 1 + call % 16, hidden = 32 * (1 + call % 8);
    std::vector<RankTensors> t;
    for (int r = 0; r < c.world; ++r) t.emplace_back(c.dtype, r, call, tokens, hidden);
    std::vector<int> rc(c.world, -1);
    OnRanks(c.world,
            [&](int r) { rc[r] = RunOp(ctxs.ctx[r], c.pattern, c.dtype, tokens, hidden, t[r]); });
    for (int r = 0; r < c.world; ++r) ASSERT_EQ(rc[r], ARFUSE_OK) << "call " << call;
    ExpectReference(c.pattern, c.dtype, tokens, hidden, t, call);
  }
  for (arfuse_ctx* ctx : ctxs.ctx) EXPECT_EQ(arfuse_check(ctx, nullptr), ARFUSE_OK);
  // Each rank counted its client ops where the sidecar reads them.
  host::HostCollective view((*ws)->mapping.data(), 0, c.world, (*ws)->slot_bytes);
  EXPECT_EQ(view.sync(c.world - 1)->client_ops.load(), 24u);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, InStreamHostResults,
    ::testing::Values(Case{2, DType::kBF16, Pattern::kAllReduceResidualRmsNorm},
                      Case{4, DType::kFP16, Pattern::kAllReduce},
                      Case{2, DType::kFP32, Pattern::kAllReduceResidualRmsNorm},
                      Case{1, DType::kBF16, Pattern::kAllReduceResidualRmsNorm}));

// ---- The FP8 patterns through arfuse_fused_allreduce_residual_rmsnorm_fp8 ----

Pattern Fp8Pattern(int quant) {
  return static_cast<Pattern>(static_cast<int>(Pattern::kAllReduceResidualRmsNormFp8Static) +
                              quant - ARFUSE_QUANT_FP8_STATIC);
}

// One rank's FP8 outputs: the codes and the scale tensor (static: the one fp32 input, the same
// on every rank), 16-byte aligned.
struct Fp8Buffers {
  Fp8Buffers(int quant, int layout, uint32_t tokens, uint32_t hidden) {
    const size_t n = size_t{tokens} * hidden;
    size_t scale_bytes = 4;
    if (quant == ARFUSE_QUANT_FP8_PER_TOKEN) scale_bytes = size_t{tokens} * 4;
    if (quant == ARFUSE_QUANT_FP8_PER_GROUP) {
      scale_bytes = fp8::GroupScaleBytes(static_cast<fp8::GroupScaleLayout>(layout), tokens,
                                         hidden / fp8::kGroupSize);
    }
    quant_words.assign((n + 15) / 8 + 2, 0xcdcdcdcdcdcdcdcdull);
    scale_words.assign((scale_bytes + 15) / 8 + 2, 0xababababababababull);
    quant_bytes = n;
    this->scale_bytes = scale_bytes;
    if (quant == ARFUSE_QUANT_FP8_STATIC) {
      const float s = 0.04f;
      std::memcpy(scale(), &s, 4);
    }
  }
  uint8_t* quant() { return reinterpret_cast<uint8_t*>(quant_words.data()); }
  uint8_t* scale() { return reinterpret_cast<uint8_t*>(scale_words.data()); }
  std::vector<uint8_t> codes() { return std::vector<uint8_t>(quant(), quant() + quant_bytes); }
  std::vector<uint8_t> scales() { return std::vector<uint8_t>(scale(), scale() + scale_bytes); }
  std::vector<uint64_t> quant_words, scale_words;
  size_t quant_bytes = 0, scale_bytes = 0;
};

int RunFp8(arfuse_ctx* ctx, int quant, int layout, DType dt, uint32_t tokens, uint32_t hidden,
           RankTensors& t, Fp8Buffers& b, bool with_norm_out) {
  return arfuse_fused_allreduce_residual_rmsnorm_fp8(
      ctx, nullptr, t.input(), t.residual_in(), t.residual_out(),
      with_norm_out ? t.norm_out() : nullptr, b.quant(), b.scale(), t.gamma(), tokens, hidden,
      static_cast<int>(dt), 1e-5f, quant, layout);
}

// The CPU reference over every rank's input, into `want` and `wb` (want's residual_in, gamma).
void ReferenceFp8(int quant, int layout, DType dt, uint32_t tokens, uint32_t hidden,
                  std::vector<RankTensors>& ranks, RankTensors& want, Fp8Buffers& wb) {
  std::vector<const void*> ins;
  for (auto& r : ranks) ins.push_back(r.input());
  CpuOpArgs a;
  a.pattern = Fp8Pattern(quant);
  a.dtype = dt;
  a.world_size = static_cast<int>(ranks.size());
  a.hidden = hidden;
  a.num_tokens = tokens;
  a.eps = 1e-5f;
  a.rank_inputs = ins.data();
  a.residual_in = want.residual_in();
  a.residual_out = want.residual_out();
  a.norm_out = want.norm_out();
  a.gamma = want.gamma();
  a.quant_out = wb.quant();
  a.scale = wb.scale();
  a.scale_layout = static_cast<uint8_t>(layout);
  absl::Status s = ReferenceFusedOp(a);
  ASSERT_TRUE(s.ok()) << s;
}

struct Fp8Case {
  int world;
  DType dtype;
  int quant;
  int layout;
};

class InStreamHostFp8 : public ::testing::TestWithParam<Fp8Case> {};

// Every rank's residual_out, norm_out (rank 0 passes none), codes and scales equal the CPU
// reference's byte for byte, call after call at tokens 1..16 and hidden 128 and 256; the ops
// count as allreduce_residual_rmsnorm in the ranks' client_ops.
TEST_P(InStreamHostFp8, MatchTheCpuReferenceByteForByteOnEveryRank) {
  const Fp8Case c = GetParam();
  auto ws = TestHostWorkspace::Create(c.world, 16, 256, c.dtype, 1);
  ASSERT_TRUE(ws.ok()) << ws.status();
  Ctxs ctxs;
  for (int r = 0; r < c.world; ++r) {
    AttachResult a = AttachBlob(Blob(HostExport(**ws, r, {128, 256})), {(*ws)->fd.get()});
    ASSERT_EQ(a.rc, ARFUSE_OK) << a.message;
    ctxs.ctx.push_back(a.ctx);
  }
  for (int call = 0; call < 12; ++call) {
    const uint32_t tokens = 1 + (call * 5) % 16, hidden = call % 2 == 0 ? 256 : 128;
    std::vector<RankTensors> t;
    std::vector<Fp8Buffers> b;
    for (int r = 0; r < c.world; ++r) {
      t.emplace_back(c.dtype, r, call, tokens, hidden);
      b.emplace_back(c.quant, c.layout, tokens, hidden);
    }
    std::vector<int> rc(c.world, -1);
    OnRanks(c.world, [&](int r) {
      rc[r] = RunFp8(ctxs.ctx[r], c.quant, c.layout, c.dtype, tokens, hidden, t[r], b[r],
                     /*with_norm_out=*/r != 0);
    });
    for (int r = 0; r < c.world; ++r) ASSERT_EQ(rc[r], ARFUSE_OK) << "call " << call;
    RankTensors want(c.dtype, 0, call, tokens, hidden);
    Fp8Buffers wb(c.quant, c.layout, tokens, hidden);
    ReferenceFp8(c.quant, c.layout, c.dtype, tokens, hidden, t, want, wb);
    const size_t n = want.tensor_bytes;
    for (int r = 0; r < c.world; ++r) {
      ASSERT_EQ(t[r].bytes(2, n), want.bytes(2, n)) << "call " << call << " rank " << r;
      if (r != 0) {
        ASSERT_EQ(t[r].bytes(3, n), want.bytes(3, n)) << "call " << call << " rank " << r;
      } else {
        ASSERT_EQ(t[r].bytes(3, n), std::vector<uint8_t>(n, 0xee)) << "norm_out untouched";
      }
      ASSERT_EQ(b[r].codes(), wb.codes()) << "call " << call << " rank " << r;
      ASSERT_EQ(b[r].scales(), wb.scales()) << "call " << call << " rank " << r;
    }
  }
  for (arfuse_ctx* ctx : ctxs.ctx) EXPECT_EQ(arfuse_check(ctx, nullptr), ARFUSE_OK);
  host::HostCollective view((*ws)->mapping.data(), 0, c.world, (*ws)->slot_bytes);
  EXPECT_EQ(view.sync(c.world - 1)->client_ops.load(), 12u);
}

INSTANTIATE_TEST_SUITE_P(
    Fp8, InStreamHostFp8,
    ::testing::Values(
        Fp8Case{2, DType::kBF16, ARFUSE_QUANT_FP8_STATIC, 0},
        Fp8Case{2, DType::kFP16, ARFUSE_QUANT_FP8_STATIC, 0},
        Fp8Case{2, DType::kBF16, ARFUSE_QUANT_FP8_PER_TOKEN, 0},
        Fp8Case{2, DType::kFP16, ARFUSE_QUANT_FP8_PER_TOKEN, 0},
        Fp8Case{2, DType::kBF16, ARFUSE_QUANT_FP8_PER_GROUP, ARFUSE_SCALE_FP32_ROW_MAJOR},
        Fp8Case{2, DType::kFP16, ARFUSE_QUANT_FP8_PER_GROUP, ARFUSE_SCALE_FP32_MN_MAJOR},
        Fp8Case{2, DType::kBF16, ARFUSE_QUANT_FP8_PER_GROUP, ARFUSE_SCALE_UE8M0_PACKED},
        Fp8Case{4, DType::kFP16, ARFUSE_QUANT_FP8_PER_GROUP, ARFUSE_SCALE_UE8M0_PACKED}));

// Ranks that ask for different FP8 ops (another quant, another scale layout) are refused alike
// with INVALID_ARGUMENT, the workspace stays healthy, and the next matching op runs.
TEST(InStreamHostFp8Agreement, RanksAskingForDifferentFp8OpsAreRefusedAlike) {
  auto ws = TestHostWorkspace::Create(2, 16, 256, DType::kBF16, 1);
  ASSERT_TRUE(ws.ok()) << ws.status();
  Ctxs ctxs;
  for (int r = 0; r < 2; ++r) {
    AttachResult a = AttachBlob(Blob(HostExport(**ws, r)), {(*ws)->fd.get()});
    ASSERT_EQ(a.rc, ARFUSE_OK) << a.message;
    ctxs.ctx.push_back(a.ctx);
  }
  struct Mix {
    int quant[2], layout[2];
    const char* part;
  };
  for (const Mix& m :
       {Mix{{ARFUSE_QUANT_FP8_PER_TOKEN, ARFUSE_QUANT_FP8_STATIC}, {0, 0}, "fp8_per_token"},
        Mix{{ARFUSE_QUANT_FP8_PER_GROUP, ARFUSE_QUANT_FP8_PER_GROUP},
            {ARFUSE_SCALE_FP32_ROW_MAJOR, ARFUSE_SCALE_UE8M0_PACKED},
            "scale_layout=3"}}) {
    std::vector<RankTensors> t;
    std::vector<Fp8Buffers> b;
    for (int r = 0; r < 2; ++r) {
      t.emplace_back(DType::kBF16, r, 0, 2, 256);
      b.emplace_back(m.quant[r], m.layout[r], 2, 256);
    }
    std::vector<int> rc(2, -1);
    std::vector<std::string> msg(2);
    OnRanks(2, [&](int r) {
      rc[r] = RunFp8(ctxs.ctx[r], m.quant[r], m.layout[r], DType::kBF16, 2, 256, t[r], b[r], true);
      msg[r] = arfuse_last_error();  // thread-local: read on the rank's own thread
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(rc[r], ARFUSE_INVALID_ARGUMENT) << m.part;
      EXPECT_THAT(msg[r], HasSubstr("ranks disagree on the op"));
      EXPECT_THAT(msg[r], HasSubstr(m.part));
    }
  }
  for (arfuse_ctx* ctx : ctxs.ctx) EXPECT_EQ(arfuse_check(ctx, nullptr), ARFUSE_OK);
  std::vector<RankTensors> t;
  std::vector<Fp8Buffers> b;
  for (int r = 0; r < 2; ++r) {
    t.emplace_back(DType::kBF16, r, 1, 2, 256);
    b.emplace_back(ARFUSE_QUANT_FP8_STATIC, 0, 2, 256);
  }
  std::vector<int> rc(2, -1);
  OnRanks(2, [&](int r) {
    rc[r] = RunFp8(ctxs.ctx[r], ARFUSE_QUANT_FP8_STATIC, 0, DType::kBF16, 2, 256, t[r], b[r], true);
  });
  EXPECT_EQ(rc[0], ARFUSE_OK);
  EXPECT_EQ(rc[1], ARFUSE_OK);
}

// arfuse_set_program_key: clients of two programs (keys that differ, or a key against none)
// never pair an op; refused alike, named as another program's, nothing poisoned. Clients that set
// the same key (or none) run the op and match the reference. Bad keys and a NULL ctx are refused.
TEST(InStreamHostProgramKey, ClientsOfTwoProgramsNeverPairAnOp) {
  auto ws = TestHostWorkspace::Create(2, 16, 256, DType::kBF16, 1);
  ASSERT_TRUE(ws.ok()) << ws.status();
  Ctxs ctxs;
  for (int r = 0; r < 2; ++r) {
    AttachResult a = AttachBlob(Blob(HostExport(**ws, r)), {(*ws)->fd.get()});
    ASSERT_EQ(a.rc, ARFUSE_OK) << a.message;
    ctxs.ctx.push_back(a.ctx);
  }
  EXPECT_EQ(arfuse_set_program_key(nullptr, 1), ARFUSE_INVALID_ARGUMENT);
  EXPECT_THAT(arfuse_last_error(), HasSubstr("ctx is NULL"));
  EXPECT_EQ(arfuse_set_program_key(ctxs.ctx[0], ARFUSE_PROGRAM_KEY_MAX + 1),
            ARFUSE_INVALID_ARGUMENT);
  EXPECT_THAT(arfuse_last_error(), HasSubstr("bits above the low 24"));
  int call = 0;
  auto run = [&](uint32_t key0, uint32_t key1) {
    EXPECT_EQ(arfuse_set_program_key(ctxs.ctx[0], key0), ARFUSE_OK);
    EXPECT_EQ(arfuse_set_program_key(ctxs.ctx[1], key1), ARFUSE_OK);
    std::vector<RankTensors> t;
    for (int r = 0; r < 2; ++r) t.emplace_back(DType::kBF16, r, call, 4, 256);
    std::vector<int> rc(2, -1);
    std::vector<std::string> msg(2);
    OnRanks(2, [&](int r) {
      rc[r] = RunOp(ctxs.ctx[r], Pattern::kAllReduceResidualRmsNorm, DType::kBF16, 4, 256, t[r]);
      msg[r] = arfuse_last_error();
    });
    if (key0 == key1) {
      for (int r = 0; r < 2; ++r) EXPECT_EQ(rc[r], ARFUSE_OK) << msg[r];
      ExpectReference(Pattern::kAllReduceResidualRmsNorm, DType::kBF16, 4, 256, t, call);
    } else {
      for (int r = 0; r < 2; ++r) {
        EXPECT_EQ(rc[r], ARFUSE_INVALID_ARGUMENT) << r;
        EXPECT_THAT(msg[r], HasSubstr("comes from another program"));
      }
    }
    ++call;
  };
  run(0x1234, 0x4321);
  run(0, 0x4321);
  run(0x4321, 0x4321);
  run(0x1234, 0);
  run(0, 0);
  run(ARFUSE_PROGRAM_KEY_MAX, ARFUSE_PROGRAM_KEY_MAX);
  for (arfuse_ctx* ctx : ctxs.ctx) EXPECT_EQ(arfuse_check(ctx, nullptr), ARFUSE_OK);
}

// Rank 1 in a child process, which gets the workspace the way a client does: a descriptor and a
// blob (here inherited over fork; from the sidecar's fd socket in production).
TEST(InStreamHost, TwoProcessesShareTheWorkspace) {
  auto ws = TestHostWorkspace::Create(2, 8, 128, DType::kBF16, 4);
  ASSERT_TRUE(ws.ok()) << ws.status();
  const std::string blob0 = Blob(HostExport(**ws, 0));
  const std::string blob1 = Blob(HostExport(**ws, 1));
  constexpr int kCalls = 20;
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    arfuse_ctx* ctx = nullptr;
    const int fd = (*ws)->fd.get();
    if (arfuse_attach(blob1.data(), blob1.size(), &fd, 1, &ctx) != ARFUSE_OK) ::_exit(2);
    for (int call = 0; call < kCalls; ++call) {
      RankTensors t(DType::kBF16, 1, call, 8, 128);
      if (RunOp(ctx, Pattern::kAllReduceResidualRmsNorm, DType::kBF16, 8, 128, t) != ARFUSE_OK) {
        ::_exit(3);
      }
    }
    arfuse_detach(ctx);
    ::_exit(0);
  }
  AttachResult a = AttachBlob(blob0, {(*ws)->fd.get()});
  ASSERT_EQ(a.rc, ARFUSE_OK) << a.message;
  for (int call = 0; call < kCalls; ++call) {
    RankTensors mine(DType::kBF16, 0, call, 8, 128);
    ASSERT_EQ(RunOp(a.ctx, Pattern::kAllReduceResidualRmsNorm, DType::kBF16, 8, 128, mine),
              ARFUSE_OK)
        << arfuse_last_error();
    // Rank 0's outputs hold the sum with the child's input (made from the same (rank, call)).
    std::vector<RankTensors> inputs;
    inputs.emplace_back(DType::kBF16, 0, call, 8, 128);
    inputs.emplace_back(DType::kBF16, 1, call, 8, 128);
    RankTensors want(DType::kBF16, 0, call, 8, 128);
    testing::Reference(Pattern::kAllReduceResidualRmsNorm, DType::kBF16, 8, 128, inputs, want);
    ASSERT_EQ(mine.bytes(2, want.tensor_bytes), want.bytes(2, want.tensor_bytes));
    ASSERT_EQ(mine.bytes(3, want.tensor_bytes), want.bytes(3, want.tensor_bytes));
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  arfuse_detach(a.ctx);
}

TEST(InStreamHost, APeerThatNeverArrivesEndsWithinTheSpinTimeoutAndPoisons) {
  auto ws = TestHostWorkspace::Create(2, 8, 64, DType::kBF16, 1);
  ASSERT_TRUE(ws.ok());
  Ctxs ctxs;
  for (int r = 0; r < 2; ++r) {
    InStreamExport e = HostExport(**ws, r);
    e.spin_timeout_ns = 200'000'000;  // 200 ms
    AttachResult a = AttachBlob(Blob(e), {(*ws)->fd.get()});
    ASSERT_EQ(a.rc, ARFUSE_OK) << a.message;
    ctxs.ctx.push_back(a.ctx);
  }
  RankTensors t(DType::kBF16, 0, 0, 2, 64);
  const absl::Time t0 = absl::Now();
  EXPECT_EQ(RunOp(ctxs.ctx[0], Pattern::kAllReduce, DType::kBF16, 2, 64, t),
            ARFUSE_DEADLINE_EXCEEDED);
  EXPECT_THAT(arfuse_last_error(), HasSubstr("ranks 1 did not arrive"));
  EXPECT_THAT(arfuse_last_error(), HasSubstr("spin_timeout"));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  EXPECT_EQ(t.bytes(4, t.tensor_bytes), std::vector<uint8_t>(t.tensor_bytes, 0xee));
  uint32_t code = 0;
  EXPECT_EQ(arfuse_check(ctxs.ctx[0], &code), ARFUSE_ABORTED);
  EXPECT_EQ(code, 1u);
  EXPECT_THAT(arfuse_last_error(), HasSubstr("(timeout)"));
  // The late rank finds the abort word and gives up at once instead of computing.
  RankTensors t1(DType::kBF16, 1, 0, 2, 64);
  EXPECT_EQ(RunOp(ctxs.ctx[1], Pattern::kAllReduce, DType::kBF16, 2, 64, t1), ARFUSE_ABORTED);
  EXPECT_THAT(arfuse_last_error(), HasSubstr("rank 0 gave up"));
  EXPECT_EQ(arfuse_check(ctxs.ctx[1], &code), ARFUSE_ABORTED);
  EXPECT_EQ(code, 3u);  // peer_abort
}

// ---- against real host engines ----

EngineOptions Opts(int rank, int world) {
  EngineOptions o;
  o.rank = rank;
  o.world_size = world;
  o.backend = "trtllm";
  o.max_tokens = 16;
  o.max_hidden = 256;
  o.dtype = DType::kBF16;
  o.spin_timeout = absl::Seconds(20);
  return o;
}

struct EngineGroup {
  explicit EngineGroup(int world, absl::Duration spin_timeout = absl::Seconds(20)) {
    ex = LocalExchangeGroup::Create(world);
    for (int r = 0; r < world; ++r) {
      EngineOptions o = Opts(r, world);
      o.spin_timeout = spin_timeout;
      auto e = MakeHostEngine(o);
      EXPECT_TRUE(e.ok()) << e.status();
      eng.push_back(std::move(*e));
    }
    Initialize();
  }
  void Initialize() {
    std::vector<absl::Status> st(eng.size());
    OnRanks(static_cast<int>(eng.size()),
            [&](int r) { st[r] = eng[r]->Initialize(*ex[r], absl::Now() + absl::Seconds(30)); });
    for (auto& s : st) EXPECT_TRUE(s.ok()) << s;
  }
  // Each rank's attach, exactly as the service does it: export, blob, descriptors.
  AttachResult Attach(int r, const std::vector<uint32_t>& hiddens) {
    absl::StatusOr<InStreamExport> e = eng[r]->instream_host()->ExportInStream(hiddens);
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return {};
    return AttachBlob(Blob(*e, 100 + r), AttachBlobFds(*e));
  }
  std::vector<std::unique_ptr<Exchange>> ex;
  std::vector<std::unique_ptr<Engine>> eng;
};

OpArgs EngineArgs(RankTensors& t, uint32_t tokens, uint32_t hidden) {
  OpArgs a;
  a.pattern = Pattern::kAllReduceResidualRmsNorm;
  a.dtype = DType::kBF16;
  a.hidden = hidden;
  a.num_tokens = tokens;
  a.eps = 1e-5f;
  a.input = t.input();
  a.residual_in = t.residual_in();
  a.residual_out = t.residual_out();
  a.norm_out = t.norm_out();
  a.gamma = t.gamma();
  return a;
}

TEST(InStreamHostEngine, TheClientAndTheEngineTakeTurnsOnEveryRank) {
  EngineGroup g(2);
  Ctxs ctxs;
  for (int r = 0; r < 2; ++r) {
    AttachResult a = g.Attach(r, {32, 64, 96, 128, 160, 192, 224, 256});
    ASSERT_EQ(a.rc, ARFUSE_OK) << a.message;
    ctxs.ctx.push_back(a.ctx);
  }
  for (int call = 0; call < 12; ++call) {
    const uint32_t tokens = 1 + call % 16, hidden = 32 * (1 + call % 8);
    std::vector<RankTensors> t;
    for (int r = 0; r < 2; ++r) t.emplace_back(DType::kBF16, r, call, tokens, hidden);
    std::vector<absl::Status> st(2);
    OnRanks(2, [&](int r) {
      if (call % 3 == 2) {  // every third op on the eager plane, the others in-stream
        ExecContext ec;
        ec.deadline = absl::Now() + absl::Seconds(20);
        ec.synchronous = true;
        st[r] = g.eng[r]->Execute(EngineArgs(t[r], tokens, hidden), ec).status();
      } else {
        st[r] = ToStatus(RunOp(ctxs.ctx[r], Pattern::kAllReduceResidualRmsNorm, DType::kBF16,
                               tokens, hidden, t[r]));
      }
    });
    ASSERT_TRUE(st[0].ok()) << "call " << call << ": " << st[0];
    ASSERT_TRUE(st[1].ok()) << "call " << call << ": " << st[1];
    ExpectReference(Pattern::kAllReduceResidualRmsNorm, DType::kBF16, tokens, hidden, t, call);
  }
  absl::StatusOr<InStreamCounters> c = g.eng[1]->instream_host()->InStreamStatus();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->launches, 8u);
  EXPECT_EQ(c->error, 0u);
}

TEST(InStreamHostEngine, AReinitializationMakesTheAttachmentStaleUntilItAttachesAgain) {
  EngineGroup g(2);
  AttachResult a0 = g.Attach(0, {64});
  ASSERT_EQ(a0.rc, ARFUSE_OK) << a0.message;
  Ctxs ctxs{{a0.ctx}};
  uint32_t code = 0;
  ASSERT_EQ(arfuse_check(a0.ctx, &code), ARFUSE_OK);
  g.Initialize();  // the engines drop generation 1 and build generation 2

  // Before any op: arfuse_check already sees the dropped workspace.
  EXPECT_EQ(arfuse_check(a0.ctx, &code), ARFUSE_FAILED_PRECONDITION);
  EXPECT_EQ(code, kErrorStaleGeneration);
  EXPECT_THAT(arfuse_last_error(), HasSubstr("attach again"));
  // An op fails fast without touching anything (no peer is waited for).
  RankTensors t(DType::kBF16, 0, 0, 2, 64);
  const absl::Time t0 = absl::Now();
  EXPECT_EQ(RunOp(a0.ctx, Pattern::kAllReduceResidualRmsNorm, DType::kBF16, 2, 64, t),
            ARFUSE_FAILED_PRECONDITION);
  EXPECT_THAT(arfuse_last_error(), HasSubstr("stale generation: attach again"));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(1));
  EXPECT_EQ(t.bytes(2, t.tensor_bytes), std::vector<uint8_t>(t.tensor_bytes, 0xee));

  // Attached again, both ranks run on the new generation.
  for (int r = 0; r < 2; ++r) {
    AttachResult a = g.Attach(r, {64});
    ASSERT_EQ(a.rc, ARFUSE_OK) << a.message;
    ctxs.ctx.push_back(a.ctx);
    arfuse_ctx_info info{};
    info.struct_bytes = sizeof(info);
    ASSERT_EQ(arfuse_ctx_get_info(a.ctx, &info), ARFUSE_OK);
    EXPECT_EQ(info.generation, g.eng[r]->Status().generation);
    EXPECT_EQ(info.attach_id, 100u + r);
  }
  std::vector<RankTensors> tt;
  for (int r = 0; r < 2; ++r) tt.emplace_back(DType::kBF16, r, 1, 2, 64);
  std::vector<int> rc(2);
  OnRanks(2, [&](int r) {
    rc[r] = RunOp(ctxs.ctx[1 + r], Pattern::kAllReduceResidualRmsNorm, DType::kBF16, 2, 64, tt[r]);
  });
  ASSERT_EQ(rc[0], ARFUSE_OK);
  ASSERT_EQ(rc[1], ARFUSE_OK);
  ExpectReference(Pattern::kAllReduceResidualRmsNorm, DType::kBF16, 2, 64, tt, 1);
}

TEST(InStreamHostEngine, TheSidecarsAbortEndsAClientsWait) {
  EngineGroup g(2);
  AttachResult a0 = g.Attach(0, {64});
  ASSERT_EQ(a0.rc, ARFUSE_OK) << a0.message;
  Ctxs ctxs{{a0.ctx}};
  RankTensors t(DType::kBF16, 0, 0, 2, 64);
  int rc = -1;
  std::string message;  // arfuse_last_error() is the calling thread's
  const absl::Time t0 = absl::Now();
  std::thread waiter([&] {
    rc = RunOp(a0.ctx, Pattern::kAllReduce, DType::kBF16, 2, 64, t);  // rank 1 never comes
    message = arfuse_last_error();
  });
  absl::SleepFor(absl::Milliseconds(100));
  g.eng[1]->instream_host()->AbortInStream();
  waiter.join();
  EXPECT_EQ(rc, ARFUSE_ABORTED);
  EXPECT_THAT(message, HasSubstr("rank 1 gave up"));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
  absl::StatusOr<InStreamCounters> c = g.eng[0]->instream_host()->InStreamStatus();
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->error, 2u);  // host_abort
  EXPECT_EQ(g.eng[1]->Status().state, WorkspaceState::kPoisoned);
}

// A client's op that times out marks the shared header only: every rank's engine reports the
// workspace poisoned (the supervisor re-forms the group on it) and refuses new attachments to
// it, each naming the in-stream op and the error, until the ranks re-initialize.
TEST(InStreamHostEngine, AClientsFailedOpPoisonsTheWorkspaceUntilItIsRebuilt) {
  EngineGroup g(2, absl::Milliseconds(200));
  AttachResult a0 = g.Attach(0, {64});
  ASSERT_EQ(a0.rc, ARFUSE_OK) << a0.message;
  Ctxs ctxs{{a0.ctx}};
  RankTensors t(DType::kBF16, 0, 0, 2, 64);
  EXPECT_EQ(RunOp(a0.ctx, Pattern::kAllReduce, DType::kBF16, 2, 64, t),
            ARFUSE_DEADLINE_EXCEEDED);  // rank 1 never comes
  for (int r = 0; r < 2; ++r) {
    const EngineStatus s = g.eng[r]->Status();
    EXPECT_EQ(s.state, WorkspaceState::kPoisoned) << "rank " << r;
    EXPECT_FALSE(s.fusion_enabled);
    EXPECT_THAT(s.reason, HasSubstr("poisoned by an in-stream op (timeout)"));
    absl::StatusOr<InStreamExport> e = g.eng[r]->instream_host()->ExportInStream({64});
    EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << "rank " << r;
    EXPECT_THAT(e.status().message(), HasSubstr("poisoned by an in-stream op (timeout)"));
    EXPECT_THAT(e.status().message(), HasSubstr("attach after every rank re-initialized"));
  }
  g.Initialize();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(g.eng[r]->Status().state, WorkspaceState::kReady) << "rank " << r;
    EXPECT_TRUE(g.eng[r]->instream_host()->ExportInStream({64}).ok()) << "rank " << r;
  }
}

// ---- a client killed mid-op ----

// The dead client's rank, which op comes next (the engines' Execute or attached clients), which
// rank's next op starts first, and whether the sidecar saw the client's session end before.
struct KillCase {
  int dead_rank;
  bool next_in_stream;
  bool peer_first;
  bool session_end_seen;
};

std::string KillCaseName(const ::testing::TestParamInfo<KillCase>& info) {
  const KillCase& c = info.param;
  return absl::StrCat("DeadRank", c.dead_rank, c.next_in_stream ? "InStream" : "Eager",
                      c.peer_first ? "PeerFirst" : "PeerLate",
                      c.session_end_seen ? "SessionEndSeen" : "SessionEndUnseen");
}

class ClientKilledMidOp : public ::testing::TestWithParam<KillCase> {};

// A client of one rank starts an op its peer never joins and is SIGKILLed; then both ranks run
// their next op, one 0.3 s before the other. Without sequence numbers that are never reused and
// the confirmation before any slot is read, the first rank read the dead client's slot and
// answered OK with a wrong sum. Now no op of either rank answers OK: the dead rank's next op
// finds the abandoned op (ABORTED "abandoned"), its peer's op ends ABORTED when the workspace
// is poisoned, nothing is written, both engines report the poisoning, and after the group
// re-initializes a paired op is correct again.
TEST_P(ClientKilledMidOp, NoOpIsPairedWithTheDeadClientsSlot) {
  const KillCase c = GetParam();
  const int dead = c.dead_rank, peer = 1 - c.dead_rank;
  EngineGroup g(2, absl::Seconds(2));
  ExecContext ec;
  ec.synchronous = true;
  constexpr uint32_t kTokens = 2, kHidden = 64;
  // One paired op on the eager plane first, so the dead client's op is not the first.
  {
    std::vector<RankTensors> t;
    for (int r = 0; r < 2; ++r) t.emplace_back(DType::kBF16, r, 0, kTokens, kHidden);
    std::vector<absl::Status> st(2);
    OnRanks(2, [&](int r) {
      ec.deadline = absl::Now() + absl::Seconds(10);
      st[r] = g.eng[r]->Execute(EngineArgs(t[r], kTokens, kHidden), ec).status();
    });
    ASSERT_TRUE(st[0].ok()) << st[0];
    ASSERT_TRUE(st[1].ok()) << st[1];
    ExpectReference(Pattern::kAllReduceResidualRmsNorm, DType::kBF16, kTokens, kHidden, t, 0);
  }
  // The doomed client: rank `dead` in a child process, attached as a client is (a blob with its
  // attach id and the workspace descriptor); its op waits for a peer that never comes.
  constexpr uint64_t kDeadAttachId = 900;
  absl::StatusOr<InStreamExport> e = g.eng[dead]->instream_host()->ExportInStream({kHidden});
  ASSERT_TRUE(e.ok()) << e.status();
  const std::string blob = Blob(*e, kDeadAttachId);
  const std::vector<int> fds = AttachBlobFds(*e);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    arfuse_ctx* ctx = nullptr;
    if (arfuse_attach(blob.data(), blob.size(), fds.data(), fds.size(), &ctx) != ARFUSE_OK) {
      ::_exit(2);
    }
    RankTensors t(DType::kBF16, dead, 77, kTokens, kHidden);
    RunOp(ctx, Pattern::kAllReduceResidualRmsNorm, DType::kBF16, kTokens, kHidden, t);
    ::_exit(3);  // only after the spin timeout: the parent kills it long before
  }
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFSIGNALED(wstatus)) << "the child ended on its own: " << wstatus;
  // Another attachment's end retires nothing; the dead one's does (when the sidecar saw it).
  EXPECT_FALSE(g.eng[dead]->instream_host()->InStreamClientEnded(kDeadAttachId + 1));
  if (c.session_end_seen) {
    EXPECT_TRUE(g.eng[dead]->instream_host()->InStreamClientEnded(kDeadAttachId));
  }

  Ctxs ctxs;
  std::vector<arfuse_ctx*> by_rank(2, nullptr);
  if (c.next_in_stream) {
    // The peer's client attached all along (as in a framework); the dead rank's replacement
    // attaches now, unless the workspace is already known to be poisoned.
    for (int r : {peer, dead}) {
      absl::StatusOr<InStreamExport> x = g.eng[r]->instream_host()->ExportInStream({kHidden});
      if (!x.ok()) {
        EXPECT_TRUE(c.session_end_seen) << x.status();
        EXPECT_EQ(x.status().code(), absl::StatusCode::kFailedPrecondition);
        EXPECT_THAT(x.status().message(), HasSubstr("poisoned by an in-stream op (abandoned)"));
        continue;
      }
      AttachResult a = AttachBlob(Blob(*x, 100 + r), AttachBlobFds(*x));
      ASSERT_EQ(a.rc, ARFUSE_OK) << a.message;
      ctxs.ctx.push_back(a.ctx);
      by_rank[r] = a.ctx;
    }
  }
  std::vector<RankTensors> t;
  for (int r = 0; r < 2; ++r) t.emplace_back(DType::kBF16, r, 1, kTokens, kHidden);
  std::vector<absl::Status> st(2, absl::UnknownError("not run"));
  const std::vector<uint8_t> untouched = t[0].bytes(2, t[0].tensor_bytes);
  OnRanks(2, [&](int r) {
    const bool second = (r == peer) != c.peer_first;
    if (second) absl::SleepFor(absl::Milliseconds(300));
    if (!c.next_in_stream) {
      ExecContext x;
      x.synchronous = true;
      x.deadline = absl::Now() + absl::Seconds(10);
      st[r] = g.eng[r]->Execute(EngineArgs(t[r], kTokens, kHidden), x).status();
    } else if (by_rank[r] == nullptr) {
      st[r] = absl::FailedPreconditionError("no attachment (the workspace was poisoned)");
    } else {
      st[r] = ToStatus(RunOp(by_rank[r], Pattern::kAllReduceResidualRmsNorm, DType::kBF16, kTokens,
                             kHidden, t[r]));
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r << " answered OK after the dead client's op";
    EXPECT_THAT(st[r].code(),
                ::testing::AnyOf(absl::StatusCode::kAborted, absl::StatusCode::kFailedPrecondition))
        << "rank " << r << ": " << st[r];
    // Nothing was written.
    EXPECT_EQ(t[r].bytes(2, t[r].tensor_bytes), untouched) << "rank " << r;
  }
  if (!c.session_end_seen && c.next_in_stream == false) {
    // The dead rank's own next op is the one that found the abandoned op.
    EXPECT_THAT(st[dead].message(), HasSubstr("was abandoned")) << st[dead];
  }
  for (int r = 0; r < 2; ++r) {
    const EngineStatus s = g.eng[r]->Status();
    EXPECT_EQ(s.state, WorkspaceState::kPoisoned) << "rank " << r << ": " << s.reason;
  }
  absl::StatusOr<InStreamCounters> counters = g.eng[peer]->instream_host()->InStreamStatus();
  ASSERT_TRUE(counters.ok());
  EXPECT_EQ(counters->error, static_cast<uint32_t>(host::HostWsError::kAbandoned));
  EXPECT_EQ(counters->error_name, "abandoned");

  // The group re-forms; a paired op is correct again.
  g.Initialize();
  std::vector<RankTensors> tt;
  for (int r = 0; r < 2; ++r) tt.emplace_back(DType::kBF16, r, 2, kTokens, kHidden);
  std::vector<absl::Status> again(2);
  OnRanks(2, [&](int r) {
    ExecContext x;
    x.synchronous = true;
    x.deadline = absl::Now() + absl::Seconds(10);
    again[r] = g.eng[r]->Execute(EngineArgs(tt[r], kTokens, kHidden), x).status();
  });
  ASSERT_TRUE(again[0].ok()) << again[0];
  ASSERT_TRUE(again[1].ok()) << again[1];
  ExpectReference(Pattern::kAllReduceResidualRmsNorm, DType::kBF16, kTokens, kHidden, tt, 2);
}

INSTANTIATE_TEST_SUITE_P(
    Variants, ClientKilledMidOp,
    ::testing::Values(KillCase{0, false, true, false}, KillCase{0, false, false, false},
                      KillCase{1, false, true, false}, KillCase{1, false, false, false},
                      KillCase{0, true, true, false}, KillCase{0, true, false, false},
                      KillCase{1, true, true, false}, KillCase{1, true, false, false},
                      KillCase{0, false, true, true}, KillCase{1, true, true, true}),
    KillCaseName);

// A rank's next op after a claimed op that never finished, in one process: the number is not
// claimed again, and the rank's op fails naming the abandoned op.
TEST(InStreamHost, AnOpClaimedAndNeverFinishedIsAbandonedNotReused) {
  auto ws = TestHostWorkspace::Create(2, 8, 64, DType::kBF16, 1);
  ASSERT_TRUE(ws.ok());
  host::HostCollective rank0((*ws)->mapping.data(), 0, 2, (*ws)->slot_bytes);
  // What a launcher that died right after its claim leaves behind.
  rank0.sync(0)->launcher.store(5);
  rank0.sync(0)->launch_seq.store(1);
  EXPECT_FALSE(rank0.RetireAbandoned(6));  // not that launcher's op
  RankTensors t(DType::kBF16, 0, 0, 2, 64);
  OpArgs a = EngineArgs(t, 2, 64);
  host::HostOpResult r = rank0.Run(a, 1, host::HostWaitLimits{});
  EXPECT_EQ(r.status.code(), plain::StatusCode::kAborted);
  EXPECT_THAT(r.status.message(), HasSubstr("op 1 of rank 0 was abandoned"));
  EXPECT_TRUE(r.poisoned);
  EXPECT_EQ(r.error, static_cast<uint32_t>(host::HostWsError::kAbandoned));
  EXPECT_EQ(rank0.sync(0)->launch_seq.load(), 1u);  // nothing claimed
  EXPECT_EQ(rank0.header()->abort_seq.load(), 1u);
  // The peer's op 1 is dropped, not paired with the abandoned one.
  host::HostCollective rank1((*ws)->mapping.data(), 1, 2, (*ws)->slot_bytes);
  RankTensors t1(DType::kBF16, 1, 0, 2, 64);
  host::HostOpResult r1 = rank1.Run(EngineArgs(t1, 2, 64), 1, host::HostWaitLimits{});
  EXPECT_EQ(r1.status.code(), plain::StatusCode::kAborted);
  EXPECT_THAT(r1.status.message(), HasSubstr("rank 0 gave up on this op"));
  EXPECT_EQ(t1.bytes(2, t1.tensor_bytes), std::vector<uint8_t>(t1.tensor_bytes, 0xee));
}

// Every op the client decides is counted in its attachment's counter page, through the real
// library in host mode, and the sidecar's numbers (the attachments' table, the metrics) equal
// what the client did: fused ops by pattern and token bucket (a batch in each bucket, up to the
// top of the fused range), declined ops by reason (a batch above the fused range, one beyond the
// workspace, another dtype, hidden sizes not attached or not a multiple of 16, a misaligned
// tensor, a disabled ctx, and what the caller reports itself). Series carry the sidecar's rank
// first, then their own labels in name order.
TEST(InStreamHostCounters, TheSidecarCountsWhatTheClientDidOpForOp) {
  constexpr int kWorld = 2;
  constexpr uint32_t kHidden = 64, kFusedTokens = 600;
  auto ws = TestHostWorkspace::Create(kWorld, 1024, kHidden, DType::kBF16, 1);
  ASSERT_TRUE(ws.ok()) << ws.status();
  std::vector<std::unique_ptr<InStreamAttachments>> tables;
  std::vector<uint64_t> ids;
  Ctxs ctxs;
  for (int r = 0; r < kWorld; ++r) {
    tables.push_back(std::make_unique<InStreamAttachments>([](uint64_t, const AttachEventData&) {},
                                                           [] { return InStreamProbe{}; }));
    absl::StatusOr<std::unique_ptr<InStreamOpCounterPage>> page = InStreamOpCounterPage::Create();
    ASSERT_TRUE(page.ok()) << page.status();
    std::shared_ptr<InStreamOpCounterPage> shared = std::move(*page);
    absl::StatusOr<uint64_t> id = tables[r]->Add(1, 1, shared);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
    InStreamExport e = HostExport(**ws, r);
    // The fused range ends at 600 tokens, below the workspace's 1024.
    e.oneshot_max_bytes = e.twoshot_max_bytes = uint64_t{kFusedTokens} * kHidden * 2;
    AttachResult a = AttachBlob(Blob(e, *id, /*counters=*/true), {(*ws)->fd.get(), shared->fd()});
    ASSERT_EQ(a.rc, ARFUSE_OK) << a.message;
    ctxs.ctx.push_back(a.ctx);
  }
  const Pattern kNorm = Pattern::kAllReduceResidualRmsNorm, kSum = Pattern::kAllReduce;
  int call = 0;
  auto fused = [&](Pattern p, uint32_t tokens) {
    std::vector<RankTensors> t;
    for (int r = 0; r < kWorld; ++r) t.emplace_back(DType::kBF16, r, call, tokens, kHidden);
    std::vector<int> rc(kWorld, -1);
    OnRanks(kWorld,
            [&](int r) { rc[r] = RunOp(ctxs.ctx[r], p, DType::kBF16, tokens, kHidden, t[r]); });
    for (int r = 0; r < kWorld; ++r) ASSERT_EQ(rc[r], ARFUSE_OK) << "tokens " << tokens;
    ExpectReference(p, DType::kBF16, tokens, kHidden, t, call++);
  };
  // Declined on every rank alike (nothing runs, no peer is waited for).
  auto declined = [&](int want_rc, Pattern p, DType dt, uint32_t tokens, uint32_t hidden) {
    for (int r = 0; r < kWorld; ++r) {
      RankTensors t(dt, r, 0, tokens, hidden);
      EXPECT_EQ(RunOp(ctxs.ctx[r], p, dt, tokens, hidden, t), want_rc)
          << "tokens " << tokens << " hidden " << hidden;
    }
  };
  for (int i = 0; i < 3; ++i) fused(kNorm, 1);
  fused(kNorm, 5);
  fused(kNorm, 8);
  fused(kNorm, 64);
  fused(kSum, 65);
  fused(kSum, 512);
  fused(kNorm, 513);
  fused(kNorm, kFusedTokens);
  // FP8 ops count in the allreduce_residual_rmsnorm slot: one of 1 token, one of 5.
  for (auto [quant, tokens] :
       {std::pair{ARFUSE_QUANT_FP8_STATIC, 1u}, std::pair{ARFUSE_QUANT_FP8_PER_TOKEN, 5u}}) {
    std::vector<RankTensors> t;
    std::vector<Fp8Buffers> b;
    for (int r = 0; r < kWorld; ++r) {
      t.emplace_back(DType::kBF16, r, call, tokens, kHidden);
      b.emplace_back(quant, 0, tokens, kHidden);
    }
    std::vector<int> rc(kWorld, -1);
    OnRanks(kWorld, [&](int r) {
      rc[r] = RunFp8(ctxs.ctx[r], quant, 0, DType::kBF16, tokens, kHidden, t[r], b[r], true);
    });
    for (int r = 0; r < kWorld; ++r) ASSERT_EQ(rc[r], ARFUSE_OK) << "quant " << quant;
  }
  for (int r = 0; r < kWorld; ++r) {
    // Declined: a per-group hidden that is not a multiple of 128 (shape), a bad quant value.
    RankTensors t(DType::kBF16, r, 0, 4, kHidden);
    Fp8Buffers b(ARFUSE_QUANT_FP8_PER_GROUP, 1, 4, 128);
    EXPECT_EQ(
        RunFp8(ctxs.ctx[r], ARFUSE_QUANT_FP8_PER_GROUP, 1, DType::kBF16, 4, kHidden, t, b, true),
        ARFUSE_OUT_OF_RANGE);
    EXPECT_EQ(RunFp8(ctxs.ctx[r], 9, 0, DType::kBF16, 4, kHidden, t, b, true),
              ARFUSE_INVALID_ARGUMENT);
  }
  declined(ARFUSE_OUT_OF_RANGE, kNorm, DType::kBF16, kFusedTokens + 1, kHidden);  // range
  declined(ARFUSE_OUT_OF_RANGE, kNorm, DType::kBF16, 700, kHidden);               // range
  declined(ARFUSE_OUT_OF_RANGE, kSum, DType::kBF16, 2000, kHidden);               // capacity
  declined(ARFUSE_OUT_OF_RANGE, kNorm, DType::kFP16, 4, kHidden);                 // dtype
  declined(ARFUSE_OUT_OF_RANGE, kNorm, DType::kBF16, 4, 48);                      // not_attached
  declined(ARFUSE_OUT_OF_RANGE, kNorm, DType::kBF16, 4, 36);                      // shape
  declined(ARFUSE_OK, kNorm, DType::kBF16, 0, kHidden);  // no tokens: nothing runs or counts
  for (int r = 0; r < kWorld; ++r) {
    RankTensors t(DType::kBF16, r, 0, 4, kHidden);
    EXPECT_EQ(arfuse_fused_allreduce(ctxs.ctx[r], nullptr, t.input() + 2, t.output(), 4, kHidden,
                                     ARFUSE_DTYPE_BF16),
              ARFUSE_INVALID_ARGUMENT);
    EXPECT_EQ(arfuse_supports(ctxs.ctx[r], 2, 4, kHidden, ARFUSE_DTYPE_BF16), ARFUSE_OK);
    EXPECT_EQ(arfuse_note_declined(ctxs.ctx[r], ARFUSE_DECLINE_NOT_CONTIGUOUS), ARFUSE_OK);
    EXPECT_EQ(arfuse_note_declined(ctxs.ctx[r], ARFUSE_DECLINE_NOT_CONTIGUOUS), ARFUSE_OK);
    EXPECT_EQ(arfuse_note_declined(ctxs.ctx[r], 11), ARFUSE_INVALID_ARGUMENT);
    EXPECT_THAT(arfuse_last_error(), HasSubstr("decline reason 11 is not one of ARFUSE_DECLINE_*"));
    ASSERT_EQ(arfuse_disable(ctxs.ctx[r], "drained"), ARFUSE_OK);
  }
  declined(ARFUSE_UNAVAILABLE, kNorm, DType::kBF16, 4, kHidden);  // disabled
  declined(ARFUSE_UNAVAILABLE, kSum, DType::kBF16, 4, kHidden);   // disabled

  InStreamOpCounts want;
  const uint32_t norm = 1, sum = 0;
  want.fused[norm][0] = 4;  // 1 token (one FP8)
  want.fused[norm][1] = 3;  // 2-8 (one FP8)
  want.fused[norm][2] = 1;  // 9-64
  want.fused[sum][3] = 2;   // 65-512
  want.fused[norm][4] = 2;  // 513+
  auto slot = [](DeclineReason r) { return static_cast<uint32_t>(r); };
  want.declined[slot(DeclineReason::kRange)] = 2;
  want.declined[slot(DeclineReason::kCapacity)] = 1;
  want.declined[slot(DeclineReason::kDtype)] = 1;
  want.declined[slot(DeclineReason::kNotAttached)] = 1;
  want.declined[slot(DeclineReason::kShape)] = 2;            // one per-group hidden
  want.declined[slot(DeclineReason::kInvalidArgument)] = 2;  // one FP8 quant value
  want.declined[slot(DeclineReason::kNotContiguous)] = 2;
  want.declined[slot(DeclineReason::kDisabled)] = 2;
  ASSERT_EQ(want.fused_total(), 12u);
  ASSERT_EQ(want.declined_total(), 13u);
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(*tables[r]->op_counts(ids[r]), want) << "rank " << r;
    EXPECT_EQ(tables[r]->op_counts(), want) << "rank " << r;
  }

  // The metrics export the same numbers.
  Metrics m(0, kWorld, "host", {"0.0.0", "test", "1.0"});
  m.SetInStreamOps(tables[0]->op_counts());
  const std::string text = m.Render();
  for (const char* series :
       {"{rank=\"0\",path=\"fused\",pattern=\"allreduce_residual_rmsnorm\",reason=\"none\","
        "tokens=\"1\"} 4",
        "{rank=\"0\",path=\"fused\",pattern=\"allreduce\",reason=\"none\",tokens=\"65-512\"} 2",
        "{rank=\"0\",path=\"fused\",pattern=\"allreduce_residual_rmsnorm\",reason=\"none\","
        "tokens=\"513+\"} 2",
        "{rank=\"0\",path=\"fused\",pattern=\"allreduce\",reason=\"none\",tokens=\"1\"} 0",
        "{rank=\"0\",path=\"declined\",reason=\"range\"} 2",
        "{rank=\"0\",path=\"declined\",reason=\"shape\"} 2",
        "{rank=\"0\",path=\"declined\",reason=\"not_contiguous\"} 2",
        "{rank=\"0\",path=\"declined\",reason=\"memory\"} 0"}) {
    EXPECT_THAT(text, HasSubstr(absl::StrCat("\narfuse_instream_ops_total", series, "\n")));
  }

  // Detached: the counts stay (read a last time as the attachment ends).
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(tables[r]->Remove(1, ids[r]).ok());
    EXPECT_EQ(tables[r]->op_counts(), want);
  }
}

}  // namespace
}  // namespace arfuse::instream
