#include "server/cuda_device/mps.h"

#include <dirent.h>
#include <sys/stat.h>

#include <cctype>
#include <cstdlib>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace arfuse {
namespace {

constexpr char kDefaultPipeDir[] = "/tmp/nvidia-mps";

bool IsFifo(const std::string& path) {
  struct stat st;
  // The control endpoint is a named pipe in older MPS releases and a socket in newer ones.
  return stat(path.c_str(), &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode));
}

bool AllDigits(const char* s) {
  if (*s == '\0') return false;
  for (; *s != '\0'; ++s) {
    if (!std::isdigit(static_cast<unsigned char>(*s))) return false;
  }
  return true;
}

}  // namespace

DriverMps DriverMpsFromAttribute(int cu_result, int value) {
  if (cu_result != 0) return DriverMps::kUnknown;
  return value != 0 ? DriverMps::kEnabled : DriverMps::kDisabled;
}

std::string MpsInfo::Describe() const {
  std::string out =
      absl::StrCat("mps=", active() ? "active" : "inactive", " pipe_dir=", pipe_directory,
                   " control_pipe=", control_pipe_present ? "present" : "absent",
                   " control_daemon=", control_daemon_running ? "running" : "absent",
                   " server=", server_running ? "running" : "absent");
  // Only when the driver answered, so that the line reads as before where it cannot.
  if (driver != DriverMps::kUnknown) {
    absl::StrAppend(&out, " driver=", driver == DriverMps::kEnabled ? "enabled" : "disabled");
  }
  return out;
}

MpsInfo DetectMps(const std::string& pipe_dir_env, const std::string& proc_root, DriverMps driver) {
  MpsInfo info;
  info.driver = driver;
  info.pipe_directory = pipe_dir_env.empty() ? kDefaultPipeDir : pipe_dir_env;
  info.control_pipe_present = IsFifo(info.pipe_directory + "/control");
  DIR* dir = opendir(proc_root.c_str());
  if (dir == nullptr) return info;
  while (struct dirent* ent = readdir(dir)) {
    if (!AllDigits(ent->d_name)) continue;
    std::ifstream comm(absl::StrCat(proc_root, "/", ent->d_name, "/comm"));
    std::string name;
    if (!std::getline(comm, name)) continue;
    absl::string_view trimmed = absl::StripAsciiWhitespace(name);
    // /proc/PID/comm holds at most 15 characters of the name.
    if (trimmed != "nvidia-cuda-mps") continue;
    // Both binaries truncate to "nvidia-cuda-mps"; tell them apart by the command line.
    std::ifstream cmdline(absl::StrCat(proc_root, "/", ent->d_name, "/cmdline"));
    std::string argv0;
    std::getline(cmdline, argv0, '\0');
    if (argv0.find("mps-control") != std::string::npos) info.control_daemon_running = true;
    if (argv0.find("mps-server") != std::string::npos) info.server_running = true;
  }
  closedir(dir);
  return info;
}

MpsInfo DetectMps() {
  const char* env = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  return DetectMps(env == nullptr ? "" : env, "/proc");
}

}  // namespace arfuse
