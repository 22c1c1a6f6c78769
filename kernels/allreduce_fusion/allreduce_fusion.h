// Fused allreduce (+ residual add + RMSNorm) across the ranks of a tensor-parallel group over
// unicast peer pointers: the one-shot Lamport kernel and the two-shot (reduce-scatter +
// all-gather) kernel. Host-includable: no device code here, only the launch contract.
// docs/kernels.md explains the algorithms, the sizing rule and the memory-ordering argument.
//
// Who does what:
//   * The workspace owner (server/cuda_device) allocates ComputeWorkspaceLayout(...).total_bytes
//     per rank (cudaMalloc + IPC, or cuMemCreate), maps every peer's workspace into this process
//     (unicast, never NVLink multicast), runs LaunchWorkspaceInit on its own workspace,
//     synchronizes, and barriers with the peers BEFORE the first op of a generation (and before any
//     graph capture).
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
#include "kernels/contract/op_contract.h"

namespace arfuse {

// Codes of the workspace error word (0 = healthy), sticky until LaunchWorkspaceInit: the kernels'
// part of the one device error table (kernels/contract/device_errors.h), which names them.
enum class FusionError : uint32_t {
  kNone = static_cast<uint32_t>(DeviceError::kNone),
  kTimeout = static_cast<uint32_t>(DeviceError::kTimeout),  // past FusionParams::spin_timeout_ns
  kHostAbort = static_cast<uint32_t>(DeviceError::kHostAbort),  // FusionParams::host_abort was set
  kPeerAbort = static_cast<uint32_t>(DeviceError::kPeerAbort),  // a peer failed and told us to stop
  kPoisoned = static_cast<uint32_t>(DeviceError::kPoisoned),  // an earlier error; nothing was done
  // The ranks launched different ops (num_tokens, hidden, eps, dtype, pattern, algo or world
  // size differ: FusionControl's op descriptors): no rank stores any output of the call.
  kOpMismatch = static_cast<uint32_t>(DeviceError::kOpMismatch),
  // Written by the owning sidecar, never by a kernel: an in-stream client's session ended while
  // an op it launched was in flight on this rank (FusionControl's in-flight counters), so what it
  // published is retired by poisoning every rank's workspace before a peer's op pairs with it.
  kAbandoned = static_cast<uint32_t>(DeviceError::kAbandoned),
};
// The sentence of a code (DeviceErrorInfo::text), "unknown fusion error" for any other number.
const char* FusionErrorName(uint32_t code);

// kMaxFusionBlocks, MaxFusionHidden, FusionAlgo, WorkspaceLayout, ComputeWorkspaceLayout and
// FusionParams are the op contract's (kernels/contract/op_contract.h).

// Whether the fused kernels have an instantiation for these arguments (the support table).
bool IsFusionSupported(DType dtype, int world_size, Pattern pattern, FusionAlgo algo);

// Checks params without touching the device: cudaErrorInvalidValue when anything is out of range
// (unsupported combination, dtype/world size differing from the layout, num_tokens x hidden
// beyond the workspace (contract::Fits), null or misaligned (16 B) pointers, rank out of range).
// `why` (optional) receives a static message naming the problem.
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
