// The host engine's in-stream plane (InStreamHost): what ExportInStream hands out, its refusals,
// the counters and abort on the workspace's header words, and the generation it retires.
#include <fcntl.h>
#include <sys/stat.h>

#include <functional>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/host/host_collective.h"
#include "server/engine_api/instream_host.h"
#include "server/host/host_engine.h"
#include "server/peers/local_exchange.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;

void OnRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> t;
  for (int r = 0; r < n; ++r) t.emplace_back(fn, r);
  for (auto& x : t) x.join();
}

EngineOptions Opts(int rank, int world, const std::string& backend = "trtllm") {
  EngineOptions o;
  o.rank = rank;
  o.world_size = world;
  o.backend = backend;
  o.max_tokens = 16;
  o.max_hidden = 256;
  o.dtype = DType::kFP16;
  o.spin_timeout = absl::Milliseconds(1500);
  return o;
}

struct Group {
  explicit Group(int world, const std::string& backend = "trtllm") {
    ex = LocalExchangeGroup::Create(world);
    for (int r = 0; r < world; ++r)
      eng.push_back(std::move(*MakeHostEngine(Opts(r, world, backend))));
  }
  void Initialize() {
    std::vector<absl::Status> st(eng.size());
    OnRanks(static_cast<int>(eng.size()),
            [&](int r) { st[r] = eng[r]->Initialize(*ex[r], absl::Now() + absl::Seconds(30)); });
    for (auto& s : st) ASSERT_TRUE(s.ok()) << s;
  }
  InStreamHost& host(int r) { return *eng[r]->instream_host(); }
  std::vector<std::unique_ptr<Exchange>> ex;
  std::vector<std::unique_ptr<Engine>> eng;
};

TEST(HostInStream, TheExportDescribesTheGroupsOneWorkspaceObject) {
  Group g(2);
  g.Initialize();
  ASSERT_NE(g.eng[1]->instream_host(), nullptr);
  absl::StatusOr<InStreamExport> e = g.host(1).ExportInStream({64, 256, 64});
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->device, instream::DeviceKind::kHost);
  EXPECT_EQ(e->rank, 1u);
  EXPECT_EQ(e->world_size, 2u);
  EXPECT_EQ(e->generation, g.eng[1]->Status().generation);
  EXPECT_EQ(e->dtype, DType::kFP16);
  EXPECT_EQ(e->max_tokens, 16u);
  EXPECT_EQ(e->hidden, 256u);
  EXPECT_EQ(e->spin_timeout_ns, 1'500'000'000u);
  EXPECT_EQ(e->host_slot_bytes, host::HostWsSlotBytes(16, 256, DType::kFP16));
  EXPECT_EQ(e->oneshot_max_bytes, 16u * 256 * 2);
  EXPECT_EQ(e->twoshot_max_bytes, 16u * 256 * 2);
  EXPECT_EQ(e->image, nullptr);
  EXPECT_EQ(e->image_bytes, 0u);
  // Every pattern (an fp16 workspace: the FP8 ones too) at each hidden asked for, duplicates
  // once.
  ASSERT_EQ(e->entries.size(), 10u);
  EXPECT_EQ(e->entries[0].hidden, 64u);
  EXPECT_EQ(e->entries[5].hidden, 256u);
  for (size_t i = 0; i < e->entries.size(); ++i) {
    const auto& k = e->entries[i];
    EXPECT_EQ(k.pattern, i % 5 + 1);
    EXPECT_EQ(k.dtype, static_cast<uint8_t>(DType::kFP16));
    EXPECT_EQ(k.algo, 1);
  }
  const uint64_t total = host::HostWsTotalBytes(2, e->host_slot_bytes);
  ASSERT_EQ(e->ranks.size(), 2u);
  for (const auto& m : e->ranks) {
    EXPECT_EQ(m.kind, instream::MemoryKind::kHostShm);
    EXPECT_EQ(m.bytes, total);
  }
  EXPECT_FALSE(e->ranks[0].fd.valid());
  ASSERT_TRUE(e->ranks[1].fd.valid());
  // The descriptor is the workspace itself: mapped, its header is this generation's.
  auto m = host::HostWsMapping::Map(e->ranks[1].fd.get(), total);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(host::CheckHostWorkspace(m->data(), 2, e->host_slot_bytes, e->generation).ok());
  // The export's descriptor is its own: the engine keeps serving others.
  absl::StatusOr<InStreamExport> again = g.host(1).ExportInStream({});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(again->ranks[1].fd.get(), e->ranks[1].fd.get());
  ASSERT_EQ(again->entries.size(), 5u);
  EXPECT_EQ(again->entries[0].hidden, 256u);
}

TEST(HostInStream, ExportRefusals) {
  Group g(2);
  absl::StatusOr<InStreamExport> e = g.host(0).ExportInStream({});
  EXPECT_EQ(e.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(e.status().message(), HasSubstr("not initialized"));
  EXPECT_EQ(g.host(0).InStreamStatus().status().code(), absl::StatusCode::kUnavailable);
  g.Initialize();
  e = g.host(0).ExportInStream({12});
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), HasSubstr("hidden 12 must be a positive multiple of 8"));
  e = g.host(0).ExportInStream({264});
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), HasSubstr("hidden 264 exceeds the workspace's max_hidden 256"));
  e = g.host(0).ExportInStream(std::vector<uint32_t>(17, 64));
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), HasSubstr("at most 16 hidden sizes, not 17"));
  g.host(0).AbortInStream();
  e = g.host(0).ExportInStream({});
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(e.status().message(), HasSubstr("poisoned"));
}

TEST(HostInStream, NothingToAttachToWhenFusionIsOff) {
  Group g(2, "none");
  g.Initialize();
  absl::StatusOr<InStreamExport> e = g.host(0).ExportInStream({});
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(e.status().message(), HasSubstr("fusion is off for this group"));
}

TEST(HostInStream, AbortPoisonsTheWorkspaceForEveryRank) {
  Group g(2);
  g.Initialize();
  absl::StatusOr<InStreamCounters> c = g.host(0).InStreamStatus();
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->error, 0u);
  EXPECT_EQ(c->launches, 0u);
  g.host(1).AbortInStream();
  EXPECT_EQ(g.eng[1]->Status().state, WorkspaceState::kPoisoned);
  // Rank 0's engine reads the shared error word, and its next op gives up without waiting.
  c = g.host(0).InStreamStatus();
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->error, static_cast<uint32_t>(host::HostWsError::kHostAbort));
  std::vector<uint8_t> in(64 * 2), out(64 * 2);
  OpArgs a;
  a.pattern = Pattern::kAllReduce;
  a.dtype = DType::kFP16;
  a.hidden = 64;
  a.num_tokens = 1;
  a.input = in.data();
  a.output = out.data();
  ExecContext ec;
  ec.deadline = absl::Now() + absl::Seconds(20);
  const absl::Time t0 = absl::Now();
  auto r = g.eng[0]->Execute(a, ec);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("rank 1 gave up"));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(1));
  EXPECT_EQ(g.eng[0]->Status().state, WorkspaceState::kPoisoned);
}

TEST(HostInStream, ReinitializingAndShuttingDownRetireTheGeneration) {
  Group g(2);
  g.Initialize();
  absl::StatusOr<InStreamExport> e = g.host(0).ExportInStream({});
  ASSERT_TRUE(e.ok());
  const uint64_t total = host::HostWsTotalBytes(2, e->host_slot_bytes);
  auto first = host::HostWsMapping::Map(e->ranks[0].fd.get(), total);
  ASSERT_TRUE(first.ok());
  g.Initialize();
  plain::Status s = host::CheckHostWorkspace(first->data(), 2, e->host_slot_bytes, e->generation);
  EXPECT_EQ(s.code(), plain::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("stale generation: the sidecar dropped"));

  absl::StatusOr<InStreamExport> e2 = g.host(0).ExportInStream({});
  ASSERT_TRUE(e2.ok());
  EXPECT_GT(e2->generation, e->generation);
  auto second = host::HostWsMapping::Map(e2->ranks[0].fd.get(), total);
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(
      host::CheckHostWorkspace(second->data(), 2, e2->host_slot_bytes, e2->generation).ok());
  g.eng[1].reset();  // one rank's sidecar shutting down ends the generation for the group
  EXPECT_THAT(
      host::CheckHostWorkspace(second->data(), 2, e2->host_slot_bytes, e2->generation).message(),
      HasSubstr("stale generation"));
}

}  // namespace
}  // namespace arfuse
