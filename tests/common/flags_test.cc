// The command-line library every binary parses with (common/flags.h).
#include "common/flags.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"

ABSL_FLAG(int, flags_test_count, 3, "a number");
ABSL_FLAG(bool, flags_test_switch, false, "a switch");
ABSL_FLAG(arfuse::flags::PositiveList, flags_test_list, (arfuse::flags::PositiveList{{1, 2}}),
          "a list");
ABSL_FLAG(int, flags_test_not_owned, 0, "a flag of some linked library");

namespace arfuse::flags {
namespace {

class FlagSetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::SetFlag(&FLAGS_flags_test_count, 3);
    absl::SetFlag(&FLAGS_flags_test_switch, false);
    absl::SetFlag(&FLAGS_flags_test_list, PositiveList{{1, 2}});
  }

  absl::StatusOr<std::vector<GivenFlag>> Parse(std::vector<std::string> args) {
    std::vector<char*> argv = {const_cast<char*>("prog")};
    for (auto& a : args) argv.push_back(a.data());
    return set_.Parse(static_cast<int>(argv.size()), argv.data());
  }

  FlagSet set_{"prog", {"flags_test_count", "flags_test_switch", "flags_test_list"}};
};

TEST_F(FlagSetTest, TakesEverySpelling) {
  ASSERT_TRUE(Parse({"--flags-test-count=5"}).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_flags_test_count), 5);
  ASSERT_TRUE(Parse({"--flags_test_count", "6"}).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_flags_test_count), 6);
  ASSERT_TRUE(Parse({"-flags-test-switch"}).ok());
  EXPECT_TRUE(absl::GetFlag(FLAGS_flags_test_switch));
  ASSERT_TRUE(Parse({"--noflags-test-switch"}).ok());
  EXPECT_FALSE(absl::GetFlag(FLAGS_flags_test_switch));
  ASSERT_TRUE(Parse({"--flags-test-list=8,32"}).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_flags_test_list).values, (std::vector<uint32_t>{8, 32}));
}

TEST_F(FlagSetTest, LastValueWins) {
  auto given = Parse({"--flags-test-count=5", "--flags-test-count=7"});
  ASSERT_TRUE(given.ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_flags_test_count), 7);
  EXPECT_TRUE(WasGiven(*given, "flags_test_count"));
  EXPECT_FALSE(WasGiven(*given, "flags_test_switch"));
}

TEST_F(FlagSetTest, RefusesWhatItCannotTake) {
  EXPECT_EQ(Parse({"positional"}).status().message(),
            "unexpected argument \"positional\" (prog takes only flags; see --help)");
  EXPECT_EQ(Parse({"--"}).status().message(), "empty flag \"--\" (see --help)");
  EXPECT_EQ(Parse({"--nope=1"}).status().message(), "unknown flag --nope (see --help)");
  // Linked libraries' flags are not on this binary's command line.
  EXPECT_EQ(Parse({"--flags-test-not-owned=1"}).status().message(),
            "unknown flag --flags-test-not-owned (see --help)");
  EXPECT_EQ(Parse({"--flags-test-count"}).status().message(),
            "flag --flags-test-count needs a value");
  EXPECT_EQ(Parse({"--noflags-test-count"}).status().message(),
            "unknown flag --noflags-test-count (see --help)");
  EXPECT_EQ(Parse({"--noflags-test-switch=1"}).status().message(),
            "unknown flag --noflags-test-switch (see --help)");
  EXPECT_TRUE(absl::StartsWith(Parse({"--flags-test-count=x"}).status().message(),
                               "command line: bad value \"x\" for --flags-test-count: "));
  // abseil's own words come first ("Illegal value ... specified for flag ..."), the list's last.
  EXPECT_TRUE(absl::StartsWith(Parse({"--flags-test-list=1,0"}).status().message(),
                               "command line: bad value \"1,0\" for --flags-test-list: "));
  EXPECT_TRUE(absl::EndsWith(Parse({"--flags-test-list=1,0"}).status().message(),
                             "\"0\" is not a positive number"));
  EXPECT_TRUE(
      absl::EndsWith(Parse({"--flags-test-list=,"}).status().message(), "the list is empty"));
  EXPECT_EQ(absl::GetFlag(FLAGS_flags_test_list).values, (std::vector<uint32_t>{1, 2}));
}

TEST_F(FlagSetTest, TakesTheEnvironment) {
  setenv("ARFUSE_FLAGS_TEST_COUNT", "11", 1);
  setenv("ARFUSE_FLAGS_TEST_SWITCH", "true", 1);
  std::vector<std::string> set;
  ASSERT_TRUE(set_.ApplyEnvironment({"flags_test_switch"},
                                    [&](const std::string& name) { set.push_back(name); })
                  .ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_flags_test_count), 11);
  EXPECT_FALSE(absl::GetFlag(FLAGS_flags_test_switch));  // skipped
  EXPECT_EQ(set, std::vector<std::string>{"flags_test_count"});
  setenv("ARFUSE_FLAGS_TEST_COUNT", "eleven", 1);
  EXPECT_TRUE(absl::StartsWith(set_.ApplyEnvironment({}, [](const std::string&) {}).message(),
                               "ARFUSE_FLAGS_TEST_COUNT: bad value \"eleven\""));
  unsetenv("ARFUSE_FLAGS_TEST_COUNT");
  unsetenv("ARFUSE_FLAGS_TEST_SWITCH");
}

// Subcommands of one binary keep their flags apart under a prefix; messages name the command
// line's spelling.
TEST(FlagSetPrefix, MapsNamesToPrefixedFlags) {
  FlagSet sub("prog sub", {"count"}, "flags_test_");
  std::string count = "--count=9";
  std::vector<char*> argv = {const_cast<char*>("sub"), count.data()};
  auto given = sub.Parse(2, argv.data());
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ(given->front().name, "count");
  EXPECT_EQ(absl::GetFlag(FLAGS_flags_test_count), 9);
  EXPECT_EQ(sub.Find("count"), absl::FindCommandLineFlag("flags_test_count"));
  EXPECT_EQ(sub.Find("flags_test_count"), nullptr);
  EXPECT_EQ(sub.Set("switch", "true", "here").message(),
            "here: unknown flag --switch (see --help)");
  // abseil's words name the flag as the command line does.
  EXPECT_EQ(sub.Set("count", "x", "here").message(),
            "here: bad value \"x\" for --count: Illegal value 'x' specified for flag 'count'");
}

// Strict rules (arfusectl's): a flag given once, booleans as words, a value that is not the next
// flag, messages that name the command.
TEST(FlagSetStrict, RefusesWhatArgparseLetsThrough) {
  Strict strict;
  strict.single = true;
  strict.repeatable = {"list"};
  strict.bool_words = true;
  strict.value_not_flag = true;
  strict.name_program = true;
  FlagSet sub("prog sub", {"count", "switch", "list"}, "flags_test_", strict);
  auto parse = [&](std::vector<std::string> args) {
    std::vector<char*> argv = {const_cast<char*>("sub")};
    for (auto& a : args) argv.push_back(a.data());
    return sub.Tokenize(static_cast<int>(argv.size()), argv.data());
  };
  EXPECT_EQ(parse({"--count=1", "--count", "2"}).status().message(),
            "--count given more than once");
  EXPECT_EQ(parse({"--switch", "--noswitch"}).status().message(), "--switch given more than once");
  auto lists = parse({"--list=1", "--list=2"});
  ASSERT_TRUE(lists.ok()) << lists.status();
  EXPECT_EQ(lists->size(), 2u);
  EXPECT_EQ(parse({"--switch=yes"}).status().message(),
            "--switch=yes: expected --switch, --switch=true or --switch=false");
  EXPECT_TRUE(parse({"--switch=false"}).ok());
  EXPECT_EQ(parse({"--count", "--switch"}).status().message(), "flag --count needs a value");
  EXPECT_EQ(parse({"--bogus"}).status().message(),
            "unknown option --bogus for 'prog sub' (see prog sub --help)");
  EXPECT_EQ(parse({"extra"}).status().message(),
            "unexpected argument \"extra\" for 'prog sub': options are --name value");
  // Without Strict the same command lines pass.
  FlagSet loose("prog sub", {"count", "switch"}, "flags_test_");
  std::vector<std::string> args = {"--count=1", "--count", "--switch", "--switch=yes"};
  std::vector<char*> argv = {const_cast<char*>("sub")};
  for (auto& a : args) argv.push_back(a.data());
  auto given = loose.Tokenize(static_cast<int>(argv.size()), argv.data());
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ((*given)[1].value, "--switch");
}

TEST(FlagNames, Spellings) {
  EXPECT_EQ(Hyphenated("world_size"), "world-size");
  EXPECT_EQ(EnvName("world_size"), "ARFUSE_WORLD_SIZE");
}

}  // namespace
}  // namespace arfuse::flags
