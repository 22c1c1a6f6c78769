#include "server/daemon/unix_socket.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "spdlog/spdlog.h"

namespace arfuse {

static_assert(sizeof(sockaddr_un::sun_path) == kMaxUnixSocketPath + 1);

bool UnixSocketIsLive(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  bool live = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return live;
}

absl::Status PrepareUnixSocketPath(const std::string& path, bool create_dir) {
  if (path.empty()) return absl::InvalidArgumentError("socket path is empty");
  if (path.size() > kMaxUnixSocketPath) {
    return absl::InvalidArgumentError(absl::StrCat("socket path is ", path.size(),
                                                   " bytes, longer than the ", kMaxUnixSocketPath,
                                                   " a Unix socket allows: ", path));
  }
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    if (!create_dir) {
      return absl::InvalidArgumentError(
          absl::StrCat("socket directory ", dir.string(), " does not exist"));
    }
    std::filesystem::create_directories(dir, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot create socket directory ", dir.string(), ": ", ec.message()));
    }
    // 0750: the socket's 0660 is only as good as the directory around it.
    ::chmod(dir.c_str(), 0750);
  }
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("socket path ", path, " exists and is not a socket"));
    }
    if (UnixSocketIsLive(path)) {
      return absl::AlreadyExistsError(absl::StrCat("another arfused is already serving on ", path));
    }
    if (::unlink(path.c_str()) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot remove stale socket ", path, ": ", std::strerror(errno)));
    }
    spdlog::warn("event=stale_socket_removed path={}", path);
  }
  return absl::OkStatus();
}

}  // namespace arfuse
