// HostEngine with ranks as threads (LocalExchangeGroup): results against the CPU reference,
// a rank that never arrives, abort, poisoning and re-initialization, bad shapes.
#include "server/host/host_engine.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/contract/op_contract.h"
#include "kernels/host/host_workspace.h"
#include "kernels/host/reference_op.h"
#include "server/peers/local_exchange.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;

void OnRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> t;
  for (int r = 0; r < n; ++r) t.emplace_back(fn, r);
  for (auto& x : t) x.join();
}

absl::Time Soon(int s = 60) { return absl::Now() + absl::Seconds(s); }

EngineOptions Opts(int rank, int world, uint32_t max_tokens = 16, uint32_t max_hidden = 256,
                   DType dtype = DType::kBF16) {
  EngineOptions o;
  o.rank = rank;
  o.world_size = world;
  o.backend = "none";
  o.max_tokens = max_tokens;
  o.max_hidden = max_hidden;
  o.dtype = dtype;
  o.spin_timeout = absl::Seconds(60);
  return o;
}

struct Group {
  std::vector<std::unique_ptr<Exchange>> ex;
  std::vector<std::unique_ptr<Engine>> eng;
};

Group MakeGroup(int world, uint32_t max_tokens = 16, uint32_t max_hidden = 256,
                DType dtype = DType::kBF16) {
  Group g;
  g.ex = LocalExchangeGroup::Create(world);
  for (int r = 0; r < world; ++r) {
    auto e = MakeHostEngine(Opts(r, world, max_tokens, max_hidden, dtype));
    EXPECT_TRUE(e.ok()) << e.status();
    g.eng.push_back(std::move(*e));
  }
  std::vector<absl::Status> st(world);
  OnRanks(world, [&](int r) { st[r] = g.eng[r]->Initialize(*g.ex[r], Soon()); });
  for (auto& s : st) EXPECT_TRUE(s.ok()) << s;
  return g;
}

// One rank's tensors for one call, filled from (rank, call) so every call differs.
struct Tensors {
  std::vector<uint8_t> input, residual_in, gamma, output, residual_out, norm_out;
};

Tensors Fill(DType dt, int rank, int call, uint32_t tokens, uint32_t hidden) {
  Tensors t;
  const size_t n = size_t{tokens} * hidden, es = DTypeSize(dt);
  t.input.resize(n * es);
  t.residual_in.resize(n * es);
  t.output.assign(n * es, 0xee);
  t.residual_out.assign(n * es, 0xee);
  t.norm_out.assign(n * es, 0xee);
  t.gamma.resize(hidden * es);
  for (size_t i = 0; i < n; ++i) {
    StoreFromFloat(dt, t.input.data(), i,
                   static_cast<float>(((i * 7 + rank * 13 + call * 5) % 33)) / 8.0f - 2.0f);
    StoreFromFloat(dt, t.residual_in.data(), i, static_cast<float>((i + call) % 9) / 4.0f - 1.0f);
  }
  for (size_t i = 0; i < hidden; ++i) {
    StoreFromFloat(dt, t.gamma.data(), i, 0.5f + static_cast<float>(i % 5) / 4.0f);
  }
  return t;
}

OpArgs Args(Pattern p, DType dt, uint32_t tokens, uint32_t hidden, Tensors& t) {
  OpArgs a;
  a.pattern = p;
  a.dtype = dt;
  a.hidden = hidden;
  a.num_tokens = tokens;
  a.eps = 1e-5f;
  a.input = t.input.data();
  if (p == Pattern::kAllReduce) {
    a.output = t.output.data();
  } else {
    a.residual_in = t.residual_in.data();
    a.residual_out = t.residual_out.data();
    a.norm_out = t.norm_out.data();
    a.gamma = t.gamma.data();
  }
  return a;
}

ExecContext Ctx(absl::Time deadline) {
  ExecContext c;
  c.deadline = deadline;
  c.synchronous = true;
  return c;
}

struct Case {
  int world;
  DType dtype;
  Pattern pattern;
};

class HostEngineResults : public ::testing::TestWithParam<Case> {};

TEST_P(HostEngineResults, MatchTheCpuReferenceBitForBitOnEveryRankCallAfterCall) {
  const Case c = GetParam();
  Group g = MakeGroup(c.world, 16, 256, c.dtype);
  constexpr int kCalls = 40;
  for (int call = 0; call < kCalls; ++call) {
    const uint32_t tokens = 1 + call % 16, hidden = 8 * (1 + call % 32);
    std::vector<Tensors> t;
    for (int r = 0; r < c.world; ++r) t.push_back(Fill(c.dtype, r, call, tokens, hidden));
    // Expected: the reference over the original inputs, computed here.
    Tensors want = t[0];
    std::vector<const void*> ins;
    for (auto& x : t) ins.push_back(x.input.data());
    CpuOpArgs ref;
    ref.pattern = c.pattern;
    ref.dtype = c.dtype;
    ref.world_size = c.world;
    ref.hidden = hidden;
    ref.num_tokens = tokens;
    ref.eps = 1e-5f;
    ref.rank_inputs = ins.data();
    ref.output = want.output.data();
    ref.residual_in = want.residual_in.data();
    ref.residual_out = want.residual_out.data();
    ref.norm_out = want.norm_out.data();
    ref.gamma = want.gamma.data();
    ASSERT_TRUE(ReferenceFusedOp(ref).ok());

    std::vector<absl::StatusOr<OpOutcome>> out(c.world, absl::UnknownError("not run"));
    OnRanks(c.world, [&](int r) {
      out[r] = g.eng[r]->Execute(Args(c.pattern, c.dtype, tokens, hidden, t[r]), Ctx(Soon()));
    });
    for (int r = 0; r < c.world; ++r) {
      ASSERT_TRUE(out[r].ok()) << "call " << call << " rank " << r << ": " << out[r].status();
      EXPECT_EQ(out[r]->path, ExecPath::kHost);
      if (c.pattern == Pattern::kAllReduce) {
        ASSERT_EQ(t[r].output, want.output) << "call " << call << " rank " << r;
      } else {
        ASSERT_EQ(t[r].residual_out, want.residual_out) << "call " << call << " rank " << r;
        ASSERT_EQ(t[r].norm_out, want.norm_out) << "call " << call << " rank " << r;
      }
    }
  }
  EXPECT_EQ(g.eng[0]->Status().state, WorkspaceState::kReady);
}

// Client memory that faults (its shm object shrank): every page of the mapping raises SIGBUS.
struct Vanished {
  explicit Vanished(size_t size) : size(size) {
    fd = memfd_create("arfuse-host-test", MFD_CLOEXEC);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    base = static_cast<uint8_t*>(mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    EXPECT_EQ(ftruncate(fd, 0), 0);
  }
  ~Vanished() {
    munmap(base, size);
    close(fd);
  }
  size_t size;
  int fd;
  uint8_t* base;
};

// docs/security.md (host memory by descriptor): a rank whose client's residual memory vanished
// fails that op alone; its peers complete it, nobody dies, the workspace stays ready, and the next
// op runs on every rank.
TEST(HostEngine, ClientMemoryThatFaultsFailsThatRanksOpOnly) {
  Group g = MakeGroup(2, 4, 64, DType::kFP32);
  Vanished gone(1 << 16);
  std::vector<Tensors> t = {Fill(DType::kFP32, 0, 0, 4, 64), Fill(DType::kFP32, 1, 0, 4, 64)};
  std::vector<absl::StatusOr<OpOutcome>> out(2, absl::UnknownError("not run"));
  OnRanks(2, [&](int r) {
    OpArgs a = Args(Pattern::kAllReduceResidualRmsNorm, DType::kFP32, 4, 64, t[r]);
    if (r == 1) a.residual_in = gone.base;
    out[r] = g.eng[r]->Execute(a, Ctx(Soon()));
  });
  EXPECT_TRUE(out[0].ok()) << out[0].status();
  EXPECT_EQ(out[1].status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(out[1].status().message(), HasSubstr("residual_in: the client's memory faulted"));
  EXPECT_EQ(g.eng[1]->Status().state, WorkspaceState::kReady);
  OnRanks(2, [&](int r) {
    out[r] = g.eng[r]->Execute(Args(Pattern::kAllReduce, DType::kFP32, 4, 64, t[r]), Ctx(Soon()));
  });
  EXPECT_TRUE(out[0].ok()) << out[0].status();
  EXPECT_TRUE(out[1].ok()) << out[1].status();
}

// A rank that cannot read its input publishes its slot flagged: every rank drops the op alike
// (none sums a slot that holds no input), and the group goes on.
TEST(HostEngine, AnInputThatFaultsDropsTheOpOnEveryRankAlike) {
  Group g = MakeGroup(2, 4, 64, DType::kFP32);
  Vanished gone(1 << 16);
  std::vector<Tensors> t = {Fill(DType::kFP32, 0, 0, 4, 64), Fill(DType::kFP32, 1, 0, 4, 64)};
  std::vector<absl::StatusOr<OpOutcome>> out(2, absl::UnknownError("not run"));
  OnRanks(2, [&](int r) {
    OpArgs a = Args(Pattern::kAllReduce, DType::kFP32, 4, 64, t[r]);
    if (r == 0) a.input = gone.base;
    out[r] = g.eng[r]->Execute(a, Ctx(Soon()));
  });
  EXPECT_EQ(out[0].status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(out[0].status().message(), HasSubstr("input: the client's memory faulted"));
  EXPECT_EQ(out[1].status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(out[1].status().message(), HasSubstr("rank 0 could not read its client's input"));
  std::vector<uint8_t> untouched(t[1].output.size(), 0xee);
  EXPECT_EQ(t[1].output, untouched);
  OnRanks(2, [&](int r) {
    out[r] = g.eng[r]->Execute(Args(Pattern::kAllReduce, DType::kFP32, 4, 64, t[r]), Ctx(Soon()));
  });
  EXPECT_TRUE(out[0].ok()) << out[0].status();
  EXPECT_TRUE(out[1].ok()) << out[1].status();
  EXPECT_EQ(g.eng[0]->Status().state, WorkspaceState::kReady);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, HostEngineResults,
    ::testing::Values(Case{2, DType::kBF16, Pattern::kAllReduceResidualRmsNorm},
                      Case{4, DType::kBF16, Pattern::kAllReduceResidualRmsNorm},
                      Case{4, DType::kFP16, Pattern::kAllReduce},
                      Case{2, DType::kFP32, Pattern::kAllReduceResidualRmsNorm},
                      Case{8, DType::kBF16, Pattern::kAllReduce}));

// The FP8 patterns through the host engine (its staging of quant_out and scale included): every
// pattern and scale layout, with and without norm_out, 2 ranks, against the CPU reference bit for
// bit. The static scale is an input (the engine reads it), the others are outputs.
TEST(HostEngine, Fp8PatternsMatchTheCpuReferenceWithAndWithoutNormOut) {
  constexpr int kWorld = 2;
  constexpr uint32_t kHidden = 256;
  Group g = MakeGroup(kWorld, 16, kHidden, DType::kBF16);
  struct Fp8Case {
    Pattern pattern;
    uint8_t layout;
  };
  const Fp8Case cases[] = {{Pattern::kAllReduceResidualRmsNormFp8Static, 0},
                           {Pattern::kAllReduceResidualRmsNormFp8PerToken, 0},
                           {Pattern::kAllReduceResidualRmsNormFp8PerGroup, 1},
                           {Pattern::kAllReduceResidualRmsNormFp8PerGroup, 2},
                           {Pattern::kAllReduceResidualRmsNormFp8PerGroup, 3}};
  int call = 0;
  for (const Fp8Case& c : cases) {
    for (bool with_norm : {true, false}) {
      for (uint32_t tokens : {1u, 5u, 16u}) {
        ++call;
        SCOPED_TRACE(absl::StrCat(PatternName(c.pattern), " layout ", c.layout, " norm_out ",
                                  with_norm, " tokens ", tokens));
        const contract::OpShape shape{DType::kBF16, kHidden, tokens, c.pattern, c.layout};
        const size_t scale_bytes = static_cast<size_t>(contract::ScaleBytes(shape));
        ASSERT_GT(scale_bytes, 0u);
        std::vector<Tensors> t;
        std::vector<std::vector<uint8_t>> quant(kWorld), scale(kWorld);
        for (int r = 0; r < kWorld; ++r) {
          t.push_back(Fill(DType::kBF16, r, call, tokens, kHidden));
          quant[r].assign(size_t{tokens} * kHidden, 0xee);
          scale[r].assign(scale_bytes, 0xee);
          if (c.pattern == Pattern::kAllReduceResidualRmsNormFp8Static) {
            const float s = 0.03125f;
            std::memcpy(scale[r].data(), &s, sizeof(s));
          }
        }
        Tensors want = t[0];
        std::vector<uint8_t> want_quant(quant[0].size()), want_scale = scale[0];
        std::vector<const void*> ins;
        for (auto& x : t) ins.push_back(x.input.data());
        CpuOpArgs ref;
        ref.pattern = c.pattern;
        ref.dtype = DType::kBF16;
        ref.world_size = kWorld;
        ref.hidden = kHidden;
        ref.num_tokens = tokens;
        ref.eps = 1e-5f;
        ref.rank_inputs = ins.data();
        ref.residual_in = want.residual_in.data();
        ref.residual_out = want.residual_out.data();
        ref.norm_out = want.norm_out.data();
        ref.gamma = want.gamma.data();
        ref.quant_out = want_quant.data();
        ref.scale = want_scale.data();
        ref.scale_layout = c.layout;
        ASSERT_TRUE(ReferenceFusedOp(ref).ok());

        std::vector<absl::StatusOr<OpOutcome>> out(kWorld, absl::UnknownError("not run"));
        OnRanks(kWorld, [&](int r) {
          OpArgs a = Args(c.pattern, DType::kBF16, tokens, kHidden, t[r]);
          if (!with_norm) a.norm_out = nullptr;
          a.quant_out = quant[r].data();
          a.scale = scale[r].data();
          a.scale_layout = c.layout;
          out[r] = g.eng[r]->Execute(a, Ctx(Soon()));
        });
        for (int r = 0; r < kWorld; ++r) {
          ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status();
          EXPECT_EQ(t[r].residual_out, want.residual_out) << "rank " << r;
          EXPECT_EQ(quant[r], want_quant) << "rank " << r;
          EXPECT_EQ(scale[r], want_scale) << "rank " << r;
          if (with_norm) {
            EXPECT_EQ(t[r].norm_out, want.norm_out) << "rank " << r;
          } else {
            EXPECT_EQ(t[r].norm_out, std::vector<uint8_t>(t[r].norm_out.size(), 0xee))
                << "rank " << r << ": norm_out written though not given";
          }
        }
      }
    }
  }
  EXPECT_EQ(g.eng[0]->Status().state, WorkspaceState::kReady);
}

// What the FP8 patterns need, refused before any rank takes part: quant_out or scale missing, an
// fp32 input, a per-group op with hidden off the group or no layout.
TEST(HostEngine, RefusesFp8OpsMissingATensorOrBreakingThePatternsRules) {
  Group g = MakeGroup(2, 16, 256, DType::kBF16);
  Tensors t = Fill(DType::kBF16, 0, 1, 2, 256);
  std::vector<uint8_t> quant(2 * 256), scale(64);
  auto fp8 = [&](Pattern p) {
    OpArgs a = Args(p, DType::kBF16, 2, 256, t);
    a.quant_out = quant.data();
    a.scale = scale.data();
    a.scale_layout = 1;
    return a;
  };
  struct Bad {
    OpArgs op;
    const char* says;
  };
  std::vector<Bad> bad;
  OpArgs no_quant = fp8(Pattern::kAllReduceResidualRmsNormFp8Static);
  no_quant.quant_out = nullptr;
  bad.push_back({no_quant, "needs quant_out and scale"});
  OpArgs no_scale = fp8(Pattern::kAllReduceResidualRmsNormFp8PerToken);
  no_scale.scale = nullptr;
  bad.push_back({no_scale, "needs quant_out and scale"});
  OpArgs off_group = fp8(Pattern::kAllReduceResidualRmsNormFp8PerGroup);
  off_group.hidden = 192;
  bad.push_back({off_group, "not a multiple of the group size 128"});
  OpArgs no_layout = fp8(Pattern::kAllReduceResidualRmsNormFp8PerGroup);
  no_layout.scale_layout = 0;
  bad.push_back({no_layout, "scale layout 0"});
  Group g32 = MakeGroup(2, 16, 256, DType::kFP32);
  Tensors t32 = Fill(DType::kFP32, 0, 1, 2, 256);
  OpArgs fp32 = Args(Pattern::kAllReduceResidualRmsNormFp8Static, DType::kFP32, 2, 256, t32);
  fp32.quant_out = quant.data();
  fp32.scale = scale.data();
  {
    absl::StatusOr<OpOutcome> r = g32.eng[0]->Execute(fp32, Ctx(Soon()));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("takes bf16 or fp16 input"));
  }
  for (const Bad& b : bad) {
    absl::StatusOr<OpOutcome> r = g.eng[0]->Execute(b.op, Ctx(Soon()));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << b.says;
    EXPECT_THAT(r.status().message(), HasSubstr(b.says));
  }
  EXPECT_EQ(g.eng[0]->Status().state, WorkspaceState::kReady);
}

TEST(HostEngine, FastRankNeverOverwritesASlotASlowRankStillReads) {
  // Many back-to-back calls with no barrier between them: rank 0 races ahead as far as the
  // protocol lets it; every result is checked.
  Group g = MakeGroup(2, 4, 64, DType::kFP32);
  constexpr int kCalls = 500;
  std::vector<int> bad(2, 0);
  OnRanks(2, [&](int r) {
    for (int call = 0; call < kCalls; ++call) {
      Tensors t = Fill(DType::kFP32, r, call, 4, 64);
      Tensors other = Fill(DType::kFP32, 1 - r, call, 4, 64);
      auto s = g.eng[r]->Execute(Args(Pattern::kAllReduce, DType::kFP32, 4, 64, t), Ctx(Soon()));
      if (!s.ok()) {
        ADD_FAILURE() << "rank " << r << " call " << call << ": " << s.status();
        ++bad[r];
        break;
      }
      for (size_t i = 0; i < 4 * 64; ++i) {
        float want = LoadAsFloat(DType::kFP32, t.input.data(), i) +
                     LoadAsFloat(DType::kFP32, other.input.data(), i);
        if (LoadAsFloat(DType::kFP32, t.output.data(), i) != want) {
          ++bad[r];
          break;
        }
      }
    }
  });
  EXPECT_EQ(bad[0], 0);
  EXPECT_EQ(bad[1], 0);
}

TEST(HostEngine, MissingRankTimesOutPoisonsAndReinitializeRecovers) {
  Group g = MakeGroup(2);
  Tensors t = Fill(DType::kBF16, 0, 0, 2, 64);
  const absl::Time t0 = absl::Now();
  auto r = g.eng[0]->Execute(Args(Pattern::kAllReduceResidualRmsNorm, DType::kBF16, 2, 64, t),
                             Ctx(absl::Now() + absl::Milliseconds(300)));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(20));
  ASSERT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("ranks 1 did not arrive"));
  EXPECT_THAT(r.status().message(), HasSubstr("the op's deadline"));
  EngineStatus st = g.eng[0]->Status();
  EXPECT_EQ(st.state, WorkspaceState::kPoisoned);
  EXPECT_FALSE(st.fusion_enabled);
  const uint64_t gen = st.generation;

  r = g.eng[0]->Execute(Args(Pattern::kAllReduceResidualRmsNorm, DType::kBF16, 2, 64, t),
                        Ctx(Soon()));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("poisoned"));
  EXPECT_THAT(r.status().message(), HasSubstr("re-initialize"));

  // The late rank finds rank 0's abort word and gives up at once rather than computing.
  Tensors t1 = Fill(DType::kBF16, 1, 0, 2, 64);
  r = g.eng[1]->Execute(Args(Pattern::kAllReduceResidualRmsNorm, DType::kBF16, 2, 64, t1),
                        Ctx(Soon()));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(r.status().message(), HasSubstr("rank 0 gave up"));
  EXPECT_EQ(g.eng[1]->Status().state, WorkspaceState::kPoisoned);

  std::vector<absl::Status> init(2);
  OnRanks(2, [&](int k) { init[k] = g.eng[k]->Initialize(*g.ex[k], Soon()); });
  ASSERT_TRUE(init[0].ok()) << init[0];
  ASSERT_TRUE(init[1].ok()) << init[1];
  EXPECT_EQ(g.eng[0]->Status().state, WorkspaceState::kReady);
  EXPECT_GT(g.eng[0]->Status().generation, gen);
  EXPECT_EQ(g.eng[0]->Status().generation, g.eng[1]->Status().generation);
  std::vector<absl::Status> st2(2);
  std::vector<Tensors> tt = {Fill(DType::kBF16, 0, 1, 2, 64), Fill(DType::kBF16, 1, 1, 2, 64)};
  OnRanks(2, [&](int k) {
    st2[k] = g.eng[k]
                 ->Execute(Args(Pattern::kAllReduceResidualRmsNorm, DType::kBF16, 2, 64, tt[k]),
                           Ctx(Soon()))
                 .status();
  });
  EXPECT_TRUE(st2[0].ok()) << st2[0];
  EXPECT_TRUE(st2[1].ok()) << st2[1];
  EXPECT_EQ(tt[0].norm_out, tt[1].norm_out);
}

// After a rank gave up on op k, ops before k (every rank's input already there) still run on a
// rank that reaches them late; ops from k on are dropped. Without the recorded op, a rank frozen
// inside op k - 1 and continued later dropped it although its peer had completed it.
TEST(HostEngineAbort, OnlyOpsFromTheOneGivenUpOnAreDropped) {
  EXPECT_FALSE(host::DropsOpAfterAbort(/*abort_word=*/0, /*abort_seq=*/0, /*seq=*/6));
  EXPECT_FALSE(host::DropsOpAfterAbort(1, 7, 6));
  EXPECT_TRUE(host::DropsOpAfterAbort(1, 7, 7));
  EXPECT_TRUE(host::DropsOpAfterAbort(2, 7, 8));
  // A word without a recorded op (written by nothing but an older layout) drops everything.
  EXPECT_TRUE(host::DropsOpAfterAbort(1, 0, 6));
}

TEST(HostEngine, SpinTimeoutBoundsAnOpWithoutADeadline) {
  auto ex = LocalExchangeGroup::Create(2);
  std::vector<std::unique_ptr<Engine>> eng;
  for (int r = 0; r < 2; ++r) {
    EngineOptions o = Opts(r, 2);
    o.spin_timeout = absl::Milliseconds(200);
    eng.push_back(std::move(*MakeHostEngine(o)));
  }
  OnRanks(2, [&](int r) { ASSERT_TRUE(eng[r]->Initialize(*ex[r], Soon()).ok()); });
  Tensors t = Fill(DType::kBF16, 0, 0, 1, 8);
  auto r = eng[0]->Execute(Args(Pattern::kAllReduce, DType::kBF16, 1, 8, t),
                           Ctx(absl::InfiniteFuture()));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(r.status().message(), HasSubstr("spin_timeout"));
}

TEST(HostEngine, AbortEndsAWaitWithAborted) {
  Group g = MakeGroup(2);
  g.eng[0]->Abort();  // sticky until re-initialize: the wait below cannot miss it
  Tensors t = Fill(DType::kBF16, 0, 0, 1, 8);
  auto r = g.eng[0]->Execute(Args(Pattern::kAllReduce, DType::kBF16, 1, 8, t), Ctx(Soon()));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(r.status().message(), HasSubstr("aborted on rank 0"));
  EXPECT_EQ(g.eng[0]->Status().state, WorkspaceState::kPoisoned);
}

TEST(HostEngine, RanksRunningDifferentOpsAreRefusedAlikeWithoutPoisoning) {
  Group g = MakeGroup(2);
  std::vector<Tensors> t = {Fill(DType::kBF16, 0, 0, 2, 64), Fill(DType::kBF16, 1, 0, 3, 64)};
  std::vector<absl::Status> st(2);
  OnRanks(2, [&](int r) {
    st[r] = g.eng[r]
                ->Execute(Args(Pattern::kAllReduce, DType::kBF16, r == 0 ? 2 : 3, 64, t[r]),
                          Ctx(Soon()))
                .status();
  });
  for (auto& s : st) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("ranks disagree on the op"));
  }
  EXPECT_EQ(g.eng[0]->Status().state, WorkspaceState::kReady);
  OnRanks(2, [&](int r) {
    EXPECT_TRUE(
        g.eng[r]->Execute(Args(Pattern::kAllReduce, DType::kBF16, 2, 64, t[r]), Ctx(Soon())).ok());
  });
}

TEST(HostEngine, RefusesOpsThatDoNotFitTheWorkspace) {
  Group g = MakeGroup(2, 4, 64);
  Tensors t = Fill(DType::kBF16, 0, 0, 8, 128);
  auto check = [&](OpArgs a, const std::string& msg) {
    auto r = g.eng[0]->Execute(a, Ctx(Soon()));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << msg;
    EXPECT_THAT(r.status().message(), HasSubstr(msg));
  };
  const Pattern kNorm = Pattern::kAllReduceResidualRmsNorm;
  check(Args(kNorm, DType::kBF16, 1, 12, t), "hidden 12 must be a positive multiple of 8");
  check(Args(kNorm, DType::kBF16, 1, 0, t), "hidden 0 must be a positive multiple of 8");
  check(Args(kNorm, DType::kBF16, 1, 128, t), "hidden 128 exceeds the workspace's max_hidden 64");
  check(Args(kNorm, DType::kBF16, 5, 64, t), "exceeds the workspace slot of 512 bytes");
  check(Args(kNorm, DType::kFP32, 3, 64, t), "(768 bytes) exceeds the workspace slot");
  OpArgs a = Args(kNorm, DType::kBF16, 1, 64, t);
  a.gamma = nullptr;
  check(a, "needs gamma");
  a = Args(kNorm, DType::kBF16, 1, 64, t);
  a.residual_in = nullptr;
  check(a, "needs residual_in");
  a = Args(kNorm, DType::kBF16, 1, 64, t);
  a.norm_out = nullptr;
  check(a, "needs norm_out");
  a = Args(Pattern::kAllReduce, DType::kBF16, 1, 64, t);
  a.output = nullptr;
  check(a, "allreduce needs an output");
  a = Args(Pattern::kAllReduce, DType::kBF16, 1, 64, t);
  a.input = nullptr;
  check(a, "input is missing");
  a = Args(Pattern::kAllReduce, DType::kBF16, 1, 64, t);
  a.pattern = static_cast<Pattern>(9);
  check(a, "unknown pattern 9");
  a = Args(Pattern::kAllReduce, DType::kBF16, 1, 64, t);
  a.dtype = static_cast<DType>(7);
  check(a, "unknown dtype 7");
  a = Args(kNorm, DType::kBF16, 1, 64, t);
  a.eps = -1.0f;
  check(a, "eps must be finite");
  // Refusals do not poison: the workspace still serves.
  EXPECT_EQ(g.eng[0]->Status().state, WorkspaceState::kReady);
}

TEST(HostEngine, OpsBeforeInitializeAreUnavailable) {
  auto e = MakeHostEngine(Opts(0, 2));
  ASSERT_TRUE(e.ok());
  Tensors t = Fill(DType::kBF16, 0, 0, 1, 8);
  auto r = (*e)->Execute(Args(Pattern::kAllReduce, DType::kBF16, 1, 8, t), Ctx(Soon()));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("not initialized"));
  EXPECT_EQ((*e)->Status().state, WorkspaceState::kInitializing);
}

TEST(HostEngine, FactoryRefusesBadOptions) {
  EngineOptions o = Opts(0, 2);
  o.world_size = 17;
  EXPECT_THAT(MakeHostEngine(o).status().message(), HasSubstr("world_size 17 is out of range"));
  o = Opts(2, 2);
  EXPECT_THAT(MakeHostEngine(o).status().message(), HasSubstr("rank 2 is out of range"));
  o = Opts(0, 2);
  o.max_hidden = 100;
  auto s = MakeHostEngine(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("multiple of 8"));
  o = Opts(0, 2, 1u << 20, 1u << 16);
  s = MakeHostEngine(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("1 GiB"));
}

TEST(HostEngine, InitializeRefusesAnEngineOfAnotherRankAndTellsEveryRank) {
  auto ex = LocalExchangeGroup::Create(2);
  std::vector<std::unique_ptr<Engine>> eng;
  eng.push_back(std::move(*MakeHostEngine(Opts(0, 2))));
  eng.push_back(std::move(*MakeHostEngine(Opts(0, 2))));  // wrong: says rank 0 on rank 1
  std::vector<absl::Status> st(2);
  OnRanks(2, [&](int r) { st[r] = eng[r]->Initialize(*ex[r], Soon()); });
  for (auto& s : st) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(),
                HasSubstr("rank 1: engine is rank 0 of 2 but the peer group says rank 1"));
  }
}

}  // namespace
}  // namespace arfuse
