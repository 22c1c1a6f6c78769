/* libarfuse_client: the in-stream data plane's client library (docs/instream.md).
 *
 * The sidecar (arfused) owns the cross-rank workspace and the fused kernels; this library maps
 * the workspace into the caller's process and launches the sidecar's kernels in the caller's own
 * CUDA stream, on the caller's own tensors: one cuLaunchKernelEx per op, no RPC, nothing
 * registered, nothing resident. It carries no kernel code: the kernel image comes from the
 * sidecar at attach, so a new sidecar image upgrades the kernels of every client.
 *
 * The caller does the control path (the C++ wrapper arfuse_client.hpp and the Python package do
 * it for you): Fusion.Attach over the sidecar's Unix socket, the descriptors picked up on its fd
 * socket with the response's ticket, then
 *
 *   arfuse_ctx* ctx = NULL;
 *   if (arfuse_attach(resp.attach_blob, len, fds, nfds, &ctx) != ARFUSE_OK) ... arfuse_last_error()
 *   ... per op, in the caller's stream (capturable in CUDA graphs):
 *   int rc = arfuse_fused_allreduce_residual_rmsnorm(ctx, stream, input, residual_in,
 *                                                    residual_out, norm_out, gamma, tokens,
 *                                                    hidden, ARFUSE_DTYPE_BF16, 1e-6f);
 *   if (rc == ARFUSE_OUT_OF_RANGE || rc == ARFUSE_UNAVAILABLE) ... run the framework's own path
 *   ... now and then, outside capture (cheap: reads a host-mapped word):
 *   uint32_t code; if (arfuse_check(ctx, &code) != ARFUSE_OK) ... re-attach
 *   arfuse_detach(ctx);   // after every graph that captured its launches is destroyed
 *
 * Every rank of the group must make the same calls in the same order (as with NCCL). All ranks
 * must agree that the plane is available before the first launch: a rank that runs its own path
 * while its peers launch leaves them spinning until the spin timeout.
 *
 * Host mode (a sidecar started with --device=host): the same calls run the CPU implementation
 * synchronously on host memory, through the host workspace shared with the other ranks' clients
 * (stream is ignored).
 *
 * Thread safety: one ctx may be used from one thread at a time; distinct ctxs are independent.
 * Return codes are absl/gRPC status code numbers; arfuse_last_error() describes the last failure
 * on the calling thread.
 */
#ifndef ARFUSE_CLIENT_INSTREAM_ARFUSE_CLIENT_H_
#define ARFUSE_CLIENT_INSTREAM_ARFUSE_CLIENT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of this C ABI (functions and structs below) and of the attach blob it reads.
 * 2: the attachment's op counter page, arfuse_note_declined. */
#define ARFUSE_CLIENT_ABI_VERSION 4

/* Status codes (absl::StatusCode / grpc::StatusCode numbers). */
#define ARFUSE_OK 0
#define ARFUSE_INVALID_ARGUMENT 3  /* a bad pointer, shape, dtype or alias: nothing launched */
#define ARFUSE_DEADLINE_EXCEEDED 4 /* host mode: a peer did not arrive within the spin timeout */
#define ARFUSE_NOT_FOUND 5
#define ARFUSE_PERMISSION_DENIED 7
#define ARFUSE_FAILED_PRECONDITION 9 /* ABI/version mismatch, wrong GPU, stale generation */
#define ARFUSE_ABORTED 10            /* a kernel (or a peer) gave up: the workspace is poisoned */
#define ARFUSE_OUT_OF_RANGE                                             \
  11 /* fusion unavailable for this op (shape/dtype): run your own path \
      */
#define ARFUSE_UNIMPLEMENTED 12
#define ARFUSE_INTERNAL 13
#define ARFUSE_UNAVAILABLE 14 /* the ctx is disabled (drained, sidecar lost): run your own path */

#define ARFUSE_DTYPE_BF16 1
#define ARFUSE_DTYPE_FP16 2
#define ARFUSE_DTYPE_FP32 3

/* arfuse_supports' patterns (arfuse::Pattern). */
#define ARFUSE_PATTERN_ALLREDUCE 1
#define ARFUSE_PATTERN_ALLREDUCE_RESIDUAL_RMSNORM 2
#define ARFUSE_PATTERN_FP8_STATIC 3
#define ARFUSE_PATTERN_FP8_PER_TOKEN 4
#define ARFUSE_PATTERN_FP8_PER_GROUP 5

/* arfuse_fused_allreduce_residual_rmsnorm_fp8's quant: how the E4M3 codes are scaled. */
#define ARFUSE_QUANT_FP8_STATIC 1    /* one fp32 scale, read: q = e4m3(x * (1 / scale[0])) */
#define ARFUSE_QUANT_FP8_PER_TOKEN 2 /* fp32 [tokens] written: max(amax / 448, 1 / (448 * 512)) */
#define ARFUSE_QUANT_FP8_PER_GROUP 3 /* one scale per 128 elements of a row, written */
/* ... and its scale_layout for ARFUSE_QUANT_FP8_PER_GROUP (fp8::GroupScaleLayout; 0 otherwise).
 * With G = hidden / 128 groups and A = tokens rounded up to 4, the scale tensor is:
 *   ARFUSE_SCALE_FP32_ROW_MAJOR  fp32 [tokens, G] row-major: T * G floats;
 *   ARFUSE_SCALE_FP32_MN_MAJOR   fp32 [tokens, G], strides [1, A]: (G - 1) * A + T floats;
 *   ARFUSE_SCALE_UE8M0_PACKED    UE8M0 exponent bytes, four groups per int32 (little-endian),
 *                                [tokens, ceil(G / 4)], strides [1, A]: (ceil(G/4) - 1) * A + T
 *                                words. */
#define ARFUSE_SCALE_FP32_ROW_MAJOR 1
#define ARFUSE_SCALE_FP32_MN_MAJOR 2
#define ARFUSE_SCALE_UE8M0_PACKED 3

/* Decline reasons a caller reports with arfuse_note_declined (kernels/instream/op_counters.h has
 * the full list; the library counts the others itself). */
#define ARFUSE_DECLINE_NOT_CONTIGUOUS 9
#define ARFUSE_DECLINE_OTHER 10

typedef struct arfuse_ctx arfuse_ctx;

typedef struct arfuse_ctx_info {
  uint32_t struct_bytes; /* set by the caller: sizeof(arfuse_ctx_info) */
  uint32_t device_kind;  /* 1 CUDA, 2 host */
  uint32_t rank;
  uint32_t world_size;
  uint64_t generation;
  uint64_t attach_id;
  uint32_t max_tokens; /* workspace capacity: tokens x hidden <= max_tokens x hidden */
  uint32_t hidden;
  uint32_t dtype; /* ARFUSE_DTYPE_* of the workspace */
  uint32_t sm;    /* compute capability x 10 (0 in host mode) */
  uint64_t oneshot_max_bytes;
  uint64_t twoshot_max_bytes;
  uint64_t image_bytes;
  uint32_t num_entries;
  uint32_t pdl;
} arfuse_ctx_info;

/* This library's ABI version (ARFUSE_CLIENT_ABI_VERSION), the kernel launch ABI it fills
 * (kLaunchAbiVersion and the argument size) and its version string. Send the first three in
 * Fusion.AttachRequest. */
uint32_t arfuse_client_abi_version(void);
uint32_t arfuse_launch_abi_version(void);
uint32_t arfuse_launch_args_bytes(void);
const char* arfuse_client_version(void);

/* The last failure's message on this thread ("" when none). Never NULL. */
const char* arfuse_last_error(void);

/* Maps every rank's workspace, loads the kernel image (every function loaded before first use)
 * and checks the blob: magic, versions, sizes, offsets, the GPU (the current CUDA context's
 * device must be the sidecar's). `fds` are the descriptors picked up with the attach's ticket,
 * in order; the library duplicates what it keeps, the caller closes its own. Not inside a graph
 * capture. FAILED_PRECONDITION for a version or GPU mismatch, INVALID_ARGUMENT for a malformed
 * blob, UNAVAILABLE when the CUDA driver cannot be loaded. */
int arfuse_attach(const void* blob, size_t blob_bytes, const int* fds, size_t num_fds,
                  arfuse_ctx** out);

/* Unmaps and frees. The caller's stream must have finished every launch of this ctx, and graphs
 * that captured them must be destroyed first (their launches point into these mappings). NULL is
 * a no-op. */
int arfuse_detach(arfuse_ctx* ctx);

int arfuse_ctx_get_info(const arfuse_ctx* ctx, arfuse_ctx_info* info);

/* Whether an op of this shape would launch fused: ARFUSE_OK, or ARFUSE_OUT_OF_RANGE with the
 * reason (tokens x hidden beyond the workspace or the dispatch's fused range, hidden not
 * attached, another dtype, no kernel for the pattern, an FP8 pattern of fp32, a per-group hidden
 * that is not a multiple of 128) or ARFUSE_UNAVAILABLE (disabled). Pure host logic, the same
 * answer on every rank for the same arguments. pattern: ARFUSE_PATTERN_* (1 allreduce, 2
 * allreduce + residual + RMSNorm, 3 to 5 the same with FP8 output, static, per-token or
 * per-group; the answer for 5 holds for every scale layout). */
int arfuse_supports(const arfuse_ctx* ctx, int pattern, uint32_t tokens, uint32_t hidden,
                    int dtype);

/* residual_out = sum over ranks of input + residual_in; norm_out = rmsnorm(residual_out) * gamma.
 * Tensors are contiguous [tokens, hidden] (gamma [hidden]) of `dtype`, 16-byte aligned, device
 * memory of the ctx's GPU (host memory in host mode). residual_out may be residual_in (in place);
 * no other two may overlap, and no output may overlap input. Host-side checks first (a failure
 * launches nothing), then one kernel launch on `stream` (a CUstream / cudaStream_t; NULL: the
 * legacy default stream). tokens == 0 launches nothing. */
int arfuse_fused_allreduce_residual_rmsnorm(arfuse_ctx* ctx, void* stream, const void* input,
                                            const void* residual_in, void* residual_out,
                                            void* norm_out, const void* gamma, uint32_t tokens,
                                            uint32_t hidden, int dtype, float eps);

/* The same op with FP8 E4M3 output (C ABI 4; attach ABI 4 blobs list the FP8 patterns' kernel
 * entries, and arfuse_supports takes patterns 3 to 5): quant_out = e4m3(x * (1 / scale)), at
 * most one E4M3 step from e4m3(x / scale), x the normalized value (rmsnorm(residual_out) *
 * gamma) in fp32 before its rounding to dtype (docs/kernels.md, "FP8 outputs"). quant:
 * ARFUSE_QUANT_FP8_*; scale_layout: ARFUSE_SCALE_* for ARFUSE_QUANT_FP8_PER_GROUP, 0 otherwise (a
 * bad value of either: INVALID_ARGUMENT). dtype bf16 or fp16 (fp32: OUT_OF_RANGE), per group hidden
 * a multiple of 128 (else OUT_OF_RANGE). quant_out: [tokens, hidden] bytes of E4M3 codes, 16-byte
 * aligned. scale, 4-byte aligned: the static scale (one fp32, read), per token fp32 [tokens]
 * (written), per group the layout's extent (written, padding bytes 0). norm_out may be NULL (only
 * the codes and scales are written); when given it is the pattern-2 norm_out. residual_out as
 * above. No output may overlap another tensor (residual_out may be residual_in). The fused op
 * counters count these ops as allreduce_residual_rmsnorm. */
int arfuse_fused_allreduce_residual_rmsnorm_fp8(arfuse_ctx* ctx, void* stream, const void* input,
                                                const void* residual_in, void* residual_out,
                                                void* norm_out, void* quant_out, void* scale,
                                                const void* gamma, uint32_t tokens, uint32_t hidden,
                                                int dtype, float eps, int quant, int scale_layout);

/* output = sum over ranks of input (output may equal input; no partial overlap). */
int arfuse_fused_allreduce(arfuse_ctx* ctx, void* stream, const void* input, void* output,
                           uint32_t tokens, uint32_t hidden, int dtype);

/* Reads the ctx's host-mapped error word, which the kernels write when a launch fails (a peer
 * did not arrive, an abort, a stale generation, a poisoned workspace). *code = 0 and ARFUSE_OK
 * while healthy; otherwise *code is the kernel's error code (arfuse_error_name) and the return is
 * FAILED_PRECONDITION (stale generation: attach again) or ABORTED (poisoned: the sidecars
 * re-initialize; attach again after). Outputs of the failed launch and of later launches are not
 * written. Cheap (no CUDA call); outside capture. */
int arfuse_check(arfuse_ctx* ctx, uint32_t* code);

/* Names the program this ctx's ops belong to: every rank of one client program sets the same
 * key (drawn once and shared over the program's own group, as arfuse.torch.agree does), before
 * its first op and outside capture (a captured launch keeps the key it was captured with). Ops
 * then pair only with ops of the same key: a client of another program launching on a peer rank
 * (one that attached in the milliseconds after a client of this group died mid-op) fails with
 * op_mismatch on every rank (ARFUSE_ABORTED from arfuse_check on CUDA; ARFUSE_INVALID_ARGUMENT
 * from the op in host mode) instead of pairing with the dead client's op. 0 (the default) is no
 * key; it pairs with other clients' key 0. INVALID_ARGUMENT for a key above 2^24 - 1
 * (ARFUSE_PROGRAM_KEY_MAX). Launch ABI 4. */
#define ARFUSE_PROGRAM_KEY_MAX 0xFFFFFFu
int arfuse_set_program_key(arfuse_ctx* ctx, uint32_t key);

/* Disables the ctx: every later op returns ARFUSE_UNAVAILABLE with `reason` (a drain, a lost
 * sidecar). Launches already enqueued are not affected. */
int arfuse_disable(arfuse_ctx* ctx, const char* reason);

/* Every op the library decides is counted in the attachment's op counter page, shared with the
 * sidecar (no RPC, one relaxed atomic add): fused ops by pattern and token bucket, declined ops
 * (OUT_OF_RANGE, UNAVAILABLE, INVALID_ARGUMENT) by reason; the FP8 ops count as
 * allreduce_residual_rmsnorm (the page has the two patterns); the sidecar exports them as
 * arfuse_instream_ops_total. Graph replays of a captured launch run no host code: the kernels
 * count every launch in the attachment's counter slot of the workspace (on CUDA the sidecar
 * exports those as the fused ops). arfuse_supports counts nothing. A caller
 * that declines an op before asking the library (its tensors are not contiguous, say) reports it
 * here so the sidecar sees it: reason is ARFUSE_DECLINE_* (any reason number of
 * kernels/instream/op_counters.h below 11); INVALID_ARGUMENT for another. */
int arfuse_note_declined(arfuse_ctx* ctx, int reason);

/* A static name for a kernel error code ("timeout", "stale_generation", ...). Never NULL. */
const char* arfuse_error_name(uint32_t code);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ARFUSE_CLIENT_INSTREAM_ARFUSE_CLIENT_H_ */
