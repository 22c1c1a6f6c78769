// Host memory (--device=host), two ways in:
//  - by descriptor (HostFdMemory, preferred): a memfd the client sent over the fd channel, which
//    proves its access; it must be open read-write and sealed against shrinking (F_SEAL_SHRINK),
//    so it can never shrink under the sidecar. Mapped shared; the descriptor is not kept.
//  - by name (HostSharedMemory, for compatibility): a POSIX shm object, opened only when the
//    calling user could open it read-write itself (owner, group and mode bits against the
//    caller's credentials), never with the sidecar's own rights on the caller's behalf. Such an
//    object can still shrink, so its descriptor is kept and its size measured before every op
//    (Mapping::CheckIntact); the host engine guards each access too (server/host/).
// The mapping keeps the memory alive after the client unlinks or closes it.
#pragma once

#include <sys/stat.h>

#include <memory>

#include "server/fdpass/socket_credentials.h"
#include "server/registry/opener.h"

namespace arfuse {

class HostShmOpener final : public MemoryOpener {
 public:
  MemoryKind kind() const override { return MemoryKind::kHostShm; }
  int32_t device_id() const override { return 0; }
  absl::StatusOr<std::unique_ptr<Mapping>> Open(const RegionSpec& spec) override;
};

// Whether `caller` could open an object of owner/group/mode `st` for reading and writing, by the
// kernel's permission classes: the owner's bits for its owner, the group's bits for a member of
// its group (primary or supplementary), the others' bits otherwise; root always. ACLs are not
// consulted.
bool CallerMayReadWrite(const struct stat& st, const SocketCredentials& caller);

}  // namespace arfuse
