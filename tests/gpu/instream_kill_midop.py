#!/usr/bin/env python3
"""A client SIGKILLed mid-op on the in-stream plane, with real sidecars and torch rank processes.

Per variant, two fresh sidecars (--device=cuda on the GPU machine, one GPU or one each; or
--device=host) and rank processes: one attached client per rank, one paired op, then an op
launched by one rank's client alone (its peer never joins), that process SIGKILLed 0.5 s later,
then both ranks' next op (in-stream through a new client process on the dead rank, or eager
`Execute` of a plan with the peer detached first), one rank starting 0.3 s before the other.
Every op that answers OK must have the correct residual_out (bit for bit: the bf16 rank-order sum
of both ranks' inputs of that call, plus the residual) and norm_out; every other op must end in a
specific error (or "not served"); then both ranks must run correct paired ops again within 60 s.

Variants (--variants, default all): dead0/dead1 x instream/eager x early/late, e.g.
dead0-eager-early (the peer, rank 1, starts first).

  python3 tests/gpu/instream_kill_midop.py --arfused BIN [--device cuda|host] [--gpus N]
      [--variants ...] [--json FILE] [--keep-logs DIR]
(libarfuse_client: $ARFUSE_CLIENT_LIB or the usual search, docs/integration.md)
Exit status 0 when every variant passed.
"""
import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client" / "python"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

SPIN_TIMEOUT_S = 2.0
EPS = 1e-6
TOKENS = 1
FAILURES = {"ABORTED", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION", "UNAVAILABLE"}
VARIANTS = [f"dead{d}-{n}-{w}" for d in (0, 1) for n in ("instream", "eager")
            for w in ("early", "late")]


# ---------------------------------------------------------------- a rank process

class Worker:
    """One rank's process: reads one JSON command per line, answers one JSON line."""

    def __init__(self, args):
        import torch
        import arfuse
        import arfuse.torch as aft
        self.torch, self.arfuse, self.aft, self.args = torch, arfuse, aft, args
        self.rank, self.hidden = args.rank, args.hidden
        if args.device == "cuda":
            torch.cuda.set_device(args.gpu)
            self.dev = torch.device("cuda", args.gpu)
        else:
            self.dev = torch.device("cpu")
        self.client = arfuse.Client(args.socket, client_name=f"kill-midop-{self.rank}")
        self.client.wait_ready(90)
        self.ctx = None
        self.ws = None

    def tensor(self, seed, shape):
        g = self.torch.Generator(device="cpu").manual_seed(seed)
        return (0.5 * self.torch.randn(*shape, generator=g)).bfloat16()

    def inputs(self, call, rank):
        return self.tensor(7919 * call + 31 * rank + 1, (TOKENS, self.hidden))

    def residual(self, call):
        return self.tensor(7919 * call + 3, (TOKENS, self.hidden))

    def gamma(self):
        return (1 + self.tensor(5, (self.hidden,)).float() * 0.2).bfloat16()

    def reference(self, call):
        # World size 2: x_0 + x_1 in fp32, rounded to bf16, + residual, rounded (docs/kernels.md).
        a = (self.inputs(call, 0).float() + self.inputs(call, 1).float()).bfloat16()
        r_out = (a.float() + self.residual(call).float()).bfloat16()
        y = r_out.float()
        n = y * self.torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS) * self.gamma().float()
        return r_out, n

    def summed(self, mine, theirs, residual_call):
        """residual_out of this rank's input of call `mine` with the peer's of call `theirs`."""
        x = {self.rank: self.inputs(mine, self.rank), 1 - self.rank: self.inputs(theirs,
                                                                                  1 - self.rank)}
        a = (x[0].float() + x[1].float()).bfloat16()
        return (a.float() + self.residual(residual_call).float()).bfloat16()

    def explain(self, call, got_r):
        """Which of the peer's calls a wrong residual_out summed, when one explains it exactly:
        tells a stale slot (an earlier call's data) from a torn or uninitialized one."""
        bits = got_r.view(self.torch.int16)
        for theirs in (call - 1, call - 2, call + 1, 99, 1, 0):
            if theirs >= 0 and self.torch.equal(
                    bits, self.summed(call, theirs, call).view(self.torch.int16)):
                return f"the peer's input of call {theirs}"
        if self.torch.equal(bits, self.residual(call).view(self.torch.int16)):
            return "the residual unchanged (the op's outputs were never written)"
        if self.torch.equal(bits, (self.inputs(call, self.rank).float() +
                                   self.residual(call).float()).bfloat16().view(self.torch.int16)):
            return "this rank's input alone (the peer's slot read as zeros)"
        return "no single call's data"

    def verdict(self, call, r_out, n_out):
        want_r, want_n = self.reference(call)
        got_r = r_out.cpu()
        wrong = int((got_r.view(self.torch.int16) != want_r.view(self.torch.int16)).sum())
        err = (n_out.cpu().float() - want_n).abs().max().item()
        bound = (2.0 ** -6) * max(1.0, want_n.abs().max().item())
        out = {"outcome": "ok", "wrong": wrong, "norm_ok": err <= bound,
               "elements": got_r.numel(), "t": time.time()}
        if wrong:
            out["explained_by"] = self.explain(call, got_r)
        return out

    def attach(self):
        self.ctx = self.aft.attach(self.client, [self.hidden])
        return {"outcome": "ok"}

    def detach(self):
        if self.ctx is not None:
            self.aft.detach()
            self.ctx = None
        return {"outcome": "ok"}

    def instream_op(self, call):
        if self.ctx is None:
            self.attach()
        x = self.inputs(call, self.rank).to(self.dev)
        res = self.residual(call).to(self.dev)
        n, r = self.aft.fused_allreduce_residual_rmsnorm(x, res, self.gamma().to(self.dev), EPS)
        if n is None:
            return {"outcome": "not_served",
                    "message": str(self.aft.why_not(x, res, self.gamma().to(self.dev)))}
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()
        self.aft.check()  # raises when the launch failed
        return self.verdict(call, r, n)

    def eager_op(self, call):
        torch, arfuse = self.torch, self.arfuse
        if self.ws is None:
            self.ws = arfuse.FusionWorkspace(self.client)
            nbytes = TOKENS * self.hidden * 2
            if self.dev.type == "cuda":
                self.buf = arfuse.CudaBuffer(4 * nbytes + self.hidden * 2 + 4096,
                                             device=self.args.gpu)
                view = lambda off, shape: self.buf.tensor(torch.bfloat16, shape, off)  # noqa
            else:
                import numpy as np
                self.buf = arfuse.HostShmBuffer(4 * nbytes + self.hidden * 2 + 4096)
                view = lambda off, shape: torch.from_numpy(  # noqa: E731
                    self.buf.array(np.int16, shape, off)).view(torch.bfloat16)
            self.ws.register(self.buf, "t")
            self.t = {k: view(i * nbytes, (TOKENS, self.hidden))
                      for i, k in enumerate(("x", "res", "n"))}
            self.t["g"] = view(3 * nbytes, (self.hidden,))
        t = self.t
        t["x"].copy_(self.inputs(call, self.rank))
        t["res"].copy_(self.residual(call))
        t["g"].copy_(self.gamma())
        t["n"].fill_(float("nan"))
        out = arfuse.allreduce_fusion(input=t["x"], workspace=self.ws, residual_in=t["res"],
                                      residual_out=t["res"], norm_out=t["n"], rms_gamma=t["g"],
                                      rms_eps=EPS)
        if out is None:
            return {"outcome": "not_served", "message": str(self.ws.unavailable_reason)}
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        # The op was asynchronous: an OK reply means enqueued, check() that it completed.
        self.ws.check()
        return self.verdict(call, t["res"].clone(), t["n"].clone())

    def serve(self):
        print(json.dumps({"outcome": "ready"}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                if cmd["cmd"] == "attach":
                    reply = self.attach()
                elif cmd["cmd"] == "detach":
                    reply = self.detach()
                elif cmd["cmd"] == "op":
                    reply = (self.instream_op if cmd["plane"] == "instream" else self.eager_op)(
                        cmd["call"])
                else:
                    break
            except self.arfuse.ArfuseError as e:
                reply = {"outcome": "error", "code": e.code.name, "message": e.message[:500]}
            except Exception as e:  # noqa: BLE001: reported to the launcher
                reply = {"outcome": "exception", "message": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-2000:]}
            reply["t"] = round(time.time(), 3)
            print(json.dumps(reply), flush=True)
        os._exit(0)


# ---------------------------------------------------------------- the launcher

class Proc:
    def __init__(self, args, d, rank, name):
        argv = [sys.executable, __file__, "--worker", "--rank", str(rank), "--socket",
                str(d / f"r{rank}.sock"), "--hidden", str(args.hidden), "--device", args.device,
                "--gpu", str(rank % args.gpus)]
        self.log = open(d / f"{name}.log", "w")
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.log, text=True)
        first = self.read(120)
        if first.get("outcome") != "ready":
            raise RuntimeError(f"{name} did not start: {first} (log {d}/{name}.log)")

    def send(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def read(self, timeout):
        result = {}

        def get():
            line = self.p.stdout.readline()
            result["v"] = json.loads(line) if line else {"outcome": "exited"}
        t = threading.Thread(target=get, daemon=True)
        t.start()
        t.join(timeout)
        return result.get("v", {"outcome": "timeout"})

    def call(self, timeout=60, **cmd):
        self.send(**cmd)
        return self.read(timeout)

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


def judge(reply, what, problems, timeline=None):
    """OK must be correct; anything else a specific error. Returns a short label."""
    o = reply.get("outcome")
    if timeline is not None:
        timeline.append({"what": what, **{k: v for k, v in reply.items() if k != "traceback"}})
    if o == "ok":
        if reply.get("wrong"):
            problems.append(f"{what}: OK with residual_out wrong in {reply['wrong']} of "
                            f"{reply['elements']} elements ({reply.get('explained_by')})")
        elif not reply.get("norm_ok"):
            problems.append(f"{what}: OK with norm_out outside the bound")
        return "ok"
    if o == "error":
        if reply.get("code") not in FAILURES or not reply.get("message"):
            problems.append(f"{what}: unexpected error {reply}")
        return reply["code"]
    if o == "not_served":
        return "not_served"
    problems.append(f"{what}: {reply}")
    return o


def run_variant(args, variant):
    from instream_scenarios import Sidecars
    dead = int(variant[4])
    plane = variant.split("-")[1]
    peer_first = variant.endswith("early")
    peer = 1 - dead
    d = pathlib.Path(tempfile.mkdtemp(prefix=f"arfuse-kill-{variant}-"))
    ns = argparse.Namespace(arfused=args.arfused, device=args.device, world=2, gpus=args.gpus,
                            hidden=args.hidden)
    verdict = {"variant": variant, "problems": [], "dir": str(d), "timeline": []}
    sc = Sidecars(ns, d)
    procs = []
    try:
        sc.wait_ready()
        doomed = Proc(args, d, dead, f"doomed{dead}")
        procs.append(doomed)
        other = Proc(args, d, peer, f"peer{peer}")
        procs.append(other)
        # 1. One paired op. A group that re-forms right after it first formed disables the
        # attachments made before: both ranks attach again and retry (a few rounds at most).
        for attempt in range(4):
            for p in (doomed, other):
                p.call(cmd="detach")
                r = p.call(cmd="attach")
                if r.get("outcome") != "ok":
                    time.sleep(1.0)
            doomed.send(cmd="op", plane="instream", call=0)
            r_peer = other.call(cmd="op", plane="instream", call=0)
            r_dead = doomed.read(60)
            got = [judge(r, what, verdict["problems"])
                   for what, r in (("paired op (peer)", r_peer), ("paired op (doomed)", r_dead))]
            if got == ["ok", "ok"]:
                break
            time.sleep(1.0)
        else:
            raise RuntimeError(f"the paired op did not succeed in 4 rounds: {r_peer} {r_dead}")
        # The dead rank's next process is up before the kill (its torch start takes seconds), and
        # the eager variant's peer detached, so the next ops follow the kill at once.
        replacement = Proc(args, d, dead, f"replacement{dead}")
        procs.append(replacement)
        if plane == "eager":
            other.call(cmd="detach")
        # 2. The doomed op, joined by no one; SIGKILL 0.5 s into it.
        doomed.send(cmd="op", plane="instream", call=99)
        time.sleep(0.5)
        verdict["timeline"].append({"what": f"SIGKILL rank {dead}'s client", "t": time.time()})
        doomed.p.send_signal(signal.SIGKILL)
        doomed.p.wait(10)
        # 3. Both ranks' next op, one 0.3 s before the other.
        ranks = {peer: other, dead: replacement}
        outcomes = {}

        def go(r):
            if (r == peer) != peer_first:
                time.sleep(0.3)
            outcomes[r] = ranks[r].call(timeout=60, cmd="op", plane=plane, call=1)
        ts = [threading.Thread(target=go, args=(r,)) for r in (0, 1)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(90)
        verdict["next_ops"] = {r: judge(outcomes.get(r, {"outcome": "timeout"}),
                                        f"rank {r}'s next op", verdict["problems"],
                                        verdict["timeline"])
                               for r in (0, 1)}
        # 4. Recovery: eager paired ops until both are correct (detached first).
        for p in ranks.values():
            p.call(cmd="detach")
        until, call = time.monotonic() + 60, 2
        while True:
            res = {}

            def eager(r, call=call):
                res[r] = ranks[r].call(timeout=60, cmd="op", plane="eager", call=call)
            ts = [threading.Thread(target=eager, args=(r,)) for r in (0, 1)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(90)
            got = {r: judge(res.get(r, {"outcome": "timeout"}), f"rank {r} recovering (call {call})",
                            verdict["problems"], verdict["timeline"]) for r in (0, 1)}
            if got == {0: "ok", 1: "ok"}:
                verdict["recovered_after_calls"] = call - 1
                break
            if time.monotonic() > until:
                verdict["problems"].append(f"no correct paired op within 60 s: {got}")
                break
            time.sleep(0.5)
            call += 1
    except Exception as e:  # noqa: BLE001
        verdict["problems"].append(f"{type(e).__name__}: {e}")
    finally:
        for p in procs:
            p.kill()
        sc.stop()
    verdict["ok"] = not verdict["problems"]
    if args.keep_logs and not verdict["ok"]:
        # The sidecars' and ranks' logs of a failed variant, for the timeline above.
        shutil.copytree(d, pathlib.Path(args.keep_logs) / variant, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.sock", "*.sock.*", "peers"))
    return verdict


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arfused", default=os.environ.get("ARFUSE_ARFUSED"))
    ap.add_argument("--device", choices=("cuda", "host"), default="cuda")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep-logs", default=None,
                    help="copy a failed variant's sidecar and rank logs under this folder")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--socket", default="", help=argparse.SUPPRESS)
    ap.add_argument("--gpu", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        Worker(args).serve()
        return 0
    if not args.arfused:
        ap.error("--arfused (or $ARFUSE_ARFUSED) is required")
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {','.join(bad)}: expected {','.join(VARIANTS)}")
    results = []
    for v in names:
        t0 = time.monotonic()
        res = run_variant(args, v)
        res["seconds"] = round(time.monotonic() - t0, 2)
        results.append(res)
        print(f"{v:24s} {'ok' if res['ok'] else 'FAIL'}  next ops {res.get('next_ops')}  "
              f"{'; '.join(res['problems'])[:600]}", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    ok = all(r["ok"] for r in results)
    print(f"{sum(r['ok'] for r in results)}/{len(results)} variants passed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
