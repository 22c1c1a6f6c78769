// Test helper: run a binary as a child process (exec, never a bare fork), capture its output in
// files, wait for a line, signal it, and reap it with a bound.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace arfuse::testing {

class Subprocess {
 public:
  // Starts `argv[0]` with `argv` and `env` (added to the current environment).
  Subprocess(std::vector<std::string> argv, std::vector<std::string> env = {});
  ~Subprocess();  // SIGKILLs a child still running
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  std::string Stdout() const;
  std::string Stderr() const;
  // Waits until stdout or stderr contains `text`; false on timeout or when the child exited.
  bool WaitForOutput(const std::string& text, std::chrono::milliseconds timeout);
  // Exit code (128+signal when killed), or nullopt on timeout.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  void Signal(int sig);

 private:
  pid_t pid_ = -1;
  std::string out_path_;
  std::string err_path_;
  std::optional<int> exit_code_;
};

// Runs to completion (bounded) and returns (exit code, stdout + stderr).
std::pair<int, std::string> RunToCompletion(
    std::vector<std::string> argv, std::vector<std::string> env = {},
    std::chrono::milliseconds timeout = std::chrono::seconds(30));

// A fresh temporary directory under /tmp (short, so socket paths stay well under 107 bytes).
std::string MakeTempDir();

// Path of a built binary under the build tree (ARFUSE_BINARY_DIR/<relative>).
std::string BinaryPath(const std::string& relative);

}  // namespace arfuse::testing
