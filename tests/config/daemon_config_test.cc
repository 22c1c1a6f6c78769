// arfused's config flags as a process (docs/config.md): SGLang's spellings, bad values refused at
// startup, a repeated flag's last value, sglang-29063's five refused configurations, upstream's
// log lines, and a group's negotiated decision under DP attention and the per-batch limit.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "arfuse/v1/config.grpc.pb.h"
#include "tests/daemon/daemon_test_util.h"
#include "tests/support/daemon_process.h"
#include "tests/support/subprocess.h"

namespace arfuse {
namespace {

using ::arfuse::testing::ArfusedPath;
using ::arfuse::testing::DaemonProcess;
using ::arfuse::testing::ExitsWith2;
using ::arfuse::testing::MakeTempDir;
using ::arfuse::testing::RunToCompletion;
using ::testing::HasSubstr;
using ::testing::Not;

// A host-mode rank 0 of a two-rank group: it stops before waiting for peers when its own flags
// are refused.
std::vector<std::string> Rank0(const std::string& dir, std::vector<std::string> extra) {
  std::vector<std::string> argv = {ArfusedPath(),
                                   "--device=host",
                                   "--rank=0",
                                   "--world-size=2",
                                   "--socket=" + dir + "/a.sock",
                                   "--health-port=0",
                                   "--peer-timeout=5"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

TEST(DaemonConfigFlags, BadValuesOfTheNewFlagsExit2) {
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--fusion-rules=sglang-latest"},
                         "unknown --fusion-rules value \"sglang-latest\": expected sglang-23402 or "
                         "sglang-29063"));
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--model-architecture=Deepseek V3"},
                         "--model-architecture \"Deepseek V3\" is not an architecture name"));
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--moe-a2a-backend=nccl"},
                         "unknown --moe-a2a-backend value \"nccl\": expected one of none, deepep"));
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--enable-dp-attention=maybe"},
                         "bad value \"maybe\" for --enable-dp-attention"));
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--device=host"}, "unknown --fusion-rules value \"x\"",
                         {"ARFUSE_FUSION_RULES=x"}));
  // TP32 is refused by the sidecar itself, saying why (the kernels' 16 peer slots).
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--world-size=32"},
                         "--world-size must be between 1 and 16, got 32 (the fused kernels hold 16 "
                         "peer workspaces"));
}

// SGLang #28789/#29063 flashinfer_comm_fusion.py _resolve_backend: five configurations stop the
// server with a ValueError. Under --fusion-rules=sglang-29063 they stop arfused at startup.
TEST(DaemonConfigFlags, Sglang29063RefusesItsFiveConfigurationsAtStartup) {
  struct Case {
    std::vector<std::string> flags;
    std::string value_error;
  };
  const Case cases[] = {
      {{"--sm=80", "--flashinfer-allreduce-fusion-backend=auto"},
       "FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs."},
      {{"--sm=90", "--nnodes=2", "--flashinfer-allreduce-fusion-backend=auto"},
       "FlashInfer allreduce fusion does not support multi-node on non-Blackwell systems."},
      {{"--sm=90", "--nnodes=2", "--flashinfer-allreduce-fusion-backend=trtllm"},
       "FlashInfer allreduce fusion trtllm backend supports single-node only."},
      {{"--sm=90", "--nnodes=2", "--flashinfer-allreduce-fusion-backend=mnnvl"},
       "FlashInfer allreduce fusion mnnvl backend requires a Blackwell system, or SM90 "
       "single-node."},
      {{"--sm=100", "--nnodes=2", "--flashinfer-allreduce-fusion-backend=trtllm"},
       "FlashInfer allreduce fusion trtllm backend supports single-node only."},
  };
  const std::string dir = MakeTempDir();
  for (const Case& c : cases) {
    std::vector<std::string> flags = c.flags;
    flags.push_back("--fusion-rules=sglang-29063");
    EXPECT_TRUE(ExitsWith2(Rank0(dir, flags), c.value_error)) << c.value_error;
  }
}

// argparse semantics: the last of a repeated flag wins, and every occurrence is checked against
// the choices (an earlier bad value is refused too).
TEST(DaemonConfigFlags, RepeatedFusionFlagTakesTheLastValue) {
  const std::string dir = MakeTempDir();
  const std::string refused =
      "FlashInfer allreduce fusion trtllm backend supports single-node only.";
  EXPECT_TRUE(ExitsWith2(
      Rank0(dir, {"--sm=90", "--nnodes=2", "--fusion-rules=sglang-23402",
                  "--fusion-rules=sglang-29063", "--flashinfer-allreduce-fusion-backend=mnnvl",
                  "--flashinfer-allreduce-fusion-backend=trtllm"}),
      refused));
  EXPECT_TRUE(ExitsWith2(Rank0(dir, {"--fusion-rules=sglang-29063", "--fusion-rules=sglang-x"}),
                         "unknown --fusion-rules value \"sglang-x\""));
  EXPECT_TRUE(ExitsWith2(Rank0(dir, {"--fusion-rules=sglang-x", "--fusion-rules=sglang-29063"}),
                         "unknown --fusion-rules value \"sglang-x\""));
  EXPECT_TRUE(ExitsWith2(Rank0(dir, {"--flashinfer-allreduce-fusion-backend=nccl",
                                     "--flashinfer-allreduce-fusion-backend=trtllm"}),
                         "bad value \"nccl\" for --flashinfer-allreduce-fusion-backend"));
  EXPECT_TRUE(ExitsWith2(Rank0(dir, {"--moe-a2a-backend=x", "--moe-a2a-backend=none"}),
                         "unknown --moe-a2a-backend value \"x\""));
  // The later sglang-23402 wins over sglang-29063: nothing is refused, the sidecar starts.
  DaemonProcess started({"--rank=0", "--world-size=2", "--sm=90", "--nnodes=2",
                         "--fusion-rules=sglang-29063", "--fusion-rules=sglang-23402",
                         "--flashinfer-allreduce-fusion-backend=trtllm", "--peer-timeout=5"});
  EXPECT_TRUE(started.ready) << started.proc->Stderr();
}

// SGLang server_args.py _handle_deprecated_args: the warning's exact text, and silence when an
// explicit backend is given beside the deprecated flag.
TEST(DaemonConfigFlags, DeprecatedFlagLogsUpstreamsWarningOrNothing) {
  const std::string dir = MakeTempDir();
  const std::string warning =
      "--enable-flashinfer-allreduce-fusion is deprecated. Please use "
      "--flashinfer-allreduce-fusion-backend=auto instead.";
  // Refused afterwards (sglang-29063, SM90 across nodes), so the process ends by itself.
  auto [code, out] =
      RunToCompletion(Rank0(dir, {"--sm=90", "--nnodes=2", "--fusion-rules=sglang-29063",
                                  "--enable-flashinfer-allreduce-fusion"}));
  EXPECT_EQ(code, 2);
  EXPECT_THAT(out, HasSubstr(absl::StrCat("warning=\"", warning, "\"")));
  auto [code2, silent] =
      RunToCompletion(Rank0(dir, {"--sm=90", "--nnodes=2", "--fusion-rules=sglang-29063",
                                  "--enable-flashinfer-allreduce-fusion",
                                  "--flashinfer-allreduce-fusion-backend=trtllm"}));
  EXPECT_EQ(code2, 2);
  EXPECT_THAT(silent, HasSubstr("trtllm backend supports single-node only"));
  EXPECT_THAT(silent, Not(HasSubstr("deprecated")));
}

// Two host-mode ranks of one group, started with the same flags.
struct Group {
  explicit Group(const std::vector<std::string>& flags) : peers(MakeTempDir()) {
    for (int rank = 0; rank < 2; ++rank) {
      std::vector<std::string> extra = {
          absl::StrCat("--rank=", rank), "--world-size=2", "--peer-dir=" + peers,
          "--peer-timeout=30",           "--hidden=1024",  "--dtype=fp32"};
      extra.insert(extra.end(), flags.begin(), flags.end());
      ranks.push_back(std::make_unique<DaemonProcess>(extra));
    }
  }
  // Config.Negotiate on `rank`, retried while the group has not decided.
  grpc::Status Negotiate(int rank, v1::NegotiateResponse* response) {
    auto stub = v1::Config::NewStub(
        grpc::CreateChannel("unix:" + ranks[rank]->socket, grpc::InsecureChannelCredentials()));
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    grpc::Status status;
    do {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      v1::NegotiateRequest request;
      request.mutable_capture()->set_cuda_graph_mode(v1::CUDA_GRAPH_MODE_NONE);
      status = stub->Negotiate(&ctx, request, response);
      if (status.error_code() != grpc::StatusCode::UNAVAILABLE) return status;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    } while (std::chrono::steady_clock::now() < until);
    return status;
  }

  std::string peers;
  std::vector<std::unique_ptr<DaemonProcess>> ranks;
};

// communicator.py's runtime gate refuses fusion under DP attention even with the flag set; the
// explicit mnnvl that sm 120 does not support becomes trtllm with one INFO line per process.
TEST(DaemonConfigGroup, DpAttentionGroupIsUnfusedAndTheFallbackNoticeIsLoggedOnce) {
  Group g({"--sm=120", "--flashinfer-allreduce-fusion-backend=mnnvl", "--enable-dp-attention",
           "--model-architecture=DeepseekV3ForCausalLM", "--moe-a2a-backend=deepep"});
  ASSERT_TRUE(g.ranks[0]->ready && g.ranks[1]->ready) << g.ranks[0]->proc->Stderr();
  v1::NegotiateResponse response;
  grpc::Status status = g.Negotiate(0, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  const v1::Decision& d = response.decision();
  EXPECT_EQ(d.backend(), "trtllm");
  EXPECT_FALSE(d.fusion_enabled());
  EXPECT_EQ(d.fusion_rules(), "sglang-23402");
  EXPECT_EQ(d.max_tokens_per_batch(), 0u);
  std::string reasons;
  for (const std::string& r : d.reasons()) reasons += r + "\n";
  EXPECT_THAT(reasons, HasSubstr("--enable-dp-attention: the runtime gate"));
  ASSERT_EQ(d.notices_size(), 1);
  EXPECT_THAT(d.notices(0), HasSubstr("FlashInfer allreduce fusion: forcing trtllm backend ("));
  ASSERT_TRUE(g.ranks[0]->proc->WaitForOutput("event=config_notice", std::chrono::seconds(10)));
  const std::string log = g.ranks[0]->proc->Stderr() + g.ranks[0]->proc->Stdout();
  EXPECT_THAT(log, HasSubstr("level=info"));
  EXPECT_EQ(log.find("event=config_notice"), log.rfind("event=config_notice")) << log;
}

// A fused group reports upstream's per-batch limit, capped by its workspace (--max-tokens).
TEST(DaemonConfigGroup, FusedGroupReportsTheTokensPerBatch) {
  Group g({"--sm=90", "--flashinfer-allreduce-fusion-backend=trtllm", "--max-tokens=64"});
  ASSERT_TRUE(g.ranks[0]->ready && g.ranks[1]->ready) << g.ranks[0]->proc->Stderr();
  v1::NegotiateResponse response;
  grpc::Status status = g.Negotiate(1, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.decision().backend(), "trtllm");
  EXPECT_TRUE(response.decision().fusion_enabled());
  EXPECT_EQ(response.decision().max_tokens_per_batch(), 64u);
  EXPECT_EQ(response.decision().prefill_cuda_graph_mode(), v1::CUDA_GRAPH_MODE_NONE);
  EXPECT_EQ(response.decision().decode_cuda_graph_mode(), v1::CUDA_GRAPH_MODE_NONE);
}

}  // namespace
}  // namespace arfuse
