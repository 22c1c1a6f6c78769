#include "server/registry/host_shm_opener.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/fd/unique_fd.h"
#include "server/registry/validation.h"

namespace arfuse {
namespace {

class ShmMapping final : public Mapping {
 public:
  // `fd`: kept when the memory may still shrink (by name), to measure it before each op.
  ShmMapping(void* base, uint64_t size, UniqueFd fd)
      : base_(base), size_(size), fd_(std::move(fd)) {}
  ~ShmMapping() override { munmap(base_, size_); }
  void* base() const override { return base_; }
  uint64_t allocation_size() const override { return size_; }
  absl::Status CheckIntact(uint64_t bytes) const override {
    if (!fd_.valid()) return absl::OkStatus();  // sealed against shrinking
    struct stat st {};
    if (fstat(fd_.get(), &st) != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "its host shared-memory object could not be measured: ", std::strerror(errno)));
    }
    if (static_cast<uint64_t>(st.st_size) < bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat("its host shared-memory object shrank to ", st.st_size,
                       " bytes, below the region's ", bytes,
                       ": unregister it (registered memory must keep its size; a memfd sealed with "
                       "F_SEAL_SHRINK, registered as host_fd, cannot shrink)"));
    }
    return absl::OkStatus();
  }

 private:
  void* base_;
  uint64_t size_;
  UniqueFd fd_;
};

absl::StatusOr<std::unique_ptr<Mapping>> Map(int fd, uint64_t byte_size, uint64_t size,
                                             UniqueFd keep, const char* what) {
  if (size == 0) return absl::InvalidArgumentError(absl::StrCat(what, " is empty"));
  absl::Status fits = CheckRegionSize(byte_size, size);
  if (!fits.ok()) return fits;
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    int err = errno;
    if (err == ENOMEM) return absl::ResourceExhaustedError("sidecar is out of address space");
    return absl::InvalidArgumentError(
        absl::StrCat(what, " could not be mapped: ", std::strerror(err)));
  }
  return std::unique_ptr<Mapping>(new ShmMapping(base, size, std::move(keep)));
}

absl::StatusOr<std::unique_ptr<Mapping>> OpenDescriptor(const RegionSpec& spec) {
  const int fd = spec.host_fd->get();
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host_fd: the descriptor could not be measured: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError("host_fd: the descriptor is not a memory file (memfd)");
  }
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || (flags & O_ACCMODE) != O_RDWR) {
    return absl::PermissionDeniedError(
        "host_fd: the descriptor is not open read-write; the sidecar writes the op's outputs");
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return absl::FailedPreconditionError(
        "host_fd: the memory is not sealed against shrinking (F_SEAL_SHRINK): create it with "
        "memfd_create(MFD_ALLOW_SEALING) and add F_SEAL_SHRINK (fcntl F_ADD_SEALS) before "
        "sending it, so that it cannot shrink under the sidecar");
  }
  if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
    return absl::FailedPreconditionError(
        "host_fd: the memory is sealed against writes (F_SEAL_WRITE or F_SEAL_FUTURE_WRITE); the "
        "sidecar writes the op's outputs into it");
  }
  // Sealed: the descriptor need not be kept.
  return Map(fd, spec.byte_size, static_cast<uint64_t>(st.st_size), UniqueFd(), "host_fd memory");
}

absl::StatusOr<std::unique_ptr<Mapping>> OpenNamed(const RegionSpec& spec) {
  // Re-checked here because this is the one place a name reaches the kernel.
  absl::Status name_ok = ValidateShmName(spec.shm_name);
  if (!name_ok.ok()) return name_ok;
  if (!spec.caller.has_value()) {
    return absl::PermissionDeniedError(
        "host shared memory is registered by name only over the sidecar's Unix socket, where "
        "it knows the caller's credentials; register a sealed memfd as host_fd instead");
  }
  // O_NOFOLLOW: /dev/shm entries are never symlinks we should follow.
  UniqueFd fd(shm_open(spec.shm_name.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0));
  if (!fd.valid()) {
    int err = errno;
    if (err == EMFILE || err == ENFILE) {
      return absl::ResourceExhaustedError("sidecar is out of file descriptors");
    }
    // The name is the client's own, but never echoed: errors go to logs and other tools.
    return absl::InvalidArgumentError(absl::StrCat(
        "host shared-memory object could not be opened read-write: ", std::strerror(err)));
  }
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host shared-memory object could not be measured: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError("host shared-memory name is not a shared-memory object");
  }
  // The sidecar may be able to open what the caller may not (it may run as root): it opens the
  // object only for a caller whom the kernel would let open it read-write too.
  if (!CallerMayReadWrite(st, *spec.caller)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "host shared-memory object: the caller (uid ", spec.caller->uid,
        ") may not open it read-write itself (owner, group and mode bits), so the sidecar does "
        "not open it for the caller; register a sealed memfd as host_fd instead"));
  }
  const int raw = fd.get();
  return Map(raw, spec.byte_size, static_cast<uint64_t>(st.st_size), std::move(fd),
             "host shared-memory object");
}

}  // namespace

bool CallerMayReadWrite(const struct stat& st, const SocketCredentials& caller) {
  if (caller.uid == 0) return true;
  mode_t bits;
  if (caller.uid == st.st_uid) {
    bits = (st.st_mode >> 6) & 07;
  } else if (caller.InGroup(st.st_gid)) {
    bits = (st.st_mode >> 3) & 07;
  } else {
    bits = st.st_mode & 07;
  }
  return (bits & 06) == 06;
}

absl::StatusOr<std::unique_ptr<Mapping>> HostShmOpener::Open(const RegionSpec& spec) {
  if (spec.host_fd != nullptr) return OpenDescriptor(spec);
  return OpenNamed(spec);
}

}  // namespace arfuse
