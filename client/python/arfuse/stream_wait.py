"""Waiting for the caller's stream without synchronizing a capture: what a drain's answer and
a detach wait for (the last launch of an attachment). Through torch when it is loaded, else the
CUDA runtime through ctypes (arfuse.regions.CudaRt).
"""
import ctypes
import sys
import time
from typing import Optional


def capturing(stream: Optional[int]) -> bool:
    """Whether the calling thread is capturing a CUDA graph (then nothing may synchronize)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return bool(torch.cuda.is_current_stream_capturing())
    if not stream:
        return False
    from .regions import CudaRt
    status = ctypes.c_int(0)
    rt = CudaRt.lib()
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
    from .regions import CUDA_EVENT_DISABLE_TIMING, CudaRt
    rt = CudaRt.lib()
    ev = ctypes.c_void_p()
    CudaRt.check(rt.cudaEventCreateWithFlags(ctypes.byref(ev), CUDA_EVENT_DISABLE_TIMING),
                 "cudaEventCreateWithFlags")
    try:
        CudaRt.check(rt.cudaEventRecord(ev, ctypes.c_void_p(stream or 0)), "cudaEventRecord")
        while True:
            err = rt.cudaEventQuery(ev)
            if err == 0:
                return True
            if err != 600:  # cudaErrorNotReady
                CudaRt.check(err, "cudaEventQuery")
            if time.monotonic() > until:
                return False
            time.sleep(0.0005)
    finally:
        rt.cudaEventDestroy(ev)
