// Host shared memory (--device=host): a POSIX shm object by name, opened read-write, sized with
// fstat and mapped shared. The mapping keeps the object alive after the client unlinks it.
#pragma once

#include <memory>

#include "server/registry/opener.h"

namespace arfuse {

class HostShmOpener final : public MemoryOpener {
 public:
  MemoryKind kind() const override { return MemoryKind::kHostShm; }
  int32_t device_id() const override { return 0; }
  absl::StatusOr<std::unique_ptr<Mapping>> Open(const RegionSpec& spec) override;
};

}  // namespace arfuse
