// arfusectl: the CLI contract of docs/operations.md (outputs and exit codes), run as the built
// binary; argument-order independence in process; resolve/health/info against an in-process server.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "arfuse/v1/admin.grpc.pb.h"
#include "arfuse/v1/fusion.grpc.pb.h"
#include "common/version.h"
#include "config/fusion_config.h"
#include "server/services/config/config_service.h"
#include "tests/config/upstream_cases.h"
#include "tools/arfusectl/cli.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::StartsWith;

struct Result {
  int code = -1;
  std::string out;
  std::string err;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A scratch directory removed (with what the tests put in it) at the end.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/arfusectl-test-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() { std::system(absl::StrCat("rm -rf '", path_, "'").c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Runs the built arfusectl with `args`; stdout and stderr go to files (no pipe deadlocks).
// `xdg` sets XDG_RUNTIME_DIR for the child ("" unsets it).
Result RunBinary(const std::vector<std::string>& args, const std::string& xdg = "") {
  static const std::string binary = std::string(ARFUSE_BINARY_DIR) + "/tools/arfusectl/arfusectl";
  TempDir dir;
  const std::string out_path = dir.path() + "/out";
  const std::string err_path = dir.path() + "/err";
  // Everything the child needs is prepared before fork(): the parent may run gRPC threads, so
  // the child only calls async-signal-safe functions before exec.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::string(*e).rfind("XDG_RUNTIME_DIR=", 0) != 0) env_strings.push_back(*e);
  }
  if (!xdg.empty()) env_strings.push_back("XDG_RUNTIME_DIR=" + xdg);
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(binary.c_str()));
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);

  pid_t pid = fork();
  if (pid == 0) {
    int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (out < 0 || err < 0) _exit(126);
    dup2(out, 1);
    dup2(err, 2);
    execve(binary.c_str(), argv.data(), envp.data());
    _exit(127);
  }
  Result r;
  int status = 0;
  if (pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status)) {
    r.code = WEXITSTATUS(status);
  }
  r.out = ReadFile(out_path);
  r.err = ReadFile(err_path);
  return r;
}

Result RunInProcess(const std::vector<std::string>& args) {
  std::ostringstream out, err;
  Result r;
  r.code = cli::RunArfusectl(args, out, err);
  r.out = out.str();
  r.err = err.str();
  return r;
}

std::string ExpectedJson(const config::FusionFlags& flags, const config::Topology& t,
                         const config::CaptureRequest& c = {}) {
  absl::StatusOr<config::Decision> d = config::Resolve(flags, t, c);
  EXPECT_TRUE(d.ok()) << d.status();
  return config::DecisionToJson(*d) + "\n";
}

std::vector<std::string> TopologyArgs(int sm, int nnodes, int tp) {
  return {"--sm", absl::StrCat(sm), "--nnodes", absl::StrCat(nnodes), "--tp", absl::StrCat(tp)};
}

// ---- resolve, locally, through the binary ----

TEST(ArfusectlResolve, EveryArchitectureNodeCountAndBackendMatchesTheLibrary) {
  for (int sm : {80, 89, 90, 100, 103, 110, 120}) {
    for (int nnodes : {1, 2}) {
      for (const char* value : {static_cast<const char*>(nullptr), "auto", "trtllm", "mnnvl"}) {
        std::vector<std::string> args = {"resolve"};
        for (const std::string& a : TopologyArgs(sm, nnodes, 4)) args.push_back(a);
        config::FusionFlags flags;
        if (value != nullptr) {
          args.push_back(absl::StrCat("--flashinfer-allreduce-fusion-backend=", value));
          flags.backend = value;
        }
        args.push_back("--json");
        Result r = RunBinary(args);
        EXPECT_EQ(r.code, 0) << absl::StrJoin(args, " ") << "\n" << r.err;
        EXPECT_EQ(r.out, ExpectedJson(flags, {sm, 4, nnodes})) << absl::StrJoin(args, " ");
        EXPECT_THAT(r.err, IsEmpty());
      }
    }
  }
}

TEST(ArfusectlResolve, SeedCases) {
  for (const char* nnodes : {"1", "2"}) {
    Result r = RunBinary({"resolve", "--sm", "100", "--nnodes", nnodes, "--tp", "8",
                          "--flashinfer-allreduce-fusion-backend", "auto"});
    EXPECT_EQ(r.code, 0);
    EXPECT_THAT(r.out, StartsWith("{\"backend\":\"mnnvl\",\"fusion_enabled\":true,"));
  }
  Result one = RunBinary({"resolve", "--sm", "90", "--nnodes", "1", "--tp", "2",
                          "--flashinfer-allreduce-fusion-backend", "auto"});
  EXPECT_THAT(one.out, StartsWith("{\"backend\":\"mnnvl\",\"fusion_enabled\":true,"));
  Result two = RunBinary({"resolve", "--sm", "90", "--nnodes", "2", "--tp", "2",
                          "--flashinfer-allreduce-fusion-backend", "auto"});
  EXPECT_THAT(two.out, StartsWith("{\"backend\":\"trtllm\",\"fusion_enabled\":false,"));
  EXPECT_THAT(two.out, HasSubstr("trtllm needs every rank on one node"));
}

TEST(ArfusectlResolve, OutputHasEveryContractKey) {
  Result r = RunBinary({"resolve", "--sm", "100", "--nnodes", "1", "--tp", "2", "--cuda-graph-mode",
                        "piecewise", "--mnnvl-capture-safe=false", "--model-architecture",
                        "DeepseekV3ForCausalLM"});
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* key :
       {"\"backend\":\"mnnvl\"", "\"fusion_enabled\":true", "\"cuda_graph_mode\":\"none\"",
        "\"data_plane\":\"eager\"", "\"prefill\":{\"cuda_graph_mode\":\"none\"",
        "\"decode\":{\"cuda_graph_mode\":\"none\"", "\"max_tokens_per_batch\":2048",
        "\"fusion_rules\":\"sglang-23402\"", "\"warnings\":[", "\"notices\":[", "\"reasons\":["}) {
    EXPECT_THAT(r.out, HasSubstr(key));
  }
  EXPECT_THAT(r.out, HasSubstr("piecewise CUDA graphs turned off"));
  // One JSON object on one line.
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1);
  EXPECT_EQ(r.out.front(), '{');
}

TEST(ArfusectlResolve, NegotiationOptions) {
  Result safe =
      RunBinary({"resolve", "--sm", "100", "--nnodes", "1", "--tp", "2", "--cuda-graph-mode",
                 "piecewise", "--model-architecture", "Qwen3_5MoeForConditionalGeneration"});
  EXPECT_THAT(safe.out, HasSubstr("\"cuda_graph_mode\":\"piecewise\",\"data_plane\":\"doorbell\""));
  Result trt = RunBinary({"resolve", "--sm", "90", "--nnodes", "1", "--tp", "2",
                          "--flashinfer-allreduce-fusion-backend", "trtllm", "--cuda-graph-mode",
                          "piecewise", "--mnnvl-capture-safe=false"});
  EXPECT_THAT(trt.out, HasSubstr("\"cuda_graph_mode\":\"piecewise\""));
  Result split = RunBinary({"resolve", "--sm", "90", "--nnodes", "1", "--tp", "2",
                            "--flashinfer-allreduce-fusion-backend", "trtllm", "--cuda-graph-mode",
                            "full", "--fused-op-in-graph=false"});
  EXPECT_THAT(split.out, HasSubstr("\"cuda_graph_mode\":\"full\",\"data_plane\":\"eager\""));
  // Per phase (SGLang #23402): capture-unsafe mnnvl loses its piecewise prefill graphs only.
  Result phases =
      RunBinary({"resolve", "--sm", "100", "--nnodes", "1", "--tp", "2",
                 "--flashinfer-allreduce-fusion-backend", "mnnvl", "--prefill-cuda-graph-mode",
                 "piecewise", "--decode-cuda-graph-mode", "full", "--mnnvl-capture-safe=false"});
  ASSERT_EQ(phases.code, 0) << phases.err;
  EXPECT_THAT(phases.out,
              HasSubstr("\"cuda_graph_mode\":\"none\",\"data_plane\":\"eager\",\"prefill\":{"
                        "\"cuda_graph_mode\":\"none\",\"data_plane\":\"eager\"},\"decode\":{"
                        "\"cuda_graph_mode\":\"full\",\"data_plane\":\"doorbell\"}"));
  EXPECT_THAT(phases.out, HasSubstr("prefill: mnnvl kernels are not capture-safe"));
}

TEST(ArfusectlResolve, DeterministicAndEnforceDisable) {
  Result det = RunBinary({"resolve", "--sm", "100", "--nnodes", "1", "--tp", "2",
                          "--flashinfer-allreduce-fusion-backend", "mnnvl",
                          "--enable-deterministic-inference"});
  EXPECT_EQ(det.code, 0);
  EXPECT_THAT(det.out, StartsWith("{\"backend\":\"none\",\"fusion_enabled\":false"));
  EXPECT_THAT(det.out, HasSubstr("--enable-deterministic-inference clears the backend"));
  Result off = RunBinary({"resolve", "--sm", "100", "--nnodes", "1", "--tp", "2",
                          "--enforce-disable-flashinfer-allreduce-fusion"});
  EXPECT_THAT(off.out, StartsWith("{\"backend\":\"none\",\"fusion_enabled\":false"));
  // Negative: =false switches do nothing.
  Result not_off = RunBinary({"resolve", "--sm", "100", "--nnodes", "1", "--tp", "2",
                              "--enforce-disable-flashinfer-allreduce-fusion=false",
                              "--enable-deterministic-inference=false", "--model-architecture",
                              "DeepseekV32ForCausalLM"});
  EXPECT_THAT(not_off.out, StartsWith("{\"backend\":\"mnnvl\",\"fusion_enabled\":true"));
}

// Migration in every order: each permutation of the arguments gives the same answer.
TEST(ArfusectlResolve, MigrationInEveryArgumentOrder) {
  struct Case {
    std::vector<std::vector<std::string>> groups;
    std::string backend;
    std::string warning;
  };
  const Case cases[] = {
      {{{"--enable-flashinfer-allreduce-fusion"},
        {"--flashinfer-allreduce-fusion-backend", "trtllm"},
        {"--sm", "90"},
        {"--tp=2"},
        {"--nnodes", "1"}},
       "trtllm",
       // An explicit backend beside the deprecated flag is silent (SGLang _handle_deprecated_args).
       "\"warnings\":[]"},
      {{{"--enable-flashinfer-allreduce-fusion"}, {"--sm=90"}, {"--tp", "2"}, {"--nnodes=1"}},
       "mnnvl",
       "--enable-flashinfer-allreduce-fusion is deprecated. Please use "
       "--flashinfer-allreduce-fusion-backend=auto instead."},
      {{{"--enable-flashinfer-allreduce-fusion"},
        {"--enforce-disable-flashinfer-allreduce-fusion"},
        {"--sm", "100"},
        {"--tp", "2"},
        {"--nnodes", "1"}},
       "none",
       "overrides --flashinfer-allreduce-fusion-backend=auto"},
  };
  for (const Case& c : cases) {
    std::vector<int> order(c.groups.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    std::string first;
    int permutations = 0;
    do {
      std::vector<std::string> args = {"resolve"};
      for (int i : order) args.insert(args.end(), c.groups[i].begin(), c.groups[i].end());
      Result r = RunInProcess(args);
      ASSERT_EQ(r.code, 0) << absl::StrJoin(args, " ") << ": " << r.err;
      if (first.empty()) first = r.out;
      EXPECT_EQ(r.out, first) << absl::StrJoin(args, " ");
      ++permutations;
    } while (std::next_permutation(order.begin(), order.end()));
    EXPECT_GE(permutations, 24);
    EXPECT_THAT(first, StartsWith(absl::StrCat("{\"backend\":\"", c.backend, "\"")));
    EXPECT_THAT(first, HasSubstr(c.warning));
  }
}

TEST(ArfusectlResolve, JsonSwitchGivesTheSameObject) {
  Result plain = RunBinary({"resolve", "--sm", "90", "--nnodes", "1", "--tp", "2"});
  Result json = RunBinary({"resolve", "--sm", "90", "--nnodes", "1", "--tp", "2", "--json"});
  EXPECT_EQ(plain.code, 0);
  EXPECT_EQ(plain.out, json.out);
}

// Invalid input: exit 2, exactly one line on stderr that says what is wrong, nothing on stdout.
TEST(ArfusectlResolve, InvalidInputExitsTwoWithOneClearLine) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<std::string> topo = {"--sm", "90", "--nnodes", "1", "--tp", "2"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = {"resolve"};
    a.insert(a.end(), topo.begin(), topo.end());
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const Case cases[] = {
      {with({"--flashinfer-allreduce-fusion-backend", "nccl"}),
       "unknown --flashinfer-allreduce-fusion-backend value \"nccl\": expected auto, trtllm or "
       "mnnvl"},
      {{"resolve", "--sm", "90", "--nnodes", "1", "--tp", "0"}, "--tp must be >= 1, got 0"},
      {{"resolve", "--sm", "90", "--nnodes", "0", "--tp", "2"}, "--nnodes must be >= 1, got 0"},
      {{"resolve", "--sm", "abc", "--nnodes", "1", "--tp", "2"}, "--sm \"abc\" is not a number"},
      {{"resolve", "--sm", "9.0", "--nnodes", "1", "--tp", "2"}, "--sm \"9.0\" is not a number"},
      {{"resolve", "--nnodes", "1", "--tp", "2"}, "--sm is required"},
      {{"resolve", "--sm", "90", "--tp", "2"}, "--nnodes is required"},
      {with({"--bogus"}), "unknown option --bogus for 'arfusectl resolve'"},
      {with({"--cuda-graph-mode", "partial"}), "unknown --cuda-graph-mode \"partial\""},
      {with({"--mnnvl-capture-safe=maybe"}), "--mnnvl-capture-safe \"maybe\" is not a boolean"},
      {with({"--json=yes"}), "--json=yes: expected --json"},
      {with({"--tp", "4"}), "--tp given more than once"},
      {with({"extra"}), "unexpected argument \"extra\""},
      {{"resolve", "--sm", "90", "--nnodes", "1", "--tp"}, "--tp needs a value"},
      {with({"--timeout-ms", "10"}), "--timeout-ms needs --addr"},
      {{"frobnicate"}, "unknown command \"frobnicate\""},
      {{"set-backend"},
       "set-backend needs a backend: arfusectl set-backend auto|trtllm|mnnvl|none"},
      {{"set-backend", "nccl"}, "unknown backend \"nccl\": expected auto, trtllm, mnnvl or none"},
      {{"set-backend", "mnnvl", "extra"}, "unexpected argument \"extra\""},
      {{"set-backend", "mnnvl", "--backend=none"}, "--backend given more than once"},
      {{"stats", "--rank", "x"}, "--rank: \"x\" is not a rank (0, 1, ...)"},
      {{"stats", "--ranks", "0,1", "--all"}, "give one of --rank, --ranks and --all"},
      {{"stats", "--rank", "0,1"}, "--rank takes one rank; use --ranks N,M,..."},
      {{"info", "--rank", "1", "--addr", "127.0.0.1:9310"}, "--addr must be one Unix socket"},
      // The world-size and rule-set options (docs/config.md, "World sizes").
      {with({"--fusion-rules", "sglang-latest"}),
       "unknown --fusion-rules value \"sglang-latest\": expected sglang-23402 or sglang-29063"},
      {with({"--model-architecture", "Deepseek V3"}),
       "--model-architecture \"Deepseek V3\" is not an architecture name"},
      {with({"--model-architecture="}), "--model-architecture \"\" is not an architecture name"},
      {with({"--moe-a2a-backend", "nccl"}), "unknown --moe-a2a-backend value \"nccl\""},
      {with({"--enable-dp-attention=maybe"}), "--enable-dp-attention=maybe: expected"},
      {with({"--prefill-cuda-graph-mode", "partial"}),
       "unknown --prefill-cuda-graph-mode \"partial\""},
      {with({"--decode-cuda-graph-mode=eager"}), "unknown --decode-cuda-graph-mode \"eager\""},
      {{"resolve", "--sm", "90", "--nnodes", "4", "--tp", "2"}, "nnodes 4 is more than tp 2"},
      {with({"--cuda-graph-mode", "full", "--cuda-graph-mode", "none"}),
       "--cuda-graph-mode given more than once"},
  };
  for (const Case& c : cases) {
    Result r = RunBinary(c.args);
    EXPECT_EQ(r.code, 2) << absl::StrJoin(c.args, " ");
    EXPECT_THAT(r.out, IsEmpty()) << absl::StrJoin(c.args, " ");
    EXPECT_THAT(r.err, StartsWith("arfusectl: ")) << absl::StrJoin(c.args, " ");
    EXPECT_THAT(r.err, HasSubstr(c.message)) << absl::StrJoin(c.args, " ");
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

// The binaries' one flag library's spellings (underscores, --noswitch); in process, one run's
// options do not carry into the next (the abseil flags behind them are global).
TEST(ArfusectlResolve, TakesTheFlagLibrarysSpellings) {
  Result underscored =
      RunInProcess({"resolve", "--sm=90", "--nnodes", "1", "--tp", "2",
                    "--flashinfer_allreduce_fusion_backend", "trtllm", "--enable_dp_attention"});
  EXPECT_EQ(underscored.code, 0) << underscored.err;
  EXPECT_THAT(underscored.out, StartsWith("{\"backend\":\"trtllm\",\"fusion_enabled\":false"));
  Result next = RunInProcess({"resolve", "--sm=90", "--nnodes", "1", "--tp", "2",
                              "--flashinfer-allreduce-fusion-backend=trtllm", "--nojson"});
  EXPECT_EQ(next.code, 0) << next.err;
  EXPECT_THAT(next.out, StartsWith("{\"backend\":\"trtllm\",\"fusion_enabled\":true"));
}

// argparse semantics for the frameworks' fusion flags: the last value wins.
TEST(ArfusectlResolve, RepeatedFusionFlagTakesTheLastValue) {
  const std::vector<std::string> topo = {"resolve", "--sm", "90", "--nnodes", "1", "--tp", "2"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = topo;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  Result last = RunBinary(with({"--flashinfer-allreduce-fusion-backend=mnnvl",
                                "--flashinfer-allreduce-fusion-backend", "trtllm"}));
  EXPECT_EQ(last.code, 0) << last.err;
  EXPECT_THAT(last.out, StartsWith("{\"backend\":\"trtllm\",\"fusion_enabled\":true"));
  // Every occurrence is checked, as argparse checks each against its choices.
  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"--flashinfer-allreduce-fusion-backend=trtllm",
                                 "--flashinfer-allreduce-fusion-backend=nccl"},
        std::vector<std::string>{"--flashinfer-allreduce-fusion-backend=nccl",
                                 "--flashinfer-allreduce-fusion-backend=trtllm"},
        std::vector<std::string>{"--fusion-rules=sglang-1", "--fusion-rules=sglang-29063"}}) {
    Result r = RunBinary(with(bad));
    EXPECT_EQ(r.code, 2) << absl::StrJoin(bad, " ");
    EXPECT_THAT(r.err, ::testing::AnyOf(HasSubstr("\"nccl\""), HasSubstr("\"sglang-1\"")));
  }
  Result rules = RunBinary(with({"--flashinfer-allreduce-fusion-backend=auto",
                                 "--fusion-rules=sglang-23402", "--fusion-rules=sglang-29063"}));
  EXPECT_THAT(rules.out, StartsWith("{\"backend\":\"trtllm\""));  // SM90 auto under 29063
  Result dp = RunBinary(with({"--flashinfer-allreduce-fusion-backend=trtllm",
                              "--enable-dp-attention", "--enable-dp-attention=false"}));
  EXPECT_THAT(dp.out, StartsWith("{\"backend\":\"trtllm\",\"fusion_enabled\":true"));
  Result safe =
      RunBinary(with({"--flashinfer-allreduce-fusion-backend=mnnvl", "--cuda-graph-mode=piecewise",
                      "--mnnvl-capture-safe=false", "--mnnvl-capture-safe=true"}));
  EXPECT_THAT(safe.out, HasSubstr("\"cuda_graph_mode\":\"piecewise\""));
}

// SGLang's rules case by case, both rule sets, through the binary: the library's JSON, or exit 2
// with the library's message (upstream's ValueError text under sglang-29063).
TEST(ArfusectlResolve, UpstreamCasesGiveTheLibrarysAnswers) {
  for (const testing::UpstreamCase& c : testing::UpstreamCases()) {
    std::vector<std::string> args = {"resolve"};
    for (const std::string& a : testing::CaseArgs(c)) args.push_back(a);
    args.push_back("--json");
    Result r = RunBinary(args);
    absl::StatusOr<config::Decision> d = config::Resolve(c.flags, c.topology, {});
    if (c.where == testing::Where::kError) {
      EXPECT_EQ(r.code, 2) << testing::CaseName(c);
      EXPECT_THAT(r.err, HasSubstr(c.text)) << testing::CaseName(c);
      EXPECT_EQ(r.err, absl::StrCat("arfusectl: ", d.status().message(), "\n"));
      EXPECT_THAT(r.out, IsEmpty());
      continue;
    }
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(r.code, 0) << testing::CaseName(c) << "\n" << r.err;
    EXPECT_EQ(r.out, config::DecisionToJson(*d) + "\n") << testing::CaseName(c);
    EXPECT_THAT(r.out,
                StartsWith(absl::StrCat("{\"backend\":\"", c.backend,
                                        "\",\"fusion_enabled\":", c.fused ? "true" : "false")))
        << testing::CaseName(c);
  }
}

TEST(ArfusectlCli, HelpAndUsage) {
  Result help = RunBinary({"--help"});
  EXPECT_EQ(help.code, 0);
  EXPECT_THAT(help.out, HasSubstr("resolve"));
  EXPECT_THAT(help.out, HasSubstr("health"));
  Result resolve_help = RunBinary({"resolve", "--help"});
  EXPECT_EQ(resolve_help.code, 0);
  EXPECT_THAT(resolve_help.out, HasSubstr("--flashinfer-allreduce-fusion-backend"));
  EXPECT_THAT(resolve_help.out, HasSubstr("--mnnvl-capture-safe=true|false"));
  Result none = RunBinary({});
  EXPECT_EQ(none.code, 2);
  EXPECT_THAT(none.err, HasSubstr("usage: arfusectl"));
  Result version = RunBinary({"version"});
  EXPECT_EQ(version.code, 0);
  EXPECT_THAT(version.out, HasSubstr("api 1.1"));
  Result dash_version = RunBinary({"--version"});
  EXPECT_EQ(dash_version.code, 0);
  EXPECT_EQ(dash_version.out, version.out);
  EXPECT_THAT(dash_version.out, StartsWith(absl::StrCat("arfusectl ", kVersion, " (")));
}

TEST(ArfusectlCli, DefaultAddress) {
  const char* saved = std::getenv("XDG_RUNTIME_DIR");
  const std::string restore = saved ? saved : "";
  setenv("XDG_RUNTIME_DIR", "/run/user/1234", 1);
  EXPECT_EQ(cli::DefaultAddress(), "unix:/run/user/1234/arfuse/arfused.sock");
  unsetenv("XDG_RUNTIME_DIR");
  EXPECT_EQ(cli::DefaultAddress(), "unix:/run/arfuse/arfused.sock");
  if (saved != nullptr) setenv("XDG_RUNTIME_DIR", restore.c_str(), 1);
}

// ---- against a running server ----

// Answers GetWorkspaceInfo with fixed values and records what the client sent.
class FakeFusion final : public v1::Fusion::CallbackService {
 public:
  grpc::ServerUnaryReactor* GetWorkspaceInfo(grpc::CallbackServerContext* context,
                                             const v1::GetWorkspaceInfoRequest*,
                                             v1::GetWorkspaceInfoResponse* response) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = context->client_metadata().find("arfuse-api-version");
      api_version_ = it == context->client_metadata().end()
                         ? "<none>"
                         : std::string(it->second.data(), it->second.size());
      deadline_ = context->deadline();
    }
    response->set_backend("mnnvl");
    response->set_fusion_enabled(true);
    response->set_reason("auto resolved to mnnvl for sm 100 on one node");
    response->set_state(v1::WORKSPACE_STATE_READY);
    response->set_generation(3);
    response->set_rank(1);
    response->set_world_size(2);
    response->set_nnodes(1);
    response->set_max_tokens(2048);
    response->set_hidden(4096);
    response->set_dtype(v1::DTYPE_BF16);
    response->set_workspace_bytes(12582912);
    response->set_device(v1::DEVICE_KIND_CUDA);
    response->set_mps_detected(true);
    response->set_doorbell_hop_us(2.5);
    response->set_sm(100);
    {
      std::lock_guard<std::mutex> lock(mu_);
      *response->mutable_instream_ops() = ops_;
      *response->mutable_instream_divergence() = divergence_;
    }
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  std::string api_version() {
    std::lock_guard<std::mutex> lock(mu_);
    return api_version_;
  }
  void set_ops(const v1::InStreamOps& ops) {
    std::lock_guard<std::mutex> lock(mu_);
    ops_ = ops;
  }
  void set_divergence(const v1::InStreamDivergence& d) {
    std::lock_guard<std::mutex> lock(mu_);
    divergence_ = d;
  }
  std::chrono::system_clock::time_point deadline() {
    std::lock_guard<std::mutex> lock(mu_);
    return deadline_;
  }

 private:
  std::mutex mu_;
  std::string api_version_;
  std::chrono::system_clock::time_point deadline_;
  v1::InStreamOps ops_;
  v1::InStreamDivergence divergence_;
};

// arfused's front, minus the data path: Config (real), Fusion (fake info), health.
class Sidecar {
 public:
  explicit Sidecar(bool with_fusion = true, bool decided = true) : config_(Options(decided)) {
    mkdir((dir_.path() + "/arfuse").c_str(), 0700);
    addr_ = absl::StrCat("unix:", dir_.path(), "/arfuse/arfused.sock");
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort(addr_, grpc::InsecureServerCredentials());
    builder.RegisterService(&config_);
    if (with_fusion) builder.RegisterService(&fusion_);
    server_ = builder.BuildAndStart();
    server_->GetHealthCheckService()->SetServingStatus(true);
    server_->GetHealthCheckService()->SetServingStatus("arfuse.v1.Fusion", false);
  }
  ~Sidecar() { server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5)); }

  const std::string& addr() const { return addr_; }
  const std::string& xdg() const { return dir_.path(); }
  FakeFusion& fusion() { return fusion_; }
  bool started() const { return server_ != nullptr; }

 private:
  static ConfigServiceOptions Options(bool decided) {
    ConfigServiceOptions o;
    o.topology = config::Topology{100, 2, 1};
    ConfigSnapshot snap;
    config::FusionFlags auto_flags;
    auto_flags.backend = "auto";
    snap.decision = *config::ResolveBackend(auto_flags, o.topology);
    snap.device = v1::DEVICE_KIND_CUDA;
    snap.rank = 1;
    snap.world_size = 2;
    snap.mps_detected = true;
    snap.doorbell_hop_us = 2.5;
    o.snapshot = [snap, decided]() -> absl::StatusOr<ConfigSnapshot> {
      if (!decided) return absl::UnavailableError("the group has not decided yet: rank 1 missing");
      return snap;
    };
    return o;
  }

  TempDir dir_;
  std::string addr_;
  ConfigService config_;
  FakeFusion fusion_;
  std::unique_ptr<grpc::Server> server_;
};

TEST(ArfusectlRemote, ResolveThroughArfusedMatchesLocal) {
  Sidecar sidecar;
  ASSERT_TRUE(sidecar.started());
  const std::vector<std::vector<std::string>> cases = {
      {"--sm", "100", "--nnodes", "2", "--tp", "8", "--flashinfer-allreduce-fusion-backend",
       "auto"},
      {"--sm", "90", "--nnodes", "2", "--tp", "2", "--flashinfer-allreduce-fusion-backend",
       "mnnvl"},
      {"--sm", "90", "--nnodes", "1", "--tp", "2", "--enable-flashinfer-allreduce-fusion",
       "--cuda-graph-mode", "full"},
      {"--sm", "100", "--nnodes", "1", "--tp", "2", "--cuda-graph-mode", "piecewise",
       "--mnnvl-capture-safe=false"},
      {"--sm", "80", "--nnodes", "1", "--tp", "2", "--flashinfer-allreduce-fusion-backend",
       "trtllm"},
      {"--sm", "103", "--nnodes", "1", "--tp", "1"},
      {"--sm", "100", "--nnodes", "1", "--tp", "4", "--enable-deterministic-inference"},
  };
  for (const std::vector<std::string>& c : cases) {
    std::vector<std::string> local = {"resolve"};
    local.insert(local.end(), c.begin(), c.end());
    std::vector<std::string> remote = local;
    remote.push_back("--addr");
    remote.push_back(sidecar.addr());
    Result l = RunBinary(local);
    Result r = RunBinary(remote);
    EXPECT_EQ(l.code, 0) << l.err;
    EXPECT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.out, l.out) << absl::StrJoin(c, " ");
  }
  // SGLang's rules case by case through a running arfused (Config.Resolve): the same output as
  // locally, or exit 2 with the same message (the server's address appended).
  for (const testing::UpstreamCase& c : testing::UpstreamCases()) {
    std::vector<std::string> local = {"resolve"};
    for (const std::string& a : testing::CaseArgs(c)) local.push_back(a);
    std::vector<std::string> remote = local;
    remote.push_back("--addr");
    remote.push_back(sidecar.addr());
    Result l = RunBinary(local);
    Result r = RunBinary(remote);
    EXPECT_EQ(r.code, l.code) << testing::CaseName(c);
    EXPECT_EQ(r.out, l.out) << testing::CaseName(c);
    if (c.where == testing::Where::kError) {
      EXPECT_THAT(r.err, HasSubstr(c.text)) << testing::CaseName(c);
      EXPECT_THAT(r.err, HasSubstr(absl::StrCat("(from ", sidecar.addr(), ")")));
    }
  }
  // Without --fusion-rules a remote answer follows the server's rule set (sglang-23402 here).
  Result server_rules =
      RunBinary({"resolve", "--sm", "90", "--nnodes", "1", "--tp", "2",
                 "--flashinfer-allreduce-fusion-backend", "auto", "--addr", sidecar.addr()});
  EXPECT_THAT(server_rules.out, HasSubstr("\"fusion_rules\":\"sglang-23402\""));

  // Without a topology the server's own (sm 100, tp 2, one node) is used.
  Result own = RunBinary({"resolve", "--addr", sidecar.addr()});
  EXPECT_EQ(own.code, 0) << own.err;
  EXPECT_EQ(own.out, ExpectedJson({}, {100, 2, 1}));
  // A partial topology is refused before any call.
  Result partial = RunBinary({"resolve", "--addr", sidecar.addr(), "--sm", "90"});
  EXPECT_EQ(partial.code, 2);
  EXPECT_THAT(partial.err, HasSubstr("give --sm, --nnodes and --tp together"));
}

TEST(ArfusectlRemote, UnreachableServerExitsThreeNamingTheAddress) {
  TempDir dir;
  const std::string addr = absl::StrCat("unix:", dir.path(), "/nobody.sock");
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"health", "--addr", addr}, {"info", "--addr", addr}, {"resolve", "--addr", addr}}) {
    Result r = RunBinary(args);
    EXPECT_EQ(r.code, 3) << args[0];
    EXPECT_THAT(r.err, HasSubstr(absl::StrCat("cannot reach arfused at ", addr))) << args[0];
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

TEST(ArfusectlHealth, ServingNotServingUnknown) {
  Sidecar sidecar;
  ASSERT_TRUE(sidecar.started());
  Result serving = RunBinary({"health", "--addr", sidecar.addr()});
  EXPECT_EQ(serving.code, 0) << serving.err;
  EXPECT_EQ(serving.out, "SERVING\n");

  Result not_serving =
      RunBinary({"health", "--addr", sidecar.addr(), "--service", "arfuse.v1.Fusion"});
  EXPECT_EQ(not_serving.code, 1);
  EXPECT_EQ(not_serving.out, "NOT_SERVING\n");
  EXPECT_THAT(not_serving.err, HasSubstr("service \"arfuse.v1.Fusion\" is NOT_SERVING"));

  Result unknown = RunBinary({"health", "--addr", sidecar.addr(), "--service", "nope", "--json"});
  EXPECT_EQ(unknown.code, 1);
  EXPECT_EQ(unknown.out, absl::StrCat("{\"addr\":\"", sidecar.addr(),
                                      "\",\"service\":\"nope\",\"status\":\"SERVICE_UNKNOWN\"}\n"));

  Result usage = RunBinary({"health", "--addr", sidecar.addr(), "--tp", "2"});
  EXPECT_EQ(usage.code, 2);
  EXPECT_THAT(usage.err, HasSubstr("unknown option --tp for 'arfusectl health'"));
  Result empty = RunBinary({"health", "--addr="});
  EXPECT_EQ(empty.code, 2);
  EXPECT_THAT(empty.err, HasSubstr("--addr must not be empty"));
}

TEST(ArfusectlHealth, DefaultAddressFollowsXdgRuntimeDir) {
  Sidecar sidecar;
  ASSERT_TRUE(sidecar.started());
  Result r = RunBinary({"health"}, sidecar.xdg());
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "SERVING\n");
}

TEST(ArfusectlInfo, HumanReadableAndJson) {
  Sidecar sidecar;
  ASSERT_TRUE(sidecar.started());
  const auto before = std::chrono::system_clock::now();
  Result human = RunBinary({"info", "--addr", sidecar.addr()});
  ASSERT_EQ(human.code, 0) << human.err;
  EXPECT_THAT(human.out, HasSubstr("rank 1 of 2, 1 node, device cuda, sm 100"));
  EXPECT_THAT(human.out, HasSubstr("backend mnnvl, fusion enabled, state READY, generation 3"));
  EXPECT_THAT(human.out, HasSubstr("workspace 12582912 bytes (12.0 MiB), max_tokens 2048"));
  EXPECT_THAT(human.out, HasSubstr("MPS detected, doorbell hop 2.5 us"));
  EXPECT_THAT(human.out, HasSubstr("negotiation: cuda_graph_mode none, data plane eager"));
  // The client sent its API version and a bounded deadline.
  EXPECT_EQ(sidecar.fusion().api_version(), "1.1");
  EXPECT_LT(sidecar.fusion().deadline(), before + std::chrono::seconds(60));

  Result json =
      RunBinary({"info", "--addr", sidecar.addr(), "--json", "--cuda-graph-mode", "full"});
  ASSERT_EQ(json.code, 0) << json.err;
  EXPECT_THAT(json.out, HasSubstr("\"workspace_bytes\":12582912"));
  EXPECT_THAT(json.out, HasSubstr("\"state\":\"READY\""));
  EXPECT_THAT(json.out, HasSubstr("\"negotiation\":{\"backend\":\"mnnvl\",\"fusion_enabled\":true,"
                                  "\"cuda_graph_mode\":\"full\",\"data_plane\":\"doorbell\""));
  EXPECT_EQ(std::count(json.out.begin(), json.out.end(), '\n'), 1);
}

// The in-stream clients' ops as the sidecar counted them: the fused share and the top decline
// reasons (at most three, as the sidecar ordered them: largest first); every series in --json.
TEST(ArfusectlInfo, ShowsTheFusedShareAndTheTopDeclineReasons) {
  Sidecar sidecar;
  ASSERT_TRUE(sidecar.started());
  Result none = RunBinary({"info", "--addr", sidecar.addr()});
  ASSERT_EQ(none.code, 0) << none.err;
  EXPECT_THAT(none.out, HasSubstr("\n  in-stream ops: none counted\n"));
  Result none_json = RunBinary({"info", "--addr", sidecar.addr(), "--json"});
  EXPECT_THAT(none_json.out,
              HasSubstr("\"instream_ops\":{\"fused\":0,\"declined\":0,\"fused_share\":null,"
                        "\"fused_by_bucket\":[],\"declined_by_reason\":[],"
                        "\"kernel_counted\":false}"));
  EXPECT_THAT(none.out, HasSubstr("\n  in-stream divergence: none found\n"));
  EXPECT_THAT(none_json.out,
              HasSubstr("\"instream_divergence\":{\"total\":0,\"last_rank\":0,\"last_ops\":0,"
                        "\"last_reasons\":\"\"}"));

  v1::InStreamOps ops;
  ops.set_fused_total(90);
  ops.set_declined_total(10);
  auto fused = [&](const char* pattern, const char* tokens, uint64_t n) {
    v1::InStreamOps::Fused* f = ops.add_fused();
    f->set_pattern(pattern);
    f->set_tokens(tokens);
    f->set_count(n);
  };
  fused("allreduce_residual_rmsnorm", "1", 60);
  fused("allreduce_residual_rmsnorm", "9-64", 30);
  for (auto [reason, n] : std::vector<std::pair<const char*, uint64_t>>{
           {"range", 5}, {"dtype", 3}, {"disabled", 1}, {"shape", 1}}) {
    v1::InStreamOps::Declined* d = ops.add_declined();
    d->set_reason(reason);
    d->set_count(n);
  }
  sidecar.fusion().set_ops(ops);
  Result human = RunBinary({"info", "--addr", sidecar.addr()});
  ASSERT_EQ(human.code, 0) << human.err;
  EXPECT_THAT(human.out, HasSubstr("\n  in-stream ops: 90 fused (90.0%), 10 declined; top "
                                   "declines: range 5, dtype 3, disabled 1\n"));
  Result json = RunBinary({"info", "--addr", sidecar.addr(), "--json"});
  ASSERT_EQ(json.code, 0) << json.err;
  EXPECT_THAT(json.out,
              HasSubstr("\"instream_ops\":{\"fused\":90,\"declined\":10,\"fused_share\":0.9000,"
                        "\"fused_by_bucket\":[{\"pattern\":\"allreduce_residual_rmsnorm\","
                        "\"tokens\":\"1\",\"count\":60},{\"pattern\":"
                        "\"allreduce_residual_rmsnorm\",\"tokens\":\"9-64\",\"count\":30}],"
                        "\"declined_by_reason\":[{\"reason\":\"range\",\"count\":5},"
                        "{\"reason\":\"dtype\",\"count\":3},{\"reason\":\"disabled\","
                        "\"count\":1},{\"reason\":\"shape\",\"count\":1}],"
                        "\"kernel_counted\":false}"));

  // On CUDA the fused counts are the kernels' own, and a divergence the sidecars found is an
  // error line of its own.
  ops.set_kernel_counted(true);
  sidecar.fusion().set_ops(ops);
  v1::InStreamDivergence d;
  d.set_total(2);
  d.set_last_rank(3);
  d.set_last_ops(7);
  d.set_last_reasons("other 5, dtype 2");
  sidecar.fusion().set_divergence(d);
  Result cuda = RunBinary({"info", "--addr", sidecar.addr()});
  ASSERT_EQ(cuda.code, 0) << cuda.err;
  EXPECT_THAT(cuda.out, HasSubstr("in-stream ops: 90 fused (90.0%, counted by the kernels), 10 "
                                  "declined"));
  EXPECT_THAT(cuda.out, HasSubstr("\n  in-stream divergence: ERROR, found 2 time(s); last: rank 3 "
                                  "declined 7 op(s) its peers fused (top declines: other 5, "
                                  "dtype 2)\n"));
  Result cuda_json = RunBinary({"info", "--addr", sidecar.addr(), "--json"});
  ASSERT_EQ(cuda_json.code, 0) << cuda_json.err;
  EXPECT_THAT(cuda_json.out, HasSubstr("\"kernel_counted\":true}"));
  EXPECT_THAT(cuda_json.out,
              HasSubstr("\"instream_divergence\":{\"total\":2,\"last_rank\":3,\"last_ops\":7,"
                        "\"last_reasons\":\"other 5, dtype 2\"}"));
}

TEST(ArfusectlInfo, ServerWithoutFusionServiceIsAFailure) {
  Sidecar sidecar(/*with_fusion=*/false);
  ASSERT_TRUE(sidecar.started());
  Result r = RunBinary({"info", "--addr", sidecar.addr()});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("Fusion.GetWorkspaceInfo at " + sidecar.addr() + " failed"));
  EXPECT_THAT(r.err, HasSubstr("UNIMPLEMENTED"));
}

TEST(ArfusectlInfo, UndecidedGroupShowsTheWorkspaceAndFails) {
  Sidecar sidecar(/*with_fusion=*/true, /*decided=*/false);
  ASSERT_TRUE(sidecar.started());
  Result r = RunBinary({"info", "--addr", sidecar.addr()});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.out, HasSubstr("workspace 12582912 bytes"));
  EXPECT_THAT(r.out, HasSubstr("negotiation: not available"));
  EXPECT_THAT(r.err, HasSubstr("Config.Negotiate at " + sidecar.addr() +
                               " failed: UNAVAILABLE: the group has not decided yet"));
  Result json = RunBinary({"info", "--addr", sidecar.addr(), "--json"});
  EXPECT_EQ(json.code, 1);
  EXPECT_THAT(json.out, HasSubstr("\"negotiation\":null,\"negotiation_error\":\"UNAVAILABLE: "));
}

// Answers GetStats with a status of its own, as a sidecar answers a collective that timed out.
class DeadlineAdmin final : public v1::Admin::CallbackService {
 public:
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const v1::GetStatsRequest*, v1::GetStatsResponse*) override {
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                 "collective 'x' timed out: rank 1 did not call"));
    return reactor;
  }
};

// The sidecar's DEADLINE_EXCEEDED is its answer (exit 1, its message), not our own timeout.
TEST(ArfusectlAdmin, AServersDeadlineExceededIsItsAnswer) {
  TempDir dir;
  const std::string addr = absl::StrCat("unix:", dir.path(), "/arfused.sock");
  DeadlineAdmin admin;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(addr, grpc::InsecureServerCredentials());
  builder.RegisterService(&admin);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  Result r = RunBinary({"stats", "--addr", addr, "--timeout-ms", "30000"});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("Admin.GetStats at " + addr +
                               " failed: DEADLINE_EXCEEDED: collective 'x' timed out"));
  EXPECT_THAT(r.err, Not(HasSubstr("within 30000 ms")));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

}  // namespace
}  // namespace arfuse
