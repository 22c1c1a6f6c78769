#include "tests/support/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

extern char** environ;

namespace arfuse::testing {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string MakeTempDir() {
  char tmpl[] = "/tmp/arfuse-test-XXXXXX";
  char* dir = ::mkdtemp(tmpl);
  return dir == nullptr ? std::string("/tmp") : std::string(dir);
}

std::string BinaryPath(const std::string& relative) {
#ifdef ARFUSE_BINARY_DIR
  return std::string(ARFUSE_BINARY_DIR) + "/" + relative;
#else
  return relative;
#endif
}

Subprocess::Subprocess(std::vector<std::string> argv, std::vector<std::string> env) {
  std::string dir = MakeTempDir();
  out_path_ = dir + "/stdout";
  err_path_ = dir + "/stderr";
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0600);
  posix_spawn_file_actions_addopen(&actions, 2, err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0600);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) envs.emplace_back(*e);
  for (auto& e : env) envs.push_back(e);
  std::vector<char*> cenv;
  for (auto& e : envs) cenv.push_back(e.data());
  cenv.push_back(nullptr);
  // The child starts with default signal handling and an empty mask, whatever the test runner
  // had blocked.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  if (posix_spawn(&pid_, cargv[0], &actions, &attr, cargv.data(), cenv.data()) != 0) pid_ = -1;
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
}

Subprocess::~Subprocess() {
  if (pid_ > 0 && !exit_code_) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
}

std::string Subprocess::Stdout() const { return ReadFile(out_path_); }
std::string Subprocess::Stderr() const { return ReadFile(err_path_); }

bool Subprocess::WaitForOutput(const std::string& text, std::chrono::milliseconds timeout) {
  auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (Stdout().find(text) != std::string::npos || Stderr().find(text) != std::string::npos) {
      return true;
    }
    if (exit_code_) return false;
    int status = 0;
    if (pid_ > 0 && ::waitpid(pid_, &status, WNOHANG) == pid_) {
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return Stdout().find(text) != std::string::npos || Stderr().find(text) != std::string::npos;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

std::optional<int> Subprocess::Wait(std::chrono::milliseconds timeout) {
  if (exit_code_) return exit_code_;
  if (pid_ <= 0) return 127;
  auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return exit_code_;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return std::nullopt;
}

void Subprocess::Signal(int sig) {
  if (pid_ > 0 && !exit_code_) ::kill(pid_, sig);
}

std::pair<int, std::string> RunToCompletion(std::vector<std::string> argv,
                                            std::vector<std::string> env,
                                            std::chrono::milliseconds timeout) {
  Subprocess p(std::move(argv), std::move(env));
  auto code = p.Wait(timeout);
  return {code.value_or(-1), p.Stdout() + p.Stderr()};
}

}  // namespace arfuse::testing
