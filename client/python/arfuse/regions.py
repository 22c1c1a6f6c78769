"""Memory a sidecar can map: host shared memory (host mode) and plain cudaMalloc buffers (CUDA).

Regions must be exportable: host memory as a sealed memfd handed over by descriptor (or a named
shm object), CUDA memory by a legacy IPC handle. PyTorch's
caching allocator with expandable segments cannot export legacy IPC handles, so CudaBuffer
allocates with cudaMalloc itself and hands out torch tensors viewing that memory.
"""
import ctypes
import ctypes.util
import fcntl
import mmap
import os
from multiprocessing import shared_memory
from typing import Optional, Sequence

ALIGN = 16
_FORMATS = {"fp32": ("f", 4), "fp16": ("e", 2), "bf16": ("H", 2)}  # bf16 as raw 16-bit words


class HostShmBuffer:
    """Host shared memory this process owns, for host-mode regions.

    By default a memfd sealed against shrinking and growing (F_SEAL_SHRINK, F_SEAL_GROW,
    F_SEAL_SEAL), registered by descriptor (FusionWorkspace.register, Client.register_host_fd):
    the descriptor proves this process's access, and the seal keeps the memory from shrinking
    under the sidecar. With `name` (or named=True) a POSIX shared-memory object by name instead,
    for sidecars that predate descriptors; the sidecar then opens it only if this process's user
    may open it read-write itself.

    view() gives a flat memoryview (no dependency); array() a numpy view when numpy is there.
    """

    SEALS = None  # set below where fcntl knows the seal flags

    def __init__(self, byte_size: int, name: Optional[str] = None, named: bool = False):
        self.byte_size = byte_size
        self.shm = None
        self.fd: Optional[int] = None
        self._mmap = None
        if name is not None or named:
            self.shm = shared_memory.SharedMemory(create=True, size=byte_size, name=name)
            self.buf = self.shm.buf
        else:
            self.fd = os.memfd_create("arfuse-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(self.fd, byte_size)
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, HostShmBuffer.SEALS)
                self._mmap = mmap.mmap(self.fd, byte_size)
            except BaseException:
                os.close(self.fd)
                raise
            self.buf = memoryview(self._mmap)
        anchor = ctypes.c_char.from_buffer(self.buf)
        self._base = ctypes.addressof(anchor)
        del anchor  # keeps the buffer exported while it lives; close() needs it released

    @property
    def shm_name(self) -> Optional[str]:
        """The object's name ("/..."), or None for a memfd."""
        return "/" + self.shm.name.lstrip("/") if self.shm is not None else None

    @property
    def base_address(self) -> int:
        return self._base

    def _check(self, offset: int, nbytes: int):
        if offset % ALIGN:
            raise ValueError(f"offset {offset} is not a multiple of {ALIGN}")
        if offset < 0 or offset + nbytes > self.byte_size:
            raise ValueError("the view does not fit in the buffer")

    def view(self, dtype: str, count: int, offset: int = 0) -> "TensorView":
        """`count` elements of dtype ("fp32", "fp16", "bf16") at byte `offset`."""
        fmt, size = _FORMATS[dtype]
        self._check(offset, count * size)
        mv = self.buf[offset:offset + count * size].cast(fmt)
        return TensorView(mv, dtype, self._base + offset, count * size)

    def array(self, dtype, shape: Sequence[int], offset: int = 0):
        """A numpy view of `shape` elements of `dtype` at byte `offset` (16-byte aligned)."""
        import numpy as np  # optional dependency

        count = 1
        for s in shape:
            count *= int(s)
        self._check(offset, count * np.dtype(dtype).itemsize)
        return np.ndarray(tuple(shape), dtype=dtype, buffer=self.buf, offset=offset)

    def close(self):
        if self.shm is not None:
            # Unlink first: the name goes even when a caller still holds a view (then close()
            # cannot unmap, and the mapping goes with the last view).
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
            try:
                self.shm.close()
            except BufferError:
                # Views (memoryviews, numpy/torch tensors) still use the mapping: it goes with
                # the last of them. Keep the object, or its __del__ would retry and complain.
                self._still_mapped = self.shm
            self.shm = None
        if self.fd is not None:
            # The sidecar holds its own mapping; this process's descriptor and mapping go.
            os.close(self.fd)
            self.fd = None
            try:
                self.buf.release()
                self._mmap.close()
            except BufferError:
                self._still_mapped = self._mmap  # views still use it: it goes with the last
            self._mmap = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if hasattr(fcntl, "F_ADD_SEALS"):
    HostShmBuffer.SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class TensorView:
    """A flat view into a HostShmBuffer that allreduce_fusion can locate (no numpy needed)."""

    def __init__(self, mv: memoryview, dtype: str, address: int, nbytes: int):
        self.mv = mv
        self.dtype = dtype
        self.address = address
        self.nbytes = nbytes
        self.shape = (len(mv),)

    def reshape(self, rows: int, cols: int) -> "TensorView":
        if rows * cols != len(self.mv):
            raise ValueError("reshape does not preserve the element count")
        v = TensorView(self.mv, self.dtype, self.address, self.nbytes)
        v.shape = (rows, cols)
        return v

    def __len__(self):
        return len(self.mv)

    def __getitem__(self, i):
        return self.mv[i]

    def __setitem__(self, i, v):
        self.mv[i] = v

    def release(self):
        self.mv.release()


class CudaRt:
    """The few CUDA runtime calls the client needs, through ctypes (no torch required)."""

    _lib = None

    @classmethod
    def lib(cls):
        if cls._lib is None:
            names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12",
                     ctypes.util.find_library("cudart")]
            for n in names:
                if not n:
                    continue
                try:
                    cls._lib = ctypes.CDLL(n)
                    break
                except OSError:
                    continue
            if cls._lib is None:
                raise RuntimeError("libcudart was not found: CUDA regions need the CUDA runtime")
        return cls._lib

    @classmethod
    def check(cls, err: int, what: str):
        if err != 0:
            lib = cls.lib()
            lib.cudaGetErrorName.restype = ctypes.c_char_p
            raise RuntimeError(f"{what} failed: {lib.cudaGetErrorName(err).decode()}")


class _IpcHandle(ctypes.Structure):
    """cudaIpcEventHandle_t / cudaIpcMemHandle_t: 64 opaque bytes, passed *by value* to the
    Open calls (a bare ctypes array would decay to a pointer and the runtime would read garbage
    off the stack)."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


CUDA_EVENT_DISABLE_TIMING = 0x2
CUDA_EVENT_INTERPROCESS = 0x4


class CudaBuffer:
    """Device memory from plain cudaMalloc, exportable by cudaIpcGetMemHandle."""

    def __init__(self, byte_size: int, device: int = 0):
        rt = CudaRt.lib()
        self.device = device
        self.byte_size = byte_size
        CudaRt.check(rt.cudaSetDevice(device), "cudaSetDevice")
        ptr = ctypes.c_void_p()
        CudaRt.check(rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(byte_size)), "cudaMalloc")
        self.ptr = ptr.value
        handle = (ctypes.c_char * 64)()
        CudaRt.check(rt.cudaIpcGetMemHandle(handle, ctypes.c_void_p(self.ptr)),
                     "cudaIpcGetMemHandle")
        self.ipc_handle = bytes(handle)

    @property
    def base_address(self) -> int:
        return self.ptr

    def tensor(self, dtype, shape: Sequence[int], offset: int = 0):
        """A torch tensor viewing this memory (the buffer must outlive it)."""
        import torch  # optional dependency

        if offset % ALIGN:
            raise ValueError(f"offset {offset} is not a multiple of {ALIGN}")
        elem = torch.empty((), dtype=dtype).element_size()
        count = 1
        for s in shape:
            count *= int(s)
        if offset + count * elem > self.byte_size:
            raise ValueError("the view does not fit in the buffer")
        # __cuda_array_interface__ has no bf16 typestr: view the bytes, then reinterpret.
        owner = self

        class _View:
            __cuda_array_interface__ = {
                "shape": (count * elem,), "typestr": "|u1",
                "data": (owner.ptr + offset, False), "version": 2}

        raw = torch.as_tensor(_View(), device=f"cuda:{self.device}")
        return raw.view(dtype).view(*shape)

    def close(self):
        if self.ptr:
            CudaRt.lib().cudaFree(ctypes.c_void_p(self.ptr))
            self.ptr = 0


class IpcEvent:
    """An interprocess CUDA event: record on a stream and export, or open a peer's and wait."""

    def __init__(self, handle: Optional[bytes] = None):
        rt = CudaRt.lib()
        ev = ctypes.c_void_p()
        if handle is None:
            CudaRt.check(rt.cudaEventCreateWithFlags(
                ctypes.byref(ev), CUDA_EVENT_INTERPROCESS | CUDA_EVENT_DISABLE_TIMING),
                "cudaEventCreateWithFlags")
            self.event = ev.value
            h = (ctypes.c_char * 64)()
            CudaRt.check(rt.cudaIpcGetEventHandle(h, ctypes.c_void_p(self.event)),
                         "cudaIpcGetEventHandle")
            self.handle = bytes(h)
        else:
            if len(handle) != 64:
                raise ValueError(f"an IPC event handle is 64 bytes, got {len(handle)}")
            h = _IpcHandle.from_buffer_copy(handle)
            rt.cudaIpcOpenEventHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle]
            CudaRt.check(rt.cudaIpcOpenEventHandle(ctypes.byref(ev), h),
                         "cudaIpcOpenEventHandle")
            self.event = ev.value
            self.handle = bytes(handle)

    def record(self, stream: int):
        CudaRt.check(CudaRt.lib().cudaEventRecord(ctypes.c_void_p(self.event),
                                                  ctypes.c_void_p(stream)), "cudaEventRecord")

    def wait_on(self, stream: int):
        CudaRt.check(CudaRt.lib().cudaStreamWaitEvent(ctypes.c_void_p(stream),
                                                      ctypes.c_void_p(self.event), 0),
                     "cudaStreamWaitEvent")

    def synchronize(self):
        """Blocks the calling thread until the work before the event's last record finished."""
        CudaRt.check(CudaRt.lib().cudaEventSynchronize(ctypes.c_void_p(self.event)),
                     "cudaEventSynchronize")
