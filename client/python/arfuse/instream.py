"""The in-stream data plane: the sidecar's fused kernels launched in this process's own stream.

    import arfuse
    client = arfuse.Client("/run/arfuse/rank0.sock")
    ctx = client.attach([4096])          # Fusion.Attach + the library's arfuse_attach, once
    ctx.fused_allreduce_residual_rmsnorm(stream, x, r, r, y, gamma, tokens, 4096, "bf16", 1e-6)
    ctx.check()                          # now and then, outside capture
    ctx.detach()                         # after every graph that captured its launches is gone

This module binds libarfuse_client (client/instream/arfuse_client.h) with ctypes: raw pointers
and stream handles in, no torch needed. arfuse.torch builds the torch op on it, and
arfuse.integrations.sglang the SGLang shim.

What the pieces do:
- attach() asks this rank's sidecar for the workspace (Fusion.Attach, sending the library's ABI
  and launch-ABI versions), picks up the descriptors the answer names on the sidecar's fd socket,
  and hands both to arfuse_attach, which maps every rank's buffers and loads the kernel image.
- An op is one launch in the caller's stream. OUT_OF_RANGE (this shape or dtype is not served
  fused) and UNAVAILABLE (the context is disabled) launch nothing and raise Unavailable: the
  framework runs its own path for that op, exactly as with FlashInfer's (None, None).
- The sidecar talks back over the client's Session stream (arfuse.Client), which hands its
  events to the client's attachment table (arfuse.instream_sessions, one of the client's session
  listeners) and from there to each context: DRAIN disables the context and is answered
  (SessionRequest.drained_attach_id) at the next op or check() once the last launch has
  finished; REINITIALIZED and POISONED disable it with the reason; a sidecar that is gone (the
  stream ended) disables it with "sidecar gone: ...". reattach() makes a new client and context
  once the sidecar is back.

Where it lives (this module re-exports every public name of these, and registers attach() as
Client.attach's implementation):
- arfuse.instream_abi: the library's C ABI through ctypes (numbers, errors, load_library).
- arfuse.instream_fp8: the FP8 patterns' quant and scale-layout codes and scale tensors.
- arfuse.stream_wait: waiting for the caller's stream outside a capture (the drain's answer).
- arfuse.instream_sessions: each client's attachments and the session events for them
  (attachments(client), attachments_of(client), the event kinds).
- arfuse.instream_context: InStreamContext, one attachment, and its ContextInfo.
- arfuse.instream_attach: attach(), pick_up_fds() and reattach().

The library is found through $ARFUSE_CLIENT_LIB, then in or beside this package, then by name
through the system's library path (arfuse._native).
"""
from . import client as _client_module
from .instream_abi import (ABORTED, CLIENT_ABI_VERSION, DEADLINE_EXCEEDED, DECLINE_REASONS,
                           DEVICE_KINDS, DTYPE_NAMES, DTYPES, FAILED_PRECONDITION,
                           INVALID_ARGUMENT, LIBRARY, OK, OUT_OF_RANGE, PATTERN_ALLREDUCE,
                           PATTERN_ALLREDUCE_RESIDUAL_RMSNORM, PATTERN_FP8_PER_GROUP,
                           PATTERN_FP8_PER_TOKEN, PATTERN_FP8_STATIC, PROGRAM_KEY_MAX,
                           UNAVAILABLE, CtxInfoStruct, InStreamError, Unavailable,
                           draw_program_key, dtype_code, error_name, find_client_library,
                           last_error, library_versions, load_library, status_code)
from .instream_attach import attach, pick_up_fds, reattach
from .instream_context import ContextInfo, InStreamContext
from .instream_fp8 import (FP8_GROUP_SIZE, QUANTS, SCALE_LAYOUTS, fp8_pattern,
                           fp8_scale_elements, fp8_scale_tensor, quant_code, scale_layout_code,
                           tma_aligned_tokens)
from .instream_sessions import (EVENT_CLIENT_CLOSED, EVENT_DRAIN, EVENT_POISONED,
                                EVENT_REINITIALIZED, EVENT_SESSION_LOST, ClientAttachments,
                                attachments, attachments_of)
from .stream_wait import capturing, wait_stream

__all__ = [
    "ABORTED", "CLIENT_ABI_VERSION", "DEADLINE_EXCEEDED", "DECLINE_REASONS", "DEVICE_KINDS",
    "DTYPE_NAMES", "DTYPES", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "LIBRARY", "OK",
    "OUT_OF_RANGE", "PATTERN_ALLREDUCE", "PATTERN_ALLREDUCE_RESIDUAL_RMSNORM",
    "PATTERN_FP8_PER_GROUP", "PATTERN_FP8_PER_TOKEN", "PATTERN_FP8_STATIC", "PROGRAM_KEY_MAX",
    "UNAVAILABLE",
    "CtxInfoStruct", "InStreamError", "Unavailable", "draw_program_key", "dtype_code",
    "error_name",
    "find_client_library", "last_error", "library_versions", "load_library", "status_code",
    "attach", "pick_up_fds", "reattach",
    "EVENT_CLIENT_CLOSED", "EVENT_DRAIN", "EVENT_POISONED", "EVENT_REINITIALIZED",
    "EVENT_SESSION_LOST", "ClientAttachments", "attachments", "attachments_of", "ContextInfo",
    "InStreamContext",
    "FP8_GROUP_SIZE", "QUANTS", "SCALE_LAYOUTS", "fp8_pattern", "fp8_scale_elements",
    "fp8_scale_tensor", "quant_code", "scale_layout_code", "tma_aligned_tokens",
    "capturing", "wait_stream",
]

_client_module.register_attach(attach)
