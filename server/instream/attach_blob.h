// The attach blob (kernels/instream/attach_abi.h) of an engine's InStreamExport: what
// Fusion.Attach sends and arfuse_attach() reads. Plain bytes, no CUDA and no gRPC here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/instream/op_counters.h"
#include "server/engine_api/instream_host.h"

namespace arfuse {

// The blob for one attach: header, kernel entries, per-rank memory, kernel image. File
// descriptors do not travel in it: RankMemory::fd_index indexes AttachBlobFds(e). INVALID_ARGUMENT
// (naming the field) for an export the client would refuse: ranks not world_size long, rank out
// of range, a handle that is not 64 bytes, a descriptor missing where the kind needs one (or
// present where it must not be), an image on a host export or none on a CUDA one, too many
// entries, or a function name that does not fit. With `counters`, the blob names an op counter
// page (kernels/instream/op_counters.h) whose descriptor follows AttachBlobFds(e) in the offer
// (OfferAttachFds' counters_fd); without, counters_fd_index is -1 and the client counts nothing.
// `counter_slot` is the attachment's slot of the kernels' launch counts (AttachHeader::
// counter_slot; INVALID_ARGUMENT at kInStreamCounterSlots or above).
absl::StatusOr<std::string> BuildAttachBlob(
    const InStreamExport& e, uint64_t attach_id, bool counters = false,
    uint32_t counter_slot = instream::kInStreamUnattributedSlot);

// The descriptors the blob's fd_index values refer to, in index order (the export keeps owning
// them): those the rank entries hold, in rank order. A kVmmPosixFd rank points at its own; every
// kHostShm rank points at the one the group's object came with. Offer them on the fd socket in
// this order.
std::vector<int> AttachBlobFds(const InStreamExport& e);

// The proto's AttachResponse.memory_kind for logs: "cuda_ipc", "vmm_posix_fd", "vmm_fabric",
// "host_shm" (the first rank's kind), or "none".
const char* AttachMemoryKindName(const InStreamExport& e);

}  // namespace arfuse
