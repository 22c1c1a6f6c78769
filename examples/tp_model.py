"""The torch half of tp_decode: a model rank's run, with the allreduce + residual add + RMSNorm
of a compact Llama-style decoder with tensor parallelism going through arfuse (imported only by
model ranks). It imports tp_decode's torch-free modules (tpd_*), never tp_decode.py itself.

The parts: tpm_layers.py (the model: weights, norms, attention, MLP, the forward pieces),
tpm_comms.py (the per-layer op on each plane), and this file: the runner (prefill eagerly,
decode in graphs), a pass, the comparison with the framework path, the perf rows, and the
rank's setup and run. The names tp_oracle.py and the tests use are importable from here.

The row-parallel outputs are partial sums. As in SGLang's LayerCommunicator, each one's
allreduce is fused with the residual add and the *next* RMSNorm (post_attention_layernorm after
attention; the next layer's input_layernorm, or the final norm, after the MLP): 2 fused ops per
layer, "sites" 0 .. 2*layers-1. The forward is pieces 0 .. 2*layers with site i between piece i
and piece i+1; the pieces are what piecewise CUDA graphs capture.
"""
import dataclasses
import math
import statistics
import time
from datetime import timedelta
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

import arfuse

from tpd_common import PROG, SetupError, log
from tpd_planes import (decide_execution, destroy_plans, report_eager_decode, try_doorbell,
                        try_instream)
from tpd_sidecars import negotiation_key
from tpd_verdicts import print_perf
from tpm_comms import (ArfuseEagerComm, DoorbellComm, FrameworkComm, InStreamComm, OpFailed,
                       TapComm)
from tpm_layers import LayerWeights, TPModel, Weights, generate_weights, rmsnorm, rope

# This module's names, and the model's and the comms' that tp_oracle.py and the tests reach
# through it.
__all__ = [
    "LayerWeights", "TPModel", "Weights", "generate_weights", "rmsnorm", "rope",
    "ArfuseEagerComm", "DoorbellComm", "FrameworkComm", "InStreamComm", "OpFailed", "TapComm",
    "TORCH_DTYPES", "RTOL", "ATOL_REL", "depth_factor", "Runner", "PassResult", "run_pass",
    "compare", "time_decode", "perf_row", "gather", "framework_mode", "RankSetup", "setup_rank",
    "make_prompt", "run_rank", "run_perf",
]

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
                f"{rings[0].library_path or '?'})", rank)
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

