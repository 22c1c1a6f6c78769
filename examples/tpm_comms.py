"""The per-layer op of tp_decode's model ranks, one comm per plane: the framework path, the
arfuse eager plane, the doorbell plane, the in-stream plane, and a wrapper that taps the
residual stream for the oracle. A comm's site(i, n) is fused-op site i on the first n tokens.
"""
import torch
import torch.distributed as dist

import arfuse

from tpd_common import site_name
from tpm_layers import TPModel, rmsnorm


class OpFailed(RuntimeError):
    """A fused op failed (the sidecar answered an error, or a doorbell slot holds one)."""


class FrameworkComm:
    """The framework's own path (SGLang: tensor_model_parallel_all_reduce, then its add-RMSNorm
    kernel): torch.distributed all_reduce + residual add + RMSNorm."""
    plane = "framework"

    def __init__(self, model: TPModel, backend: str, local: bool = False):
        self.m, self.backend, self.local = model, backend, local
        self.capturable = model.cuda and (backend == "nccl" or local)
        self.phase = ""

    def site(self, i: int, n: int):
        m = self.m
        x = m.partial[:n]
        if m.world > 1 and not self.local:
            if self.backend == "nccl":
                dist.all_reduce(x)
            else:  # gloo: sum in fp32, round once (for two ranks the same bits as a dtype sum)
                t = x.float()
                dist.all_reduce(t)
                x.copy_(t)
        r = m.residual[:n]
        r.add_(x)
        m.h[:n].copy_(rmsnorm(r, m.gammas[i + 1], m.cfg.eps))


class ArfuseEagerComm:
    """The eager plane, called the way SGLang calls FlashInfer's fused op: allreduce_fusion()
    returns None when fusion is unavailable, and the framework's own path runs that op."""
    plane = "eager"
    capturable = False

    def __init__(self, model: TPModel, ws, fallback: FrameworkComm, op_timeout: float,
                 force_none: bool = False):
        self.m, self.ws, self.fallback = model, ws, fallback
        self.op_timeout, self.force_none = op_timeout, force_none
        self.fused = 0
        self.fallbacks = 0
        self.phase = ""

    def site(self, i: int, n: int):
        m = self.m
        out = None
        if not self.force_none:
            try:
                out = arfuse.allreduce_fusion(
                    input=m.partial[:n], workspace=self.ws, residual_in=m.residual[:n],
                    residual_out=m.residual[:n], norm_out=m.h[:n], rms_gamma=m.gammas[i + 1],
                    rms_eps=m.cfg.eps, timeout=self.op_timeout)
            except arfuse.SidecarLost:
                raise
            except arfuse.ArfuseError as e:
                raise OpFailed(f"fused op failed ({self.phase}, {site_name(m.cfg, i)}): "
                               f"{e}") from e
        if out is None:
            self.fallbacks += 1
            self.fallback.site(i, n)  # fusion unavailable: the framework's path
        else:
            self.fused += 1


class DoorbellComm:
    """The doorbell plane: the ring kernel of libarfuse_ring.so, captured in the decode graph."""
    plane = "doorbell"
    capturable = True

    def __init__(self, model: TPModel, rings, timeout_ns: int):
        self.m, self.rings, self.timeout_ns = model, rings, timeout_ns
        self.phase = ""

    def site(self, i: int, n: int):
        self.rings[i].ring(torch.cuda.current_stream().cuda_stream, n, self.timeout_ns)

    def check(self, phase: str):
        """After a replay (outside capture): a slot error means that op's outputs are stale."""
        for i, ring in enumerate(self.rings):
            code = ring.error()
            if code:
                from arfuse import ring as ringmod
                raise OpFailed(f"doorbell op failed ({phase}, {site_name(self.m.cfg, i)}): "
                               f"slot error {code:#x}: {ringmod.slot_error_name(code)}")


class InStreamComm:
    """The in-stream plane: arfuse.torch's op, the sidecar's kernel launched on the current
    stream (captured in the decode graph like any kernel). An op it does not serve fused (a
    prefill above the fused range, say) takes the framework's path: decided alike on every
    rank, from the shapes and the sidecars' shared tables."""
    plane = "instream"

    def __init__(self, model: TPModel, ictx, fallback: FrameworkComm):
        import arfuse.torch as aft

        self.m, self.ctx, self.fallback, self.aft = model, ictx, fallback, aft
        self.capturable = model.cuda
        self.fused = 0
        self.fallbacks = 0
        self.phase = ""

    def site(self, i: int, n: int):
        m = self.m
        try:
            ok = self.aft.fused_allreduce_residual_rmsnorm_(m.partial[:n], m.residual[:n],
                                                            m.gammas[i + 1], m.cfg.eps,
                                                            m.h[:n])
        except arfuse.ArfuseError as e:
            raise OpFailed(f"fused op failed ({self.phase}, {site_name(m.cfg, i)}): {e}") from e
        if ok:
            self.fused += 1
        else:
            self.fallbacks += 1
            self.fallback.site(i, n)

    def check(self, phase: str):
        """After a replay or a pass (outside capture): a failed launch's outputs are stale."""
        try:
            self.ctx.check()
        except arfuse.ArfuseError as e:
            raise OpFailed(f"in-stream op failed ({phase}): {e}") from e


class TapComm:
    """Wraps a comm: after every MLP site (the end of a layer) copies the residual stream into
    taps[layer] (the oracle's per-layer hidden states; in the graph when the op is)."""

    def __init__(self, inner, taps: list):
        self.inner, self.taps = inner, taps
        self.plane, self.capturable = inner.plane, inner.capturable

    @property
    def phase(self):
        return self.inner.phase

    @phase.setter
    def phase(self, v):
        self.inner.phase = v

    def site(self, i: int, n: int):
        self.inner.site(i, n)
        if i % 2 == 1:
            self.taps[i // 2][:n].copy_(self.inner.m.residual[:n])

    def __getattr__(self, name):  # check(), fused, fallbacks, m ...
        return getattr(self.inner, name)
