#include "tests/support/line_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "absl/time/clock.h"
#include "tests/support/subprocess.h"

extern char** environ;

namespace arfuse::testing {

LineProcess::LineProcess(const std::string& binary, const std::vector<std::string>& args) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) return;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, p[1], 1);
  std::vector<std::string> all = {BinaryPath(binary)};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  if (posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ) != 0) pid_ = -1;
  posix_spawn_file_actions_destroy(&fa);
  ::close(p[1]);
  out_ = p[0];
}

LineProcess::~LineProcess() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  if (out_ >= 0) ::close(out_);
}

std::string LineProcess::Await(const std::string& prefix, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    size_t nl;
    while ((nl = buf_.find('\n')) != std::string::npos) {
      std::string line = buf_.substr(0, nl);
      buf_.erase(0, nl + 1);
      if (line.rfind(prefix, 0) == 0) return line;
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration() || out_ < 0) return "";
    pollfd pfd{out_, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) continue;
    char tmp[4096];
    const ssize_t n = ::read(out_, tmp, sizeof(tmp));
    if (n <= 0) return "";
    buf_.append(tmp, static_cast<size_t>(n));
  }
}

}  // namespace arfuse::testing
