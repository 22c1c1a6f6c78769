"""A bump allocator over one registered buffer: the framework's static tensors for the fused op.

The sidecar opens client memory by legacy CUDA IPC handle, which PyTorch's caching allocator
(expandable segments) cannot export. So a framework allocates one plain cudaMalloc buffer
(arfuse.CudaBuffer), registers it once, and carves every tensor the fused op touches out of it:
the row-parallel outputs, the residual stream, the norm outputs and the norm weights. The
addresses never change, which is what CUDA graphs and doorbell plans need.

    buf = arfuse.CudaBuffer(pool.size_for(plan_bytes), device=gpu)   # or HostShmBuffer (host mode)
    ws.register(buf, "pool")
    pool = TensorPool(buf)
    residual = pool.tensor(torch.bfloat16, (max_tokens, hidden))

reserve(nbytes) hands out offsets without torch (what tests and non-torch tools use).
"""
from typing import Dict, Sequence, Tuple

ALIGN = 256  # every tensor starts on a 256-byte boundary (the sidecar needs 16)


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def size_for(nbytes: Sequence[int], align: int = ALIGN) -> int:
    """Bytes a pool needs to hold tensors of these sizes."""
    return sum(align_up(int(n), align) for n in nbytes)


class TensorPool:
    def __init__(self, buffer, align: int = ALIGN):
        self.buffer = buffer
        self.align = align
        self.used = 0
        self.byte_size = buffer.byte_size
        self.named: Dict[str, Tuple[int, int]] = {}

    def reserve(self, nbytes: int, name: str = "") -> int:
        """Byte offset of `nbytes` fresh bytes. MemoryError when the buffer is full."""
        offset = self.used
        end = offset + align_up(int(nbytes), self.align)
        if end > self.byte_size:
            raise MemoryError(f"pool of {self.byte_size} bytes cannot hold {nbytes} more "
                              f"({offset} used)")
        self.used = end
        if name:
            self.named[name] = (offset, int(nbytes))
        return offset

    def view(self, dtype, shape: Sequence[int], offset: int):
        """A torch tensor of `shape` at byte `offset` of the buffer (CUDA or host shm)."""
        import torch  # optional dependency

        count = 1
        for s in shape:
            count *= int(s)
        elem = torch.empty((), dtype=dtype).element_size()
        if offset % 16 or offset + count * elem > self.byte_size:
            raise ValueError(f"view at {offset} (+{count * elem} bytes) does not fit the pool")
        if hasattr(self.buffer, "tensor"):  # CudaBuffer
            return self.buffer.tensor(dtype, tuple(shape), offset)
        raw = torch.frombuffer(self.buffer.buf, dtype=torch.uint8, count=count * elem,
                               offset=offset)
        return raw.view(dtype).view(*shape)

    def tensor(self, dtype, shape: Sequence[int], name: str = ""):
        """A fresh torch tensor carved out of the pool (contents undefined)."""
        import torch  # optional dependency

        count = 1
        for s in shape:
            count *= int(s)
        elem = torch.empty((), dtype=dtype).element_size()
        return self.view(dtype, shape, self.reserve(count * elem, name))
