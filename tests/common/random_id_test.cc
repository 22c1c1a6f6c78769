// The ids that name a caller's objects (session tokens, plan and attach ids): 128 (or 64) random
// bits from the kernel, distinct, in their documented text form.
#include "common/random_id.h"

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdint>
#include <set>
#include <string>

#include "gtest/gtest.h"

namespace arfuse {
namespace {

TEST(RandomId, SessionTokensAre128BitsAsLowercaseHex) {
  for (int i = 0; i < 100; ++i) {
    const std::string t = NewSessionToken();
    ASSERT_EQ(t.size(), 32u);
    EXPECT_TRUE(IsWellFormedSessionToken(t)) << t;
    for (char c : t) EXPECT_TRUE((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')) << t;
  }
}

TEST(RandomId, EveryBitOfATokenVaries) {
  // Each of the 128 bits is 0 in some of 2000 tokens and 1 in others: no bit is fixed, as it
  // would be in a token padded from a 64-bit value or taken from a clock. (A truly random bit is
  // the same in all 2000 with probability 2^-1999.)
  std::array<int, 128> ones{};
  std::set<std::string> seen;
  constexpr int kTokens = 2000;
  for (int i = 0; i < kTokens; ++i) {
    const std::string t = NewSessionToken();
    seen.insert(t);
    for (int nibble = 0; nibble < 32; ++nibble) {
      const char c = t[nibble];
      const int v = c <= '9' ? c - '0' : c - 'a' + 10;
      for (int b = 0; b < 4; ++b) ones[nibble * 4 + b] += (v >> b) & 1;
    }
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(kTokens));
  for (int b = 0; b < 128; ++b) {
    EXPECT_GT(ones[b], 0) << "bit " << b;
    EXPECT_LT(ones[b], kTokens) << "bit " << b;
  }
}

TEST(RandomId, TokensComeFromTheKernelNotFromStateAForkCopies) {
  // A generator seeded once in the process would hand a forked child the same next token as its
  // parent; the kernel's pool does not.
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const std::string t = NewSessionToken();
    const bool ok = ::write(fds[1], t.data(), t.size()) == static_cast<ssize_t>(t.size());
    ::_exit(ok ? 0 : 1);
  }
  const std::string mine = NewSessionToken();
  ::close(fds[1]);
  char buf[32];
  ssize_t got = 0;
  while (got < 32) {
    ssize_t n = ::read(fds[0], buf + got, sizeof(buf) - got);
    if (n <= 0) break;
    got += n;
  }
  ::close(fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ASSERT_EQ(got, 32);
  EXPECT_NE(std::string(buf, 32), mine);
}

TEST(RandomId, MalformedTokensAreRecognized) {
  const std::string good = NewSessionToken();
  std::string upper = good;
  upper[0] = 'A';
  for (const std::string& bad :
       {std::string(), good.substr(0, 31), good + "0", upper, std::string(32, 'g'),
        std::string("12345"), std::string(32, ' ')}) {
    EXPECT_FALSE(IsWellFormedSessionToken(bad)) << bad;
  }
}

TEST(RandomId, IdsAreNonZeroAndDistinct) {
  std::set<uint64_t> seen;
  for (int i = 0; i < 10000; ++i) {
    const uint64_t id = RandomNonZeroId();
    EXPECT_NE(id, 0u);
    seen.insert(id);
  }
  EXPECT_EQ(seen.size(), 10000u);
}

}  // namespace
}  // namespace arfuse
