// arfused's --config files (YAML, as vLLM's and SGLang's --config take them; the older name=value
// lines with a warning) and --log-format=json, through the binary.
#include <signal.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/daemon/daemon_test_util.h"
#include "tests/support/daemon_process.h"
#include "tests/support/subprocess.h"

namespace arfuse {
namespace {

using ::arfuse::testing::ArfusedPath;
using ::arfuse::testing::ExitsWith2;
using ::arfuse::testing::MakeTempDir;
using ::testing::HasSubstr;
using ::testing::Not;
using Daemon = ::arfuse::testing::DaemonProcess;
using namespace std::chrono_literals;

std::string Write(const std::string& name, const std::string& text) {
  const std::string path = MakeTempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(ConfigFile, YamlKeysAreFlagNamesWithDashesOrUnderscores) {
  const std::string path = Write("arfused.yaml",
                                 "# as vLLM's --config\n"
                                 "group: from-yaml\n"
                                 "max_tokens: 64\n"
                                 "hidden: 1024\n"
                                 "--dtype: fp16\n"
                                 "allowed-uids: [1000, 1001]\n"
                                 "allowed_gids:\n  - 2000\n"
                                 "mnnvl-capture-safe: false\n");
  Daemon d({"--config=" + path, "--hidden=512"}, {"ARFUSE_MAX_TOKENS=128"});
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  const std::string log = d.proc->Stderr();
  EXPECT_THAT(log, HasSubstr("group=from-yaml(file)"));
  EXPECT_THAT(log, HasSubstr("dtype=fp16(file)"));
  EXPECT_THAT(log, HasSubstr("allowed_uids=1000,1001(file)"));
  EXPECT_THAT(log, HasSubstr("allowed_gids=2000(file)"));
  EXPECT_THAT(log, HasSubstr("mnnvl_capture_safe=false(file)"));
  // Precedence: command line, then environment, then the file.
  EXPECT_THAT(log, HasSubstr("max_tokens=128(env)"));
  EXPECT_THAT(log, HasSubstr("hidden=512(cli)"));
  EXPECT_THAT(log, Not(HasSubstr("older format")));
}

TEST(ConfigFile, YamlErrorsNameFileLineAndFlag) {
  const struct {
    std::string yaml, message;
  } cases[] = {
      {"group: g\nno-such-flag: 1\n", "arfused.yaml:2: unknown flag --no-such-flag"},
      {"max-tokens: many\n", "arfused.yaml:1: bad value \"many\" for --max-tokens"},
      {"hidden: 512\ngroup: a\nhidden: 256\n",
       "arfused.yaml:3: --hidden is set twice (first on line 1)"},
      {"max_tokens: 64\nmax-tokens: 32\n", "--max-tokens is set twice"},
      {"group: [a, b]\n", "arfused.yaml:1: --group takes one value, not a list"},
      {"group:\n  name: a\n", "arfused.yaml:1: --group takes one value, not a map"},
      {"allowed-uids: [[1]]\n", "--allowed-uids takes a list of plain values"},
      {"sm:\n", "arfused.yaml:1: --sm has no value"},
      {"- group: a\n", "expected a YAML map of flag names to values"},
      {"group: [a\n", "not valid YAML"},
      {"config: other.yaml\n", "arfused.yaml:1: --config is not allowed in a file"},
      {"help: true\n", "--help is not allowed in a file"},
  };
  for (const auto& c : cases) {
    const std::string path = Write("arfused.yaml", c.yaml);
    EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--device=host", "--config=" + path}, c.message))
        << c.yaml;
  }
}

TEST(ConfigFile, EmptyYamlFileSetsNothing) {
  Daemon d({"--config=" + Write("empty.yaml", "# nothing yet\n")});
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  EXPECT_THAT(d.proc->Stderr(), HasSubstr("group=arfuse(default)"));
}

// The older format is still read, and the log says what to write instead.
TEST(ConfigFile, NameValueLinesStillLoadWithAWarning) {
  const std::string path = Write("arfused.conf", "# older\ngroup=from-lines\n--max-tokens=64\n");
  Daemon d({"--config=" + path});
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  const std::string log = d.proc->Stderr();
  EXPECT_THAT(log, HasSubstr("group=from-lines(file)"));
  EXPECT_THAT(log, HasSubstr("max_tokens=64(file)"));
  EXPECT_THAT(log, HasSubstr("event=config_warning"));
  EXPECT_THAT(log, HasSubstr("'name=value' lines are the older format; write YAML instead"));
}

TEST(LogFormat, UnknownFormatExits2) {
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--device=host", "--log-format=xml"},
                         "bad value \"xml\" for --log-format: expected text or json"));
}

// Every line is one JSON object, whatever the messages hold: quotes, backslashes, control
// characters and bytes that are not UTF-8 (here in the group name, which the log repeats).
TEST(LogFormat, JsonLinesParseWhateverTheMessageHolds) {
  Daemon d({"--log-format=json", "--group=q\"b\\s\tc\xff\xfe-end"});
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  ASSERT_TRUE(d.proc->WaitForOutput("event=ready", 30s)) << d.proc->Stderr();
  d.proc->Signal(SIGTERM);
  ASSERT_EQ(d.proc->Wait(30s), 0) << d.proc->Stderr();
  int lines = 0;
  bool saw_start = false, saw_group = false, saw_shutdown = false;
  for (absl::string_view line : absl::StrSplit(d.proc->Stderr(), '\n', absl::SkipEmpty())) {
    google::protobuf::Struct object;
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(std::string(line), &object).ok())
        << line;
    ++lines;
    const auto& f = object.fields();
    for (const char* key : {"time", "level", "pid", "msg"}) {
      EXPECT_TRUE(f.contains(key)) << key << " missing in " << line;
    }
    EXPECT_THAT(f.at("time").string_value(),
                ::testing::MatchesRegex("[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:]{8}\\.[0-9]{3}Z"));
    const std::string event = f.contains("event") ? f.at("event").string_value() : "";
    saw_start |= event == "start" && f.at("level").string_value() == "info";
    saw_shutdown |= event == "shutdown_done";
    saw_group |= f.at("msg").string_value().find("q\"b\\s\tc\xEF\xBF\xBD\xEF\xBF\xBD-end") !=
                 std::string::npos;
  }
  EXPECT_GT(lines, 3);
  EXPECT_TRUE(saw_start);
  EXPECT_TRUE(saw_shutdown);
  EXPECT_TRUE(saw_group) << d.proc->Stderr();
}

}  // namespace
}  // namespace arfuse
