"""allreduce_fusion(...) shaped like FlashInfer's, through the sidecar.

It returns None when the sidecar reports that fusion is unavailable (workspace initializing,
poisoned, draining, or the group decided to run unfused), or that the fused path cannot run this
op (OUT_OF_RANGE, "fusion unavailable for this op: ...": larger than the workspace, another
dtype), so the framework keeps its own path, as with FlashInfer's fused op:

    out = arfuse.allreduce_fusion(input=x, workspace=ws, residual_in=r, residual_out=r,
                                  norm_out=y, rms_gamma=w, rms_eps=1e-6)
    if out is None:
        out = my_allreduce_and_rmsnorm(...)

A sidecar that is gone (its session stream ended: killed, crashed) is not "unavailable": the call
raises SidecarLost, since the other ranks' sidecars are about to fail their side of the op.

The first None for a given reason also issues a FusionUnavailableWarning naming the sidecar's
reason (for example host mode without --sm, where no GPU architecture decides for fusion);
FusionWorkspace.unavailable_reason keeps the latest one.

For CUDA graphs, FusionWorkspace.create_plan(..., doorbell=True) makes a doorbell plan once;
arfuse.ring.DoorbellRing rings it from inside capture (docs/integration.md).
"""
import time
import warnings
from typing import Optional

import grpc

from .client import (ArfuseError, Client, OpSpec, Plan, SidecarLost, TensorLoc, common_pb2)
from .regions import CudaBuffer, HostShmBuffer, IpcEvent, TensorView


class FusionUnavailableWarning(RuntimeWarning):
    """allreduce_fusion returned None: nothing ran, the caller's own path must run. Issued once
    per workspace and reason; the message carries the sidecar's reason."""


class AllReduceFusionPattern:
    # FlashInfer's names and numbers for the patterns we serve ...
    kAllReduce = 0
    kARResidualRMSNorm = 1
    kARResidualRMSNormFP8Quant = 2     # static scale; quant_out (no norm_out)
    kARResidualRMSNormOutFP8Quant = 4  # static scale; norm_out and quant_out
    # ... and arfuse's own numbers for its dynamic FP8 patterns (FlashInfer's differ in their
    # scale formats): scale_out is written; norm_out is optional.
    kARResidualRMSNormFP8PerToken = 100    # scale_out fp32 [tokens]
    kARResidualRMSNormFP8PerGroup = 101    # one scale per 128 elements, in `scale_layout`


_PATTERNS = {AllReduceFusionPattern.kAllReduce: "allreduce",
             AllReduceFusionPattern.kARResidualRMSNorm: "allreduce_residual_rmsnorm",
             AllReduceFusionPattern.kARResidualRMSNormFP8Quant:
                 "allreduce_residual_rmsnorm_fp8_static",
             AllReduceFusionPattern.kARResidualRMSNormOutFP8Quant:
                 "allreduce_residual_rmsnorm_fp8_static",
             AllReduceFusionPattern.kARResidualRMSNormFP8PerToken:
                 "allreduce_residual_rmsnorm_fp8_per_token",
             AllReduceFusionPattern.kARResidualRMSNormFP8PerGroup:
                 "allreduce_residual_rmsnorm_fp8_per_group"}
# The static FP8 patterns read scale_factor; the dynamic ones write scale_out.
_STATIC_FP8_PATTERNS = (AllReduceFusionPattern.kARResidualRMSNormFP8Quant,
                        AllReduceFusionPattern.kARResidualRMSNormOutFP8Quant)
_FP8_PATTERNS = _STATIC_FP8_PATTERNS + (AllReduceFusionPattern.kARResidualRMSNormFP8PerToken,
                                        AllReduceFusionPattern.kARResidualRMSNormFP8PerGroup)

# Refresh a "fusion unavailable" answer at most this often (seconds).
_RECHECK_S = 1.0
# How long a failed call waits for the session stream to say whether the sidecar is gone.
_LOST_GRACE_S = 0.25
# Opened done events kept per workspace (the sidecar reuses a small ring of them).
_MAX_DONE_EVENTS = 64


def _dtype_name(t, explicit: Optional[str]) -> str:
    if explicit:
        return explicit
    if isinstance(t, TensorView):
        return t.dtype
    name = str(getattr(t, "dtype", ""))
    if "bfloat16" in name:
        return "bf16"
    if "float16" in name:
        return "fp16"
    if "float32" in name:
        return "fp32"
    raise ValueError(f"dtype {name} is not supported (bf16, fp16, fp32); pass dtype=")


def _address_and_bytes(t):
    if isinstance(t, TensorView):
        return t.address, t.nbytes
    if hasattr(t, "data_ptr"):  # torch
        if not t.is_contiguous():
            raise ValueError("tensors must be contiguous")
        return t.data_ptr(), t.numel() * t.element_size()
    ai = t.__array_interface__  # numpy
    if not t.flags["C_CONTIGUOUS"]:
        raise ValueError("arrays must be C-contiguous")
    return ai["data"][0], t.nbytes


def _start_address(t) -> int:
    """Where a tensor starts, whatever its strides (an FP8 scale tensor of a token-contiguous
    layout is strided; the sidecar checks its extent against the region)."""
    if isinstance(t, TensorView):
        return t.address
    if hasattr(t, "data_ptr"):
        return t.data_ptr()
    return t.__array_interface__["data"][0]


class FusionWorkspace:
    """This rank's connection to its sidecar plus the buffers registered with it.

    Tensors passed to allreduce_fusion must live inside a registered buffer; they are located by
    address, so any view at a 16-byte-aligned offset works.
    """

    def __init__(self, client: Client):
        self.client = client
        self._buffers = []  # (base, size, Region, buffer)
        self._available = None
        self._checked_at = 0.0
        self._event = None
        self._done_events = {}  # done_event handle -> opened IpcEvent
        # Asynchronous ops not confirmed by check(): the workspace generation of the first, the
        # done event of the last, and whether any answered from another generation.
        self._unconfirmed = None  # (generation, IpcEvent, generation_changed)
        self.unavailable_reason = ""  # why the last None was returned
        self._warned = set()  # reasons already warned about

    def register(self, buffer, name: Optional[str] = None):
        name = name or f"buf{len(self._buffers)}"
        if isinstance(buffer, HostShmBuffer) and buffer.fd is not None:
            region = self.client.register_host_fd(name, buffer.fd, buffer.byte_size)
        elif isinstance(buffer, HostShmBuffer):
            region = self.client.register_host_shm(name, buffer.shm_name, buffer.byte_size)
        elif isinstance(buffer, CudaBuffer):
            region = self.client.register_cuda_ipc(name, buffer.ipc_handle, buffer.device,
                                                   buffer.byte_size)
        else:
            raise TypeError("register a HostShmBuffer or a CudaBuffer")
        self._buffers.append((buffer.base_address, buffer.byte_size, region, buffer))
        return region

    def locate(self, t, strided: bool = False) -> TensorLoc:
        """The region and offset of `t`; strided=True locates only its start (the sidecar
        checks the extent the op's shape gives it)."""
        addr, nbytes = (_start_address(t), 1) if strided else _address_and_bytes(t)
        for base, size, region, _ in self._buffers:
            if base <= addr and addr + nbytes <= base + size:
                return TensorLoc(region, addr - base)
        raise ValueError("tensor is not inside a buffer registered with this workspace")

    def fusion_available(self) -> bool:
        now = time.monotonic()
        if self._available is None or (not self._available and now - self._checked_at > _RECHECK_S):
            try:
                info = self.client.workspace_info()
            except ArfuseError as e:
                if e.code == grpc.StatusCode.UNAVAILABLE:
                    self.client.raise_if_lost(_LOST_GRACE_S)
                raise
            self._available = bool(info.fusion_enabled) and \
                info.state == common_pb2.WORKSPACE_STATE_READY
            if not self._available:
                state = common_pb2.WorkspaceState.Name(info.state)
                self.unavailable_reason = info.reason or f"workspace {state}"
            self._checked_at = now
        return self._available

    def mark_unavailable(self, reason: str = ""):
        self._available = False
        self._checked_at = time.monotonic()
        if reason:
            self.unavailable_reason = reason

    def _none(self, stacklevel: int = 3):
        """allreduce_fusion's None, with a warning the first time for each reason."""
        reason = self.unavailable_reason or "the sidecar reports fusion unavailable"
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"arfuse: allreduce_fusion returns None (nothing ran; run your own "
                          f"path): {reason}", FusionUnavailableWarning, stacklevel=stacklevel)
        return None

    def check(self):
        """Confirms that every asynchronous op since the last check completed, or raises.

        On CUDA, allreduce_fusion returns once the sidecar enqueued the op (its stream then waits
        for it, as with NCCL): an op whose kernel fails afterwards (a peer that never ran its
        half, an abort, a group that re-forms meanwhile) has left its outputs unwritten. check()
        waits for the last op (a host wait on its done event), then asks the sidecar: the ops
        are confirmed when the workspace is READY in the generation the first one ran in, and
        ArfuseError(ABORTED) names the workspace's state otherwise. Host mode and synchronous
        ops complete before their reply, so there is nothing to confirm."""
        pending, self._unconfirmed = self._unconfirmed, None
        if pending is None:
            return
        generation, event, changed = pending
        event.synchronize()
        try:
            info = self.client.workspace_info()
        except ArfuseError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE:
                self.client.raise_if_lost(_LOST_GRACE_S)
            raise ArfuseError(grpc.StatusCode.ABORTED,
                              f"asynchronous ops could not be confirmed: {e.message}") from e
        state = common_pb2.WorkspaceState.Name(info.state)
        if changed or info.generation != generation:
            why = (f"the workspace was re-initialized while they ran (generation {generation}, "
                   f"now {info.generation}, {state}: {info.reason})")
        elif info.state != common_pb2.WORKSPACE_STATE_READY:
            why = f"the workspace is {state}: {info.reason}"
        else:
            return
        self.mark_unavailable(info.reason)
        raise ArfuseError(grpc.StatusCode.ABORTED,
                          f"asynchronous ops since the last check may not have completed (their "
                          f"outputs are undefined): {why}")

    def _note_unconfirmed(self, generation: int, event: IpcEvent):
        if self._unconfirmed is None:
            self._unconfirmed = (generation, event, False)
        else:
            first, _, changed = self._unconfirmed
            self._unconfirmed = (first, event, changed or generation != first)

    def _done_event(self, handle: bytes) -> IpcEvent:
        ev = self._done_events.get(handle)
        if ev is None:
            if len(self._done_events) >= _MAX_DONE_EVENTS:
                self._done_events.clear()
            ev = self._done_events[handle] = IpcEvent(handle)
        return ev

    def create_plan(self, input, residual_in=None, residual_out=None, norm_out=None,
                    rms_gamma=None, output=None,
                    pattern: int = AllReduceFusionPattern.kARResidualRMSNorm,
                    rms_eps: float = 1e-6, max_tokens: Optional[int] = None,
                    dtype: Optional[str] = None, doorbell: bool = False, quant_out=None,
                    scale=None, scale_layout=None) -> Plan:
        """A plan over tensors inside registered buffers (located by address, like
        allreduce_fusion), valid for up to `max_tokens` rows (default: input's rows).

        doorbell=True asks for the doorbell plane: the plan's `doorbell` is the Doorbell message
        to open with arfuse.ring.DoorbellRing. Raises ArfuseError (FAILED_PRECONDITION on a sidecar
        that cannot serve it: host mode or an unfused shape; RESOURCE_EXHAUSTED when its slots
        are taken). The FP8 patterns take quant_out and scale (scale_factor or scale_out of
        allreduce_fusion) and, per group, scale_layout."""
        op, _ = _op_spec(self, input, pattern, output, residual_in, residual_out, norm_out,
                         rms_gamma, rms_eps, dtype, quant_out=quant_out, scale=scale,
                         scale_layout=scale_layout)
        if max_tokens is not None:
            op.max_tokens = int(max_tokens)
        return self.client.create_plan(op, doorbell=doorbell)


def _op_spec(workspace, input, pattern, output, residual_in, residual_out, norm_out, rms_gamma,
             rms_eps, dtype, quant_out=None, scale=None, scale_layout=None):
    """(OpSpec at input's row count, the op's main output: quant_out for the FP8 patterns)."""
    shape = tuple(input.shape)
    if len(shape) != 2:
        raise ValueError("input must be [num_tokens, hidden]")
    num_tokens, hidden = int(shape[0]), int(shape[1])
    op = OpSpec(pattern=_PATTERNS[pattern], dtype=_dtype_name(input, dtype), hidden=hidden,
                max_tokens=num_tokens, eps=rms_eps, input=workspace.locate(input))
    if pattern == AllReduceFusionPattern.kAllReduce:
        op.output = workspace.locate(output if output is not None else input)
        return op, (output if output is not None else input)
    fp8 = pattern in _FP8_PATTERNS
    # FlashInfer's kARResidualRMSNormFP8Quant writes no norm_out; its Out variant needs one; the
    # dynamic patterns take one if given.
    if pattern == AllReduceFusionPattern.kARResidualRMSNormFP8Quant:
        norm_out = None
    needs = [("residual_in", residual_in), ("rms_gamma", rms_gamma)]
    if not fp8 or pattern == AllReduceFusionPattern.kARResidualRMSNormOutFP8Quant:
        needs.append(("norm_out", norm_out))
    if fp8:
        needs += [("quant_out", quant_out),
                  ("scale_factor" if pattern in _STATIC_FP8_PATTERNS else "scale_out", scale)]
    for name, t in needs:
        if t is None:
            raise ValueError(f"{name} is required for pattern {pattern}")
    op.residual_in = workspace.locate(residual_in)
    op.residual_out = workspace.locate(residual_out if residual_out is not None else residual_in)
    if norm_out is not None:
        op.norm_out = workspace.locate(norm_out)
    op.gamma = workspace.locate(rms_gamma)
    if not fp8:
        return op, norm_out
    op.quant_out = workspace.locate(quant_out)
    op.scale = workspace.locate(scale, strided=True)
    if pattern == AllReduceFusionPattern.kARResidualRMSNormFP8PerGroup:
        op.scale_layout = scale_layout if scale_layout is not None else "fp32_row_major"
    return op, quant_out


def allreduce_fusion(input, workspace: FusionWorkspace,
                     pattern: int = AllReduceFusionPattern.kARResidualRMSNorm,
                     launch_with_pdl: bool = False, trigger_completion_at_end: bool = True,
                     output=None, residual_out=None, norm_out=None, quant_out=None,
                     scale_out=None, residual_in=None, rms_gamma=None, rms_eps: float = 1e-6,
                     scale_factor=None, layout_code=None, use_oneshot=None, fp32_acc=None,
                     dtype: Optional[str] = None, timeout: Optional[float] = None,
                     scale_layout=None, **unused):
    """Runs the fused op on this rank; every rank of the group must call it alike.

    The FP8 patterns also write quant_out (E4M3 codes, [num_tokens, hidden] bytes) from the
    normalized value: the static ones (kARResidualRMSNormFP8Quant, kARResidualRMSNormOutFP8Quant)
    with scale_factor, a one-element fp32 tensor, as quant = e4m3(norm * (1 / scale_factor));
    arfuse's kARResidualRMSNormFP8PerToken and kARResidualRMSNormFP8PerGroup write their scales
    into scale_out (fp32 [num_tokens], or the per-group `scale_layout`'s tensor:
    "fp32_row_major" (default), "fp32_mn_major" or "ue8m0_packed"). bf16 or fp16 input only.

    Returns the main output (norm_out for kARResidualRMSNorm, output for kAllReduce, quant_out
    for the FP8 patterns), or None
    when the sidecar reports fusion unavailable, for the group or for this op (OUT_OF_RANGE:
    nothing ran on any rank). Errors of a call that did run
    raise ArfuseError; a sidecar that is gone raises SidecarLost. On CUDA the op is
    asynchronous, ordered in the input's stream: a kernel failure after the enqueue is reported by
    workspace.check(). launch_with_pdl, use_oneshot and fp32_acc are accepted for FlashInfer
    compatibility; the sidecar picks the path and always accumulates in fp32.
    """
    if pattern not in _PATTERNS:
        raise ValueError(f"pattern {pattern} is not supported")
    if pattern not in _FP8_PATTERNS and (quant_out is not None or scale_out is not None):
        raise ValueError(f"pattern {pattern} has no quantized output (quant_out, scale_out)")
    if layout_code is not None:
        raise NotImplementedError("layout_code (FlashInfer's FP4 scale layouts) is not served")
    if not workspace.fusion_available():
        return workspace._none()
    static = pattern in _STATIC_FP8_PATTERNS
    op, main = _op_spec(workspace, input, pattern, output, residual_in, residual_out, norm_out,
                        rms_gamma, rms_eps, dtype, quant_out=quant_out,
                        scale=scale_factor if static else scale_out, scale_layout=scale_layout)
    num_tokens = op.max_tokens

    wait_event = b""
    stream = None
    if hasattr(input, "is_cuda") and input.is_cuda:
        import torch
        stream = torch.cuda.current_stream(input.device).cuda_stream
        if workspace._event is None:
            workspace._event = IpcEvent()
        workspace._event.record(stream)  # the sidecar's stream waits for our producer
        wait_event = workspace._event.handle
    try:
        resp = workspace.client.execute_op(op, num_tokens, wait_event=wait_event,
                                           timeout=timeout)
    except SidecarLost:
        raise
    except ArfuseError as e:
        if e.code == grpc.StatusCode.OUT_OF_RANGE:
            # The fused path cannot run this op (its shape or dtype); other ops still fuse, so
            # the workspace stays available.
            return None
        if e.code == grpc.StatusCode.UNAVAILABLE:
            # The sidecar said "not now" (engine initializing, shutting down), or it is gone:
            # the session stream tells which.
            workspace.client.raise_if_lost(_LOST_GRACE_S)
            # The op did not run: the framework's path takes it.
            workspace.mark_unavailable(e.message)
            return workspace._none()
        raise
    if resp.path == common_pb2.EXEC_PATH_UNSPECIFIED:
        workspace.unavailable_reason = resp.reason or "no path was run"
        return workspace._none()
    if stream is not None and resp.done_event:
        done = workspace._done_event(bytes(resp.done_event))
        done.wait_on(stream)
        workspace._note_unconfirmed(resp.workspace_generation, done)
    return main
