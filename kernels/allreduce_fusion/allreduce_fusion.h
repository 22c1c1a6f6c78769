// Fused allreduce (+ residual add + RMSNorm) across the ranks of a tensor-parallel group over
// unicast peer pointers: the one-shot Lamport kernel and the two-shot (reduce-scatter +
// all-gather) kernel. Host-includable: no device code here, only the launch contract.
// docs/kernels.md explains the algorithms, the sizing rule and the memory-ordering argument.
//
// Who does what:
//   * The workspace owner (server/gpu) allocates ComputeWorkspaceLayout(...).total_bytes per rank
//     (cudaMalloc + IPC, or cuMemCreate), maps every peer's workspace into this process (unicast,
//     never NVLink multicast), runs LaunchWorkspaceInit on its own workspace, synchronizes, and
//     barriers with the peers BEFORE the first op of a generation (and before any graph capture).
//   * Per op it fills FusionParams and calls LaunchAllReduceFusion on its stream. Every rank of
//     the group must launch the same sequence of (algo, num_tokens, hidden) calls. Where they
//     do not (two clients racing on one group), every rank checks its peers' op descriptor
//     before it stores any output and fails the call with kOpMismatch instead of computing a
//     sum of different ops.
//   * A kernel that hits the spin deadline or sees an abort records an error code in its
//     workspace's error word (and the optional host mirror), tells its peers to abort, and exits.
//     The workspace is then poisoned: every later launch exits at once without touching peers,
//     until every rank re-runs LaunchWorkspaceInit (after all its kernels finished) and barriers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/op_types.h"

namespace arfuse {

enum class FusionAlgo : uint8_t { kOneShot = 1, kTwoShot = 2 };

// Codes of the workspace error word (0 = healthy). Sticky until LaunchWorkspaceInit.
enum class FusionError : uint32_t {
  kNone = 0,
  kTimeout = 1,    // a spin passed FusionParams::spin_timeout_ns: a peer did not arrive
  kHostAbort = 2,  // the host abort word (FusionParams::host_abort) was set
  kPeerAbort = 3,  // a peer failed and told this rank to stop
  kPoisoned = 4,   // launched on a workspace that already held an error; nothing was done
  // The ranks launched different ops (num_tokens, hidden, eps, dtype, pattern, algo or world
  // size differ: FusionControl's op descriptors): no rank stores any output of the call.
  kOpMismatch = 5,
  // Written by the owning sidecar, never by a kernel: an in-stream client's session ended while
  // an op it launched was in flight on this rank (FusionControl's in-flight counters), so what it
  // published is retired by poisoning every rank's workspace before a peer's op pairs with it.
  kAbandoned = 6,
};
const char* FusionErrorName(uint32_t code);

// Largest grid any fused kernel uses; the two-shot barrier has one slot per block.
inline constexpr int kMaxFusionBlocks = 1024;
// Largest hidden the kernels accept, per dtype: 1024 threads x 8 vectors of 16 bytes per row.
inline constexpr uint32_t MaxFusionHidden(DType t) { return 1024u * 8u * (16u / DTypeSize(t)); }

// Byte offsets inside one rank's workspace. All offsets are multiples of 256 (16-byte vector
// access and cache-line friendly); total_bytes is a multiple of 2 MiB (the VMM granularity).
//
// Sizing rule (per rank), with E = DTypeSize(dtype), N = world_size, T = max_tokens, H = hidden:
//   control        = sizeof(FusionControl)   error/abort words, counters, two-shot barrier slots
//   lamport        = 3 x N x T x H x E       three rotating one-shot buffers, one slot per rank
//   twoshot_scatter= N x ceil(T/N) x H x E   reduce-scatter inbox: a slice row from every rank
//   twoshot_gather = T x H x E               all-gather inbox: every reduced row
//   total          = round_up(sum of the above, each rounded up to 256, 2 MiB)
// Example: N=8, T=2048, H=8192, bf16 -> lamport 768 MiB, scatter 32 MiB, gather 32 MiB.
struct WorkspaceLayout {
  uint64_t control_offset;
  uint64_t lamport_offset;
  uint64_t lamport_buffer_bytes;  // one of the three buffers: N slots
  uint64_t lamport_slot_bytes;    // one rank's slot: T x H x E
  uint64_t scatter_offset;
  uint64_t scatter_slot_bytes;  // one rank's slot: ceil(T/N) x H x E
  uint64_t gather_offset;
  uint64_t total_bytes;
  uint32_t max_tokens;
  uint32_t hidden;  // the hidden size the workspace was sized for; ops may use any hidden <= it
                    // as long as num_tokens x hidden <= max_tokens x this hidden
  int32_t world_size;
  DType dtype;  // the sentinel pattern depends on it: ops must use this dtype
  uint8_t reserved[3];
};
static_assert(sizeof(WorkspaceLayout) == 80, "WorkspaceLayout is copied into kernel params");
static_assert(offsetof(WorkspaceLayout, max_tokens) == 64);
static_assert(offsetof(WorkspaceLayout, dtype) == 76);

// The layout for a workspace, or a zero total_bytes when the arguments are unsupported (world
// size not in {2,4,8,16}, hidden not a positive multiple of 8 or above MaxFusionHidden, zero
// tokens, or a size above 2^47 bytes). `why` (optional) receives a static message then.
WorkspaceLayout ComputeWorkspaceLayout(int world_size, uint32_t max_tokens, uint32_t hidden,
                                       DType dtype, const char** why = nullptr);

// Everything one rank's launch needs. Plain data, copied by value into the kernel parameters.
struct FusionParams {
  // Base pointer of every rank's workspace, mapped in this process (unicast), indexed by rank;
  // peer_workspace[rank] is this rank's own workspace. Entries >= world_size are ignored.
  void* peer_workspace[kMaxWorldSize];
  const void* input;        // [num_tokens, hidden] this rank's contribution
  void* output;             // kAllReduce: [num_tokens, hidden] the sum
  const void* residual_in;  // kAllReduceResidualRmsNorm: [num_tokens, hidden]
  void* residual_out;       // kAllReduceResidualRmsNorm: pre-norm sum; may equal residual_in
  void* norm_out;           // kAllReduceResidualRmsNorm: [num_tokens, hidden]
  const void* gamma;        // kAllReduceResidualRmsNorm: [hidden]
  // Optional (may be null): a word the host can set at any time to make every spin exit with
  // kHostAbort, e.g. cudaHostAlloc(cudaHostAllocMapped) memory's device pointer.
  const uint32_t* host_abort;
  // Optional (may be null): host-mapped word the kernel also writes its error code into, so the
  // host sees a failure without a copy.
  uint32_t* host_error;
  uint64_t
      spin_timeout_ns;     // each spin's budget, measured from the spin's first poll (%globaltimer)
  WorkspaceLayout layout;  // ComputeWorkspaceLayout(...) of the workspaces (same on all ranks)
  uint32_t num_tokens;     // may be 0: nothing is launched
  uint32_t hidden;
  float eps;
  int32_t rank;
  int32_t world_size;
  // SMs the launcher may assume are free for this kernel; 0 = the device's SM count. Must be the
  // same on every rank. Tests that run all ranks on one GPU set it to SMs / world_size so that the
  // spinning grids of every simulated rank are co-resident.
  uint32_t sm_budget;
  DType dtype;
  Pattern pattern;
  FusionAlgo algo;
  uint8_t reserved[5];
};
static_assert(sizeof(FusionParams) == 312, "FusionParams layout is part of the kernel ABI");
static_assert(offsetof(FusionParams, input) == 128);
static_assert(offsetof(FusionParams, spin_timeout_ns) == 192);
static_assert(offsetof(FusionParams, layout) == 200);
static_assert(offsetof(FusionParams, num_tokens) == 280);
static_assert(offsetof(FusionParams, dtype) == 304);

// Whether the fused kernels have an instantiation for these arguments (the support table).
bool IsFusionSupported(DType dtype, int world_size, Pattern pattern, FusionAlgo algo);

// Checks params without touching the device: cudaErrorInvalidValue when anything is out of range
// (unsupported combination, dtype/world size differing from the layout, num_tokens x hidden
// beyond the workspace, null or misaligned (16 B) pointers, rank out of range). `why` (optional)
// receives a static message naming the problem.
cudaError_t CheckFusionParams(const FusionParams& params, const char** why = nullptr);

// Enqueues the op on `stream` (one kernel). Returns the launch error, or cudaErrorInvalidValue
// from CheckFusionParams without launching. Capturable in CUDA graphs: all protocol state lives
// in the workspace. The launch grid depends only on (num_tokens, hidden, world_size, dtype,
// pattern, algo, sm_budget, device).
// With sm_budget == 0 (the rank has its GPU to itself) the kernel is a programmatic dependent
// launch (sm_90+): it may be scheduled while the kernel before it on the stream still runs and
// waits (griddepcontrol.wait) for it and its stores before touching anything, then lets the
// kernel after it be scheduled early. Results are the same; the launch gap shrinks.
cudaError_t LaunchAllReduceFusion(const FusionParams& params, cudaStream_t stream);

// Indirect launch, for ops whose token count (and params) are only known on the device when the
// kernel runs: the doorbell plane (kernels/doorbell/) queues this launch behind a waiter kernel
// that writes the op into `device_params` (device memory, read by every block when it starts;
// stream order makes a preceding kernel's stores visible).
//
// The launch (kernel, grid, block) depends only on `grid_template`: its dtype, pattern, algo,
// hidden, world size, sm_budget and layout (with the largest token count the workspace fits at
// that hidden, layout.max_tokens x layout.hidden / hidden), never on the op's num_tokens, so
// every rank that passes the same template launches the same grid.
//
// The kernel runs the device params only when they belong to this launch: same dtype, pattern,
// algo, hidden, world size, rank and sm_budget as the template, num_tokens > 0 and within the
// workspace (so two launches queued with different templates never both run one op).
// Otherwise (num_tokens == 0: an idle waiter; another shape or algorithm: a launch queued for
// another plan, or the one-shot and two-shot launches queued behind one waiter so the device
// may pick either) every block returns at once WITHOUT touching any protocol state (epoch,
// sequence, Lamport buffers, barrier slots, error and abort words). That is what lets each rank
// skip launches on its own: the launches that run still pair up one to one across ranks, in
// order. The host must make the device params of every rank agree on whether an op runs and on
// its num_tokens and algo, exactly as for LaunchAllReduceFusion.
//
// programmatic_dependent (sm_90+): launch with programmatic stream serialization, so the blocks
// may be scheduled while the kernel before it on the stream still runs, once that kernel
// executed griddepcontrol.launch_dependents (the doorbell's waiter does right after it took a
// ring); every block waits (griddepcontrol.wait) for that kernel to finish and its stores to be
// visible before reading the device params. The kernel also lets its own dependents launch
// early. It hides a launch latency; the results are the same.
//
// cudaErrorInvalidValue (nothing launched) when device_params is null or misaligned (8 B), or
// the template fails CheckFusionParams with num_tokens = 0 (pointers are then checked only by
// the host that wrote the device params). Capturable in CUDA graphs.
cudaError_t LaunchAllReduceFusionIndirect(const FusionParams& grid_template,
                                          const FusionParams* device_params, cudaStream_t stream,
                                          bool programmatic_dependent = false);

// Loads every fused kernel (by value and indirect, each dtype, pattern, algorithm and row
// bucket) and the workspace reset into the current context now. Call once per device before a
// fused kernel may spin while another is first launched (the doorbell plane, the engine):
// lazy module loading would load that kernel at its launch and may wait for the spinning one
// (kernels/common/launch.cuh). Not inside a graph capture. Returns the first load error.
cudaError_t PrepareAllReduceFusionKernels();

// The launch-time knobs the kernels of this process run with (KernelConfig: lookahead, tight
// polls, back-off, two-shot barriers, op check, from ARFUSE_FUSION_TUNING or the defaults) and
// whether launches are programmatic dependents where the GPU is not shared. The in-stream plane
// hands them to clients so their launches run exactly as the sidecar's would.
void CurrentFusionKernelConfig(uint32_t config[5], bool* pdl);

// Blocks of `kernel` launched with `threads` threads that can be resident at once on this device
// within `sm_budget` SMs (0: all), capped at kMaxFusionBlocks: a grid whose blocks spin on each
// other must not exceed it. Cached per (kernel, threads, device); 0 when the device cannot be
// queried. Used by the fused launches here and by the doorbell's serving launch.
uint32_t FusionResidentBlocks(const void* kernel, int threads, uint32_t sm_budget);

// Resets this rank's own workspace (peer pointers are not touched): Lamport buffers to the
// dtype's -0.0 sentinel, counters, barrier slots, abort and error words to zero.
cudaError_t LaunchWorkspaceInit(void* local_workspace, const WorkspaceLayout& layout,
                                cudaStream_t stream);

// Device addresses of the control words in this rank's workspace (for cudaMemcpyAsync into
// pinned memory, or cudaMemset of the abort word to make this rank's spins exit).
uint32_t* WorkspaceErrorWord(void* local_workspace, const WorkspaceLayout& layout);
uint32_t* WorkspaceAbortWord(void* local_workspace, const WorkspaceLayout& layout);

// Copies the error word to the host and waits for `stream` (use off the hot path).
cudaError_t ReadWorkspaceError(void* local_workspace, const WorkspaceLayout& layout,
                               cudaStream_t stream, uint32_t* error_code);

}  // namespace arfuse
