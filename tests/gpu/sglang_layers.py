#!/usr/bin/env python3
"""SGLang's real layer modules (a pinned release's source, unmodified) with arfuse installed the way
its sglang.srt.plugins entry point installs it, two ranks with their own sidecars.

Each rank imports the staged release's sglang.srt.layers.layernorm and the gate's module
(communicator.py up to 0.5.20, layer_boundary/residual/add_norm.py from 0.5.21), with stand-ins
(tests/gpu/sglang_standins.py) only for packages not installed (sgl_kernel, flashinfer,
transformers, ...). The test publishes the parallel layout (TP 2, attention TP 2, MoE TP 2) and the
backend flag where the release reads them, calls install() as the plugin does (ARFUSE_SOCKET) and
SGLang's pre_initialize_workspaces, then for each hidden size and token count runs what SGLang's
boundary runs: when SGLang's gate says yes, RMSNorm.forward_with_allreduce_fusion (SGLang's
layernorm calling the fused op it imports); otherwise SGLang's own path (the all-reduce, here the
sum of both ranks' inputs since NCCL refuses two ranks on one GPU, then RMSNorm.forward_native).
Every output is compared with a reference from both ranks' inputs (fp32 sum + add + RMSNorm, cast)
within bf16 tolerance, for use_attn_tp_group True and False. On CUDA, the fused path is also
captured in a torch.cuda.CUDAGraph and compiled with torch.compile(fullgraph=True) (inductor, and
mode="reduce-overhead"): 0 graph breaks, bit-identical to eager. Host mode (--device=host): host
sidecars (--sm=90), CPU tensors, torch.compile without CUDA graphs.

  python3 tests/gpu/sglang_layers.py --sglang-src DIR [--device=cuda|host] [--arfused BIN]
      [--hidden 4096,8192] [--tokens 1,2,...] [--out result.json]

DIR: an unpacked SGLang wheel's top directory (it contains sglang/). Exit status 0 when every
output matched.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / "client" / "python")]

TOKENS = (1, 2, 16, 64, 128, 512, 1024, 2048, 4096)
EPS = 1e-6
WORLD = 2


# ---------------------------------------------------------------- the rank processes

class Group:
    """What arfuse's setup and SGLang's layers read of a GroupCoordinator."""

    def __init__(self, ranks, rank):
        self.ranks, self.world_size = list(ranks), len(ranks)
        self.rank_in_group = self.ranks.index(rank) if rank in self.ranks else 0
        self.rank = rank
        self.cpu_group = None  # the default (gloo) process group


class Bag:
    """A published configuration namespace: attributes, nested bags, None for the rest."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def publish(rank):
    """Publishes TP 2 (attention TP and MoE TP the same two ranks, no EP, no DP attention) and
    the fusion backend where this release's modules read them. Returns what was set."""
    import importlib
    tp = Group(range(WORLD), rank)
    one = Group([rank], rank)
    ps = importlib.import_module("sglang.srt.distributed.parallel_state")
    rc = importlib.import_module("sglang.srt.runtime_context")
    sizes = dict(tp_size=WORLD, tp_rank=rank, attn_tp_size=WORLD, attn_tp_rank=rank,
                 moe_ep_size=1, moe_ep_rank=0, moe_tp_size=WORLD, moe_tp_rank=rank,
                 moe_dp_size=1)
    groups = dict(tp_group=tp, attn_tp_group=tp, moe_ep_group=one, moe_tp_group=tp)
    par = rc.get_parallel()
    if hasattr(par, "_stamp"):           # 0.5.21+: permanent per-process values
        par._stamp.update(sizes, **groups)
    else:                                # up to 0.5.20: the groups live in parallel_state
        fields = getattr(rc, "_PARALLEL_FIELDS", set(sizes))
        par._overrides.update({k: v for k, v in sizes.items() if k in fields})
        ps._TP, ps._ATTN_TP, ps._MOE_EP, ps._MOE_TP = tp, tp, one, tp
    comm = Bag(flashinfer_allreduce_fusion_backend="auto", enable_aiter_allreduce_fusion=False)
    if not hasattr(rc, "get_exec"):
        # Up to 0.5.14: the gate reads the global ServerArgs for the backend flag.
        sa = importlib.import_module("sglang.srt.server_args")
        sa.set_global_server_args_for_scheduler(
            Bag(flashinfer_allreduce_fusion_backend="auto", enable_aiter_allreduce_fusion=False))
    else:
        # From 0.5.20: the config bags SGLang's launcher publishes (exec.comm, flags.dp), at
        # every module's binding of the accessors.
        bags = {"get_exec": Bag(comm=comm), "get_flags": Bag(dp=Bag(enabled=False))}
        originals = {name: getattr(rc, name) for name in bags if hasattr(rc, name)}
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("sglang"):
                for name, orig in originals.items():
                    if vars(mod).get(name) is orig:
                        setattr(mod, name, (lambda b: (lambda: b))(bags[name]))
    return {"sizes": sizes, "backend": "auto"}


def rank_main(args):
    import torch
    import torch.distributed as dist
    import sglang_standins

    sglang_standins.install()
    sys.path.insert(0, args.sglang_src)
    import logging
    logging.basicConfig(level=logging.WARNING)
    rank = args.rank
    on_cuda = args.device == "cuda"
    if on_cuda:
        torch.cuda.set_device(0)
    dev = torch.device("cuda", 0) if on_cuda else torch.device("cpu")
    dist.init_process_group("gloo", init_method=f"file://{args.dir}/init.{args.hidden}",
                            rank=rank, world_size=WORLD)
    import importlib
    from arfuse.integrations import sglang as shim
    out = {"rank": rank, "hidden": args.hidden, "problems": []}
    t0 = time.monotonic()
    layernorm = importlib.import_module("sglang.srt.layers.layernorm")
    patched = shim.install()  # as the plugin does: the socket from $ARFUSE_SOCKET
    layout = shim._state.layout
    gate_mod = importlib.import_module(layout.gate_module)
    gate = getattr(gate_mod, shim._state.gate_name.rsplit(".", 1)[1])
    publish(rank)
    out.update(sglang=shim.sglang_version(), layout=layout.name, gate=shim._state.gate_name,
               patched=patched, import_s=round(time.monotonic() - t0, 2),
               standins=sorted(sglang_standins.FINDER.stubbed))
    fusion = importlib.import_module("sglang.srt.layers.flashinfer_comm_fusion")
    dtype = torch.bfloat16
    fusion.pre_initialize_workspaces(max_token_num=2048, hidden_dim=args.hidden, dtype=dtype)
    st = shim.status()
    out["served"], out["reason"] = st["served"], st["reason"]
    if not st["served"]:
        out["problems"].append(f"not served: {st['reason']}")
    max_batch = getattr(importlib.import_module(layout.max_batch_module),
                        "FUSE_ALLREDUCE_MAX_BATCH_SIZE")
    out["gate_max_batch"] = max_batch
    norm = layernorm.RMSNorm(args.hidden, eps=EPS).to(device=dev, dtype=dtype)

    def inputs(tokens, seed):
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randn(tokens, args.hidden, generator=g).to(dtype) for _ in range(WORLD)]
        r = torch.randn(tokens, args.hidden, generator=g).to(dtype)
        w = (torch.rand(args.hidden, generator=g) + 0.5).to(dtype)
        return xs, r, w

    def reference(xs, r, w):
        s = sum(x.float() for x in xs) + r.float()
        n = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w.float()
        return n.to(dtype), s.to(dtype)

    def err(a, b):
        return ((a.float().cpu() - b.float()).abs().max() /
                (1 + b.float().abs().max())).item()

    rows = []
    for tokens in args.tokens:
        for use_attn in (True, False):
            xs, r, w = inputs(tokens, seed=tokens * 2 + int(use_attn))
            with torch.no_grad():
                norm.weight.copy_(w.to(dev))
            x, res = xs[rank].to(dev), r.to(dev)
            yes = bool(gate(tokens))
            with torch.no_grad():
                if yes:
                    path = "fused"
                    launches = shim.status()["launches"]
                    n, rs = norm.forward_with_allreduce_fusion(x, res.clone(),
                                                               use_attn_tp_group=use_attn)
                    if shim.status()["launches"] == launches:
                        out["problems"].append(f"{tokens} tokens: no fused launch after a yes")
                else:
                    path = "sglang"
                    reduced = sum(t.float() for t in xs).to(dtype).to(dev)  # the all-reduce
                    n, rs = norm.forward_native(reduced, res.clone())
            if on_cuda:
                torch.cuda.synchronize()
            rn, rr = reference(xs, r, w)
            e = max(err(n, rn), err(rs, rr))
            ok = e <= args.tol
            rows.append({"tokens": tokens, "use_attn_tp_group": use_attn, "gate": yes,
                         "path": path, "max_rel_err": e, "ok": ok})
            if not ok:
                out["problems"].append(f"{tokens} tokens use_attn={use_attn} {path}: err {e:.3g}")
            if yes != (0 < tokens <= max_batch) and st["served"]:
                out["problems"].append(f"{tokens} tokens: gate {yes}, SGLang's limit {max_batch}")
    out["rows"] = rows

    # Graphs and compile: the fused path at a token count inside the fused range.
    import torch._dynamo
    extra = []
    for tokens in (t for t in args.graph_tokens if t <= max_batch and st["served"]):
        xs, r, w = inputs(tokens, seed=10_000 + tokens)
        with torch.no_grad():
            norm.weight.copy_(w.to(dev))
        x, res = xs[rank].to(dev), r.to(dev)

        def f(x, res):
            return norm.forward_with_allreduce_fusion(x, res, use_attn_tp_group=True)

        with torch.no_grad():
            eager = [t.clone() for t in f(x, res.clone())]
            rn, rr = reference(xs, r, w)
            row = {"tokens": tokens, "eager_err": max(err(eager[0], rn), err(eager[1], rr))}
            torch._dynamo.reset()
            expl = torch._dynamo.explain(f)(x, res.clone())
            row["graph_breaks"] = expl.graph_break_count
            modes = [("inductor", None)] + ([("inductor", "reduce-overhead")] if on_cuda else [])
            for backend, mode in modes:
                torch._dynamo.reset()
                cf = torch.compile(f, fullgraph=True, backend=backend, mode=mode)
                got = None
                for _ in range(3):  # reduce-overhead records on the first calls, replays after
                    got = cf(x, res.clone())
                    if on_cuda:
                        torch.cuda.synchronize()
                key = f"compile_{mode or 'default'}"
                row[key] = all(torch.equal(a, b) for a, b in zip(eager, got))
            if on_cuda:
                sx, sres = x.clone(), res.clone()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(2):
                        f(sx, sres.clone())
                torch.cuda.current_stream().wait_stream(s)
                dist.barrier()
                g = torch.cuda.CUDAGraph()
                cres = res.clone()
                with torch.cuda.graph(g):
                    gout = f(sx, cres)
                dist.barrier()
                same = True
                for _ in range(3):
                    cres.copy_(res)
                    g.replay()
                    torch.cuda.synchronize()
                    same = same and all(torch.equal(a, b) for a, b in zip(eager, gout))
                row["cuda_graph"] = same
        bad = [k for k, v in row.items() if (k.startswith("compile_") or k == "cuda_graph")
               and v is not True]
        if row["graph_breaks"] != 0 or bad or row["eager_err"] > args.tol:
            out["problems"].append(f"graphs at {tokens} tokens: {row}")
        extra.append(row)
        dist.barrier()
    out["graphs"] = extra
    if args.fp8:
        out["fp8"] = fp8_checks(args, layernorm, shim, dev, out["problems"])
    out["launches"] = shim.status()["launches"]
    fusion.cleanup_flashinfer_workspace()
    out["ok"] = not out["problems"]
    (pathlib.Path(args.dir) / f"rank{rank}.{args.hidden}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


E4M3_MAX = 448.0


def e4m3_steps(a, b):
    """Per element, how many E4M3 codes apart two float8_e4m3fn tensors are: the codes' bytes
    with the sign applied are consecutive integers along the value axis (+0 and -0 both 0)."""
    import torch

    def ordinal(t):
        c = t.view(torch.uint8).to(torch.int32)
        return torch.where(c >= 128, -(c - 128), c)

    return (ordinal(a) - ordinal(b)).abs()


def fp8_reference(xs, r, w, eps, dtype):
    """What SGLang's CUDA path computes when its per-group FP8 hook answers None: the allreduce
    (rounded to the model's dtype, as NCCL hands it over), the residual add (rounded: the new
    residual), RMSNorm of that residual in fp32 (output in the model's dtype), then
    per_token_group_quant_fp8 of that output (group 128, scale = max(amax, 1e-10) / 448 in fp32,
    codes clamp(x / scale) in E4M3, scales row-major [tokens, hidden / 128]). Also the same
    scale formula on the fp32 normalized value before its rounding: what arfuse quantizes."""
    import torch
    a = sum(x.float() for x in xs).to(dtype)
    s = (a.float() + r.float()).to(dtype).float()
    n = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(dtype)
    tokens, hidden = n.shape
    g = n.float().view(tokens, hidden // 128, 128)
    scale = g.abs().amax(-1).clamp(min=1e-10) / E4M3_MAX
    q = (g / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).view(tokens, hidden)
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    scale32 = y.view(tokens, hidden // 128, 128).abs().amax(-1).clamp(min=1e-10) / E4M3_MAX
    return q.to(torch.float8_e4m3fn), scale, s.to(dtype), scale32


def fp8_checks(args, layernorm, shim, dev, problems):
    """SGLang's per-group FP8 hook through RMSNorm's and GemmaRMSNorm's
    forward_with_allreduce_fusion_quant_per_group (the methods SGLang's boundary calls), on
    both ranks alike: served calls against fp8_reference (codes within one E4M3 step, scales
    within bf16 rounding of the group's amax, residual within bf16 tolerance, the scale tensor's
    dtype, shape and strides), declined calls (keep_bf16, another group size, beyond the FP8
    launch limit) answer SGLang's own hook's None and are noted; from 0.5.21 also through the
    layer boundary's fused_attn_input as SGLang's fusion module runs it; and torch.compile
    (fullgraph) through the hook."""
    import importlib
    import torch
    dtype = torch.bfloat16
    st = shim.status()["fp8"]
    res = {"status": st, "rows": []}
    if not st["served"]:
        problems.append(f"fp8 hook not served: {st['reason']}")
        return res
    hidden = args.hidden

    def inputs(tokens, seed):
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(WORLD)]
        r = torch.randn(tokens, hidden, generator=g).to(dtype)
        w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
        return xs, r, w

    norms = {"RMSNorm": layernorm.RMSNorm(hidden, eps=EPS).to(device=dev, dtype=dtype),
             "GemmaRMSNorm": layernorm.GemmaRMSNorm(hidden, eps=EPS).to(device=dev,
                                                                        dtype=dtype)}

    def set_weight(kind, norm, w):
        with torch.no_grad():
            if kind == "GemmaRMSNorm":
                norm.gemma_weight.copy_(w.to(dev))  # the weight + 1 its hook passes
            else:
                norm.weight.copy_(w.to(dev))

    def compare(label, got, xs, r, w):
        (q, scale), rs = got
        rq, rscale, rres, rscale32 = fp8_reference(xs, r, w, EPS, dtype)
        tokens = rq.shape[0]
        row = {"case": label, "tokens": tokens}
        row["layout_ok"] = (q.dtype == torch.float8_e4m3fn and tuple(q.shape) == tuple(rq.shape)
                            and q.is_contiguous() and scale.dtype == torch.float32
                            and tuple(scale.shape) == (tokens, hidden // 128)
                            and scale.stride() == (hidden // 128, 1))
        steps = e4m3_steps(q.cpu(), rq)
        row["max_code_steps"] = int(steps.max())
        row["codes_off_by_one"] = int((steps == 1).sum())
        sc = scale.cpu()
        # arfuse's scale is SGLang's formula on the fp32 normalized value (equal up to the sum of
        # squares' order, hidden x 2^-24); SGLang's fallback applies it after rounding that value
        # to bf16, so the two agree once arfuse's amax is rounded alike, except where the fp32
        # difference straddles a bf16 rounding midpoint (one bf16 step then).
        row["scale_vs_fp32_rel"] = ((sc - rscale32).abs() / rscale32).max().item()
        rounded = (sc * E4M3_MAX).to(dtype).float() / E4M3_MAX
        row["scales_equal_after_rounding"] = float((rounded == rscale).float().mean())
        row["scale_max_rel"] = ((sc - rscale).abs() / rscale).max().item()
        row["residual_bit_equal"] = bool(torch.equal(rs.cpu(), rres))
        row["ok"] = (row["layout_ok"] and row["max_code_steps"] <= 1
                     and row["scale_vs_fp32_rel"] <= hidden * 2.0 ** -24
                     and row["scale_max_rel"] <= 2.0 ** -7 and row["residual_bit_equal"])
        if not row["ok"]:
            problems.append(f"fp8 {label}: {row}")
        res["rows"].append(row)

    for kind, norm in norms.items():
        for tokens in args.fp8_tokens:
            xs, r, w = inputs(tokens, seed=20_000 + tokens)
            set_weight(kind, norm, w)
            x, rr = xs[args.rank].to(dev), r.to(dev)
            r0 = rr.clone()
            before = shim.status()["launches"]
            with torch.no_grad():
                got = norm.forward_with_allreduce_fusion_quant_per_group(
                    x, rr, use_attn_tp_group=False)
            if got is None:
                problems.append(f"fp8 {kind} {tokens} tokens: the hook answered None")
                continue
            if shim.status()["launches"] != before + 1:
                problems.append(f"fp8 {kind} {tokens} tokens: not one fused launch")
            if not torch.equal(rr, r0):
                problems.append(f"fp8 {kind} {tokens} tokens: the caller's residual changed")
            compare(f"{kind} hook", got, xs, r, w)

    # Declines: SGLang's own hook answers (None off ROCm/aiter), no launch, a noted reason.
    norm = norms["RMSNorm"]
    xs, r, w = inputs(8, seed=30_000)
    set_weight("RMSNorm", norm, w)
    x, rr = xs[args.rank].to(dev), r.to(dev)
    big = st["max_tokens"] + 1
    bx, br, _ = inputs(big, seed=30_001)
    declines = {"keep_bf16": dict(x=x, residual=rr, keep_bf16=True),
                "group_size": dict(x=x, residual=rr, group_size=64),
                "range": dict(x=bx[args.rank].to(dev), residual=br.to(dev))}
    res["declines"] = {}
    import logging

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    lines = Lines()
    log = logging.getLogger("arfuse.integrations.sglang")
    level = log.level
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    for what, kw in declines.items():
        before = shim.status()["launches"]
        with torch.no_grad():
            got = norm.forward_with_allreduce_fusion_quant_per_group(
                kw.pop("x"), kw.pop("residual"), use_attn_tp_group=False, **kw)
        res["declines"][what] = {"none": got is None,
                                 "launched": shim.status()["launches"] != before}
        if got is not None or shim.status()["launches"] != before:
            problems.append(f"fp8 decline {what}: {res['declines'][what]}")
    log.removeHandler(lines)
    log.setLevel(level)
    noted = shim.status()["fp8"]["declined"]
    res["noted"], res["decline_lines"] = noted, lines.lines
    for cls in ("fp8_keep_bf16", "fp8_group_size", "fp8_range"):
        if cls not in noted or not any(f"declined ({cls})" in m for m in lines.lines):
            problems.append(f"fp8 decline {cls} not logged ({noted}, {lines.lines})")

    # SGLang's layer-boundary fusion module (0.5.21 on): the attention-input fusion
    # (complete_attention_input in 0.5.21, fused_attn_input from 0.5.23) with fuses_quant as
    # attn_input_fusions sets it on ROCm/aiter (off elsewhere: it gates on _use_aiter).
    try:
        fusions = importlib.import_module("sglang.srt.layers.layer_boundary.fusions.allreduce")
    except ImportError:
        fusions = None
    attn_input = None if fusions is None else (getattr(fusions, "fused_attn_input", None) or
                                               getattr(fusions, "complete_attention_input", None))
    if attn_input is not None:
        output = importlib.import_module("sglang.srt.layers.layer_boundary.output")
        moe = importlib.import_module("sglang.srt.layers.moe")

        class Plan:
            pass

        plan = Plan()
        plan.norm = norm
        xs, r, w = inputs(64, seed=40_000)
        set_weight("RMSNorm", norm, w)
        owed = output.UnreducedOutput(partial=xs[args.rank].to(dev),
                                      group=moe.post_experts_reduction_group())
        with torch.no_grad():
            got = attn_input(plan, owed, r.to(dev), None, None, fuses_quant=True,
                             keep_bf16=False)
        if not (isinstance(got, tuple) and isinstance(got[0], tuple)):
            problems.append(f"fp8 {attn_input.__name__} answered {type(got).__name__}, not "
                            "((fp8, scale), residual)")
        else:
            compare(f"boundary {attn_input.__name__}", got, xs, r, w)
        res["caller_fuses_quant_here"] = bool(fusions._use_aiter)

    # torch.compile(fullgraph=True) through the hook: no graph break, bit-identical to eager.
    import torch._dynamo
    xs, r, w = inputs(16, seed=50_000)
    set_weight("RMSNorm", norm, w)
    x, rr = xs[args.rank].to(dev), r.to(dev)

    def f(x, rr):
        (q, scale), rs = norm.forward_with_allreduce_fusion_quant_per_group(
            x, rr, use_attn_tp_group=False)
        return q.view(torch.uint8), scale, rs

    with torch.no_grad():
        eager = f(x, rr)
        torch._dynamo.reset()
        res["graph_breaks"] = torch._dynamo.explain(f)(x, rr).graph_break_count
        torch._dynamo.reset()
        got = torch.compile(f, fullgraph=True, backend="inductor")(x, rr)
    res["compile_bit_identical"] = all(torch.equal(a, b) for a, b in zip(eager, got))
    if res["graph_breaks"] != 0 or not res["compile_bit_identical"]:
        problems.append(f"fp8 compile: {res['graph_breaks']} breaks, bit-identical "
                        f"{res['compile_bit_identical']}")
    return res


# ---------------------------------------------------------------- the launcher

def run_hidden(args, d, hidden):
    from instream_scenarios import Sidecars
    ns = argparse.Namespace(arfused=args.arfused, device=args.device, world=WORLD, gpus=1,
                            hidden=hidden)
    sc = Sidecars(ns, d, max_tokens=2048, spin_timeout=None)
    try:
        sc.wait_ready()
        env = dict(os.environ, ARFUSE_SOCKET=f"{d}/r{{rank}}.sock", ARFUSE_SGLANG="1",
                   PYTHONPATH=os.pathsep.join([str(REPO / "client" / "python"),
                                               os.environ.get("PYTHONPATH", "")]))
        procs = []
        for r in range(WORLD):
            argv = [sys.executable, __file__, "--rank-worker", str(r), "--dir", str(d),
                    "--hidden", str(hidden), "--device", args.device,
                    "--sglang-src", args.sglang_src, "--tol", str(args.tol),
                    "--tokens", ",".join(map(str, args.tokens)),
                    "--graph-tokens", ",".join(map(str, args.graph_tokens)),
                    "--fp8-tokens", ",".join(map(str, args.fp8_tokens))] + \
                (["--fp8"] if args.fp8 else [])
            log = open(d / f"rank{r}.{hidden}.log", "w")
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        for p in procs:
            try:
                p.wait(args.timeout)
            except subprocess.TimeoutExpired:
                p.kill()
        results = []
        for r in range(WORLD):
            f = d / f"rank{r}.{hidden}.json"
            if f.exists():
                results.append(json.loads(f.read_text()))
            else:
                tail = (d / f"rank{r}.{hidden}.log").read_text()[-3000:]
                results.append({"rank": r, "hidden": hidden, "ok": False,
                                "problems": [f"rank {r} left no result (rc "
                                             f"{procs[r].returncode}):\n{tail}"]})
        return results
    finally:
        sc.stop()


def table(results):
    lines = []
    for res in results:
        if "rows" not in res:
            continue
        lines.append(f"SGLang {res['sglang']} ({res['layout']}), rank {res['rank']}, hidden "
                     f"{res['hidden']} bf16: served={res['served']}, gate limit "
                     f"{res['gate_max_batch']}, {res['launches']} fused launches")
        lines.append(f"  {'tokens':>6} {'attn':>5} {'gate':>5} {'path':>7} {'max_rel_err':>12}  ok")
        for row in res["rows"]:
            lines.append(f"  {row['tokens']:>6} {str(row['use_attn_tp_group']):>5} "
                         f"{str(row['gate']):>5} {row['path']:>7} {row['max_rel_err']:>12.3e}  "
                         f"{'ok' if row['ok'] else 'MISMATCH'}")
        for g in res.get("graphs", []):
            lines.append("  graphs " + ", ".join(f"{k}={v}" for k, v in g.items()))
    return "\n".join(lines)


# Parts of an SGLang wheel the layer modules never import: left out of a staged copy.
STAGE_SKIP = ("sglang/multimodal_gen/", "sglang/srt/models/", "sglang/test/")


# Staged whole: the JIT kernels' modules check at import that their sources are beside them.
JIT_TREE = ("sglang/kernels/jit/", "sglang/jit_kernel/")


def stage(src, dest):
    """Copies the .py files of src/sglang (an unpacked wheel, or the wheel itself) that the
    layer modules can import into dest/sglang, and every file of sglang/kernels/jit/ or sglang/jit_kernel/ (the JIT
    modules look for their include/ and csrc/ beside them at import); prints the size."""
    import shutil
    import zipfile
    dest = pathlib.Path(dest)
    n = size = 0
    if str(src).endswith(".whl"):
        with zipfile.ZipFile(src) as z:
            for name in z.namelist():
                wanted = name.endswith(".py") or name.startswith(JIT_TREE)
                if name.startswith("sglang/") and wanted and not name.endswith("/") and \
                        not name.startswith(STAGE_SKIP):
                    z.extract(name, dest)
                    n, size = n + 1, size + z.getinfo(name).file_size
    else:
        root = pathlib.Path(src)
        for f in (root / "sglang").rglob("*"):
            rel = f.relative_to(root).as_posix()
            if f.is_file() and (rel.endswith(".py") or rel.startswith(JIT_TREE)) and \
                    not rel.startswith(STAGE_SKIP):
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, dest / rel)
                n, size = n + 1, size + f.stat().st_size
    print(f"staged {n} files, {size / 2**20:.1f} MiB, in {dest}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang-src", help="unpacked wheel: DIR/sglang/srt/...")
    ap.add_argument("--stage", nargs=2, metavar=("WHEEL_OR_DIR", "DEST"),
                    help="copy the .py files the test needs of a release into DEST, then exit")
    ap.add_argument("--device", choices=("cuda", "host"), default="cuda")
    ap.add_argument("--arfused", default=os.environ.get("ARFUSE_ARFUSED"))
    ap.add_argument("--hidden", default="4096,8192")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--graph-tokens", default="1,16,64")
    ap.add_argument("--fp8", action="store_true",
                    help="also check SGLang's per-group FP8 hook (0.5.20 on) served by arfuse")
    ap.add_argument("--fp8-tokens", default="1,7,64,2048")
    ap.add_argument("--tol", type=float, default=2e-2, help="max |out - ref| / (1 + max |ref|)")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds per hidden size")
    ap.add_argument("--out", default=None, help="JSON summary")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--rank-worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage:
        stage(*args.stage)
        return 0
    if not args.sglang_src:
        ap.error("--sglang-src is required")
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.graph_tokens = [int(t) for t in args.graph_tokens.split(",") if t]
    args.fp8_tokens = [int(t) for t in args.fp8_tokens.split(",") if t]
    args.sglang_src = str(pathlib.Path(args.sglang_src).resolve())
    if args.rank_worker is not None:
        args.rank, args.hidden = args.rank_worker, int(args.hidden)
        try:
            rank_main(args)
        except Exception:  # noqa: BLE001: reported through the result file
            res = {"rank": args.rank, "hidden": args.hidden, "ok": False,
                   "problems": [traceback.format_exc()]}
            (pathlib.Path(args.dir) / f"rank{args.rank}.{args.hidden}.json").write_text(
                json.dumps(res))
        os._exit(0)
    if not (pathlib.Path(args.sglang_src) / "sglang" / "srt" / "layers" / "layernorm.py").exists():
        ap.error(f"--sglang-src {args.sglang_src} has no sglang/srt/layers/layernorm.py")
    if not args.arfused or not os.access(args.arfused, os.X_OK):
        ap.error(f"--arfused names no executable ({args.arfused!r})")
    d = pathlib.Path(tempfile.mkdtemp(prefix="arfuse-sglang-layers-"))
    results = []
    for hidden in (int(h) for h in args.hidden.split(",")):
        results += run_hidden(args, d, hidden)
    ok = bool(results) and all(r.get("ok") for r in results)
    print(table(results))
    for r in results:
        for p in r.get("problems", []):
            print(f"PROBLEM rank {r['rank']} hidden {r['hidden']}: {p}")
    summary = {"ok": ok, "device": args.device, "sglang_src": args.sglang_src, "dir": str(d),
               "results": results}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(summary, indent=1))
    print(f"{'PASS' if ok else 'FAIL'}: logs in {d}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
