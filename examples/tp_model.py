"""The torch half of tp_decode: a compact Llama-style decoder with tensor parallelism whose
allreduce + residual add + RMSNorm goes through arfuse (imported only by model ranks).
It imports tp_decode's torch-free modules (tpd_*), never tp_decode.py itself.

Model: replicated embedding and lm_head; per layer RMSNorm -> attention (column-parallel fused
QKV, rotary embedding, grouped-query attention over a KV cache, row-parallel o_proj) -> RMSNorm
-> SwiGLU MLP (column-parallel gate/up, row-parallel down_proj), residuals: Hugging Face's
LlamaForCausalLM, layer for layer (tp_oracle.py checks that). Weights are random from --seed,
generated whole on every rank (one layer at a time, on the GPU when there is one) and sliced, so
every world size computes the same model.

The row-parallel outputs are partial sums. As in SGLang's LayerCommunicator, each one's
allreduce is fused with the residual add and the *next* RMSNorm (post_attention_layernorm after
attention; the next layer's input_layernorm, or the final norm, after the MLP): 2 fused ops per
layer, "sites" 0 .. 2*layers-1. The forward is pieces 0 .. 2*layers with site i between piece i
and piece i+1; the pieces are what piecewise CUDA graphs capture.

The tensors a fused op touches (partial: the allreduce input; residual, in place; h: the norm
output; the norm weights) have fixed addresses, which CUDA graphs need. On the in-stream plane
they are ordinary torch tensors (the op takes memory from any allocator); on the eager and
doorbell planes they live in one plain-cudaMalloc buffer registered with the sidecar once
(arfuse.CudaBuffer; a HostShmBuffer on --device cpu).
"""
import dataclasses
import math
import statistics
import time
from datetime import timedelta
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

import arfuse
from arfuse.pool import TensorPool

from tpd_common import PROG, SetupError, log, site_name
from tpd_planes import (decide_execution, destroy_plans, report_eager_decode, try_doorbell,
                        try_instream)
from tpd_sidecars import negotiation_key
from tpd_verdicts import print_perf

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# bf16 tolerance for logits: |a - r| <= k * (RTOL * |r| + ATOL_REL * max|r|) (per row), with
# k = DepthFactor(layers). Two bf16 paths that round in different orders (the fused kernel sums in
# fp32 and rounds once; the framework rounds the allreduce, then the residual add) drift apart
# through the residual stream as the model gets deeper. The numerics oracle (oracle.py) measured
# both paths' distance from fp32 at Llama-3-8B sizes: rel_l2 0.5 % after layer 0, 2.1 % after
# layer 31 and at the logits, arfuse within 0.1 % of the framework at every layer, no token
# differing from fp32 but near ties (docs/numerics.md). So the tolerance between the two paths
# grows with depth: as sqrt(layers / 4), 1 up to the 4 layers of the default model.
RTOL = 1.6e-2
ATOL_REL = 1e-2


def depth_factor(layers: int) -> float:
    return max(1.0, math.sqrt(layers / 4.0))


class OpFailed(RuntimeError):
    """A fused op failed (the sidecar answered an error, or a doorbell slot holds one)."""


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The framework's RMSNorm with the fused op's numerics (kernels/cpu/reference_op.h): fp32
    math on the dtype-rounded input, 1/sqrt(mean(x^2) + eps), (x * inv) * weight, one rounding."""
    y = x.float()
    inv = 1.0 / torch.sqrt(y.pow(2).mean(dim=-1, keepdim=True) + eps)
    return ((y * inv) * weight.float()).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    half = xf.shape[-1] // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


# =============================================================================================
# Weights and model
# =============================================================================================

@dataclasses.dataclass
class LayerWeights:
    wqkv_t: torch.Tensor   # [hidden, (heads_local + 2 * kv_local) * head_dim]  column-parallel
    wo_t: torch.Tensor     # [heads_local * head_dim, hidden]                   row-parallel
    wgu_t: torch.Tensor    # [hidden, 2 * inter_local]                          column-parallel
    wd_t: torch.Tensor     # [inter_local, hidden]                              row-parallel


def generate_weights(cfg, device):
    """The model's weights from the seed, in a fixed order, one layer at a time, fp32 on
    `device` (a generator of its own: the same numbers on every rank and in every process on the
    same kind of device). Yields ("embed", [V, H]), then per layer ("layer", l, {q, k, v, o,
    gate, up, down: [out, in]; input_norm, post_norm: [H]}), then ("final_norm", [H]) and
    ("lm_head", [V, H]): Hugging Face's Llama layout."""
    gdev = device if device.type == "cuda" else torch.device("cpu")
    g = torch.Generator(device=gdev).manual_seed(cfg.seed)
    H, V, hd = cfg.hidden, cfg.vocab, cfg.head_dim
    nh, nkv, inter = cfg.heads, cfg.kv_heads, cfg.intermediate

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float32, device=gdev) * std

    yield ("embed", randn(V, H))
    for layer in range(cfg.layers):
        w = {"q": randn(nh * hd, H, std=H ** -0.5), "k": randn(nkv * hd, H, std=H ** -0.5),
             "v": randn(nkv * hd, H, std=H ** -0.5), "o": randn(H, nh * hd, std=(nh * hd) ** -0.5),
             "gate": randn(inter, H, std=H ** -0.5), "up": randn(inter, H, std=H ** -0.5),
             "down": randn(H, inter, std=inter ** -0.5)}
        w["input_norm"] = 1.0 + 0.1 * randn(H)
        w["post_norm"] = 1.0 + 0.1 * randn(H)
        yield ("layer", layer, w)
    yield ("final_norm", 1.0 + 0.1 * randn(H))
    yield ("lm_head", randn(V, H, std=H ** -0.5))


class Weights:
    """This rank's shard of the model generate_weights() makes (world=1 and dtype float32: the
    fp32 reference, tp_oracle.py). An 80-layer model at 8B sizes never sits whole in memory."""

    def __init__(self, cfg, rank: int, world: int, device, dtype):
        hd = cfg.head_dim
        hl, kvl, il = cfg.heads // world, cfg.kv_heads // world, cfg.intermediate // world
        q = slice(rank * hl * hd, (rank + 1) * hl * hd)
        kv = slice(rank * kvl * hd, (rank + 1) * kvl * hd)
        mi = slice(rank * il, (rank + 1) * il)

        def put(t):
            return t.to(device=device, dtype=dtype).contiguous()

        self.layers: List[LayerWeights] = []
        self.norms: List[torch.Tensor] = []  # in_0, post_0, in_1, post_1, ..., final
        for item in generate_weights(cfg, device):
            if item[0] == "embed":
                self.embed = put(item[1])
            elif item[0] == "layer":
                w = item[2]
                self.norms += [put(w["input_norm"]), put(w["post_norm"])]
                self.layers.append(LayerWeights(
                    wqkv_t=put(torch.cat([w["q"][q], w["k"][kv], w["v"][kv]], 0).t()),
                    wo_t=put(w["o"][:, q].t()),
                    wgu_t=put(torch.cat([w["gate"][mi], w["up"][mi]], 0).t()),
                    wd_t=put(w["down"][:, mi].t())))
            elif item[0] == "final_norm":
                self.norms.append(put(item[1]))
            else:
                self.lm_head_t = item[1].t().contiguous().to(device)  # [H, V] fp32 logits


class TPModel:
    """pool_buffer: the registered buffer the fused op's tensors are carved from (eager and
    doorbell planes), or None for ordinary torch tensors (the in-stream plane, the references).
    """

    def __init__(self, cfg, weights: Weights, pool_buffer, layout, rank: int, world: int,
                 device, dtype):
        self.cfg, self.w, self.rank, self.world = cfg, weights, rank, world
        self.device, self.dtype = device, dtype
        self.cuda = device.type == "cuda"
        H, M, B, S, hd = cfg.hidden, layout.max_tokens, cfg.batch, cfg.max_seq, cfg.head_dim
        self.hl, self.kvl = cfg.heads // world, cfg.kv_heads // world
        self.il = cfg.intermediate // world
        self.sites = cfg.sites
        self.pieces = cfg.sites + 1
        # The fused op's tensors: static, in the registered pool or torch's allocator.
        if pool_buffer is not None:
            pool = TensorPool(pool_buffer)
            self.partial = pool.view(dtype, (M, H), layout.offset("partial"))
            self.residual = pool.view(dtype, (M, H), layout.offset("residual"))
            self.h = pool.view(dtype, (M, H), layout.offset("h"))
            self.gammas = pool.view(dtype, (cfg.sites + 1, H), layout.offset("gamma"))
        else:
            self.partial, self.residual, self.h = (torch.zeros(M, H, device=device, dtype=dtype)
                                                   for _ in range(3))
            self.gammas = torch.zeros(cfg.sites + 1, H, device=device, dtype=dtype)
        self.gammas.copy_(torch.stack(weights.norms).to(device=device, dtype=dtype))
        # Everything else: ordinary torch memory, allocated before any capture.
        self.k_cache = [torch.zeros(B, self.kvl, S, hd, device=device, dtype=dtype)
                        for _ in range(cfg.layers)]
        self.v_cache = [torch.zeros_like(c) for c in self.k_cache]
        self.key_pos = torch.arange(S, device=device)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        f = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq)
        emb = torch.cat([f, f], dim=-1)
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)
        self.logits_out = torch.zeros(B, cfg.vocab, dtype=torch.float32, device=device)
        self.next_tok = torch.zeros(B, dtype=torch.long, device=device)
        # Decode's static inputs.
        self.dec_tok = torch.zeros(B, dtype=torch.long, device=device)
        self.dec_pos = torch.zeros(1, dtype=torch.long, device=device)

    def reset(self):
        for c in self.k_cache + self.v_cache:
            c.zero_()

    # -- pieces --
    def piece(self, i: int, tok: torch.Tensor, pos: torch.Tensor, B: int, T: int):
        n = B * T
        if i == 0:
            torch.index_select(self.w.embed, 0, tok, out=self.residual[:n])
            # Layer 0's input_layernorm has no allreduce before it: a local norm.
            self.h[:n].copy_(rmsnorm(self.residual[:n], self.gammas[0], self.cfg.eps))
            self.attention(0, pos, B, T)
        elif i == self.sites:
            self.lm_head(B, T)
        elif i % 2 == 1:
            self.mlp((i - 1) // 2, n)
        else:
            self.attention(i // 2, pos, B, T)

    def attention(self, layer: int, pos: torch.Tensor, B: int, T: int):
        n, hd, hl, kvl = B * T, self.cfg.head_dim, self.hl, self.kvl
        W = self.w.layers[layer]
        qkv = torch.mm(self.h[:n], W.wqkv_t)
        q, k, v = qkv.split([hl * hd, kvl * hd, kvl * hd], dim=1)
        q = q.reshape(B, T, hl, hd).transpose(1, 2)
        k = k.reshape(B, T, kvl, hd).transpose(1, 2)
        v = v.reshape(B, T, kvl, hd).transpose(1, 2)
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        self.k_cache[layer].index_copy_(2, pos, k.contiguous())
        self.v_cache[layer].index_copy_(2, pos, v.contiguous())
        S, group = self.cfg.max_seq, hl // kvl
        kk = self.k_cache[layer][:, :, None].expand(B, kvl, group, S, hd).reshape(B, hl, S, hd)
        vv = self.v_cache[layer][:, :, None].expand(B, kvl, group, S, hd).reshape(B, hl, S, hd)
        mask = self.key_pos[None, :] <= pos[:, None]  # [T, S]: causal over the cache
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        torch.mm(o.transpose(1, 2).reshape(n, hl * hd), W.wo_t, out=self.partial[:n])

    def mlp(self, layer: int, n: int):
        W = self.w.layers[layer]
        gu = torch.mm(self.h[:n], W.wgu_t)
        g, u = gu.split(self.il, dim=1)
        torch.mm(F.silu(g) * u, W.wd_t, out=self.partial[:n])

    def lm_head(self, B: int, T: int):
        last = self.h[:B * T].view(B, T, self.cfg.hidden)[:, T - 1]
        torch.mm(last.float(), self.w.lm_head_t, out=self.logits_out)
        torch.argmax(self.logits_out, dim=-1, out=self.next_tok)


# =============================================================================================
# The per-layer op: framework path, arfuse eager plane, arfuse doorbell plane
# =============================================================================================

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


# =============================================================================================
# Running: prefill eagerly, decode in graphs
# =============================================================================================

class Runner:
    """Decode with one full graph, one graph per piece (the op between pieces unless it is
    capturable), or no graph."""

    def __init__(self, model: TPModel, comm, mode: str):
        if mode == "full" and not comm.capturable:
            raise ValueError(f"a {comm.plane} op cannot sit inside a full CUDA graph")
        self.m, self.comm = model, comm
        self.mode = mode if model.cuda else "none"
        self.graphs = []

    def forward(self, tok, pos, B: int, T: int, comm):
        for i in range(self.m.pieces):
            self.m.piece(i, tok, pos, B, T)
            if i < self.m.sites:
                comm.site(i, B * T)

    def prefill(self, prompt: torch.Tensor, comm):
        """Eager (the eager plane): prompt [B, T]; returns (next tokens, logits) of position T-1."""
        B, T = prompt.shape
        pos = torch.arange(T, device=self.m.device)
        self.forward(prompt.reshape(-1).contiguous(), pos, B, T, comm)
        return self.m.next_tok.clone(), self.m.logits_out.clone()

    def _decode_eager(self):
        self.forward(self.m.dec_tok, self.m.dec_pos, self.m.cfg.batch, 1, self.comm)

    def prepare_decode(self, first_tok: torch.Tensor, start_pos: int):
        m = self.m
        m.dec_tok.copy_(first_tok)
        m.dec_pos.fill_(start_pos)
        if self.mode == "none":
            return
        # Warm up on a side stream before capture (torch's rule). The warm-up is a real decode
        # step at the current position: every rank runs it alike, and the first replay redoes it.
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self._decode_eager()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        B = m.cfg.batch
        if self.mode == "full":
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._decode_eager()
            self.graphs = [g]
        else:
            for i in range(m.pieces):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    m.piece(i, m.dec_tok, m.dec_pos, B, 1)
                    if i < m.sites and self.comm.capturable:
                        self.comm.site(i, B)
                self.graphs.append(g)
        torch.cuda.synchronize()

    def step(self):
        if self.mode == "none":
            self._decode_eager()
        elif self.mode == "full":
            self.graphs[0].replay()
        else:
            B = self.m.cfg.batch
            for i, g in enumerate(self.graphs):
                g.replay()
                if i < self.m.sites and not self.comm.capturable:
                    self.comm.site(i, B)  # the split op, eager, between graph pieces

    def advance(self, forced: Optional[torch.Tensor] = None):
        """The next decode step's input: this step's greedy tokens, or `forced` (teacher
        forcing: every implementation then sees the same sequence)."""
        self.m.dec_tok.copy_(self.m.next_tok if forced is None else forced)
        self.m.dec_pos.add_(1)

    def release(self):
        self.graphs = []
        if self.m.cuda:
            torch.cuda.synchronize()


@dataclasses.dataclass
class PassResult:
    name: str
    graph: str
    plane: str
    tokens: torch.Tensor   # [steps, batch]
    logits: torch.Tensor   # [steps, batch, vocab] fp32
    seconds: float
    # With taps: per layer, the residual stream after it at every position run (the prefill's
    # batch x prompt rows, then batch rows per decode step), fp32 on the CPU.
    taps: Optional[List[torch.Tensor]] = None


def run_pass(ctx, model: TPModel, prompt, name: str, prefill_comm, decode_comm, mode: str,
             inject_step: Optional[int] = None, forced: Optional[torch.Tensor] = None,
             taps: Optional[List[torch.Tensor]] = None) -> PassResult:
    """Prefill, then steps-1 decode steps. forced [steps, batch]: teacher forcing (decode step
    s reads forced[s-1] instead of its own last token). taps: static [max_tokens, hidden]
    tensors per layer that the comms (TapComm) fill; collected after every step."""
    cfg = model.cfg
    model.reset()
    t0 = time.perf_counter()
    runner = Runner(model, decode_comm, mode)
    got_taps = [[] for _ in taps] if taps is not None else None

    def collect(n):
        if taps is not None:
            for layer, t in enumerate(taps):
                # A copy: on the CPU, fp32 .float().cpu() would be a view of the static tap.
                got_taps[layer].append(t[:n].to(device="cpu", dtype=torch.float32, copy=True))

    prefill_comm.phase = "prefill"
    tok, logits = runner.prefill(prompt, prefill_comm)
    collect(cfg.batch * cfg.prompt_len)
    toks, logs = [tok.to("cpu", copy=True)], [logits.to("cpu", copy=True)]
    if hasattr(prefill_comm, "check"):
        prefill_comm.check("prefill")
    decode_comm.phase = "decode warm-up and capture"
    first = forced[0].to(model.device) if forced is not None else tok
    runner.prepare_decode(first, cfg.prompt_len)
    if hasattr(decode_comm, "check"):
        decode_comm.check("decode warm-up")
    for s in range(1, cfg.steps):
        if inject_step is not None and s == inject_step:
            ctx.kill_own_sidecar(s)
        decode_comm.phase = f"decode step {s}"
        runner.step()
        t = model.next_tok.to("cpu", copy=True)  # synchronizes, as a server reading tokens does
        if hasattr(decode_comm, "check"):
            decode_comm.check(f"decode step {s}")
        collect(cfg.batch)
        toks.append(t)
        logs.append(model.logits_out.to("cpu", copy=True))
        runner.advance(forced[s].to(model.device) if forced is not None and s < cfg.steps
                       else None)
    runner.release()
    r = PassResult(name, runner.mode, decode_comm.plane, torch.stack(toks), torch.stack(logs),
                   time.perf_counter() - t0,
                   [torch.cat(chunks) for chunks in got_taps] if got_taps is not None else None)
    log(f"pass {name}: {cfg.steps} tokens x {cfg.batch} sequences in {r.seconds:.2f} s "
        f"(decode graph {r.graph}, {r.plane})", ctx.rank)
    return r


def compare(ref: PassResult, got: PassResult, exact: bool, strict: bool, layers: int = 4) -> dict:
    """Greedy tokens equal, logits within bf16 tolerance (scaled by depth_factor(layers)). A
    token difference is accepted (unless exact or strict) only at a near tie: the reference's
    logits of both tokens within tolerance; that sequence is then compared no further (its
    context differs from there on)."""
    S, B = ref.tokens.shape
    k = 1.0 if exact else depth_factor(layers)
    rtol, atol_rel = k * RTOL, k * ATOL_REL
    problems, ties = [], []
    max_abs, rows, equal = 0.0, 0, 0
    for b in range(B):
        for s in range(S):
            rl, gl = ref.logits[s, b], got.logits[s, b]
            scale = float(rl.abs().max())
            d = (gl - rl).abs()
            max_abs = max(max_abs, float(d.max()))
            rows += 1
            if not bool((d <= rtol * rl.abs() + atol_rel * scale).all()):
                problems.append(f"seq {b} step {s}: logits beyond bf16 tolerance x{k:.2f} "
                                f"(max |diff| {float(d.max()):.4g}, max |logit| {scale:.4g})")
                break
            rt, gt = int(ref.tokens[s, b]), int(got.tokens[s, b])
            if rt == gt:
                equal += 1
                continue
            gap = float(rl[rt] - rl[gt])
            if not exact and not strict and gap <= rtol * abs(float(rl[rt])) + atol_rel * scale:
                ties.append(f"seq {b} step {s}: near tie {rt} vs {gt} (gap {gap:.3g})")
                break
            problems.append(f"seq {b} step {s}: token {gt}, reference {rt} (logit gap {gap:.3g})")
            break
    name = f"{got.name} vs {ref.name}"
    if problems:
        msg = "; ".join(problems[:4])
    else:
        msg = (f"{equal}/{S * B} tokens equal, logits max |diff| {max_abs:.3g} over {rows} "
               f"positions (bf16 tolerance x{k:.2f} for {layers} layers)")
        if ties:
            msg += "; " + "; ".join(ties) + " (accepted: within bf16 tolerance)"
    return {"name": name, "ok": not problems, "message": msg, "max_abs_logit_diff": max_abs,
            "tokens_equal": equal, "tokens_total": S * B, "near_ties": ties}


def time_decode(model: TPModel, comm, mode: str, iters: int, warmup: int) -> List[float]:
    """Seconds per decode step (replay + reading the tokens back), at a fixed position."""
    model.reset()
    runner = Runner(model, comm, mode)
    comm.phase = "perf warm-up"
    runner.prepare_decode(torch.zeros_like(model.next_tok), model.cfg.prompt_len)
    for _ in range(warmup):
        runner.step()
        model.next_tok.to("cpu", copy=True)
    times = []
    comm.phase = "perf"
    for _ in range(iters):
        t0 = time.perf_counter()
        runner.step()
        model.next_tok.to("cpu", copy=True)
        times.append(time.perf_counter() - t0)
    if hasattr(comm, "check"):
        comm.check("perf")
    runner.release()
    return times


def perf_row(name: str, graph: str, plane: str, times: List[float], batch: int) -> dict:
    ts = sorted(times)
    p50 = statistics.median(ts)
    p90 = ts[min(len(ts) - 1, int(0.9 * len(ts)))]
    return {"name": name, "graph": graph, "plane": plane, "p50_ms": p50 * 1e3,
            "p90_ms": p90 * 1e3, "mean_ms": statistics.fmean(ts) * 1e3,
            "tokens_per_s": batch / p50, "iters": len(ts)}


# =============================================================================================
# One rank
# =============================================================================================

def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def framework_mode(want: str, capturable: bool, cuda: bool, override: str = "auto") -> str:
    """The reference's graph mode: as asked when its collective can be captured (NCCL), else
    piecewise with the collective between pieces (gloo); --framework-graph overrides."""
    if not cuda:
        return "none"
    if override != "auto":
        return "piecewise" if override == "full" and not capturable else override
    if want == "none":
        return "none"
    return want if capturable else "piecewise"


@dataclasses.dataclass
class RankSetup:
    """A model rank after setup: the process group, the negotiated plane set up, the model."""
    device: object
    backend: str               # the framework path's collective: "nccl" or "gloo"
    neg: object
    ex: object                 # tpd_planes.ExecPlan
    model: TPModel
    fw: FrameworkComm
    prefill_comm: object
    decode_comm: object
    ref_mode: str              # the framework reference's graph mode
    ws: object = None
    plans: list = dataclasses.field(default_factory=list)
    rings: list = dataclasses.field(default_factory=list)
    instream: object = None

    def release(self, client):
        for ring in self.rings:
            ring.close()
        destroy_plans(client, self.plans)
        if self.instream is not None:
            import arfuse.torch as aft

            aft.set_context(None, self.device)
            try:
                self.instream.detach()
            except arfuse.ArfuseError as e:
                log(f"detach: {e}", self.model.rank)


def _vote(what: str, rank: int, ok: bool, why: Optional[str]) -> Tuple[bool, str]:
    """Every rank's outcome: all ok, or the reasons of those that were not."""
    oks = gather((ok, why or ""))
    if all(o for o, _ in oks):
        return True, ""
    reason = "; ".join(f"rank {r}: {w}" for r, (o, w) in enumerate(oks) if not o)
    log(f"{what} not set up on every rank ({reason})", rank)
    return False, reason


def setup_rank(ctx) -> RankSetup:
    args, cfg, rank, world = ctx.args, ctx.cfg, ctx.rank, ctx.world
    cuda = ctx.device == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            raise SetupError("--device cuda but torch sees no GPU")
        torch.cuda.set_device(ctx.gpu)
        device = torch.device("cuda", ctx.gpu)
    else:
        device = torch.device("cpu")
    backend = "nccl" if cuda and ctx.one_gpu_per_rank else "gloo"
    dist.init_process_group(backend, init_method=args.dist_init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.pg_timeout))
    log(f"torch {torch.__version__}, torch.distributed {backend}, device {device}", rank)

    # Every rank must run the same path (docs/config.md, "Every rank alike"): check the group
    # decision is the same.
    neg = ctx.neg
    keys = gather(negotiation_key(neg))
    if any(k != keys[0] for k in keys):
        why = "; ".join(f"rank {r}: {k}" for r, k in enumerate(keys))
        log(f"ranks negotiated differently ({why}): fusion off on every rank", rank)
        neg = dataclasses.replace(neg, fusion_enabled=False,
                                  reasons=neg.reasons + (f"ranks disagree: {why}",))

    dtype = TORCH_DTYPES[cfg.dtype]
    weights = Weights(cfg, rank, world, device, dtype)
    layout = ctx.layout

    # The in-stream plane: one attachment for every site, agreed by every rank.
    ictx, iok, ireason = None, None, ""
    if neg.fusion_enabled and neg.data_plane == "instream":
        import arfuse.torch as aft

        ictx, why = try_instream(ctx.client, [cfg.hidden], ctx.client_lib)
        if ictx is not None:
            aft.set_context(ictx, device)
            not_fused = ictx.why_not(cfg.batch, cfg.hidden, cfg.dtype)
            if not_fused is not None:
                why = (f"the decode batch ({cfg.batch} x {cfg.hidden} {cfg.dtype}) is not "
                       f"served fused: {not_fused}")
            else:
                log(f"attached: {ictx!r}; fused up to "
                    f"{ictx.max_fused_tokens(cfg.hidden, cfg.dtype)} tokens", rank)
        iok, ireason = _vote("the in-stream plane", rank, why is None, why)
        if not iok and ictx is not None:
            aft.set_context(None, device)
            ictx.detach()
            ictx = None
        ctx.instream = ictx

    buf = None
    if ictx is None:
        # One plain-cudaMalloc buffer for every tensor the fused op touches, registered once.
        buf = arfuse.CudaBuffer(layout.total, ctx.gpu) if cuda else \
            arfuse.HostShmBuffer(layout.total)
        ctx.buffers.append(buf)
    model = TPModel(cfg, weights, buf, layout, rank, world, device, dtype)
    ws = region = None
    if neg.fusion_enabled and ictx is None:
        ws = arfuse.FusionWorkspace(ctx.client)
        region = ws.register(buf, f"{PROG}-pool")

    # Doorbell plans (one per fused op of a decode step) and their rings, when negotiated.
    plans, rings, dok, dreason = [], [], None, ""
    if neg.fusion_enabled and neg.data_plane == "doorbell" and cuda and \
            neg.cuda_graph_mode != "none":
        plans, rings, why = try_doorbell(ctx.client, cfg, layout, region, ctx.ring_lib)
        dok, dreason = _vote("the doorbell plane", rank, why is None, why)
        if not dok:
            for ring in rings:
                ring.close()
            destroy_plans(ctx.client, plans)
            plans, rings = [], []
        else:
            log(f"{len(plans)} doorbell plans, rings opened (lib "
                f"{getattr(rings[0]._lib, '_arfuse_path', '?')})", rank)
    ex = decide_execution(neg, ctx.device, ctx.want_mode,
                          framework_capturable=cuda and backend == "nccl",
                          doorbell_ok=dok, doorbell_reason=dreason,
                          instream_ok=iok, instream_reason=ireason)
    ctx.report_execution(ex)

    fw = FrameworkComm(model, backend)
    ref_mode = framework_mode(ctx.want_mode, fw.capturable, cuda, args.framework_graph)
    if not ex.fused:
        prefill_comm = decode_comm = fw
    elif ex.decode_plane == "instream":
        prefill_comm = decode_comm = InStreamComm(model, ictx, fw)
    else:
        prefill_comm = ArfuseEagerComm(model, ws, fw, args.op_timeout)
        decode_comm = (DoorbellComm(model, rings, int(args.op_timeout * 1e9))
                       if ex.decode_plane == "doorbell" else prefill_comm)
    return RankSetup(device, backend, neg, ex, model, fw, prefill_comm, decode_comm, ref_mode,
                     ws, plans, rings, ictx)


def make_prompt(cfg, device) -> torch.Tensor:
    return torch.randint(0, cfg.vocab, (cfg.batch, cfg.prompt_len),
                         generator=torch.Generator().manual_seed(cfg.seed + 1)).to(device)


def run_rank(ctx) -> bool:
    args, cfg, rank = ctx.args, ctx.cfg, ctx.rank
    rs = setup_rank(ctx)
    ex, model, fw = rs.ex, rs.model, rs.fw
    checks = report_eager_decode(ex, ctx.allow_eager_decode, rank)
    cuda = model.cuda
    prompt = make_prompt(cfg, rs.device)
    inject_step = ctx.inject[1] if ctx.inject and ctx.inject[0] == rank else None
    ref = None
    if args.check:
        ref = run_pass(ctx, model, prompt, f"framework ({rs.backend})", fw, fw, rs.ref_mode)
    arf = run_pass(ctx, model, prompt, "arfuse" if ex.fused else "arfuse (fusion off)",
                   rs.prefill_comm, rs.decode_comm, ex.decode_graph, inject_step)
    ctx.result["tokens"] = arf.tokens.tolist()
    if ex.fused and hasattr(rs.prefill_comm, "fused"):
        ctx.result["ops"] = {"plane": rs.prefill_comm.plane, "fused": rs.prefill_comm.fused,
                             "fallbacks": rs.prefill_comm.fallbacks}
        log(f"{rs.prefill_comm.plane} plane: {rs.prefill_comm.fused} ops fused, "
            f"{rs.prefill_comm.fallbacks} on the framework path (outside graphs: counted as "
            "called, a captured op once)", rank)
    if ref is not None:
        checks.append(compare(ref, arf, exact=not ex.fused, strict=args.strict_tokens,
                              layers=args.layers))
        if ex.fused and ctx.args.scenario == "main":
            # The fallback branch itself: every op reported unavailable.
            forced = ArfuseEagerComm(model, rs.ws, fw, args.op_timeout, force_none=True)
            fb = run_pass(ctx, model, prompt, "fallback (every op unavailable)", forced,
                          forced, "piecewise" if cuda and ctx.want_mode != "none" else "none")
            checks.append(compare(ref, fb, exact=True, strict=True))
    ctx.result["checks"] = checks
    for c in checks:
        log(f"check {c['name']}: {'PASS' if c['ok'] else 'FAIL'}: {c['message']}", rank)

    if args.perf and ctx.args.scenario == "main":
        ctx.result["perf"] = run_perf(ctx, model, fw, rs.decode_comm if ex.fused else None, ex,
                                      rs.ref_mode, rs.backend)
    rs.release(ctx.client)
    dist.barrier()
    ok = all(c["ok"] for c in checks)
    log("PASS" if ok else "FAIL", rank)
    return ok


def run_perf(ctx, model, fw, arfuse_comm, ex, ref_mode, backend) -> dict:
    cfg, args = model.cfg, ctx.args
    variants = [(f"framework ({backend} + torch RMSNorm)", fw, ref_mode, backend)]
    if arfuse_comm is not None:
        variants.append(("arfuse", arfuse_comm, ex.decode_graph, ex.decode_plane))
    local = FrameworkComm(model, backend, local=True)
    variants.append(("no allreduce (compute floor)", local,
                     "full" if model.cuda and ctx.want_mode != "none" else "none", "-"))
    rows = []
    for name, comm, mode, plane in variants:
        dist.barrier()
        times = time_decode(model, comm, mode, args.perf_iters, args.perf_warmup)
        rows.append(perf_row(name, mode if model.cuda else "none", plane, times, cfg.batch))
    by = {r["name"]: r for r in rows}
    floor = rows[-1]["p50_ms"]
    L = cfg.layers
    summary = []
    fwr = rows[0]
    summary.append(f"framework path: {(fwr['p50_ms'] - floor) * 1e3 / L:.1f} us/layer over the "
                   f"compute floor ({(fwr['p50_ms'] - floor) * 1e3 / (2 * L):.1f} us per op)")
    if "arfuse" in by:
        a = by["arfuse"]["p50_ms"]
        summary.append(f"arfuse sidecar: {(a - floor) * 1e3 / L:.1f} us/layer over the compute "
                       f"floor ({(a - floor) * 1e3 / (2 * L):.1f} us per fused op); "
                       f"{(a - fwr['p50_ms']) * 1e3 / L:+.1f} us/layer vs the framework path; "
                       f"step time {a / fwr['p50_ms']:.2f}x the framework's")
    if backend != "nccl" and model.cuda:
        summary.append("ranks share a GPU: NCCL refuses that, so the framework path is gloo "
                       "(a host round trip per op); compare arfuse with the floor here, and with "
                       "NCCL on the two-GPU run")
    if rows and ctx.rank == 0 and not ctx.workdir:  # the launcher prints it in its summary
        print_perf({"rows": rows, "summary": summary},
                      f"rank 0: batch {cfg.batch}, {cfg.layers} layers, hidden {cfg.hidden}, "
                      f"tp {ctx.world}")
    return {"rows": rows, "summary": summary, "layers": L, "batch": cfg.batch}
