/* libarfuse_ring: ring an arfuse sidecar's doorbell from inside a CUDA graph (docs/doorbell.md).
 *
 * C ABI, for C++ clients and Python (ctypes). Typical use, once per doorbell plan:
 *
 *   void* slot = NULL;
 *   arfuse_open_doorbell(doorbell.ipc_handle, doorbell.offset, &slot);   // outside capture
 *   arfuse_doorbell_check_values(doorbell.request_value, doorbell.complete_value,
 *                                doorbell.reset_value);
 *   ... inside the captured region, after the kernels that produce the op's input:
 *   arfuse_ring(stream, slot, num_tokens, 5000000000ull);   // the op's outputs are ready after
 *   ... after a replay (or every N replays), outside capture:
 *   uint32_t code; arfuse_doorbell_error(slot, &code);      // 0: every ring so far succeeded
 *   arfuse_close_doorbell(slot);
 *
 * The current CUDA device must be the client's GPU when opening. Every function returns 0 on
 * success, a negative ARFUSE_RING_E* code for a bad argument or state, or a positive cudaError_t
 * value from the CUDA runtime; arfuse_ring_strerror() describes any of them.
 */
#ifndef ARFUSE_CLIENT_RING_ARFUSE_RING_H_
#define ARFUSE_CLIENT_RING_ARFUSE_RING_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ARFUSE_RING_OK 0
#define ARFUSE_RING_EINVAL (-1)   /* a null, misaligned or out-of-range argument */
#define ARFUSE_RING_ENOTOPEN (-2) /* the slot pointer was not returned by arfuse_open_doorbell */
#define ARFUSE_RING_EVERSION (-3) /* handshake values differ from this library's */

/* Maps the sidecar's doorbell block (64-byte legacy CUDA IPC handle, from CreatePlan's Doorbell
 * message) and returns the device pointer of the slot at `offset`. Opening several slots of one
 * block maps it once (reference counted). */
int arfuse_open_doorbell(const void* ipc_handle64, uint64_t offset, void** slot_ptr);

/* Releases a slot opened with arfuse_open_doorbell; the block is unmapped with its last slot.
 * No ring may be pending on it. */
int arfuse_close_doorbell(void* slot_ptr);

/* Enqueues the ring kernel on `stream` (a cudaStream_t; NULL = the legacy default stream):
 * stores num_tokens, rings, waits for the sidecar's completion (at most timeout_ns) and re-arms.
 * Capturable in CUDA graphs. A ring never hangs: on timeout it records an error in the slot
 * (arfuse_doorbell_error). While the slot holds an error, rings do nothing. */
int arfuse_ring(void* stream, void* slot_ptr, uint32_t num_tokens, uint64_t timeout_ns);

/* Reads the slot's sticky error word (synchronous copy: not inside graph capture). 0: healthy. */
int arfuse_doorbell_error(void* slot_ptr, uint32_t* code);

/* A static description of a slot error code (never NULL). */
const char* arfuse_doorbell_error_name(uint32_t code);

/* 0 when the Doorbell message's handshake values are the ones this library rings with. */
int arfuse_doorbell_check_values(uint32_t request_value, uint32_t complete_value,
                                 uint32_t reset_value);

/* A static description of a return code of this library (never NULL). */
const char* arfuse_ring_strerror(int rc);

#ifdef __cplusplus
}
#endif

#endif /* ARFUSE_CLIENT_RING_ARFUSE_RING_H_ */
