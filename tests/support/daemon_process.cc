#include "tests/support/daemon_process.h"

#include <chrono>
#include <regex>

namespace arfuse::testing {

std::string ArfusedPath() { return BinaryPath("server/daemon/arfused"); }

DaemonProcess::DaemonProcess(std::vector<std::string> extra, std::vector<std::string> env)
    : dir(MakeTempDir()), socket(dir + "/a.sock") {
  std::vector<std::string> argv = {ArfusedPath(), "--socket=" + socket, "--health-port=0",
                                   "--device=host"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  proc = std::make_unique<Subprocess>(argv, env);
  ready = proc->WaitForOutput("ready to accept", std::chrono::seconds(30));
  std::smatch m;
  std::string out = proc->Stdout();
  if (std::regex_search(out, m, std::regex("health_port=(\\d+)"))) {
    health_port = std::stoi(m[1]);
  }
}

}  // namespace arfuse::testing
