#!/usr/bin/env python3
"""The in-stream plane with real CUDA sidecars and torch ranks, on a GPU machine.

Two arfused --device=cuda and two rank processes (torch, arfuse.torch's op on the current
stream) on one GPU (MPS, as scripts/gpu-run starts it) or one GPU each. Scenarios:

  piecewise  GEMM + fused op layers captured as one graph per layer with eager code between the
             pieces (the way piecewise CUDA graphs split a model), and as one full graph, for
             1, 16 and 64 tokens in one memory pool; every replay's outputs equal an eager run's
             bit for bit, and the first op matches a CPU-side reference of both ranks' inputs.
  pdl        bench: a graph of 20 x (GEMM [tokens x H] @ [H x H] + fused op), each fused launch a
             programmatic dependent (ARFUSE_INSTREAM_PDL=1) or not (=0), alternated; per-op time
             of the replay, and the GEMM-only graph for scale.
  switch     ranks run verified ops while `arfusectl set-backend` switches the group's backend
             twice (trtllm -> mnnvl -> trtllm): each switch drains the attached clients over their
             session stream, the ranks agree to run their own path meanwhile, re-attach to the new
             workspace and fuse again; no output is wrong, nothing hangs.
  stop       rank 1's process is SIGSTOPped between ops: rank 0's next op ends in a clear error
             within the spin deadline; after SIGCONT both ranks re-attach and fuse again.
  kill       rank 1's process is SIGKILLed between ops: rank 0's next op ends in a clear error
             within the spin deadline; a new rank 1 attaches, both fuse again.
  sidecar    rank 1's sidecar is SIGKILLed between ops (backend mnnvl: VMM memory outlives it):
             rank 1's client stays alive and its next op is refused ("sidecar gone"), rank 0's
             ends in a clear error; the sidecar is started again and both ranks re-attach.

Exit status 0 when every scenario passed. JSON with every figure: --json.
  python3 tests/gpu/instream_scenarios.py --arfused BIN --arfusectl BIN [--scenarios ...]
(libarfuse_client: $ARFUSE_CLIENT_LIB or the usual search, docs/integration.md)
"""
import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client" / "python"))

SCENARIOS = ("piecewise", "pdl", "switch", "stop", "kill", "sidecar")
SPIN_TIMEOUT_S = 2.0
EPS = 1e-6


# ---------------------------------------------------------------- the rank processes

class Rank:
    """One rank: torch on the GPU, a client of its sidecar, the context bound for arfuse.torch."""

    def __init__(self, args):
        import torch
        import arfuse
        import arfuse.torch as aft
        self.torch, self.arfuse, self.aft = torch, arfuse, aft
        self.args = args
        self.rank, self.dir = args.rank, pathlib.Path(args.dir)
        self.hidden = args.hidden
        if args.device == "cuda":
            torch.cuda.set_device(args.gpu)
            self.dev = torch.device("cuda", args.gpu)
        else:  # host mode: CPU tensors, the host plane behind the same C ABI
            self.dev = torch.device("cpu")
        self.socket = str(self.dir / f"r{self.rank}.sock")
        self.client = arfuse.Client(self.socket, client_name=f"scenario-{self.rank}")
        self.client.wait_ready(90)
        # A rank started after a fault attaches once the group's workspace is back.
        until = time.monotonic() + 90.0
        while True:
            try:
                self.ctx = aft.attach(self.client, [self.hidden])
                break
            except arfuse.ArfuseError:
                if not args.resume or time.monotonic() > until:
                    raise
                time.sleep(0.25)
        g = torch.Generator(device="cpu").manual_seed(7)
        self.gamma = (1 + 0.1 * torch.randn(self.hidden, generator=g)).bfloat16().to(self.dev)
        self.result = {"rank": self.rank, "ok": False, "problems": []}

    # Inputs every rank can make for every rank: the reference needs the peer's.
    def tensor(self, seed, tokens, scale=0.5):
        g = self.torch.Generator(device="cpu").manual_seed(seed)
        return (scale * self.torch.randn(tokens, self.hidden, generator=g)).bfloat16().to(self.dev)

    def op_inputs(self, step, tokens, rank):
        return (self.tensor(100003 * step + 17 * rank + 1, tokens),
                self.tensor(100003 * step + 5, tokens))  # the residual: the same on every rank

    def reference(self, step, tokens):
        torch = self.torch
        xs = [self.op_inputs(step, tokens, r)[0].float() for r in range(self.args.world)]
        res = self.op_inputs(step, tokens, self.rank)[1].float()
        r_out = (sum(xs) + res)
        n = r_out * torch.rsqrt(r_out.pow(2).mean(-1, keepdim=True) + EPS) * self.gamma.float()
        return n.bfloat16(), r_out.bfloat16()

    def close_to(self, got, want, what):
        torch = self.torch
        err = (got.float() - want.float()).abs().max().item()
        bound = (2.0 ** -6) * max(1.0, want.float().abs().max().item())
        if not err <= bound:
            self.result["problems"].append(f"{what}: max |diff| {err:.4g} above {bound:.4g}")
            return False
        return True

    def sync(self):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()

    def fused(self, x, res):
        return self.aft.fused_allreduce_residual_rmsnorm(x, res, self.gamma, EPS)

    def progress(self, **kv):
        tmp = self.dir / f"progress.{self.args.scenario}.{self.rank}.tmp"
        tmp.write_text(json.dumps(kv))
        tmp.replace(self.dir / f"progress.{self.args.scenario}.{self.rank}")

    def file_barrier(self, name, timeout=120.0):
        (self.dir / f"barrier.{name}.{self.rank}").write_text("")
        until = time.monotonic() + timeout
        while not all((self.dir / f"barrier.{name}.{r}").exists() for r in range(self.args.world)):
            if time.monotonic() > until:
                raise RuntimeError(f"barrier {name}: the other rank did not arrive in {timeout} s")
            time.sleep(0.01)

    def recover(self, name, newer_than, fresh=False):
        """After a failed op: this rank re-attaches to a workspace newer than the failed one,
        then the ranks meet until none holds a disabled context (a re-formation that came after
        an attach disables it: that rank re-attaches again). Every rank decides from the same
        meeting files, so all take the same number of rounds."""
        if newer_than is not None or fresh:
            self.ctx = self.aft.reattach(timeout=90.0, newer_than=newer_than)
        for attempt in range(10):
            time.sleep(0.5)  # an event on its way (a re-initialization) arrives first
            self.ctx.poll()
            tag = f"{name}.{attempt}"
            (self.dir / f"gen.{tag}.{self.rank}").write_text("1" if self.ctx.disabled else "0")
            self.file_barrier(tag)
            disabled = [(self.dir / f"gen.{tag}.{r}").read_text() == "1"
                        for r in range(self.args.world)]
            if not any(disabled):
                return
            if disabled[self.rank]:
                gone = self.ctx.disabled == "sidecar gone"
                self.ctx = self.aft.reattach(
                    timeout=90.0, newer_than=None if gone else self.ctx.info.generation)
        raise RuntimeError(f"{name}: the ranks did not all hold a usable context in 10 rounds")

    def dist(self):
        import datetime
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{self.dir}/store.{self.args.scenario}",
                                    rank=self.rank, world_size=self.args.world,
                                    timeout=datetime.timedelta(seconds=120))
        return dist


def piecewise(rk):
    torch = rk.torch
    dist = rk.dist()
    layers, H = 8, rk.hidden
    weights = []
    for l in range(layers):
        g = torch.Generator(device="cpu").manual_seed(1000 + 10 * l + rk.rank)
        weights.append((torch.randn(H, H, generator=g) * H ** -0.5).bfloat16().to(rk.dev))

    def layer(l, h, res):
        n, r = rk.fused(h @ weights[l], res)
        if n is None:
            raise RuntimeError(f"the fused op was not served at layer {l}: {rk.aft.why_not(h @ weights[l], res, rk.gamma)}")
        return n, r

    def glue(n):  # the eager part between pieces (attention's place)
        return torch.nn.functional.silu(n.float()).bfloat16()

    def eager(h, res):
        for l in range(layers):
            n, res = layer(l, h, res)
            h = glue(n)
        return h, res

    # The first op against the reference of both ranks' inputs (the GEMM included).
    tokens = 16
    h0, res0 = rk.op_inputs(1, tokens, rk.rank)
    n, r = layer(0, h0, res0)
    xs = []
    for q in range(rk.args.world):
        g = torch.Generator(device="cpu").manual_seed(1000 + q)
        wq = (torch.randn(H, H, generator=g) * H ** -0.5).bfloat16().to(rk.dev)
        xs.append((rk.op_inputs(1, tokens, q)[0] @ wq).float())
    r_ref = sum(xs) + res0.float()
    n_ref = r_ref * torch.rsqrt(r_ref.pow(2).mean(-1, keepdim=True) + EPS) * rk.gamma.float()
    ok = rk.close_to(r, r_ref, "layer 0 residual_out") & rk.close_to(n, n_ref, "layer 0 norm_out")

    pool = None  # the first graph's pool, shared by every later one (one memory pool)
    stream = torch.cuda.Stream()
    counts = {}
    keep = []  # every graph lives to the end: the pool is released with the last of them
    for tokens in (1, 16, 64):
        h_in = torch.zeros(tokens, H, dtype=torch.bfloat16, device=rk.dev)
        r_in = torch.zeros_like(h_in)
        # Warm-up on the capture stream (cuBLAS makes its handle outside capture); every rank
        # runs the same ops, so the fused ones pair up.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            eager(h_in, r_in)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        # Pieces: one graph per layer, static inputs and outputs per piece.
        pieces = []
        for l in range(layers):
            hi, ri = torch.zeros_like(h_in), torch.zeros_like(h_in)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                no, ro = layer(l, hi, ri)
            pool = graph.pool() if pool is None else pool
            pieces.append((graph, hi, ri, no, ro))
        full = torch.cuda.CUDAGraph()
        with torch.cuda.graph(full, pool=pool, stream=stream):
            f_h, f_r = eager(h_in, r_in)
        keep.append((pieces, full))
        torch.cuda.synchronize()
        dist.barrier()
        for rep in range(20):
            h, res = rk.op_inputs(1000 + rep, tokens, rk.rank)
            want_h, want_r = eager(h, res)
            ph, pr = h, res
            for graph, hi, ri, no, ro in pieces:
                hi.copy_(ph)
                ri.copy_(pr)
                graph.replay()
                ph, pr = glue(no), ro.clone()
            h_in.copy_(h)
            r_in.copy_(res)
            full.replay()
            torch.cuda.synchronize()
            for name, got, want in (("piecewise h", ph, want_h), ("piecewise residual", pr, want_r),
                                    ("full h", f_h, want_h), ("full residual", f_r, want_r)):
                if not torch.equal(got, want):
                    d = (got.float() - want.float()).abs().max().item()
                    rk.result["problems"].append(f"{tokens} tokens, replay {rep}: {name} differs "
                                                 f"from the eager run (max |diff| {d:.3g})")
                    ok = False
        counts[tokens] = 20
    rk.aft.check()
    rk.result.update(ok=ok and not rk.result["problems"], replays=counts, layers=layers,
                     launches=rk.ctx.launches)


def pdl(rk):
    torch = rk.torch
    dist = rk.dist()
    H, ops = rk.hidden, 20
    g = torch.Generator(device="cpu").manual_seed(3 + rk.rank)
    w = (torch.randn(H, H, generator=g) * H ** -0.5).bfloat16().to(rk.dev)
    rows = []

    def timed(graph, reps=60):
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        dist.barrier()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000.0)  # us
        dist.barrier()
        return statistics.median(times)

    stream = torch.cuda.Stream()
    for rnd, setting in enumerate(("0", "1", "0", "1")):
        os.environ["ARFUSE_INSTREAM_PDL"] = setting
        if rnd:
            torch.cuda.synchronize()
            dist.barrier()
        rk.ctx = rk.aft.reattach(timeout=60.0)
        if rk.ctx.info.pdl != (setting == "1"):
            rk.result["problems"].append(f"ARFUSE_INSTREAM_PDL={setting}: context pdl "
                                         f"{rk.ctx.info.pdl}")
        for tokens in (1, 16, 64, 128):
            h = rk.tensor(11 + rk.rank, tokens)
            res = rk.tensor(12, tokens)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside capture (cuBLAS's handle)
                n, _ = rk.fused(h @ w, res)
                if n is None:
                    raise RuntimeError(f"the fused op was not served at {tokens} tokens")
            torch.cuda.synchronize()
            both = torch.cuda.CUDAGraph()
            with torch.cuda.graph(both, stream=stream):
                x, r = h, res
                for _ in range(ops):
                    n, r = rk.fused(x @ w, r)
                    if n is None:
                        raise RuntimeError(f"the fused op was not served at {tokens} tokens")
                    x = n
            gemm = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gemm, stream=stream):
                x = h
                for _ in range(ops):
                    x = x @ w
            torch.cuda.synchronize()
            t_both, t_gemm = timed(both), timed(gemm)
            rows.append({"round": rnd, "pdl": int(setting), "tokens": tokens, "hidden": H,
                         "ops": ops, "gemm_and_fused_us_per_op": t_both / ops,
                         "gemm_only_us_per_op": t_gemm / ops,
                         "fused_share_us_per_op": (t_both - t_gemm) / ops})
            del both, gemm
    rk.aft.check()
    by = {}
    for row in rows:
        by.setdefault((row["tokens"], row["pdl"]), []).append(row["gemm_and_fused_us_per_op"])
    summary = []
    for tokens in (1, 16, 64, 128):
        off, on = statistics.median(by[(tokens, 0)]), statistics.median(by[(tokens, 1)])
        summary.append({"tokens": tokens, "pdl_off_us_per_op": off, "pdl_on_us_per_op": on,
                        "saved_us_per_op": off - on})
    rk.result.update(ok=not rk.result["problems"], rows=rows, summary=summary)


def switch(rk):
    """Verified ops each step; all ranks agree each step whether to fuse (a drained rank votes
    no); a rank whose context was drained or re-initialized re-attaches once the vote says no."""
    torch = rk.torch
    dist = rk.dist()
    tokens = 16
    step, fused, fallback, reattached, wrong = 0, 0, 0, [], 0
    deadline = time.monotonic() + rk.args.timeout
    while time.monotonic() < deadline:
        step += 1
        ok = rk.aft.agree()
        x, res = rk.op_inputs(step, tokens, rk.rank)
        want_n, want_r = rk.reference(step, tokens)
        if ok:
            n, r = rk.fused(x, res)
            if n is None:
                raise RuntimeError(f"step {step}: the vote said fused, the op was not served: "
                                   f"{rk.aft.why_not(x, res, rk.gamma)}")
            rk.sync()
            fused += 1
            if not (rk.close_to(r, want_r, f"step {step} residual_out") and
                    rk.close_to(n, want_n, f"step {step} norm_out")):
                wrong += 1
        else:
            fallback += 1  # the framework's own path: here the reference itself
            ctx = rk.aft.get_context()
            if ctx is None or ctx.disabled:
                why = ctx.disabled_reason if ctx is not None else "no context"
                t0 = time.monotonic()
                rk.ctx = rk.aft.reattach(timeout=90.0)
                reattached.append({"step": step, "why": why, "seconds": time.monotonic() - t0,
                                   "generation": rk.ctx.info.generation})
        rk.progress(step=step, fused=fused, fallback=fallback, reattached=len(reattached))
        if (rk.dir / "switch.done").exists() and fused >= 30 and ok:
            break
    flag = torch.tensor([step], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # both ranks stop together
    rk.result.update(ok=wrong == 0 and len(reattached) >= 2 and not rk.result["problems"],
                     steps=step, fused=fused, fallback=fallback, reattached=reattached,
                     wrong=wrong)


def faulted(rk):
    """stop / kill: verified ops with a sync after each; on an error, say which and how fast,
    re-attach, meet the other rank, and run verified ops again."""
    torch = rk.torch
    tokens = 16
    errors, steps_after, wrong = [], 0, 0
    rk.result["errors"] = errors  # kept when a later step raises
    step, recoveries = 0, 0
    resumed = rk.args.resume
    if resumed:  # a new rank 1 after the kill: straight to the first meeting point
        recoveries = 1
        rk.recover("recovered1", newer_than=None)
        step = 1000
    while True:
        step += 1
        x, res = rk.op_inputs(step, tokens, rk.rank)
        t0 = time.monotonic()
        failure = None
        try:
            n, r = rk.fused(x, res)
            if n is None:
                failure = f"not served: {rk.aft.why_not(x, res, rk.gamma)}"
            else:
                rk.sync()
                rk.aft.check()
        except rk.arfuse.ArfuseError as e:
            failure = f"{type(e).__name__} {e.code.name}: {e.message}"
        if failure is None:
            want_n, want_r = rk.reference(step, tokens)
            if not (rk.close_to(r, want_r, f"step {step} residual_out") and
                    rk.close_to(n, want_n, f"step {step} norm_out")):
                wrong += 1
            if errors or resumed:
                steps_after += 1
            rk.progress(step=step, errors=len(errors), after=steps_after)
            if steps_after >= 20:
                break
            continue
        errors.append({"step": step, "seconds": time.monotonic() - t0, "error": failure[:600]})
        rk.progress(step=step, errors=len(errors), after=steps_after, error=failure[:300])
        if len(errors) > 3:
            rk.result["problems"].append("more than three failed ops")
            break
        recoveries += 1
        # A restarted sidecar counts its generations from the start again: any will do.
        gone = rk.ctx.disabled == "sidecar gone"
        rk.recover(f"recovered{recoveries}", newer_than=None if gone else rk.ctx.info.generation,
                   fresh=gone)
        # Both ranks restart their step count at the meeting point, so they pair again.
        step = 1000 * recoveries
    rk.result.update(ok=not rk.result["problems"] and steps_after >= 20 and wrong == 0,
                     errors=errors, steps_after=steps_after, wrong=wrong, resumed=resumed)


def worker(args):
    rk = None
    try:
        rk = Rank(args)
        {"piecewise": piecewise, "pdl": pdl, "switch": switch, "stop": faulted,
         "kill": faulted, "sidecar": faulted}[args.scenario](rk)
        result = rk.result
    except BaseException as e:  # noqa: BLE001: reported to the launcher
        result = (rk.result if rk else {"rank": args.rank})
        result.update(ok=False, exception=f"{type(e).__name__}: {e}",
                      traceback=traceback.format_exc()[-3000:])
    out = pathlib.Path(args.dir) / f"result.{args.scenario}.{args.rank}"
    if args.resume:
        out = out.with_name(out.name + ".resumed")
    out.write_text(json.dumps(result))
    os._exit(0 if result.get("ok") else 1)


# ---------------------------------------------------------------- the launcher

class Sidecars:
    """args.world sidecars (args.arfused, args.device, args.gpus, args.hidden) in directory d:
    sockets d/r<rank>.sock, logs d/arfused.<rank>.log. spin_timeout None: arfused's default."""

    def __init__(self, args, d, backend="trtllm", max_tokens=256, spin_timeout=SPIN_TIMEOUT_S):
        self.args, self.dir, self.procs, self.argv = args, d, [], []
        (d / "peers").mkdir(exist_ok=True)
        for r in range(args.world):
            gpu = r % args.gpus
            where = ["--device=cuda", f"--gpu={gpu}"] if args.device == "cuda" else \
                ["--device=host", "--sm=90"]  # host mode decides as an H200 group: fusion on
            self.argv.append(
                [args.arfused, *where, f"--rank={r}",
                 f"--world-size={args.world}", f"--peer-dir={d}/peers", f"--socket={d}/r{r}.sock",
                 "--health-port=0", f"--hidden={args.hidden}", f"--max-tokens={max_tokens}",
                 "--dtype=bf16", f"--flashinfer-allreduce-fusion-backend={backend}",
                 *([f"--spin-timeout={spin_timeout}"] if spin_timeout is not None else []),
                 "--log-level=info"])
            self.procs.append(None)
            self.start(r)

    def start(self, r):
        log = open(self.dir / f"arfused.{r}.log", "a")
        self.procs[r] = subprocess.Popen(self.argv[r], stdout=log, stderr=subprocess.STDOUT)

    def addr(self):
        return ",".join(f"unix:{self.dir}/r{r}.sock" for r in range(self.args.world))

    def wait_ready(self):
        import arfuse
        for r in range(self.args.world):
            until = time.monotonic() + 120
            while not (self.dir / f"r{r}.sock").exists():
                if time.monotonic() > until or self.procs[r].poll() is not None:
                    raise RuntimeError(f"sidecar {r} did not start: {self.dir}/arfused.{r}.log")
                time.sleep(0.1)
            with arfuse.Client(str(self.dir / f"r{r}.sock")) as c:
                c.wait_ready(120)

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def start_worker(args, d, scenario, rank, resume=False):
    argv = [sys.executable, __file__, "--worker", "--rank", str(rank), "--scenario", scenario,
            "--dir", str(d), "--world", str(args.world), "--hidden", str(args.hidden),
            "--gpu", str(rank % args.gpus), "--timeout", str(args.timeout),
            "--device", args.device]
    if resume:
        argv.append("--resume")
    log = open(d / f"{scenario}.{rank}{'.resumed' if resume else ''}.log", "w")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def read_json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def wait_for(pred, timeout, procs=()):
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if pred():
            return True
        if any(p.poll() is not None for p in procs):
            return pred()
        time.sleep(0.05)
    return False


def run_scenario(args, sc, d, scenario):
    verdict = {"scenario": scenario, "ok": False, "problems": []}
    t0 = time.monotonic()
    procs = [start_worker(args, d, scenario, r) for r in range(args.world)]
    extra = []

    def progress(r):
        return read_json(d / f"progress.{scenario}.{r}") or {}

    try:
        if scenario == "switch":
            runs = []
            for backend in ("mnnvl", "trtllm"):
                if not wait_for(lambda: all(progress(r).get("fused", 0) >= 20 + 30 * len(runs)
                                            for r in range(args.world)), 180, procs):
                    verdict["problems"].append(f"the ranks did not reach fused ops before the "
                                               f"switch to {backend}")
                    break
                s0 = time.monotonic()
                p = subprocess.run([args.arfusectl, "set-backend", "--backend", backend, "--addr",
                                    sc.addr(), "--timeout-ms", "60000"], capture_output=True,
                                   text=True, timeout=120)
                runs.append({"backend": backend, "rc": p.returncode,
                             "seconds": time.monotonic() - s0,
                             "output": (p.stdout + p.stderr)[-1500:]})
                if p.returncode != 0:
                    verdict["problems"].append(f"set-backend {backend}: exit {p.returncode}")
            verdict["switches"] = runs
            (d / "switch.done").write_text("")
        elif scenario == "sidecar":
            if wait_for(lambda: all(progress(r).get("step", 0) >= 20 for r in range(args.world)),
                        120, procs):
                s0 = time.monotonic()
                sc.procs[1].kill()
                sc.procs[1].wait(10)
                seen = wait_for(lambda: all(progress(r).get("errors", 0) >= 1
                                            for r in range(args.world)), 60)
                verdict["errors_after_kill_s"] = time.monotonic() - s0
                if not seen:
                    verdict["problems"].append("a rank saw no error within 60 s of its peer's "
                                               "sidecar kill (hang)")
                sc.start(1)
            else:
                verdict["problems"].append("the ranks did not reach step 20")
        elif scenario in ("stop", "kill"):
            if wait_for(lambda: all(progress(r).get("step", 0) >= 20 for r in range(args.world)),
                        120, procs):
                victim = procs[1]
                s0 = time.monotonic()
                victim.send_signal(signal.SIGSTOP if scenario == "stop" else signal.SIGKILL)
                seen = wait_for(lambda: progress(0).get("errors", 0) >= 1, 60)
                verdict["rank0_error_after_signal_s"] = time.monotonic() - s0
                if not seen:
                    verdict["problems"].append(f"rank 0 saw no error within 60 s of the "
                                               f"{scenario} (hang)")
                if scenario == "stop":
                    time.sleep(1.0)
                    victim.send_signal(signal.SIGCONT)
                else:
                    victim.wait(10)
                    extra.append(start_worker(args, d, scenario, 1, resume=True))
            else:
                verdict["problems"].append("the ranks did not reach step 20")
        live = [p for i, p in enumerate(procs) if not (scenario == "kill" and i == 1)] + extra
        for p in live:
            try:
                p.wait(max(1.0, args.timeout - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                verdict["problems"].append(f"a rank process was still running after "
                                           f"{args.timeout:g} s: killed (hang)")
                p.kill()
    finally:
        for p in procs + extra:
            if p.poll() is None:
                p.kill()
    ranks = {}
    for r in range(args.world):
        name = f"result.{scenario}.{r}" + (".resumed" if scenario == "kill" and r == 1 else "")
        res = read_json(d / name)
        ranks[r] = res
        if res is None:
            verdict["problems"].append(f"rank {r} wrote no result (log {d}/{scenario}.{r}.log)")
        elif not res.get("ok"):
            verdict["problems"].append(f"rank {r}: {res.get('exception') or res.get('problems')}")
    if scenario in ("stop", "kill", "sidecar") and ranks.get(0):
        errs = ranks[0].get("errors") or []
        if not errs:
            verdict["problems"].append("rank 0 ran through the fault without an error")
        elif errs[0]["seconds"] > SPIN_TIMEOUT_S + 3.0:
            verdict["problems"].append(f"rank 0's failed op took {errs[0]['seconds']:.2f} s, "
                                       f"past the {SPIN_TIMEOUT_S:g} s spin deadline + 3 s")
    verdict["ranks"] = ranks
    verdict["seconds"] = time.monotonic() - t0
    verdict["ok"] = not verdict["problems"]
    return verdict


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arfused", default=os.environ.get("ARFUSE_ARFUSED"))
    ap.add_argument("--arfusectl", default=os.environ.get("ARFUSE_ARFUSECTL"))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--device", choices=("cuda", "host"), default="cuda",
                    help="host: host-mode sidecars and CPU tensors (switch, stop, kill only)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--gpus", type=int, default=1, help="GPUs the ranks spread over")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per scenario")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the run's folder (logs)")
    # The rank processes' own arguments.
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--scenario", default="", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--gpu", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in names if s not in SCENARIOS]
    if bad or not names:
        ap.error(f"unknown scenario(s) {','.join(bad)}: expected {','.join(SCENARIOS)}")
    if args.device == "host" and set(names) & {"piecewise", "pdl"}:
        ap.error("piecewise and pdl need CUDA graphs: --device=cuda")
    for flag, value in (("--arfused", args.arfused), ("--arfusectl", args.arfusectl)):
        if not value or not os.access(value, os.X_OK):
            ap.error(f"{flag} names no executable ({value!r})")
    d = pathlib.Path(tempfile.mkdtemp(prefix="arfuse-scenarios-"))
    verdicts = []
    for scenario in names:
        sc = Sidecars(args, d, backend="mnnvl" if scenario == "sidecar" else "trtllm")
        try:
            sc.wait_ready()
            v = run_scenario(args, sc, d, scenario)
        except Exception as e:  # noqa: BLE001: one scenario's failure, the others still run
            v = {"scenario": scenario, "ok": False, "problems": [f"{type(e).__name__}: {e}"]}
        finally:
            sc.stop()
        for r in range(args.world):
            log = d / f"arfused.{r}.log"
            if log.exists():
                log.replace(d / f"arfused.{scenario}.{r}.log")
        print(f"{scenario}: {'PASS' if v['ok'] else 'FAIL'} in {v.get('seconds', 0):.1f} s"
              + ("" if v["ok"] else f": {v['problems']}"), flush=True)
        if scenario == "pdl" and v.get("ranks", {}).get(0):
            for row in v["ranks"][0].get("summary", []):
                print(f"  pdl {row['tokens']:4d} tokens: off {row['pdl_off_us_per_op']:.2f} us/op, "
                      f"on {row['pdl_on_us_per_op']:.2f} us/op, saved {row['saved_us_per_op']:.2f}")
        verdicts.append(v)
        for f in d.glob("progress.*"):
            f.unlink()
        for f in [*d.glob("barrier.*"), *d.glob("gen.*")]:
            f.unlink()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"dir": str(d), "verdicts": verdicts},
                                                      indent=1))
    print(f"logs: {d}")
    return 0 if all(v["ok"] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
