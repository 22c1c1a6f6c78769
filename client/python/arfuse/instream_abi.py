"""libarfuse_client's C ABI (client/instream/arfuse_client.h) through ctypes: its numbers
(return codes, dtypes, patterns, decline reasons), the errors its calls raise, and the loading of
the library with its functions declared and its ABI version checked. arfuse.instream re-exports
every public name here.

The library is found through $ARFUSE_CLIENT_LIB, then in or beside this package, then by name
through the system's library path (arfuse._native).
"""
import ctypes
import secrets
import threading
from typing import Optional

import grpc

from ._native import find_native_library
from .client import ArfuseError

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

# The largest program key (arfuse_set_program_key, ARFUSE_PROGRAM_KEY_MAX: 24 bits).
PROGRAM_KEY_MAX = 0xFFFFFF


def draw_program_key() -> int:
    """A random program key, 1 to PROGRAM_KEY_MAX, from the OS's random source. A group takes the
    largest of its ranks' draws (one MAX all-reduce), so every rank ends with the same key."""
    return secrets.randbelow(PROGRAM_KEY_MAX) + 1

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
DEVICE_KINDS = {1: "cuda", 2: "host"}

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
            ("arfuse_set_program_key", cint, [vp, u32]),
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


def last_error(lib) -> str:
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


def dtype_code(dtype) -> int:
    if isinstance(dtype, int):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}") from None
