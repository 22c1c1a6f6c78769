#include "server/collective/dispatch_table.h"

#include "gtest/gtest.h"

namespace arfuse {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * 1024;

DispatchRequest Req(int sm, int ws, uint32_t tokens, uint32_t hidden) {
  DispatchRequest r;
  r.sm = sm;
  r.world_size = ws;
  r.num_tokens = tokens;
  r.hidden = hidden;
  r.dtype = DType::kBF16;
  r.fused_available = true;
  r.twoshot_available = true;
  r.nccl_available = true;
  r.nccl_symmetric_available = true;
  return r;
}

TEST(DispatchTable, PayloadBytesIsTokensTimesHiddenTimesDtypeSize) {
  EXPECT_EQ(PayloadBytes(3, 4096, DType::kBF16), 3u * 4096 * 2);
  EXPECT_EQ(PayloadBytes(3, 4096, DType::kFP32), 3u * 4096 * 4);
  EXPECT_EQ(PayloadBytes(2048, 8192, DType::kFP16), 32 * kMiB);
}

TEST(DispatchTable, Sm90Tp2RunsOneShotUpTo32MiBThenUnfused) {
  const DispatchTable t = DispatchTable::Published();
  auto c = ChooseExecPath(t, Req(90, 2, 2048, 8192));  // exactly 32 MiB
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->path, ExecPath::kOneShot);
  c = ChooseExecPath(t, Req(90, 2, 2049, 8192));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->path, ExecPath::kUnfused);
  EXPECT_NE(c->reason.find("above the fused limits"), std::string::npos) << c->reason;
}

TEST(DispatchTable, Sm90Tp8FusesOnlySmallPayloads) {
  const DispatchTable t = DispatchTable::Published();
  // 64 tokens x 4096 x 2 B = 512 KiB: the published one-shot limit at TP8.
  auto c = ChooseExecPath(t, Req(90, 8, 64, 4096));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kOneShot);
  c = ChooseExecPath(t, Req(90, 8, 65, 4096));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kUnfused);
}

TEST(DispatchTable, Sm90Tp4MeasuredOneShotUpTo1MiBThenTwoShotUpTo32MiB) {
  const DispatchTable t = DispatchTable::Published();
  const DispatchEntry* e = t.Find(90, 4);
  ASSERT_NE(e, nullptr);
  EXPECT_NE(e->source.find("measured"), std::string::npos);
  // 128 tokens x 4096 x 2 B = 1 MiB: the last one-shot payload; one token more is two-shot.
  auto c = ChooseExecPath(t, Req(90, 4, 128, 4096));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kOneShot);
  c = ChooseExecPath(t, Req(90, 4, 129, 4096));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kTwoShot) << c->reason;
  // 2048 x 8192 x 2 B = 32 MiB, the largest payload measured: two-shot; above it, unfused with
  // regular NCCL (symmetric windows measured slower from 14 MiB on).
  c = ChooseExecPath(t, Req(90, 4, 2048, 8192));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kTwoShot);
  c = ChooseExecPath(t, Req(90, 4, 2049, 8192));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kUnfused);
  EXPECT_FALSE(c->nccl_symmetric);
  // The two-shot range when the two-shot kernel cannot run the shape: unfused, with NCCL
  // symmetric windows at 4 MiB (measured faster there).
  DispatchRequest r = Req(90, 4, 512, 4096);
  r.twoshot_available = false;
  c = ChooseExecPath(t, r);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kUnfused);
  EXPECT_TRUE(c->nccl_symmetric);
  EXPECT_NE(c->reason.find("two-shot kernel cannot run"), std::string::npos) << c->reason;
}

TEST(DispatchTable, Sm90Tp2AndTp8NeverPickTwoShot) {
  // Two-shot was measured slower than one-shot and unfused at TP2 on Hopper, and TP8 keeps the
  // published gate (no two-shot range) until measured.
  const DispatchTable t = DispatchTable::Published();
  for (int ws : {2, 8}) {
    for (uint32_t tokens : {1u, 8u, 128u, 1024u, 2048u, 4096u}) {
      auto c = ChooseExecPath(t, Req(90, ws, tokens, 8192));
      ASSERT_TRUE(c.ok());
      EXPECT_NE(c->path, ExecPath::kTwoShot) << "ws=" << ws << " tokens=" << tokens;
    }
  }
}

TEST(DispatchTable, Sm100Tp4UsesTwoShotBetweenLimits) {
  const DispatchTable t = DispatchTable::Published();
  // 1024 x 8192 x 2 = 16 MiB: above the 8 MiB one-shot limit, below the 32 MiB fusion limit.
  auto c = ChooseExecPath(t, Req(100, 4, 1024, 8192));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kTwoShot);
  // SM103 falls back to the SM100 family entry.
  c = ChooseExecPath(t, Req(103, 4, 1024, 8192));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kTwoShot);
  // Two-shot range, but the kernel cannot run the shape: unfused, never an unmeasured fused path.
  DispatchRequest r = Req(100, 4, 1024, 8192);
  r.twoshot_available = false;
  c = ChooseExecPath(t, r);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kUnfused);
}

TEST(DispatchTable, UnknownArchitectureRunsUnfused) {
  const DispatchTable t = DispatchTable::Published();
  auto c = ChooseExecPath(t, Req(80, 2, 1, 4096));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kUnfused);
  EXPECT_NE(c->reason.find("no thresholds for sm=80 world_size=2"), std::string::npos) << c->reason;
}

TEST(DispatchTable, UnfusedPicksSymmetricPerSize) {
  const DispatchTable t = DispatchTable::Published();
  DispatchRequest r = Req(90, 2, 1, 8192);  // 16 KiB: symmetric kernels won
  r.forced = ForcedPath::kUnfused;
  auto c = ChooseExecPath(t, r);
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->nccl_symmetric);
  r.num_tokens = 32;  // 512 KiB: regular won
  c = ChooseExecPath(t, r);
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->nccl_symmetric);
  r.num_tokens = 128;  // 2 MiB: symmetric won again
  c = ChooseExecPath(t, r);
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->nccl_symmetric);
  r.nccl_symmetric_available = false;
  c = ChooseExecPath(t, r);
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->nccl_symmetric);
}

// The SM90 TP2 symmetric ranges are the measured ones (docs/performance.md): NCCL's symmetric
// kernels + add-RMSNorm won below 64 KiB and from 1.75 MiB to 8 MiB.
TEST(DispatchTable, Sm90Tp2SymmetricRangesAreTheMeasuredOnes) {
  const DispatchTable t = DispatchTable::Published();
  DispatchRequest r = Req(90, 2, 1, 4096);
  r.forced = ForcedPath::kUnfused;
  const struct {
    uint32_t tokens;
    bool symmetric;
  } cases[] = {{7, true},   {8, false},   {64, false},   {128, false},
               {224, true}, {1024, true}, {1025, false}, {2048, false}};
  for (const auto& c : cases) {
    r.num_tokens = c.tokens;  // x 4096 x 2 B
    auto choice = ChooseExecPath(t, r);
    ASSERT_TRUE(choice.ok());
    EXPECT_EQ(choice->nccl_symmetric, c.symmetric) << c.tokens << " tokens";
  }
}

TEST(DispatchTable, WithoutNcclTheFusedPathRunsWhateverTheSize) {
  const DispatchTable t = DispatchTable::Published();
  DispatchRequest r = Req(90, 8, 2048, 8192);  // far above the TP8 limit
  r.nccl_available = false;
  auto c = ChooseExecPath(t, r);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kOneShot);
  EXPECT_NE(c->reason.find("no NCCL"), std::string::npos);
}

TEST(DispatchTable, WithoutFusedWorkspaceRunsUnfused) {
  DispatchRequest r = Req(90, 2, 1, 4096);
  r.fused_available = false;
  auto c = ChooseExecPath(DispatchTable::Published(), r);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kUnfused);
}

TEST(DispatchTable, NothingAvailableIsFailedPrecondition) {
  DispatchRequest r = Req(90, 2, 1, 4096);
  r.fused_available = false;
  r.nccl_available = false;
  auto c = ChooseExecPath(DispatchTable::Published(), r);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(c.status().message().find("no path can run"), absl::string_view::npos);
}

TEST(DispatchTable, ForcedPathsOverrideTheTable) {
  const DispatchTable t = DispatchTable::Published();
  DispatchRequest r = Req(90, 2, 4096, 8192);  // 64 MiB: the table says unfused
  r.forced = ForcedPath::kOneShot;
  auto c = ChooseExecPath(t, r);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kOneShot);
  r.forced = ForcedPath::kTwoShot;
  c = ChooseExecPath(t, r);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kTwoShot);
  r = Req(90, 2, 1, 4096);  // the table says one-shot
  r.forced = ForcedPath::kUnfused;
  c = ChooseExecPath(t, r);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kUnfused);
}

TEST(DispatchTable, ForcedPathUnavailableIsFailedPrecondition) {
  const DispatchTable t = DispatchTable::Published();
  DispatchRequest r = Req(90, 2, 1, 4096);
  r.fused_available = false;
  r.forced = ForcedPath::kOneShot;
  EXPECT_EQ(ChooseExecPath(t, r).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(ChooseExecPath(t, r).status().message().find("no fused workspace"),
            absl::string_view::npos);
  r.forced = ForcedPath::kTwoShot;
  EXPECT_NE(ChooseExecPath(t, r).status().message().find("forced path twoshot"),
            absl::string_view::npos);
  r = Req(90, 2, 1, 4096);
  r.twoshot_available = false;
  r.forced = ForcedPath::kTwoShot;
  EXPECT_EQ(ChooseExecPath(t, r).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(ChooseExecPath(t, r).status().message().find("cannot run 1 tokens"),
            absl::string_view::npos);
  r = Req(90, 2, 1, 4096);
  r.nccl_available = false;
  r.forced = ForcedPath::kUnfused;
  EXPECT_EQ(ChooseExecPath(t, r).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(ChooseExecPath(t, r).status().message().find("no NCCL communicator"),
            absl::string_view::npos);
}

TEST(DispatchTable, ParseForcedPath) {
  EXPECT_EQ(*ParseForcedPath("twoshot"), ForcedPath::kTwoShot);
  EXPECT_EQ(*ParseForcedPath("auto"), ForcedPath::kAuto);
  auto bad = ParseForcedPath("threeshot");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("threeshot"), absl::string_view::npos);
}

TEST(DispatchTable, AddRejectsInvalidEntries) {
  DispatchTable t;
  auto expect_bad = [&](DispatchEntry e, const std::string& part) {
    absl::Status s = t.Add(std::move(e));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(part), absl::string_view::npos) << s.message();
  };
  expect_bad({0, 2, 1, 0, {}, ""}, "sm must be positive");
  expect_bad({90, 3, 1, 0, {}, ""}, "world size 3 is not supported");
  expect_bad({90, 2, 4 * kMiB, 2 * kMiB, {}, ""}, "must be 0 or above oneshot_max");
  expect_bad({90, 2, 1, 0, {{10, 10}}, ""}, "empty or reversed symmetric range");
  ASSERT_TRUE(t.Add({90, 2, 1, 0, {}, ""}).ok());
  expect_bad({90, 2, 1, 0, {}, ""}, "listed twice");
}

TEST(DispatchTable, PublishedEntriesAreAllValid) {
  const DispatchTable published = DispatchTable::Published();
  // SM90 and SM100 at each world size the kernels support: 2, 4, 8, 16.
  EXPECT_EQ(published.entries().size(), 8u);
  DispatchTable copy;
  for (const DispatchEntry& e : published.entries()) EXPECT_TRUE(copy.Add(e).ok()) << e.sm;
}

TEST(DispatchTable, Tp16HasARowPerFamilyThatFusesSmallPayloads) {
  // At TP16 the config fuses (docs/config.md, "World sizes"): the data path must too, one-shot for
  // decode-sized payloads, and the unfused path above the carried-over limit.
  const DispatchTable t = DispatchTable::Published();
  for (int sm : {90, 100, 103}) {
    const DispatchEntry* e = t.Find(sm, 16);
    ASSERT_NE(e, nullptr) << sm;
    EXPECT_NE(e->source.find("not measured"), std::string::npos) << e->source;
    auto one = ChooseExecPath(t, Req(sm, 16, 1, 4096));
    ASSERT_TRUE(one.ok());
    EXPECT_EQ(one->path, ExecPath::kOneShot) << sm;
    auto big = ChooseExecPath(t, Req(sm, 16, 2048, 8192));
    ASSERT_TRUE(big.ok());
    EXPECT_EQ(big->path, ExecPath::kUnfused) << sm;
    EXPECT_NE(big->reason.find("above the fused limits"), std::string::npos) << big->reason;
  }
}

TEST(DispatchTable, SerializeParseRoundTrip) {
  const DispatchTable t = DispatchTable::Published();
  auto parsed = DispatchTable::Parse(t.Serialize());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->Serialize(), t.Serialize());
  const DispatchEntry* e = parsed->Find(90, 2);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->oneshot_max_bytes, 32 * kMiB);
  ASSERT_EQ(e->nccl_symmetric.size(), 2u);
  EXPECT_EQ(e->nccl_symmetric[1].lo, 1536 * kKiB);
  EXPECT_NE(e->source.find("measured"), std::string::npos);
}

TEST(DispatchTable, ParseMeasuredTableWithComments) {
  auto t = DispatchTable::Parse(
      "# measured by arfuse-bench kernels\n"
      "sm=90 ws=2 oneshot_max=1048576 twoshot_max=0 sym= source=bench 2026\n\n");
  ASSERT_TRUE(t.ok()) << t.status();
  auto c = ChooseExecPath(*t, Req(90, 2, 65, 8192));  // 1040 KiB
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, ExecPath::kUnfused);
  EXPECT_FALSE(c->nccl_symmetric);
}

TEST(DispatchTable, ParseRejectsBadLines) {
  auto expect_bad = [](const std::string& text, const std::string& part) {
    auto t = DispatchTable::Parse(text);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(t.status().message().find(part), absl::string_view::npos) << t.status().message();
  };
  expect_bad("sm=90 ws=2 oneshot_max=1\n", "line 1: needs sm, ws, oneshot_max and twoshot_max");
  expect_bad("\nsm=x ws=2 oneshot_max=1 twoshot_max=0\n", "line 2: sm is not a number");
  expect_bad("sm=90 ws=2 oneshot_max=1 twoshot_max=0 color=red\n", "unknown key \"color\"");
  expect_bad("sm=90 ws=2 oneshot_max=1 twoshot_max=0 sym=5\n", "is not LO-HI");
  expect_bad("sm=90 ws=2 oneshot_max=1 twoshot_max=0 junk\n", "expected key=value");
  expect_bad("sm=90 ws=6 oneshot_max=1 twoshot_max=0\n", "world size 6 is not supported");
}

}  // namespace
}  // namespace arfuse
