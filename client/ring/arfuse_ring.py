"""ctypes binding of libarfuse_ring.so: ring an arfuse doorbell inside CUDA graph capture.

    ring = DoorbellRing.open(plan.doorbell)            # the CreatePlan reply's Doorbell message
    with torch.cuda.graph(g):
        ...                                            # kernels producing the op's input
        ring.ring(torch.cuda.current_stream().cuda_stream, num_tokens)
    g.replay(); ring.check()                           # raises on a sticky slot error

The library path comes from ARFUSE_RING_LIB, else libarfuse_ring.so on the loader path.
"""
import ctypes
import os

_LIB = None


def _lib():
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(os.environ.get("ARFUSE_RING_LIB", "libarfuse_ring.so"))
        lib.arfuse_open_doorbell.argtypes = [ctypes.c_char_p, ctypes.c_uint64,
                                             ctypes.POINTER(ctypes.c_void_p)]
        lib.arfuse_close_doorbell.argtypes = [ctypes.c_void_p]
        lib.arfuse_ring.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32,
                                    ctypes.c_uint64]
        lib.arfuse_doorbell_error.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
        lib.arfuse_doorbell_error_name.argtypes = [ctypes.c_uint32]
        lib.arfuse_doorbell_error_name.restype = ctypes.c_char_p
        lib.arfuse_doorbell_check_values.argtypes = [ctypes.c_uint32] * 3
        lib.arfuse_ring_strerror.argtypes = [ctypes.c_int]
        lib.arfuse_ring_strerror.restype = ctypes.c_char_p
        _LIB = lib
    return _LIB


class RingError(RuntimeError):
    pass


def _check(rc, what):
    if rc != 0:
        raise RingError(f"{what}: {_lib().arfuse_ring_strerror(rc).decode()} (rc={rc})")


class DoorbellRing:
    """One opened doorbell slot."""

    def __init__(self, slot):
        self._slot = slot

    @classmethod
    def open(cls, doorbell):
        """`doorbell`: arfuse.v1.Doorbell (ipc_handle, offset and the fixed values)."""
        lib = _lib()
        if len(doorbell.ipc_handle) != 64:
            raise RingError("doorbell ipc_handle must be 64 bytes")
        _check(lib.arfuse_doorbell_check_values(doorbell.request_value, doorbell.complete_value,
                                                doorbell.reset_value), "doorbell values")
        slot = ctypes.c_void_p()
        _check(lib.arfuse_open_doorbell(bytes(doorbell.ipc_handle), doorbell.offset,
                                        ctypes.byref(slot)), "open doorbell")
        return cls(slot)

    def ring(self, stream, num_tokens, timeout_ns=5_000_000_000):
        """Enqueues the ring on `stream` (an int cudaStream_t, e.g. torch's .cuda_stream)."""
        _check(_lib().arfuse_ring(ctypes.c_void_p(stream), self._slot, num_tokens, timeout_ns),
               "ring")

    def error(self):
        code = ctypes.c_uint32()
        _check(_lib().arfuse_doorbell_error(self._slot, ctypes.byref(code)), "read doorbell error")
        return code.value

    def check(self):
        code = self.error()
        if code != 0:
            raise RingError(f"doorbell slot error {code:#x}: "
                            f"{_lib().arfuse_doorbell_error_name(code).decode()}")

    def close(self):
        if self._slot is not None:
            _check(_lib().arfuse_close_doorbell(self._slot), "close doorbell")
            self._slot = None
