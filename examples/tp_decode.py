#!/usr/bin/env python3
"""tp_decode: tensor-parallel decoding of a Llama-style model through arfuse.

Every layer's allreduce + residual add + RMSNorm goes through arfuse, called the way SGLang's
communicator calls FlashInfer's fused op, and falls back to the framework's own path
(torch.distributed all_reduce + RMSNorm) for any op that is not served fused. By default
(--plane instream) the op is arfuse.torch's: the sidecar's kernel launched in this process's own
stream, for prefill and for decode inside full CUDA graphs. --plane doorbell (a ring kernel in
the graph) and --plane eager (one RPC per op, between graph pieces) are the other planes. The
negotiation with the sidecars' config service decides what may run; a decode that ends up on the
eager plane is printed loudly and fails the run unless --allow-eager-decode. docs/integration.md
walks through it.

    # starts N arfused sidecars and N rank processes, checks tokens against in-process
    # torch.distributed, then times decode steps
    tp_decode.py --ranks 2 --gpus 1 --flashinfer-allreduce-fusion-backend auto --perf
    tp_decode.py --ranks 2 --hidden 4096 --heads 32 --kv-heads 8 --intermediate 14336 \
        --vocab 32000 --layers 32 --batch 16 ...               # Llama-3-8B layer sizes
    tp_decode.py --ranks 2 --scenarios main,off,kill ...      # + fusion off, + a killed sidecar
    tp_decode.py --sockets /run/arfuse/r0.sock,/run/arfuse/r1.sock   # sidecars already running
    torchrun --nproc-per-node 2 tp_decode.py --sockets A,B            # one process per rank
    tp_decode.py --device cpu --setup-only ...   # no torch: sidecars, negotiation, the plane,
                                                 # every site's op on known data
    tp_decode.py --oracle out.json ...           # the numerics oracle (oracle.py)

The parts: tp_decode.py (arguments, the rank process, the launcher), tpd_common.py (geometry,
pool layout, logging), tpd_sidecars.py (starting and reaching sidecars, negotiation),
tpd_planes.py (what runs where, plans, rings, attach, setup-only), tpd_verdicts.py (judging and
printing), tp_model.py (the torch model and the per-layer ops; imported only by model ranks),
tp_oracle.py (the oracle's torch side). None imports tp_decode.py.
Exit status: 0 when every scenario passed, 1 otherwise, 2 for bad arguments.
"""
import argparse
import dataclasses
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
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from tpd_common import (DTYPE_BYTES, HERE, PKG_DIR, PROG, REPO, ModelConfig,  # noqa: E402,F401
                        PoolLayout, SetupError, UsageError, gpu_count, log, model_config,
                        pool_layout, site_name)
from tpd_planes import (EAGER_BANNER, ExecPlan, create_site_plans,  # noqa: E402,F401
                        decide_execution, destroy_plans, eager_decode_check, run_setup_only,
                        site_opspec, try_doorbell, try_instream)
from tpd_sidecars import (PLANES, SidecarGroup, Watchdog, arfused_lib_dir,  # noqa: E402,F401
                          capture_request, checkout_library, connect_sidecar, describe_failure,
                          find_arfused, fusion_flags, negotiate, negotiation_key, sidecar_argv,
                          socket_path)
from tpd_verdicts import judge_kill, judge_normal, print_perf, summarize  # noqa: E402,F401

SCENARIOS = ("main", "off", "kill")


# =============================================================================================
# Arguments
# =============================================================================================

def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tp_decode.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Tensor-parallel decode of a Llama-style model through arfuse "
                    "(docs/integration.md).",
        epilog="Paths: --arfused or $ARFUSE_ARFUSED, else the newest build*/server/daemon/arfused,"
               " else arfused on $PATH; libraries it needs from --arfused-lib-dir or "
               "$ARFUSE_ARFUSED_LIBS, else <arfused's dir>/../devlibs when present (set for the "
               "sidecars only). Ring library: --ring-lib or $ARFUSE_RING_LIB, else a build of "
               "this checkout (build/client/ring/). Client library (in-stream plane): "
               "--client-lib or $ARFUSE_CLIENT_LIB, else a build of this checkout "
               "(build/client/instream/); else the system's library path.")
    g = p.add_argument_group("processes")
    g.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="cuda (default when a GPU is visible) or cpu (host-mode sidecars, gloo, "
                        "no CUDA graphs)")
    g.add_argument("--ranks", type=int, default=2, help="tensor-parallel size (launcher)")
    g.add_argument("--gpus", type=int, default=None,
                   help="GPUs to spread the ranks over (rank r on GPU r %% gpus); default: all "
                        "visible. Fewer GPUs than ranks: ranks share them, run MPS")
    g.add_argument("--sockets", default=None,
                   help="comma-separated sockets of sidecars already running, in rank order: "
                        "start no sidecars")
    g.add_argument("--rank", type=int, default=None,
                   help="run as this rank only (with --sockets and --dist-init; torchrun sets "
                        "RANK/WORLD_SIZE instead)")
    g.add_argument("--gpu", type=int, default=None, help="this rank's GPU (default rank %% gpus)")
    g.add_argument("--dist-init", default=None,
                   help="torch.distributed init_method for --rank (e.g. tcp://host:port)")
    g.add_argument("--scenarios", default="main",
                   help="launcher: comma-separated of main (check + fallback pass + --perf), off "
                        "(sidecars with --enforce-disable-flashinfer-allreduce-fusion: the "
                        "framework path decodes the same tokens), kill (the last rank's sidecar "
                        "is SIGKILLed mid-decode: every rank must stop with an error naming it "
                        "within the op deadline)")
    g.add_argument("--timeout", type=float, default=170.0,
                   help="seconds a scenario may take before everything is killed")
    g.add_argument("--json", default=None, help="write every scenario's results here")
    g.add_argument("--keep-logs", action="store_true", help="keep the run folder")

    g = p.add_argument_group("model (random weights from --seed; nothing is downloaded)")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, default=1024)
    g.add_argument("--heads", type=int, default=16)
    g.add_argument("--kv-heads", type=int, default=8)
    g.add_argument("--intermediate", type=int, default=2816)
    g.add_argument("--vocab", type=int, default=4096)
    g.add_argument("--eps", type=float, default=1e-5, help="RMSNorm epsilon")
    g.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--batch", type=int, default=4, help="sequences decoded together")
    g.add_argument("--prompt-len", type=int, default=16)
    g.add_argument("--steps", type=int, default=24, help="tokens generated per sequence")

    g = p.add_argument_group("data plane and CUDA graphs (negotiated with the sidecar's config "
                             "service)")
    g.add_argument("--plane", choices=list(PLANES), default="instream",
                   help="instream (default): the sidecar's kernel launched in this process's "
                        "stream through arfuse.torch, prefill and decode, decode inside the "
                        "graphs; doorbell: a ring kernel in the graph and a serving launch in the "
                        "sidecar; eager: one Fusion.Execute RPC per op, between graph pieces")
    g.add_argument("--allow-eager-decode", action="store_true",
                   help="accept a decode whose fused ops run on the eager plane (otherwise the "
                        "run fails, loudly); --plane eager implies it")
    g.add_argument("--client-lib", default=None,
                   help="libarfuse_client.so for the in-stream plane (default: "
                        "$ARFUSE_CLIENT_LIB, then a build of this checkout)")
    g.add_argument("--cuda-graph", choices=["none", "piecewise", "full"], default="full",
                   help="the mode this client wants; the sidecar answers the mode it may use")
    g.add_argument("--fused-op-in-graph", type=_bool, default=True,
                   help="ask for the fused op inside the graphs (in-stream and doorbell planes)")
    g.add_argument("--framework-graph", choices=["auto", "none", "piecewise", "full"],
                   default="auto",
                   help="graph mode of the in-process reference: auto = --cuda-graph when its "
                        "collective can be captured (NCCL), else piecewise (gloo)")

    g = p.add_argument_group("sidecar flags (SGLang's spelling, passed to every arfused)")
    g.add_argument("--flashinfer-allreduce-fusion-backend", choices=["auto", "trtllm", "mnnvl"],
                   default=None, help="unset: fusion off unless auto-enabled (SM100 family)")
    g.add_argument("--enable-flashinfer-allreduce-fusion", action="store_true",
                   help="deprecated: means --flashinfer-allreduce-fusion-backend=auto")
    g.add_argument("--enforce-disable-flashinfer-allreduce-fusion", action="store_true")
    g.add_argument("--enable-deterministic-inference", action="store_true")
    g.add_argument("--sm", type=int, default=None,
                   help="compute capability for the config service (host mode: default 90)")
    g.add_argument("--spin-timeout", type=float, default=5.0,
                   help="arfused --spin-timeout: a cross-rank wait gives up after this")
    g.add_argument("--sidecar-arg", action="append", default=[],
                   help="extra arfused argument (repeatable)")
    g.add_argument("--arfused", default=None)
    g.add_argument("--arfused-lib-dir", default=None)
    g.add_argument("--ring-lib", default=None)

    g = p.add_argument_group("what to run")
    g.add_argument("--check", type=_bool, default=True,
                   help="compare tokens and logits with in-process torch.distributed")
    g.add_argument("--strict-tokens", action="store_true",
                   help="fail on any token difference, even a near tie within bf16 tolerance")
    g.add_argument("--perf", action="store_true",
                   help="time decode steps: arfuse vs the framework path vs no allreduce")
    g.add_argument("--perf-iters", type=int, default=200)
    g.add_argument("--perf-warmup", type=int, default=20)
    g.add_argument("--op-timeout", type=float, default=10.0,
                   help="deadline of one fused op (eager RPC deadline, doorbell ring timeout)")
    g.add_argument("--ready-timeout", type=float, default=90.0,
                   help="seconds to wait for the sidecar's workspace and the group decision")
    g.add_argument("--pg-timeout", type=float, default=60.0,
                   help="torch.distributed timeout (bounds the framework path's collectives)")
    g.add_argument("--setup-only", action="store_true",
                   help="no torch: connect, negotiate, set up the plane (attach, or a plan per "
                        "site), run every site's fused op on known data (host mode) and check "
                        "the values")
    g = p.add_argument_group("numerics oracle (issue 25; oracle.py is the one-command front end)")
    g.add_argument("--oracle", default=None, metavar="JSON",
                   help="instead of the check: run the same weights through arfuse, the "
                        "framework path, fp32 on one GPU and Hugging Face transformers' "
                        "LlamaForCausalLM, teacher-forced on the fp32 tokens; write per-layer and "
                        "logit distances and the token comparison to JSON")
    g.add_argument("--tie-tol", type=float, default=0.1,
                   help="oracle: a token difference where the fp32 reference's top-2 logit gap "
                        "is below this counts as a tie")
    g.add_argument("--oracle-slack", type=float, default=0.01,
                   help="oracle: arfuse passes a layer when its distance from fp32 is at most "
                        "(1 + slack) x the framework path's (default 0.01: two bf16 paths of "
                        "equal precision that round in different orders differ by a fraction "
                        "of a percent; docs/numerics.md)")
    g.add_argument("--oracle-hf", choices=["auto", "on", "off"], default="auto",
                   help="oracle: run transformers' LlamaForCausalLM (auto: when importable)")
    # Internal (launcher -> rank).
    g.add_argument("--world-size", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    g.add_argument("--scenario", default="main", help=argparse.SUPPRESS)
    g.add_argument("--sidecar-pids", default=None, help=argparse.SUPPRESS)
    g.add_argument("--inject-kill", default=None, help=argparse.SUPPRESS)  # RANK@STEP
    g.add_argument("--gpu-count", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    validate_args(args)
    return args


def validate_args(args):
    if args.ranks < 1:
        raise UsageError("--ranks must be >= 1")
    for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "batch",
                 "prompt_len", "steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.hidden % args.heads:
        raise UsageError("--hidden must be a multiple of --heads")
    if (args.hidden // args.heads) % 2:
        raise UsageError("the head size (--hidden / --heads) must be even (rotary embedding)")
    if args.heads % args.kv_heads:
        raise UsageError("--heads must be a multiple of --kv-heads")
    if args.hidden % 8:
        raise UsageError("--hidden must be a multiple of 8 (the fused op's rule)")
    if args.steps < 2:
        raise UsageError("--steps must be >= 2 (one from prefill, the rest decode)")
    bad = [s for s in scenario_list(args) if s not in SCENARIOS]
    if bad:
        raise UsageError(f"unknown scenario(s) {','.join(bad)}: expected {','.join(SCENARIOS)}")
    if "kill" in scenario_list(args) and args.sockets and args.rank is None:
        raise UsageError("the kill scenario needs sidecars this launcher starts (no --sockets)")
    if args.inject_kill is not None:
        parse_inject(args.inject_kill)
    if args.oracle and args.setup_only:
        raise UsageError("--oracle needs the model (torch): not with --setup-only")
    if args.oracle and "main" not in scenario_list(args):
        raise UsageError("--oracle runs in the main scenario")


def scenario_list(args) -> List[str]:
    return [s.strip() for s in args.scenarios.split(",") if s.strip()]


def parse_inject(spec: str) -> Tuple[int, int]:
    try:
        r, s = spec.split("@")
        return int(r), int(s)
    except ValueError:
        raise UsageError(f"--inject-kill wants RANK@STEP, got {spec!r}") from None


def check_world(args, world: int):
    """Tensor-parallel constraints of the model at this world size."""
    for name, value in (("heads", args.heads), ("kv-heads", args.kv_heads),
                        ("intermediate", args.intermediate)):
        if value % world:
            raise UsageError(f"--{name} {value} is not divisible by the {world} ranks")



class RankContext:
    """What a rank process knows; shared by the setup-only and the model path."""

    def __init__(self, args, rank: int, world: int, sockets: List[str]):
        self.args = args
        self.rank, self.world = rank, world
        self.sockets = sockets
        self.socket = sockets[rank]
        visible = args.gpu_count or gpu_count()
        self.device = args.device or ("cuda" if visible > 0 else "cpu")
        gpus = max(1, visible)
        self.gpu = args.gpu if args.gpu is not None else (
            int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else rank % gpus)
        self.one_gpu_per_rank = self.device == "cuda" and world <= gpus
        self.cfg = model_config(args)
        self.layout = pool_layout(self.cfg)
        self.want_mode = args.cuda_graph if self.device == "cuda" else "none"
        self.op_timeout = args.op_timeout
        self.ring_lib = (args.ring_lib or os.environ.get("ARFUSE_RING_LIB")
                         or checkout_library("libarfuse_ring.so", "client/ring"))
        self.client_lib = (args.client_lib or os.environ.get("ARFUSE_CLIENT_LIB")
                           or checkout_library("libarfuse_client.so", "client/instream"))
        self.plane = args.plane
        self.allow_eager_decode = args.allow_eager_decode or args.plane == "eager"
        self.workdir = args.workdir
        self.inject = parse_inject(args.inject_kill) if args.inject_kill else None
        self.sidecar_pids = ([int(p) for p in args.sidecar_pids.split(",")]
                             if args.sidecar_pids else [])
        self.client = None
        self.neg = None
        self.instream = None  # the in-stream context, once attached
        self.buffers = []
        self.result = {"rank": rank, "world": world, "scenario": args.scenario,
                       "status": "running", "device": self.device, "gpu": self.gpu}
        self._lock = threading.Lock()
        self._finished = False
        self.watchdog = None

    # -- results --
    def write_result(self):
        if not self.workdir:
            return
        path = os.path.join(self.workdir, f"result.{self.rank}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=1, default=str)
        os.replace(tmp, path)

    def finish(self, code: int, error: Optional[str] = None):
        """Writes the result, releases host memory and exits the process (never returns)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            if self.watchdog:
                self.watchdog.stopping = True
            if error:
                self.result["status"] = "error"
                self.result["error"] = error
                log(f"FAILED: {error}", err=True)  # the message starts with "rank N: "
            elif self.result.get("status") == "running":
                self.result["status"] = "pass" if code == 0 else "fail"
            self.result["exit_time"] = time.time()
            try:
                self.write_result()
            except Exception as e:  # pragma: no cover
                log(f"could not write the result: {e}", self.rank, err=True)
            for b in self.buffers:
                # Host shm names must be unlinked; device memory goes with the process (a
                # cudaFree now would wait for any kernel still running, e.g. a ring timing out).
                if hasattr(b, "shm_name"):
                    try:
                        b.close()
                    except Exception:
                        pass
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # never hang in NCCL/gRPC teardown, whatever the peers do

    def report_execution(self, ex: ExecPlan):
        self.result["execution"] = dataclasses.asdict(ex)
        log("execution: " + ex.describe(), self.rank)

    def kill_own_sidecar(self, step: int):
        """Fault injection: SIGKILL this rank's sidecar before decode step `step`."""
        pid = self.sidecar_pids[self.rank]
        log(f"injecting fault: SIGKILL to arfused rank {self.rank} (pid {pid}) before decode "
            f"step {step}", self.rank)
        t = time.time()
        if self.workdir:
            with open(os.path.join(self.workdir, "kill.json"), "w") as f:
                json.dump({"rank": self.rank, "pid": pid, "step": step, "time": t}, f)
        os.kill(pid, signal.SIGKILL)


def rank_main(args, rank: int, world: int, sockets: List[str]):
    ctx = RankContext(args, rank, world, sockets)
    try:
        check_world(args, world)
        client, info = connect_sidecar(ctx.socket, rank, world, args.op_timeout,
                                       args.ready_timeout)
        ctx.client = client
        ctx.watchdog = Watchdog(client, rank, ctx.socket, lambda m: ctx.finish(3, m))
        neg = negotiate(client, ctx.want_mode, args.fused_op_in_graph, ctx.device,
                        args.ready_timeout, args.plane, ctx.cfg.sites)
        ctx.neg = neg
        ctx.result["negotiation"] = dataclasses.asdict(neg)
        asked = capture_request(args.plane, ctx.want_mode, args.fused_op_in_graph, ctx.device)
        log(f"negotiated (asked plane={args.plane}, cuda_graph_mode={asked['cuda_graph_mode']}, "
            f"fused op in graph={asked['fused_op_in_graph']}, client loads kernels="
            f"{asked['client_loads_kernels']}): {neg.summary()}", rank)
        if neg.fusion_enabled and neg.data_plane != args.plane:
            log(f"  note: asked for the {args.plane} plane, the sidecars answered "
                f"{neg.data_plane}", rank)
        for w in neg.warnings:
            log(f"  warning: {w}", rank)
        for r in neg.reasons:
            log(f"  reason: {r}", rank)
        if ctx.device == "cuda" and neg.device == "cuda" and not neg.mps_detected:
            log("  warning: the sidecar does not see MPS: every hop between this process and "
                "its sidecar costs a GPU context switch (docs/mps.md)", rank)
        if args.setup_only:
            setup = ctx.result["setup"] = run_setup_only(ctx)
            ok = all(c["ok"] for c in setup["checks"])
            ctx.result["status"] = "pass" if ok else "fail"
            log(("PASS" if ok else "FAIL") + " (setup-only)", rank)
            ctx.finish(0 if ok else 1)
        if args.oracle:
            import tp_oracle  # torch from here on

            ok = tp_oracle.run_rank(ctx)
        else:
            import tp_model  # torch from here on

            ok = tp_model.run_rank(ctx)
        ctx.finish(0 if ok else 1)
    except SystemExit:
        raise
    except BaseException as e:  # every failure ends in one line naming the rank
        if ctx.inject is None and os.environ.get("TP_DECODE_TRACEBACK"):
            import traceback
            traceback.print_exc()
        ctx.finish(1, describe_failure(e, rank, ctx.socket, ctx.client))


# =============================================================================================
# Launcher
# =============================================================================================

FORWARD_OPTS = ("device", "layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "eps",
                "dtype", "seed", "batch", "prompt_len", "steps", "plane", "cuda_graph",
                "fused_op_in_graph", "framework_graph", "check", "perf_iters", "perf_warmup",
                "op_timeout", "ready_timeout", "pg_timeout", "ring_lib", "client_lib",
                "gpu_count", "oracle", "tie_tol", "oracle_slack", "oracle_hf")
FORWARD_FLAGS = ("strict_tokens", "perf", "setup_only", "allow_eager_decode")


def rank_argv(args, rank: int, world: int, sockets: Sequence[str], workdir: str, scenario: str,
              dist_init: str, sidecar_pids: Sequence[int] = (),
              inject: Optional[str] = None) -> List[str]:
    argv = [sys.executable, str(pathlib.Path(__file__).resolve()), "--rank", str(rank),
            "--world-size", str(world), "--sockets", ",".join(sockets), "--workdir", workdir,
            "--scenario", scenario, "--dist-init", dist_init]
    for name in FORWARD_OPTS:
        v = getattr(args, name)
        if v is not None:
            text = str(v).lower() if isinstance(v, bool) else str(v)
            argv += [f"--{name.replace('_', '-')}", text]
    for name in FORWARD_FLAGS:
        if getattr(args, name):
            argv.append(f"--{name.replace('_', '-')}")
    if sidecar_pids:
        argv += ["--sidecar-pids", ",".join(str(p) for p in sidecar_pids)]
    if inject:
        argv += ["--inject-kill", inject]
    return argv


class RankProcs:
    """The N rank processes; their output is echoed with a rank prefix and kept in logs."""

    def __init__(self):
        self.procs: List[subprocess.Popen] = []
        self.exit_at: Dict[int, float] = {}
        self.threads = []
        self.lines: Dict[int, List[str]] = {}

    def start(self, rank: int, argv: List[str], env: dict, log_path: str):
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                             text=True, errors="replace", bufsize=1)
        self.procs.append(p)
        self.lines[rank] = []

        def pump():
            with open(log_path, "w") as f:
                for line in p.stdout:
                    f.write(line)
                    self.lines[rank].append(line.rstrip("\n"))
                    sys.stdout.write(f"[rank {rank}] {line}")
                    sys.stdout.flush()

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        self.threads.append(t)

    def poll(self):
        now = time.time()
        for r, p in enumerate(self.procs):
            if p.poll() is not None and r not in self.exit_at:
                self.exit_at[r] = now

    def running(self) -> List[int]:
        return [r for r, p in enumerate(self.procs) if p.poll() is None]

    def kill(self, ranks):
        for r in ranks:
            p = self.procs[r]
            if p.poll() is None:
                p.kill()
        for r in ranks:
            try:
                self.procs[r].wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def join(self):
        for t in self.threads:
            t.join(timeout=5)


def rank_env(device: str) -> dict:
    env = dict(os.environ)
    # NVLink multicast stays off (docs/operations.md, NCCL_NVLS_ENABLE): the example needs none.
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    # Every rank of this launcher is on this host: bootstrap over loopback (a hostname that does
    # not resolve to a local address is a classic gloo "connectFullMesh" failure).
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env["PYTHONPATH"] = str(PKG_DIR) + (os.pathsep + env["PYTHONPATH"]
                                        if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_scenario(args, scenario: str, folder: str, device: str, gpus: int) -> dict:
    """Starts the sidecars (unless --sockets) and the rank processes; returns the verdict."""
    os.makedirs(folder, exist_ok=True)
    world = args.ranks
    cfg = model_config(args)
    group = None
    verdict = {"scenario": scenario, "ok": False, "problems": [], "ranks": {}}
    t_start = time.time()
    log(f"scenario {scenario}: {world} ranks on {device}"
        + (f" ({gpus} GPU(s){', ranks share GPUs: MPS needed' if gpus < world else ''})"
           if device == "cuda" else ""))
    procs = RankProcs()
    try:
        if args.sockets:
            sockets = args.sockets.split(",")
            if len(sockets) != world:
                raise UsageError(f"--sockets names {len(sockets)} sidecars, --ranks is {world}")
        else:
            binary = find_arfused(args.arfused)
            if binary is None:
                raise SetupError("arfused not found: build it, or pass --arfused / set "
                                 "ARFUSE_ARFUSED")
            flags = fusion_flags(args, scenario, device)
            group = SidecarGroup(binary, world, folder, device, gpus, cfg, flags,
                                 args.spin_timeout, args.sidecar_arg,
                                 arfused_lib_dir(binary, args.arfused_lib_dir))
            log(f"starting {world} sidecars: {' '.join(group.argv(0))} (rank 0)")
            group.start()
            group.wait_sockets(60)
            sockets = group.sockets()
        inject = f"{world - 1}@{max(1, args.steps // 2)}" if scenario == "kill" else None
        dist_init = "file://" + os.path.join(folder, "dist.init")
        env = rank_env(device)
        for r in range(world):
            procs.start(r, rank_argv(args, r, world, sockets, folder, scenario, dist_init,
                                     group.pids() if group else (), inject),
                        env, os.path.join(folder, f"rank.{r}.log"))
        deadline = t_start + args.timeout
        first_fail = None
        stop_grace = args.op_timeout + 15.0
        while True:
            procs.poll()
            running = procs.running()
            if not running:
                break
            now = time.time()
            failed = [r for r, p in enumerate(procs.procs)
                      if p.poll() is not None and p.returncode != 0]
            if failed and first_fail is None:
                first_fail = now
            if now > deadline:
                verdict["problems"].append(
                    f"rank(s) {running} still running after {args.timeout:g} s: killed (hang)")
                procs.kill(running)
                break
            if first_fail is not None and now - first_fail > stop_grace:
                verdict["problems"].append(
                    f"rank(s) {running} did not stop within {stop_grace:g} s after rank(s) "
                    f"{failed} failed: killed (hang)")
                procs.kill(running)
                break
            time.sleep(0.05)
        procs.poll()
        procs.join()
    finally:
        procs.kill(procs.running())  # only when interrupted: a finished scenario has none left
        if group is not None:
            group.stop()
    results = {}
    for r in range(world):
        path = os.path.join(folder, f"result.{r}.json")
        try:
            with open(path) as f:
                results[r] = json.load(f)
        except (OSError, ValueError):
            results[r] = {"rank": r, "status": "missing"}
        results[r]["exit_code"] = procs.procs[r].returncode if r < len(procs.procs) else None
    verdict["ranks"] = results
    verdict["seconds"] = round(time.time() - t_start, 1)
    if scenario == "kill":
        judge_kill(args, folder, results, procs, verdict)
    else:
        judge_normal(args, scenario, results, verdict)
    if not verdict["ok"] and group is not None:
        for r in range(world):
            verdict.setdefault("sidecar_logs", {})[r] = group.tail(r, 6)
    return verdict


class Interrupted(Exception):
    pass


def _interrupt(signum, frame):
    raise Interrupted(f"stopped by signal {signum}")


def launch(args) -> int:
    # An outer `timeout` or Ctrl-C: stop our sidecars and ranks too (the finally blocks), never
    # leave them holding the GPU.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    device = args.device
    gpus = args.gpus
    if device is None:
        device = "cuda" if gpu_count() > 0 else "cpu"
    if device == "cuda" and gpus is None:
        gpus = max(1, gpu_count())
    gpus = gpus or 1
    args.device = device
    args.gpu_count = gpus
    check_world(args, args.ranks)
    if args.oracle:
        args.oracle = os.path.abspath(args.oracle)  # the ranks write it
    base = tempfile.mkdtemp(prefix=f"{PROG}-")
    verdicts = []
    completed = False
    try:
        for scenario in scenario_list(args):
            verdicts.append(run_scenario(args, scenario, os.path.join(base, scenario), device,
                                         gpus))
        ok = summarize(args, verdicts, device, gpus)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device, "gpus": gpus, "ranks": args.ranks,
                           "scenarios": verdicts}, f, indent=1, default=str)
        if not ok or args.keep_logs:
            log(f"logs kept in {base}")
        completed = True
        return 0 if ok else 1
    except Interrupted as e:
        log(f"{e}: sidecars and ranks stopped; logs kept in {base}", err=True)
        return 1
    finally:
        if completed and not args.keep_logs and verdicts and all(v["ok"] for v in verdicts):
            shutil.rmtree(base, ignore_errors=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    try:
        torchrun = args.rank is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
        if args.rank is not None or torchrun:
            if not args.sockets:
                raise UsageError("a rank needs --sockets (its sidecar and every other's)")
            sockets = args.sockets.split(",")
            rank = args.rank if args.rank is not None else int(os.environ["RANK"])
            world = args.world_size or (int(os.environ["WORLD_SIZE"]) if torchrun else
                                        len(sockets))
            if len(sockets) != world:
                raise UsageError(f"--sockets names {len(sockets)} sidecars for {world} ranks")
            if args.dist_init is None:
                args.dist_init = "env://" if torchrun else None
            if args.dist_init is None and not args.setup_only:
                raise UsageError("--rank needs --dist-init (e.g. tcp://host:port)")
            rank_main(args, rank, world, sockets)
            return 0  # not reached: rank_main exits
        return launch(args)
    except UsageError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except SetupError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
