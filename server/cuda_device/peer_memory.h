// Device memory that every rank of a group maps: this rank's buffer plus a unicast pointer to
// every peer's buffer. Two owners, one per fused backend (docs/architecture.md's backend table):
//   trtllm: cudaMalloc + legacy CUDA IPC handles (bytes through Exchange::Allgather), one node.
//   mnnvl:  cuMemCreate + FABRIC handles (bytes) where the device and the system allow them, else
//           POSIX file descriptors (Exchange::AllgatherFd, SCM_RIGHTS); every peer mapped unicast
//           into one reserved VA range. NVLink multicast is never used (it can take the shared
//           machines' GPUs out of service).
//
// Creation is collective: every rank calls it with the same size, in the same order. A rank that
// fails locally still takes part in every exchange step and reports its failure in its payload,
// so the others fail fast with its reason instead of waiting for the deadline.
//
// Destruction releases mappings and memory without waiting on peers. Releasing device memory
// synchronizes the device, so an owner of kernels that spin on this memory must make them exit
// (the workspace's abort word) before destroying it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/engine_api/instream_host.h"

namespace arfuse {

class Exchange;

class PeerMemory {
 public:
  virtual ~PeerMemory() = default;
  // Usable bytes per rank (at least what was asked for).
  virtual size_t bytes() const = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // This rank's buffer; same as peer(rank()).
  void* local() const { return peer(rank()); }
  // Unicast pointer, valid in this process, to rank `r`'s buffer.
  virtual void* peer(int r) const = 0;
  // "cuda_ipc", "vmm_posix_fd" or "vmm_fabric".
  virtual const char* kind() const = 0;
  // What a client process on this node needs to map rank `r`'s buffer (the in-stream plane):
  // the kind, the bytes to map and the handle (CUDA IPC, FABRIC) or a new descriptor of the
  // allocation (POSIX FD; the caller owns it). The handles and descriptors the group exchanged
  // are kept for this; a descriptor keeps the allocation alive while a client holds it.
  virtual absl::StatusOr<InStreamRankMemory> ExportForClient(int r) const = 0;
};

// The current device's memory, shared with legacy CUDA IPC. One node only.
absl::StatusOr<std::unique_ptr<PeerMemory>> CreateIpcPeerMemory(Exchange& exchange, size_t bytes,
                                                                absl::Time deadline);

enum class VmmHandleType : uint8_t {
  kAuto = 0,     // FABRIC when every rank can create, export and import it, else POSIX FD
  kPosixFd = 1,  // file descriptors over SCM_RIGHTS: one node
  kFabric = 2,   // FABRIC only (NVLink domain across nodes); fails where unavailable
};
absl::StatusOr<VmmHandleType> ParseVmmHandleType(absl::string_view name);

// The current device's memory from cuMemCreate, shared with VMM handles.
absl::StatusOr<std::unique_ptr<PeerMemory>> CreateVmmPeerMemory(Exchange& exchange, size_t bytes,
                                                                VmmHandleType handle_type,
                                                                absl::Time deadline);

}  // namespace arfuse
