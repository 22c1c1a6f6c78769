// Memory openers: turn a validated RegionSpec into a mapping in this process. Behind an interface
// so that the registry, the service tests and the fuzzers run with fakes and never open a real
// handle; the real openers are HostShmOpener (always built) and CudaIpcOpener (cuda/, built only
// with the CUDA toolkit).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "server/registry/types.h"

namespace arfuse {

// One open mapping of client memory. Owning: the destructor unmaps or closes it, and never blocks
// (it runs on whichever thread drops the last reference: an op's worker, a session's end).
// Every live Mapping is counted, so tests can check that mappings return to their baseline.
class Mapping {
 public:
  virtual ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  // Start of the allocation in this process (host pointer or device pointer).
  virtual void* base() const = 0;
  // The real size of the allocation as measured by the opener (fstat, cuMemGetAddressRange),
  // never the size the client claimed.
  virtual uint64_t allocation_size() const = 0;
  // Before each op: the memory still holds its first `bytes` bytes. Memory the client can still
  // shrink (a named shared-memory object) is measured again; FAILED_PRECONDITION when it shrank.
  // Called with the registry's lock held: quick, never blocks.
  virtual absl::Status CheckIntact(uint64_t bytes) const;

 protected:
  Mapping();
};

// Live Mapping objects in this process.
int64_t OpenMappingCount();

class MemoryOpener {
 public:
  virtual ~MemoryOpener() = default;
  virtual MemoryKind kind() const = 0;
  // The device whose memory this opener maps (CUDA device id; 0 for host memory).
  virtual int32_t device_id() const = 0;
  // Opens memory that ValidateRegionSpec accepted. INVALID_ARGUMENT when the bytes or the name do
  // not open (the message never echoes them); PERMISSION_DENIED when the caller could not open
  // the memory itself; FAILED_PRECONDITION for memory that is not sealed as required;
  // RESOURCE_EXHAUSTED when the system is out of mappings or memory.
  virtual absl::StatusOr<std::unique_ptr<Mapping>> Open(const RegionSpec& spec) = 0;
};

}  // namespace arfuse
