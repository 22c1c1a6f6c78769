// A helper process whose stdout the test reads line by line (the multi-process host and peer
// tests: each rank is a helper binary printing "ready ...", "result ..." lines).
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/time/time.h"

namespace arfuse::testing {

class LineProcess {
 public:
  // Starts `binary` (a path relative to the build directory, as BinaryPath takes it) with `args`;
  // pid() is -1 when it could not be started. The destructor SIGKILLs and reaps it.
  LineProcess(const std::string& binary, const std::vector<std::string>& args);
  ~LineProcess();
  LineProcess(const LineProcess&) = delete;
  LineProcess& operator=(const LineProcess&) = delete;

  pid_t pid() const { return pid_; }
  // The next stdout line starting with `prefix` (earlier lines are skipped), or "" on timeout or
  // end of output.
  std::string Await(const std::string& prefix, absl::Duration timeout);

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  std::string buf_;
};

}  // namespace arfuse::testing
