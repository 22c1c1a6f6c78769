// Test helper: one host-mode arfused on a fresh socket, started and waited for.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tests/support/subprocess.h"

namespace arfuse::testing {

struct DaemonProcess {
  // Starts `arfused --socket=<tmp>/a.sock --health-port=0 --device=host <extra...>` and waits
  // (30 s at most) for its "ready to accept" line.
  explicit DaemonProcess(std::vector<std::string> extra = {}, std::vector<std::string> env = {});

  std::string dir;
  std::string socket;
  std::unique_ptr<Subprocess> proc;
  bool ready = false;
  int health_port = 0;
};

// The arfused binary of this build.
std::string ArfusedPath();

}  // namespace arfuse::testing
