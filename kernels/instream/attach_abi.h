// The in-stream plane's attach ABI: the plain-data description a sidecar hands the client library
// (libarfuse_client) so that the client can launch the sidecar's fused kernels in its own CUDA
// stream, on its own tensors (docs/instream.md). The sidecar and the client are built separately
// (the sidecar's image, the framework's copy of the library), so every struct here is pinned by
// static_asserts, the blob carries its own sizes, and both sides refuse a version they do not
// know. No CUDA and no protobuf: host-mode builds and clients include this header too.
//
// The blob (Fusion.Attach's `attach_blob`) is, in order:
//   AttachHeader                     at offset 0
//   KernelEntry  x num_entries       at entries_offset
//   RankMemory   x world_size        at ranks_offset (indexed by rank)
//   the kernel image (a fatbin)      at image_offset, image_bytes long (CUDA only; 0 in host mode)
// Every offset is a multiple of 16 and every region lies inside the blob; the client checks both.
//
// File descriptors (VMM POSIX-FD handles, the host-mode workspace, the attachment's op counter
// page) do not travel in the blob: the sidecar offers them on its fd socket under Attach's
// `fd_ticket`, and RankMemory::fd_index (AttachHeader::counters_fd_index) is the index of a
// rank's descriptor (of the counter page) in the list the client picked up.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/op_types.h"
#include "kernels/contract/device_errors.h"

namespace arfuse::instream {

inline constexpr uint32_t kAttachMagic = 0x49534641;  // "AFSI" little-endian
// 1: first version. 2: the op counter page (counters_fd_index, counters_bytes;
// kernels/instream/op_counters.h). 3: the kernels' per-attachment launch counts (counter_slot).
// 4: the FP8 patterns' entries (up to kMaxAttachEntries).
inline constexpr uint32_t kAttachAbiVersion = 4;
// The kernels' launch-parameter ABI (kernels/instream/launch_abi.h): a client built for another
// version refuses to attach, because the kernel would read its parameters at other offsets.
// 1: first version. 2: counter_slot (the kernels count each launch per attachment). 3: the FP8
// patterns' quant_out, scale and scale_layout in FusionParams. 4: program_key (compared in the
// op descriptor).
inline constexpr uint32_t kLaunchAbiVersion = 4;
inline constexpr uint32_t kLaunchArgsBytes = 368;
// At most this many hidden sizes per attach (each gets its kernel entries).
inline constexpr uint32_t kMaxAttachHiddens = 16;
// Kernel entries per hidden: one per pattern (kMaxPattern, kernels/common/op_types.h) and
// algorithm; an attach lists at most this many per hidden.
inline constexpr uint32_t kEntriesPerHidden = 2 * kMaxPattern;
inline constexpr uint32_t kMaxAttachEntries = kEntriesPerHidden * kMaxAttachHiddens;
inline constexpr uint32_t kFunctionNameBytes = 96;

enum class DeviceKind : uint32_t { kCuda = 1, kHost = 2 };

// How a rank's workspace memory reaches the client.
enum class MemoryKind : uint32_t {
  kCudaIpc = 1,     // legacy CUDA IPC handle (64 bytes in `handle`): trtllm backend
  kVmmPosixFd = 2,  // cuMemCreate allocation exported as a POSIX file descriptor (fd_index)
  kVmmFabric = 3,   // cuMemCreate allocation exported as a FABRIC handle (64 bytes in `handle`)
  kHostShm = 4,     // host mode: the group's host workspace (one object for every rank, fd_index)
};

// The kernels' error words, as the client library reports them: the codes of the one device
// error table (kernels/contract/device_errors.h); these two only in-stream launches write.
inline constexpr uint32_t kErrorStaleGeneration =
    static_cast<uint32_t>(DeviceError::kStaleGeneration);  // the workspace was re-initialized
inline constexpr uint32_t kErrorLaunchAbi =
    static_cast<uint32_t>(DeviceError::kLaunchAbi);  // the launch arguments' ABI differs

struct AttachHeader {
  uint32_t magic;               // kAttachMagic
  uint32_t abi_version;         // kAttachAbiVersion
  uint32_t launch_abi_version;  // kLaunchAbiVersion of the sidecar's kernels
  uint32_t launch_args_bytes;   // sizeof(InStreamLaunchArgs) of the sidecar's kernels
  uint32_t header_bytes;        // sizeof(AttachHeader)
  uint32_t entry_bytes;         // sizeof(KernelEntry)
  uint32_t rank_bytes;          // sizeof(RankMemory)
  // The attachment's slot of the kernels' launch counts (FusionControl::instream_ops), which
  // the client passes in every launch (InStreamLaunchArgs::counter_slot). The last slot
  // (kInStreamUnattributedSlot) when the sidecar had none free: launches are then counted for
  // the rank, not for the attachment.
  uint32_t counter_slot;
  uint32_t device_kind;  // DeviceKind
  uint32_t rank;
  uint32_t world_size;
  uint32_t num_entries;
  // The workspace generation the kernels check: a launch carrying another one changes nothing
  // and reports kErrorStaleGeneration.
  uint64_t generation;
  // Identifies this attachment in Detach and in the session's events.
  uint64_t attach_id;
  // cudaDeviceProp::uuid of the sidecar's GPU: the client must run on the same GPU.
  uint8_t gpu_uuid[16];
  uint32_t sm;         // compute capability, major * 10 + minor (0 in host mode)
  uint32_t sm_budget;  // FusionParams::sm_budget the kernels must be launched with
  uint64_t spin_timeout_ns;
  // Whether launches may be programmatic dependents (only when no other rank shares the GPU: a
  // dependent grid waiting for its SMs must never keep another rank's grid from becoming
  // resident).
  uint32_t pdl;
  uint32_t dtype;  // arfuse::DType of the workspace: ops of any other dtype are unavailable
  // The dispatch, from the sidecar's table (the same on every rank): payload = tokens x hidden x
  // dtype size; payload <= oneshot_max_bytes runs one-shot, <= twoshot_max_bytes two-shot;
  // anything larger is unavailable here (the framework's own path is faster or as fast).
  uint64_t oneshot_max_bytes;
  uint64_t twoshot_max_bytes;
  // KernelConfig of the sidecar's kernels (lookahead, tight polls, back-off, two-shot barriers,
  // op check), passed through unchanged.
  uint32_t kernel_config[5];
  uint32_t reserved1;
  // The kernels' WorkspaceLayout (kernels/allreduce_fusion/allreduce_fusion.h), byte for byte.
  uint8_t layout[80];
  uint64_t entries_offset;
  uint64_t ranks_offset;
  uint64_t image_offset;
  uint64_t image_bytes;
  // The workspace's capacity: ops with tokens x hidden above max_tokens x hidden are
  // unavailable; hidden above `hidden` too.
  uint32_t max_tokens;
  uint32_t hidden;
  // Host mode: bytes of one rank's slot in one buffer of the host workspace (0 on CUDA).
  uint64_t host_slot_bytes;
  // The attachment's op counter page (OpCounterPage, kernels/instream/op_counters.h): the index
  // of its descriptor in the picked-up list, and sizeof(OpCounterPage); -1 and 0 when the
  // sidecar hands out none (it serves no fd channel), and the library then counts nothing.
  int32_t counters_fd_index;
  uint32_t counters_bytes;
  uint64_t reserved2;
};
static_assert(sizeof(AttachHeader) == 288);
static_assert(offsetof(AttachHeader, counter_slot) == 28);
static_assert(offsetof(AttachHeader, generation) == 48);
static_assert(offsetof(AttachHeader, gpu_uuid) == 64);
static_assert(offsetof(AttachHeader, spin_timeout_ns) == 88);
static_assert(offsetof(AttachHeader, oneshot_max_bytes) == 104);
static_assert(offsetof(AttachHeader, kernel_config) == 120);
static_assert(offsetof(AttachHeader, layout) == 144);
static_assert(offsetof(AttachHeader, entries_offset) == 224);
static_assert(offsetof(AttachHeader, max_tokens) == 256);
static_assert(offsetof(AttachHeader, host_slot_bytes) == 264);
static_assert(offsetof(AttachHeader, counters_fd_index) == 272);
static_assert(offsetof(AttachHeader, counters_bytes) == 276);

// One launchable function of the image, for one (hidden, pattern, algorithm). The grid of a
// launch is clamp(ceil(num_tokens / rows_divisor), 1, max_grid) blocks of block_threads threads:
// the sidecar computed max_grid for this GPU (resident blocks within sm_budget), so every rank
// launches the same grid for the same op.
struct KernelEntry {
  uint32_t hidden;
  uint8_t pattern;  // arfuse::Pattern
  uint8_t algo;     // arfuse::FusionAlgo
  uint8_t dtype;    // arfuse::DType
  uint8_t reserved0;
  uint32_t block_threads;
  uint32_t max_grid;
  uint32_t rows_divisor;  // 1 for one-shot (a block per token), world_size for two-shot
  uint32_t reserved1[3];
  char function[kFunctionNameBytes];  // NUL-terminated name of the kernel in the image
};
static_assert(sizeof(KernelEntry) == 128);
static_assert(offsetof(KernelEntry, function) == 32);

struct RankMemory {
  uint32_t kind;       // MemoryKind
  int32_t fd_index;    // kVmmPosixFd, kHostShm: index into the picked-up descriptors; else -1
  uint64_t bytes;      // bytes to map (the rank's whole workspace allocation)
  uint8_t handle[64];  // kCudaIpc: cudaIpcMemHandle_t; kVmmFabric: CUmemFabricHandle
  uint64_t reserved[2];
};
static_assert(sizeof(RankMemory) == 96);
static_assert(offsetof(RankMemory, handle) == 16);

inline constexpr uint64_t AlignBlob(uint64_t v) { return (v + 15u) / 16u * 16u; }

}  // namespace arfuse::instream
