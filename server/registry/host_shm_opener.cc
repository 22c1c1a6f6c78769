#include "server/registry/host_shm_opener.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/registry/validation.h"

namespace arfuse {
namespace {

class ShmMapping final : public Mapping {
 public:
  ShmMapping(void* base, uint64_t size) : base_(base), size_(size) {}
  ~ShmMapping() override { munmap(base_, size_); }
  void* base() const override { return base_; }
  uint64_t allocation_size() const override { return size_; }

 private:
  void* base_;
  uint64_t size_;
};

// Closes the descriptor on every path: the mapping does not need it once mmap returned.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) close(fd);
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Mapping>> HostShmOpener::Open(const RegionSpec& spec) {
  // Re-checked here because this is the one place a name reaches the kernel.
  absl::Status name_ok = ValidateShmName(spec.shm_name);
  if (!name_ok.ok()) return name_ok;
  // O_NOFOLLOW: /dev/shm entries are never symlinks we should follow.
  FdCloser fd{shm_open(spec.shm_name.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0)};
  if (fd.fd < 0) {
    int err = errno;
    if (err == EMFILE || err == ENFILE) {
      return absl::ResourceExhaustedError("sidecar is out of file descriptors");
    }
    // The name is the client's own, but never echoed: errors go to logs and other tools.
    return absl::InvalidArgumentError(absl::StrCat(
        "host shared-memory object could not be opened read-write: ", std::strerror(err)));
  }
  struct stat st {};
  if (fstat(fd.fd, &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host shared-memory object could not be measured: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError("host shared-memory name is not a shared-memory object");
  }
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == 0) return absl::InvalidArgumentError("host shared-memory object is empty");
  absl::Status fits = CheckRegionSize(spec.byte_size, size);
  if (!fits.ok()) return fits;
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.fd, 0);
  if (base == MAP_FAILED) {
    int err = errno;
    if (err == ENOMEM) return absl::ResourceExhaustedError("sidecar is out of address space");
    return absl::InvalidArgumentError(
        absl::StrCat("host shared-memory object could not be mapped: ", std::strerror(err)));
  }
  return std::unique_ptr<Mapping>(new ShmMapping(base, size));
}

}  // namespace arfuse
