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
- The sidecar talks back over the client's Session stream (arfuse.Client): DRAIN disables the
  context and is answered (SessionRequest.drained_attach_id) at the next op or check() once the
  last launch has finished; REINITIALIZED and POISONED disable it with the reason; a sidecar
  that is gone (the stream ended) disables it with "sidecar gone: ...". reattach() makes a new
  client and context once the sidecar is back.

The library is found through $ARFUSE_CLIENT_LIB, then in or beside this package, then by name
through the system's library path (arfuse._native).
"""
import ctypes
import dataclasses
import sys
import threading
import time
from typing import Callable, List, Optional, Sequence

import grpc

from ._native import find_native_library
from . import client as _client_module
from .client import ArfuseError, Client, SidecarLost, fusion_pb2

LIBRARY = "libarfuse_client.so"
# The C ABI this binding is written for (ARFUSE_CLIENT_ABI_VERSION in arfuse_client.h).
CLIENT_ABI_VERSION = 4

# Return codes (absl/gRPC status code numbers).
OK = 0
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
FAILED_PRECONDITION = 9
ABORTED = 10
OUT_OF_RANGE = 11
UNAVAILABLE = 14

# Reasons a caller reports with note_declined (ARFUSE_DECLINE_* in arfuse_client.h); the library
# counts every other decline itself.
DECLINE_REASONS = {"not_contiguous": 9, "other": 10}

DTYPES = {"bf16": 1, "fp16": 2, "fp32": 3}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
PATTERN_ALLREDUCE = 1
PATTERN_ALLREDUCE_RESIDUAL_RMSNORM = 2
# The FP8 E4M3 output patterns (ARFUSE_PATTERN_FP8_*): the add-RMSNorm, its fp32 value quantized.
PATTERN_FP8_STATIC = 3
PATTERN_FP8_PER_TOKEN = 4
PATTERN_FP8_PER_GROUP = 5
# arfuse_fused_allreduce_residual_rmsnorm_fp8's quant (ARFUSE_QUANT_FP8_*) and the per-group
# pattern's scale layouts (ARFUSE_SCALE_*; docs/kernels.md, "FP8 outputs").
QUANTS = {"static": 1, "per_token": 2, "per_group": 3}
SCALE_LAYOUTS = {"fp32_row_major": 1, "fp32_mn_major": 2, "ue8m0_packed": 3}
FP8_GROUP_SIZE = 128
DEVICE_KINDS = {1: "cuda", 2: "host"}

# AttachEvent.Kind numbers (fusion.proto), and the session's end as the client reports it.
EVENT_DRAIN = 1
EVENT_REINITIALIZED = 2
EVENT_POISONED = 3
EVENT_SESSION_LOST = 0
EVENT_CLIENT_CLOSED = -1

_STATUS = {c.value[0]: c for c in grpc.StatusCode}


def status_code(rc: int) -> grpc.StatusCode:
    return _STATUS.get(rc, grpc.StatusCode.UNKNOWN)


class InStreamError(ArfuseError):
    """A call of libarfuse_client failed (`code`: a grpc.StatusCode; `rc` the library's number).

    For check(): `kernel_error` is the kernel's error word and `kernel_error_name` its name."""

    def __init__(self, rc: int, message: str, kernel_error: int = 0, kernel_error_name: str = ""):
        super().__init__(status_code(rc), message)
        self.rc = rc
        self.kernel_error = kernel_error
        self.kernel_error_name = kernel_error_name


class Unavailable(InStreamError):
    """Nothing was launched: this op is not served fused (OUT_OF_RANGE: shape, hidden, dtype) or
    the context is disabled (UNAVAILABLE: drained, re-initialized, poisoned, sidecar gone).
    `disabled` says which of the context's states it is ("" for OUT_OF_RANGE)."""

    def __init__(self, rc: int, message: str, disabled: str = ""):
        super().__init__(rc, message)
        self.disabled = disabled


# ---- the library ----

class CtxInfoStruct(ctypes.Structure):
    _fields_ = [("struct_bytes", ctypes.c_uint32), ("device_kind", ctypes.c_uint32),
                ("rank", ctypes.c_uint32), ("world_size", ctypes.c_uint32),
                ("generation", ctypes.c_uint64), ("attach_id", ctypes.c_uint64),
                ("max_tokens", ctypes.c_uint32), ("hidden", ctypes.c_uint32),
                ("dtype", ctypes.c_uint32), ("sm", ctypes.c_uint32),
                ("oneshot_max_bytes", ctypes.c_uint64), ("twoshot_max_bytes", ctypes.c_uint64),
                ("image_bytes", ctypes.c_uint64), ("num_entries", ctypes.c_uint32),
                ("pdl", ctypes.c_uint32)]


assert ctypes.sizeof(CtxInfoStruct) == 80  # arfuse_ctx_info on every 64-bit ABI we build for

_LIBS = {}
_libs_lock = threading.Lock()


def find_client_library() -> Optional[str]:
    return find_native_library(LIBRARY, "ARFUSE_CLIENT_LIB")


def _declare(lib):
    vp, u32, cint = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int
    for name, res, args in (
            ("arfuse_client_abi_version", u32, []),
            ("arfuse_launch_abi_version", u32, []),
            ("arfuse_launch_args_bytes", u32, []),
            ("arfuse_client_version", ctypes.c_char_p, []),
            ("arfuse_last_error", ctypes.c_char_p, []),
            ("arfuse_attach", cint, [vp, ctypes.c_size_t, ctypes.POINTER(cint), ctypes.c_size_t,
                                     ctypes.POINTER(vp)]),
            ("arfuse_detach", cint, [vp]),
            ("arfuse_ctx_get_info", cint, [vp, ctypes.POINTER(CtxInfoStruct)]),
            ("arfuse_supports", cint, [vp, cint, u32, u32, cint]),
            ("arfuse_fused_allreduce_residual_rmsnorm", cint,
             [vp, vp, vp, vp, vp, vp, vp, u32, u32, cint, ctypes.c_float]),
            ("arfuse_fused_allreduce_residual_rmsnorm_fp8", cint,
             [vp, vp, vp, vp, vp, vp, vp, vp, vp, u32, u32, cint, ctypes.c_float, cint, cint]),
            ("arfuse_fused_allreduce", cint, [vp, vp, vp, vp, u32, u32, cint]),
            ("arfuse_check", cint, [vp, ctypes.POINTER(u32)]),
            ("arfuse_disable", cint, [vp, ctypes.c_char_p]),
            ("arfuse_note_declined", cint, [vp, cint]),
            ("arfuse_error_name", ctypes.c_char_p, [u32])):
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


def load_library(path: Optional[str] = None):
    """Loads libarfuse_client (once per path), declares its C ABI and checks its ABI version.
    InStreamError UNAVAILABLE when there is none or it does not load, FAILED_PRECONDITION when it
    speaks another ABI than this binding."""
    path = path or find_client_library() or LIBRARY
    with _libs_lock:
        lib = _LIBS.get(path)
        if lib is not None:
            return lib
        try:
            lib = ctypes.CDLL(path)
            lib.arfuse_client_abi_version.restype = ctypes.c_uint32
            lib.arfuse_client_abi_version.argtypes = []
        except (OSError, AttributeError) as e:
            raise InStreamError(UNAVAILABLE, f"{LIBRARY} did not load from {path} ({e}); build "
                                "target arfuse_instream, or set ARFUSE_CLIENT_LIB") from None
        # The version first: a library of another ABI may lack functions this binding declares.
        abi = lib.arfuse_client_abi_version()
        if abi != CLIENT_ABI_VERSION:
            raise InStreamError(FAILED_PRECONDITION,
                                f"{path} speaks client ABI {abi}; this arfuse package binds "
                                f"ABI {CLIENT_ABI_VERSION} (install matching versions)")
        try:
            _declare(lib)
        except AttributeError as e:
            raise InStreamError(UNAVAILABLE, f"{LIBRARY} at {path} lacks a function of ABI "
                                f"{CLIENT_ABI_VERSION} ({e})") from None
        lib._arfuse_path = path
        _LIBS[path] = lib
        return lib


def _last_error(lib) -> str:
    return (lib.arfuse_last_error() or b"").decode(errors="replace")


def library_versions(lib) -> dict:
    """What AttachRequest carries, and the library's version string."""
    return {"attach_abi_version": int(lib.arfuse_client_abi_version()),
            "launch_abi_version": int(lib.arfuse_launch_abi_version()),
            "launch_args_bytes": int(lib.arfuse_launch_args_bytes()),
            "version": (lib.arfuse_client_version() or b"").decode(errors="replace")}


def error_name(code: int, lib=None) -> str:
    lib = lib or load_library()
    return (lib.arfuse_error_name(code) or b"").decode(errors="replace")


# ---- waiting for the caller's stream (the drain's answer) ----

def _capturing(stream: Optional[int]) -> bool:
    """Whether the calling thread is capturing a CUDA graph (then nothing may synchronize)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return bool(torch.cuda.is_current_stream_capturing())
    if not stream:
        return False
    from .regions import _CudaRt
    status = ctypes.c_int(0)
    rt = _CudaRt.lib()
    if rt.cudaStreamIsCapturing(ctypes.c_void_p(stream), ctypes.byref(status)) != 0:
        return False
    return status.value != 0


def wait_stream(stream: Optional[int], timeout: float) -> bool:
    """Waits (polling, at most `timeout` s) for the work enqueued on `stream` so far; True when
    it finished. Through torch when it is loaded, else the CUDA runtime."""
    until = time.monotonic() + timeout
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        s = torch.cuda.ExternalStream(stream) if stream else torch.cuda.default_stream()
        ev = torch.cuda.Event()
        ev.record(s)
        while not ev.query():
            if time.monotonic() > until:
                return False
            time.sleep(0.0005)
        return True
    from .regions import CUDA_EVENT_DISABLE_TIMING, _CudaRt
    rt = _CudaRt.lib()
    ev = ctypes.c_void_p()
    _CudaRt.check(rt.cudaEventCreateWithFlags(ctypes.byref(ev), CUDA_EVENT_DISABLE_TIMING),
                  "cudaEventCreateWithFlags")
    try:
        _CudaRt.check(rt.cudaEventRecord(ev, ctypes.c_void_p(stream or 0)), "cudaEventRecord")
        while True:
            err = rt.cudaEventQuery(ev)
            if err == 0:
                return True
            if err != 600:  # cudaErrorNotReady
                _CudaRt.check(err, "cudaEventQuery")
            if time.monotonic() > until:
                return False
            time.sleep(0.0005)
    finally:
        rt.cudaEventDestroy(ev)


# ---- the context ----

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


def _dtype_code(dtype) -> int:
    if isinstance(dtype, int):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}") from None


def quant_code(quant) -> int:
    """ARFUSE_QUANT_FP8_* of "static", "per_token", "per_group" (an int passes through: the
    library answers INVALID_ARGUMENT for a bad one)."""
    if isinstance(quant, int):
        return quant
    try:
        return QUANTS[quant]
    except KeyError:
        raise ValueError(f"quant {quant!r}: expected one of {sorted(QUANTS)}") from None


def scale_layout_code(layout) -> int:
    """ARFUSE_SCALE_* of a layout name; None and 0 are 0 (static and per-token scales)."""
    if layout is None:
        return 0
    if isinstance(layout, int):
        return layout
    try:
        return SCALE_LAYOUTS[layout]
    except KeyError:
        raise ValueError(f"scale layout {layout!r}: expected one of {sorted(SCALE_LAYOUTS)}") \
            from None


def fp8_pattern(quant) -> int:
    """The pattern number (PATTERN_FP8_*) of a quant."""
    return PATTERN_FP8_STATIC + quant_code(quant) - QUANTS["static"]


def tma_aligned_tokens(tokens: int) -> int:
    return (int(tokens) + 3) // 4 * 4


def fp8_scale_tensor(quant, tokens: int, hidden: int, scale_layout=None):
    """(shape, strides, element) of the scale tensor an FP8 op reads or writes, in elements of
    4 bytes: static ((1,), (1,), "float32"), per token ((tokens, 1), (1, 1), "float32"), per
    group the layout's [tokens, G] fp32 or [tokens, ceil(G / 4)] int32 tensor with its strides
    (kernels/quant/fp8_format.h: row-major, or token-contiguous columns of TmaAlignedTokens)."""
    q = quant_code(quant)
    if q == QUANTS["static"]:
        return (1,), (1,), "float32"
    if q == QUANTS["per_token"]:
        return (int(tokens), 1), (1, 1), "float32"
    groups = int(hidden) // FP8_GROUP_SIZE
    layout = scale_layout_code(scale_layout)
    if layout == SCALE_LAYOUTS["fp32_row_major"]:
        return (int(tokens), groups), (groups, 1), "float32"
    aligned = tma_aligned_tokens(tokens)
    if layout == SCALE_LAYOUTS["fp32_mn_major"]:
        return (int(tokens), groups), (1, aligned), "float32"
    return (int(tokens), (groups + 3) // 4), (1, aligned), "int32"


def fp8_scale_elements(quant, tokens: int, hidden: int, scale_layout=None) -> int:
    """Elements of 4 bytes the scale tensor spans (fp8::GroupScaleElements for per group)."""
    shape, strides, _ = fp8_scale_tensor(quant, tokens, hidden, scale_layout)
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


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
            raise InStreamError(rc, f"arfuse_ctx_get_info: {_last_error(lib)}")
        self.info = ContextInfo.from_struct(st, getattr(response, "memory_kind", ""))
        self.attach_id = int(getattr(response, "attach_id", 0) or self.info.attach_id)
        self._lock = threading.Lock()   # the library's one-thread rule, and the events' state
        self._pending: List[tuple] = []  # (kind, reason) recorded by the session thread
        self._disabled = ""              # see `disabled`
        self._disabled_reason = ""
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

    def _require(self):
        if self._detached:
            raise InStreamError(FAILED_PRECONDITION, "the in-stream context is detached")

    # -- events (from the client's session thread) --
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
            if not caller or _capturing(stream):
                return  # the caller's next op or check() outside capture answers
            if not wait_stream(stream, self.drain_wait_s):
                print(f"arfuse: attachment {self.attach_id}: the last launch did not finish "
                      f"within {self.drain_wait_s:g} s; the drain stays unanswered",
                      file=sys.stderr)
                return
        self._drain_unanswered = False
        client.answer_drain(self.attach_id)

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
                raise InStreamError(rc, f"arfuse_note_declined: {_last_error(self._lib)}")

    # -- queries --
    def why_not(self, tokens: int, hidden: int, dtype,
                pattern: int = PATTERN_ALLREDUCE_RESIDUAL_RMSNORM) -> Optional[str]:
        """None when an op of this shape would launch fused; else why not (pure host logic: the
        same answer on every rank for the same arguments)."""
        self.poll()
        with self._lock:
            self._require()
            rc = self._lib.arfuse_supports(self._handle, pattern, int(tokens), int(hidden),
                                           _dtype_code(dtype))
            if rc == OK:
                return None
            msg = _last_error(self._lib)
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
        key = (int(hidden), _dtype_code(dtype), pattern)
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
        msg = _last_error(self._lib)
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
                     _ptr(gamma), int(tokens), int(hidden), _dtype_code(dtype), float(eps))

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
                     _dtype_code(dtype), float(eps), quant_code(quant),
                     scale_layout_code(scale_layout))

    def fused_allreduce(self, stream: Optional[int], input, output, tokens: int, hidden: int,
                        dtype):
        """output = sum over ranks of input (output may be input). As above."""
        self._launch("fused allreduce", self._lib.arfuse_fused_allreduce, stream, tokens,
                     _ptr(input), _ptr(output), int(tokens), int(hidden), _dtype_code(dtype))

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
            msg = _last_error(self._lib)
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
            msg = _last_error(self._lib) if rc != OK else ""
        client = self.client
        if client is not None:
            client.forget_attachment(self.attach_id)
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


# ---- attach ----

def pick_up_fds(resp, timeout: float) -> List[int]:
    """The descriptors the sidecar offers for this attach on its fd socket (fd_ticket)."""
    try:
        from . import fdpass  # the fd-socket client (docs/security.md)
        pickup = fdpass.pickup
    except (ImportError, AttributeError):
        raise InStreamError(
            UNAVAILABLE,
            f"the sidecar offers {resp.fd_count} file descriptor(s) for this attachment on its "
            f"fd socket {resp.fd_socket or '(unnamed)'}, and this arfuse package has no "
            "fd-socket client to pick them up (arfuse.fdpass is not installed): the in-stream "
            "plane is unavailable") from None
    try:
        fds = list(pickup(resp.fd_socket, resp.fd_ticket, timeout=timeout))
    except fdpass.FdChannelError as e:
        raise InStreamError(e.code.value[0], f"picking up the attach's {resp.fd_count} descriptor(s) on "
                                    f"the fd channel {resp.fd_socket}: {e.message}") from None
    if len(fds) != resp.fd_count:
        import os
        for fd in fds:
            os.close(fd)
        raise InStreamError(INVALID_ARGUMENT, f"picked up {len(fds)} descriptors, the attach "
                                              f"announced {resp.fd_count}")
    return fds


def attach(client: Client, hiddens: Optional[Sequence[int]] = None, lib=None,
           timeout: Optional[float] = None,
           fd_pickup: Optional[Callable] = None) -> InStreamContext:
    """Attaches this process to its sidecar's workspace for ops of these hidden sizes (empty:
    the workspace's). Not inside a CUDA graph capture; with the client's GPU current (CUDA).

    Raises InStreamError/ArfuseError with the sidecar's or the library's status:
    FAILED_PRECONDITION (versions or GPU differ, fusion off, poisoned), UNAVAILABLE (no library,
    no fd-socket client, workspace not ready), UNIMPLEMENTED (a sidecar without the plane)."""
    lib = lib if lib is not None and not isinstance(lib, str) else load_library(lib)
    v = library_versions(lib)
    hiddens = [int(h) for h in (hiddens or [])]
    req = fusion_pb2.AttachRequest(hidden=hiddens, attach_abi_version=v["attach_abi_version"],
                                   launch_abi_version=v["launch_abi_version"],
                                   launch_args_bytes=v["launch_args_bytes"],
                                   client_version=v["version"])
    resp = client.attach_rpc(req, timeout)
    client.expect_attachment(resp.attach_id)
    fds: List[int] = []
    try:
        if resp.fd_count:
            fds = (fd_pickup or pick_up_fds)(resp, timeout or client.timeout)
        blob = bytes(resp.attach_blob)
        arr = (ctypes.c_int * max(1, len(fds)))(*fds)
        handle = ctypes.c_void_p()
        rc = lib.arfuse_attach(blob, len(blob), arr, len(fds), ctypes.byref(handle))
        if rc != OK:
            raise InStreamError(rc, f"arfuse_attach: {_last_error(lib)}")
        try:
            ctx = InStreamContext(lib, handle, client, resp, hiddens)
            if ctx.info.attach_id != resp.attach_id:
                raise InStreamError(FAILED_PRECONDITION,
                                    f"the attach blob names attachment {ctx.info.attach_id}, "
                                    f"the response {resp.attach_id}")
        except BaseException:
            lib.arfuse_detach(handle)
            raise
    except BaseException:
        client.forget_attachment(resp.attach_id)
        if not client.session_lost:
            try:
                client.detach_rpc(resp.attach_id)
            except ArfuseError:
                pass
        raise
    finally:
        import os
        for fd in fds:
            try:
                os.close(fd)  # the library keeps its own duplicates
            except OSError:
                pass
    client.bind_attachment(resp.attach_id, ctx)
    return ctx


def reattach(ctx: InStreamContext, timeout: float = 60.0, detach_old: bool = True,
             poll: float = 0.25, newer_than: Optional[int] = None,
             **client_kwargs) -> InStreamContext:
    """A new client and context for the same sidecar socket, once it answers again (after a
    sidecar restart, a re-initialization, a drain). Retries until `timeout`. With detach_old, the
    old context is detached first (destroy the graphs that captured its launches before).
    newer_than: only a workspace of a later generation will do (after a failed op: the group
    re-forms, and an attach that came before the re-formation would be to the failed workspace;
    the sidecars' generations restart after a sidecar restart, so not then)."""
    if detach_old:
        ctx.detach()
    old = ctx.client
    target = ctx.target
    name = client_kwargs.pop("client_name", "arfuse-py")
    until = time.monotonic() + timeout
    last = None
    while True:
        client = None
        try:
            client = Client(target, client_name=name,
                            timeout=old.timeout if old is not None else 10.0,
                            connect_timeout=max(0.5, min(5.0, until - time.monotonic())),
                            **client_kwargs)
            client.wait_ready(max(0.5, until - time.monotonic()))
            new = attach(client, ctx.hiddens, lib=ctx._lib)
            if newer_than is not None and new.info.generation <= newer_than:
                gen = new.info.generation
                new.detach()
                raise InStreamError(UNAVAILABLE, f"the workspace is still generation {gen}, "
                                                 f"not newer than {newer_than}")
            new.owns_client = True
            if old is not None and getattr(ctx, "owns_client", False):
                old.close()
            return new
        except (ArfuseError, SidecarLost) as e:
            last = e
            if client is not None:
                client.close()
        if time.monotonic() > until:
            raise InStreamError(UNAVAILABLE, f"reattach to {target}: no attachment within "
                                             f"{timeout:g} s (last: {last})")
        time.sleep(poll)


_client_module.register_attach(attach)
