"""Ring an arfuse doorbell from inside CUDA graph capture: ctypes over libarfuse_ring.so.

    plan = ws.create_plan(input=x, residual_in=r, residual_out=r, norm_out=y, rms_gamma=w,
                          max_tokens=batch, doorbell=True)        # once, outside capture
    bell = DoorbellRing.open(plan.doorbell)                       # maps the sidecar's slot
    with torch.cuda.graph(g):
        ...                                                       # kernels producing x
        bell.ring(torch.cuda.current_stream().cuda_stream, batch, timeout_ns)
        ...                                                       # kernels reading r and y
    g.replay(); bell.check()                                      # raises on a sticky slot error

The C ABI is client/ring/arfuse_ring.h (docs/doorbell.md). The library links the CUDA runtime
statically and exports only arfuse_*, so it loads beside torch's libcudart. Which file:
$ARFUSE_RING_LIB, else the wheel's own (arfuse/_lib/) or one beside the package, else the system's
library path. Loading it needs no GPU; opening a slot does
(the current CUDA device must be the client's GPU, e.g. after torch.cuda.set_device).
"""
import ctypes
from typing import Optional

from ._native import find_native_library

_LIBS = {}

# Return codes of the library (arfuse_ring.h); positive values are cudaError_t.
RING_OK = 0
RING_EINVAL = -1
RING_ENOTOPEN = -2
RING_EVERSION = -3

# Slot error words (kernels/doorbell/doorbell.h, DoorbellError).
SLOT_ERRORS = {0: "none", 1: "ring timeout (the op did not run)",
               2: "ring timeout in flight (the op may still run; the slot needs a reset)",
               3: "stopped (the sidecar's doorbell plane stopped or the plan was removed)",
               4: "bad token count (above the plan's max_tokens; the op did not run)",
               5: "desynchronized (a late completion; the op did not run)"}
SLOT_FUSION_FAILED = 0x100


class RingError(RuntimeError):
    """A library call failed, or a slot holds an error (`code`: the slot's error word)."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code


def find_ring_library() -> Optional[str]:
    """Path of libarfuse_ring.so ($ARFUSE_RING_LIB, in or beside the package: arfuse._native),
    or None when neither names one (then the loader's search path is tried by name)."""
    return find_native_library("libarfuse_ring.so", "ARFUSE_RING_LIB")


def load_library(path: Optional[str] = None):
    """Loads (once per path) and declares the C ABI. OSError when it cannot be loaded."""
    path = path or find_ring_library() or "libarfuse_ring.so"
    lib = _LIBS.get(path)
    if lib is not None:
        return lib
    lib = ctypes.CDLL(path)
    lib.arfuse_open_doorbell.argtypes = [ctypes.c_char_p, ctypes.c_uint64,
                                         ctypes.POINTER(ctypes.c_void_p)]
    lib.arfuse_open_doorbell.restype = ctypes.c_int
    lib.arfuse_close_doorbell.argtypes = [ctypes.c_void_p]
    lib.arfuse_close_doorbell.restype = ctypes.c_int
    lib.arfuse_ring.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32,
                                ctypes.c_uint64]
    lib.arfuse_ring.restype = ctypes.c_int
    lib.arfuse_doorbell_error.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
    lib.arfuse_doorbell_error.restype = ctypes.c_int
    lib.arfuse_doorbell_error_name.argtypes = [ctypes.c_uint32]
    lib.arfuse_doorbell_error_name.restype = ctypes.c_char_p
    lib.arfuse_doorbell_check_values.argtypes = [ctypes.c_uint32] * 3
    lib.arfuse_doorbell_check_values.restype = ctypes.c_int
    lib.arfuse_ring_strerror.argtypes = [ctypes.c_int]
    lib.arfuse_ring_strerror.restype = ctypes.c_char_p
    lib._arfuse_path = path
    _LIBS[path] = lib
    return lib


def strerror(rc: int, lib=None) -> str:
    lib = lib or load_library()
    return lib.arfuse_ring_strerror(rc).decode(errors="replace")


def slot_error_name(code: int, lib=None) -> str:
    lib = lib or load_library()
    return lib.arfuse_doorbell_error_name(code).decode(errors="replace")


def _check(lib, rc: int, what: str):
    if rc != RING_OK:
        raise RingError(f"{what}: {strerror(rc, lib)} (rc={rc})")


class DoorbellRing:
    """One opened doorbell slot of a doorbell plan."""

    def __init__(self, lib, slot: ctypes.c_void_p, name: str = ""):
        self._lib = lib
        self._slot = slot
        self.name = name

    @classmethod
    def open(cls, doorbell, lib=None, name: str = "") -> "DoorbellRing":
        """`doorbell`: the arfuse.v1.Doorbell of a plan made with doorbell=True (Plan.doorbell).
        Call outside graph capture, with the client's GPU current."""
        if doorbell is None:
            raise RingError("the plan has no doorbell (made without doorbell=True, or the "
                            "sidecar answered without one)")
        lib = lib or load_library()
        handle = bytes(doorbell.ipc_handle)
        if len(handle) != 64:
            raise RingError(f"doorbell ipc_handle must be 64 bytes, got {len(handle)}")
        _check(lib, lib.arfuse_doorbell_check_values(doorbell.request_value,
                                                     doorbell.complete_value,
                                                     doorbell.reset_value), "doorbell values")
        slot = ctypes.c_void_p()
        _check(lib, lib.arfuse_open_doorbell(handle, doorbell.offset, ctypes.byref(slot)),
               "open doorbell")
        return cls(lib, slot, name)

    @property
    def slot_address(self) -> int:
        return self._slot.value or 0

    @property
    def library_path(self) -> Optional[str]:
        """Where the libarfuse_ring.so this ring rings through was loaded from (for logs)."""
        return getattr(self._lib, "_arfuse_path", None)

    def ring(self, stream: int, num_tokens: int, timeout_ns: int = 5_000_000_000):
        """Enqueues the ring kernel on `stream` (an int cudaStream_t, e.g.
        torch.cuda.current_stream().cuda_stream): stores num_tokens, rings, waits for the
        sidecar's completion (at most timeout_ns), re-arms. Capturable."""
        if self._slot is None:
            raise RingError("ring on a closed doorbell")
        _check(self._lib, self._lib.arfuse_ring(ctypes.c_void_p(stream), self._slot,
                                                int(num_tokens), int(timeout_ns)),
               f"ring {self.name}".rstrip())

    def error(self) -> int:
        """The slot's sticky error word (a synchronous 4-byte copy: not during capture)."""
        code = ctypes.c_uint32()
        _check(self._lib, self._lib.arfuse_doorbell_error(self._slot, ctypes.byref(code)),
               "read doorbell error")
        return code.value

    def check(self):
        """Raises RingError when the slot holds an error (the op's outputs are stale)."""
        code = self.error()
        if code != 0:
            raise RingError(f"doorbell {self.name + ' ' if self.name else ''}slot error "
                            f"{code:#x}: {slot_error_name(code, self._lib)}", code)

    def close(self):
        if self._slot is not None:
            slot, self._slot = self._slot, None
            _check(self._lib, self._lib.arfuse_close_doorbell(slot), "close doorbell")
