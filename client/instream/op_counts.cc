#include "client/instream/op_counts.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace arfuse::instream::lib {

plain::StatusOr<OpCountsMapping> OpCountsMapping::Map(int fd) {
  if (fd < 0) {
    return plain::InvalidArgumentError(
        plain::StrCat("the op counter page's descriptor is negative (", fd, ")"));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return plain::InvalidArgumentError(
        plain::StrCat("the op counter page cannot be inspected: ", std::strerror(errno)));
  }
  if (st.st_size < static_cast<off_t>(kOpCounterObjectBytes)) {
    return plain::InvalidArgumentError(plain::StrCat("the op counter page is ", st.st_size,
                                                     " bytes, not ", kOpCounterObjectBytes));
  }
  void* map = ::mmap(nullptr, kOpCounterObjectBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    return plain::FailedPreconditionError(
        plain::StrCat("the op counter page cannot be mapped: ", std::strerror(errno)));
  }
  return OpCountsMapping(static_cast<OpCounterPage*>(map));
}

OpCountsMapping::~OpCountsMapping() {
  if (page_ != nullptr) ::munmap(page_, kOpCounterObjectBytes);
}

OpCountsMapping::OpCountsMapping(OpCountsMapping&& o) noexcept
    : page_(std::exchange(o.page_, nullptr)) {}

OpCountsMapping& OpCountsMapping::operator=(OpCountsMapping&& o) noexcept {
  if (this != &o) {
    if (page_ != nullptr) ::munmap(page_, kOpCounterObjectBytes);
    page_ = std::exchange(o.page_, nullptr);
  }
  return *this;
}

}  // namespace arfuse::instream::lib
