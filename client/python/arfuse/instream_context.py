"""One in-stream attachment: InStreamContext (the ops in the caller's stream, the sidecar's
events applied at the caller's next op, the drain's answer, the queries, detach) and its
ContextInfo. Made by arfuse.instream_attach.attach; arfuse.instream re-exports both.
"""
import ctypes
import dataclasses
import sys
import threading
from typing import List, Optional, Sequence

from .client import ArfuseError, Client
from .instream_abi import (DEADLINE_EXCEEDED, DECLINE_REASONS, DEVICE_KINDS, DTYPE_NAMES,
                           FAILED_PRECONDITION, INVALID_ARGUMENT, OK, OUT_OF_RANGE,
                           PATTERN_ALLREDUCE_RESIDUAL_RMSNORM, UNAVAILABLE, CtxInfoStruct,
                           InStreamError, Unavailable, dtype_code, error_name, last_error,
                           status_code)
from .instream_fp8 import quant_code, scale_layout_code
from .instream_sessions import (EVENT_CLIENT_CLOSED, EVENT_DRAIN, EVENT_POISONED,
                                EVENT_REINITIALIZED, EVENT_SESSION_LOST, attachments_of)
from .stream_wait import capturing, wait_stream


@dataclasses.dataclass(frozen=True)
class ContextInfo:
    device: str          # "cuda" or "host"
    rank: int
    world_size: int
    generation: int
    attach_id: int
    max_tokens: int      # workspace capacity: tokens x hidden <= max_tokens x hidden
    hidden: int
    dtype: str           # the workspace's dtype: ops of another one are not served
    sm: int
    oneshot_max_bytes: int
    twoshot_max_bytes: int
    image_bytes: int
    num_entries: int
    pdl: bool
    memory_kind: str = ""  # from the AttachResponse, for logs

    @classmethod
    def from_struct(cls, s: CtxInfoStruct, memory_kind: str = "") -> "ContextInfo":
        return cls(device=DEVICE_KINDS.get(s.device_kind, str(s.device_kind)), rank=s.rank,
                   world_size=s.world_size, generation=s.generation, attach_id=s.attach_id,
                   max_tokens=s.max_tokens, hidden=s.hidden,
                   dtype=DTYPE_NAMES.get(s.dtype, str(s.dtype)), sm=s.sm,
                   oneshot_max_bytes=s.oneshot_max_bytes, twoshot_max_bytes=s.twoshot_max_bytes,
                   image_bytes=s.image_bytes, num_entries=s.num_entries, pdl=bool(s.pdl),
                   memory_kind=memory_kind)


def _ptr(p) -> Optional[int]:
    return None if p is None else int(p)


class InStreamContext:
    """One attachment: this process's mappings of the group's workspace and the loaded kernels.

    One thread at a time may launch on it (the library's rule); the client's session thread only
    records events, which take effect at the caller's next op or check(). Garbage collection does
    not detach it: CUDA graphs that captured its launches can outlive the Python object, and
    unmapping under them would fault; call detach() once they are destroyed."""

    # How long the drain's answer may wait for the last launch (bounded: the sidecar's own wait
    # for the answer is bounded too).
    drain_wait_s = 10.0

    def __init__(self, lib, handle: ctypes.c_void_p, client: Optional[Client], response,
                 hiddens: Sequence[int]):
        self._lib = lib
        self._handle = handle
        self.client = client
        self.hiddens = list(hiddens)
        self.target = client.target if client is not None else ""
        st = CtxInfoStruct(struct_bytes=ctypes.sizeof(CtxInfoStruct))
        rc = lib.arfuse_ctx_get_info(handle, ctypes.byref(st))
        if rc != OK:
            raise InStreamError(rc, f"arfuse_ctx_get_info: {last_error(lib)}")
        self.info = ContextInfo.from_struct(st, getattr(response, "memory_kind", ""))
        self.attach_id = int(getattr(response, "attach_id", 0) or self.info.attach_id)
        self._lock = threading.Lock()   # the library's one-thread rule, and the events' state
        self._pending: List[tuple] = []  # (kind, reason) recorded by the session thread
        self._disabled = ""              # see `disabled`
        self._disabled_reason = ""
        self._program_key = 0
        self._drain_unanswered = False
        self._launches = 0
        self._last_stream: Optional[int] = None
        self._detached = False
        self._fused_range = {}
        # Set by reattach(): this context's client was made for it (closed with the next one).
        self.owns_client = False
        # Set by the first poll(at_agreement=True) (arfuse.torch.agree): from then on a drain
        # takes effect only at the ranks' agreement points, never between a rank's "yes" and its
        # launch: a rank that skipped an op its peers launched would leave them spinning.
        self._agreement = False

    # -- state --
    @property
    def disabled(self) -> str:
        """Why later ops launch nothing ("" while enabled): "drained", "reinitialized",
        "poisoned", "sidecar gone", "client closed" or "disabled" (disable() by the caller)."""
        return self._disabled

    @property
    def disabled_reason(self) -> str:
        return self._disabled_reason

    @property
    def launches(self) -> int:
        return self._launches

    @property
    def device(self) -> str:
        return self.info.device

    @property
    def lib(self):
        """The loaded libarfuse_client this context was attached with (reattach's)."""
        return self._lib

    def _require(self):
        if self._detached:
            raise InStreamError(FAILED_PRECONDITION, "the in-stream context is detached")

    # -- events (from the client's session thread, through arfuse.instream_sessions) --
    def on_session_event(self, kind: int, reason: str):
        """Records an AttachEvent or a lost session; applied by the caller's next op/check."""
        self._pending.append((kind, reason))
        # An idle context can be settled at once (nothing launched, or a host-mode context with
        # no op in progress: its ops are synchronous); otherwise the caller's thread does it.
        if self._lock.acquire(blocking=False):
            try:
                if not self._detached and (self._launches == 0 or self.info.device == "host"):
                    self._apply_pending(caller=False, defer_drain=self._agreement)
            finally:
                self._lock.release()

    def _apply_pending(self, caller: bool, defer_drain: bool = False):
        """Under self._lock. `caller`: on the caller's thread (may wait for its stream).
        `defer_drain`: drains stay pending (for the next agreement point); the rest apply."""
        kept = []
        while self._pending:
            kind, reason = self._pending.pop(0)
            if kind == EVENT_DRAIN and defer_drain:
                kept.append((kind, reason))
            elif kind == EVENT_DRAIN:
                self._disable("drained", f"drained by the sidecar: {reason or 'no reason given'}")
                self._drain_unanswered = True
            elif kind == EVENT_REINITIALIZED:
                self._disable("reinitialized",
                              f"workspace re-initialized ({reason or 'no reason given'}): "
                              "attach again and capture graphs again")
            elif kind == EVENT_POISONED:
                self._disable("poisoned", f"workspace poisoned: {reason or 'no reason given'}")
            elif kind == EVENT_CLIENT_CLOSED:
                self._disable("client closed", reason)
            else:  # EVENT_SESSION_LOST
                self._disable("sidecar gone", f"sidecar gone: {reason}")
        self._pending.extend(kept)
        if self._drain_unanswered:
            self._answer_drain(caller)

    def _disable(self, state: str, reason: str):
        if not self._disabled or state == "sidecar gone":
            self._disabled, self._disabled_reason = state, reason
        if not self._detached:
            self._lib.arfuse_disable(self._handle, reason.encode()[:4000])

    def _answer_drain(self, caller: bool):
        """Answers a drain once this context's launches have finished (bounded wait)."""
        client = self.client
        if client is None or client.session_lost:
            self._drain_unanswered = False  # nobody to answer
            return
        stream = self._last_stream
        if self.info.device == "cuda" and self._launches:
            if not caller or capturing(stream):
                return  # the caller's next op or check() outside capture answers
            if not wait_stream(stream, self.drain_wait_s):
                print(f"arfuse: attachment {self.attach_id}: the last launch did not finish "
                      f"within {self.drain_wait_s:g} s; the drain stays unanswered",
                      file=sys.stderr)
                return
        self._drain_unanswered = False
        attachments_of(client).answer_drain(self.attach_id)

    def poll(self, at_agreement: bool = False):
        """Applies what the sidecar said since the last call (called by every op and check).
        at_agreement: called where all ranks decide together whether to fuse (agree()); once
        it has been, a drain applies only there."""
        if at_agreement:
            self._agreement = True
        if self._pending or self._drain_unanswered:
            with self._lock:
                self._apply_pending(caller=True,
                                    defer_drain=self._agreement and not at_agreement)

    def disable(self, reason: str):
        """Every later op launches nothing and raises Unavailable with `reason`."""
        with self._lock:
            self._require()
            self._disable("disabled", reason)

    def set_program_key(self, key: int):
        """Names the program this context's ops belong to (arfuse_set_program_key): every rank
        of the program sets the same key, 1 to PROGRAM_KEY_MAX, before its first op and outside
        capture; ops then pair only with ops of the same key, so a client of another program on
        a peer rank fails with op_mismatch instead of pairing (arfuse.torch.agree draws one and
        sets it on every rank). 0 clears it. InStreamError INVALID_ARGUMENT above the maximum."""
        if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key <= 0xFFFFFFFF:
            raise InStreamError(INVALID_ARGUMENT,
                                "the program key is not an integer from 0 to PROGRAM_KEY_MAX")
        with self._lock:
            self._require()
            rc = self._lib.arfuse_set_program_key(self._handle, key)
            if rc != OK:
                raise InStreamError(rc, f"arfuse_set_program_key: {last_error(self._lib)}")
            self._program_key = key

    @property
    def program_key(self) -> int:
        """The key set_program_key() set (0: none)."""
        return self._program_key

    def note_declined(self, reason: str):
        """Counts an op the caller declined before asking the library ("not_contiguous" or
        "other") in the attachment's op counter page, which the sidecar exports as
        arfuse_instream_ops_total{path="declined"}. No RPC."""
        code = DECLINE_REASONS.get(reason)
        if code is None:
            raise ValueError(f"decline reason {reason!r} is not one of {sorted(DECLINE_REASONS)}")
        with self._lock:
            self._require()
            rc = self._lib.arfuse_note_declined(self._handle, code)
            if rc != OK:
                raise InStreamError(rc, f"arfuse_note_declined: {last_error(self._lib)}")

    # -- queries --
    def why_not(self, tokens: int, hidden: int, dtype,
                pattern: int = PATTERN_ALLREDUCE_RESIDUAL_RMSNORM) -> Optional[str]:
        """None when an op of this shape would launch fused; else why not (pure host logic: the
        same answer on every rank for the same arguments)."""
        self.poll()
        with self._lock:
            self._require()
            rc = self._lib.arfuse_supports(self._handle, pattern, int(tokens), int(hidden),
                                           dtype_code(dtype))
            if rc == OK:
                return None
            msg = last_error(self._lib)
        if rc in (OUT_OF_RANGE, UNAVAILABLE):
            return msg or status_code(rc).name
        raise InStreamError(rc, f"arfuse_supports: {msg}")

    def supports(self, tokens: int, hidden: int, dtype,
                 pattern: int = PATTERN_ALLREDUCE_RESIDUAL_RMSNORM) -> bool:
        return self.why_not(tokens, hidden, dtype, pattern) is None

    def max_fused_tokens(self, hidden: int, dtype,
                         pattern: int = PATTERN_ALLREDUCE_RESIDUAL_RMSNORM) -> int:
        """The largest token count served fused at this hidden size and dtype (0: none), from
        arfuse_supports (monotone in tokens). For compile-time gating (a torch.compile pass
        decides per shape range, before any op runs), the same on every rank."""
        key = (int(hidden), dtype_code(dtype), pattern)
        if key in self._fused_range:
            return self._fused_range[key]
        if not self.supports(1, hidden, dtype, pattern):
            best = 0
        else:
            lo, hi = 1, max(1, self.info.max_tokens)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.supports(mid, hidden, dtype, pattern):
                    lo = mid
                else:
                    hi = mid - 1
            best = lo
        if not self._disabled:
            self._fused_range[key] = best
        return best

    # -- ops --
    def _launch_failed(self, rc: int, what: str):
        msg = last_error(self._lib)
        if rc == OUT_OF_RANGE:
            raise Unavailable(rc, f"{what}: {msg}")
        if rc == UNAVAILABLE:
            raise Unavailable(rc, f"{what}: {msg or self._disabled_reason}",
                              self._disabled or "disabled")
        raise InStreamError(rc, f"{what}: {msg}")

    def _launch(self, what: str, fn, stream: Optional[int], tokens: int, *args):
        """One library launch under the one-thread rule; counts it and remembers its stream
        (what a drain's answer waits for)."""
        self.poll()
        with self._lock:
            self._require()
            rc = fn(self._handle, _ptr(stream), *args)
            if rc != OK:
                self._launch_failed(rc, what)
            if tokens:
                self._launches += 1
                self._last_stream = _ptr(stream)

    def fused_allreduce_residual_rmsnorm(self, stream: Optional[int], input, residual_in,
                                         residual_out, norm_out, gamma, tokens: int,
                                         hidden: int, dtype, eps: float):
        """residual_out = sum over ranks of input + residual_in; norm_out = rmsnorm(residual_out)
        * gamma. Raw addresses (ints) of contiguous [tokens, hidden] tensors (gamma [hidden]);
        residual_out may be residual_in. One launch on `stream` (a CUstream as an int; None or 0:
        the legacy default stream; ignored in host mode). Raises Unavailable (nothing launched)
        or InStreamError (INVALID_ARGUMENT: nothing launched either)."""
        self._launch("fused allreduce + residual + RMSNorm",
                     self._lib.arfuse_fused_allreduce_residual_rmsnorm, stream, tokens,
                     _ptr(input), _ptr(residual_in), _ptr(residual_out), _ptr(norm_out),
                     _ptr(gamma), int(tokens), int(hidden), dtype_code(dtype), float(eps))

    def fused_allreduce_residual_rmsnorm_fp8(self, stream: Optional[int], input, residual_in,
                                             residual_out, norm_out, quant_out, scale, gamma,
                                             tokens: int, hidden: int, dtype, eps: float,
                                             quant, scale_layout=None):
        """The same op with FP8 E4M3 output (arfuse_fused_allreduce_residual_rmsnorm_fp8):
        quant_out [tokens, hidden] codes (16-byte aligned), scale read (quant "static": one
        fp32) or written (per_token: fp32 [tokens]; per_group: fp8_scale_tensor's layout),
        4-byte aligned; norm_out may be None. quant: a QUANTS name or number; scale_layout: a
        SCALE_LAYOUTS name or number for per_group, None otherwise. dtype bf16 or fp16 (fp32
        and a per-group hidden that is not a multiple of 128 raise Unavailable: not served).
        Raises as fused_allreduce_residual_rmsnorm."""
        self._launch("fused allreduce + residual + RMSNorm + FP8 quantization",
                     self._lib.arfuse_fused_allreduce_residual_rmsnorm_fp8, stream, tokens,
                     _ptr(input), _ptr(residual_in), _ptr(residual_out), _ptr(norm_out),
                     _ptr(quant_out), _ptr(scale), _ptr(gamma), int(tokens), int(hidden),
                     dtype_code(dtype), float(eps), quant_code(quant),
                     scale_layout_code(scale_layout))

    def fused_allreduce(self, stream: Optional[int], input, output, tokens: int, hidden: int,
                        dtype):
        """output = sum over ranks of input (output may be input). As above."""
        self._launch("fused allreduce", self._lib.arfuse_fused_allreduce, stream, tokens,
                     _ptr(input), _ptr(output), int(tokens), int(hidden), dtype_code(dtype))

    def check(self):
        """Raises InStreamError when a launch failed: FAILED_PRECONDITION for a stale generation
        (attach again), ABORTED for a poisoned workspace (the sidecars re-initialize; attach
        again after). The failed launch's outputs and later ones are not written. Also answers
        a pending drain. Cheap (reads a host-mapped word); outside capture."""
        self.poll()
        with self._lock:
            self._require()
            code = ctypes.c_uint32(0)
            rc = self._lib.arfuse_check(self._handle, ctypes.byref(code))
            if rc == OK:
                return
            name = error_name(code.value, self._lib)
            msg = last_error(self._lib)
        raise InStreamError(rc, f"in-stream launch failed: {name} (kernel error {code.value})"
                            + (f": {msg}" if msg else ""), code.value, name)

    # -- teardown --
    def detach(self, wait: float = 10.0):
        """Answers a pending drain, waits (at most `wait` s) for the last launch, unmaps, and
        tells the sidecar (Fusion.Detach; skipped when it is gone). Graphs that captured launches
        of this context must be destroyed first. Idempotent."""
        with self._lock:
            if self._detached:
                return
            if self._pending:
                self._apply_pending(caller=True)
            if self.info.device == "cuda" and self._launches and \
                    not wait_stream(self._last_stream, wait):
                raise InStreamError(DEADLINE_EXCEEDED,
                                    f"attachment {self.attach_id}: the last launch did not "
                                    f"finish within {wait:g} s; not detached")
            self._drain_unanswered = False
            rc = self._lib.arfuse_detach(self._handle)
            self._detached = True
            msg = last_error(self._lib) if rc != OK else ""
        client = self.client
        if client is not None:
            attachments_of(client).forget(self.attach_id)
            if not client.session_lost and not client.closed:
                try:
                    client.detach_rpc(self.attach_id)
                except ArfuseError:
                    pass  # the sidecar releases the attachment with the session anyway
        if rc != OK:
            raise InStreamError(rc, f"arfuse_detach: {msg}")

    def __repr__(self):
        i = self.info
        state = f", disabled: {self._disabled_reason}" if self._disabled else ""
        return (f"InStreamContext(attach_id={self.attach_id}, {i.device}, rank {i.rank}/"
                f"{i.world_size}, hidden {i.hidden}, {i.dtype}, max_tokens {i.max_tokens}"
                f"{state})")
