#!/usr/bin/env python3
"""tp_decode: tensor-parallel decoding of a small Llama-style model through arfuse.

Every layer's allreduce + residual add + RMSNorm goes through this rank's arfused sidecar, called
the way SGLang's communicator calls FlashInfer's fused op, and falls back to the framework's own
path (torch.distributed all_reduce + RMSNorm) whenever the sidecar reports fusion unavailable.
Prefill runs eagerly on the eager plane; decode runs in CUDA graphs with the ring kernel of the
doorbell plane captured in them, when the config service's negotiation allows it (otherwise the
fused op runs eagerly between graph pieces, or without graphs). docs/integration.md walks through
it.

    # starts N arfused sidecars and N rank processes, checks tokens against in-process
    # torch.distributed, then times decode steps
    tp_decode.py --ranks 2 --gpus 1 --flashinfer-allreduce-fusion-backend auto --perf
    tp_decode.py --ranks 2 --scenarios main,off,kill ...      # + fusion off, + a killed sidecar
    tp_decode.py --sockets /run/arfuse/r0.sock,/run/arfuse/r1.sock   # sidecars already running
    torchrun --nproc-per-node 2 tp_decode.py --sockets A,B            # one process per rank
    tp_decode.py --device cpu --setup-only ...   # no torch: sidecars, negotiation, plans

This file holds everything that needs no torch (arguments, sidecars, negotiation, plans, the
launcher, the verdicts); tp_model.py holds the model and is imported only by model ranks.
Exit status: 0 when every scenario passed, 1 otherwise, 2 for bad arguments.
"""
import argparse
import dataclasses
import datetime
import glob
import json
import math
import os
import pathlib
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

HERE = pathlib.Path(__file__).resolve().parent
PKG_DIR = HERE.parent                       # client/python (the arfuse package)
REPO = HERE.parents[2]
for _p in (str(PKG_DIR), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

PROG = "tp_decode"
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
SCENARIOS = ("main", "off", "kill")


def log(msg: str, rank: Optional[int] = None, err: bool = False):
    prefix = f"{PROG}: rank {rank}: " if rank is not None else f"{PROG}: "
    print(prefix + msg, file=sys.stderr if err else sys.stdout, flush=True)


class UsageError(Exception):
    pass


class SetupError(Exception):
    pass


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
        description="Tensor-parallel decode of a small Llama-style model through arfuse "
                    "(docs/integration.md).",
        epilog="Paths: --arfused or $ARFUSE_ARFUSED, else the newest build*/server/daemon/arfused,"
               " else .devstage/bin/arfused; libraries it needs from --arfused-lib-dir or "
               "$ARFUSE_ARFUSED_LIBS, else <arfused's dir>/../devlibs when present (set for the "
               "sidecars only). Ring library: --ring-lib or $ARFUSE_RING_LIB.")
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

    g = p.add_argument_group("CUDA graphs (negotiated with the sidecar's config service)")
    g.add_argument("--cuda-graph", choices=["none", "piecewise", "full"], default="full",
                   help="the mode this client wants; the sidecar answers the mode it may use")
    g.add_argument("--fused-op-in-graph", type=_bool, default=True,
                   help="ask for the fused op inside the graphs (doorbell plane)")
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
                   help="no torch: connect, negotiate, register a pool, create every layer's "
                        "plan, run the fused ops on known data (host mode) and check them")
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


# =============================================================================================
# Model geometry and the registered pool (no torch)
# =============================================================================================

@dataclasses.dataclass(frozen=True)
class ModelConfig:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    eps: float
    dtype: str
    seed: int
    batch: int
    prompt_len: int
    steps: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def sites(self) -> int:
        """Fused ops per forward: after attention and after the MLP of every layer."""
        return 2 * self.layers

    @property
    def prefill_tokens(self) -> int:
        return self.batch * self.prompt_len

    @property
    def max_seq(self) -> int:
        return self.prompt_len + self.steps + 1

    @property
    def max_tokens(self) -> int:
        """Rows the pool's tensors hold: the prefill's (decode uses the first `batch`)."""
        return max(self.prefill_tokens, self.batch)


def model_config(args) -> ModelConfig:
    return ModelConfig(layers=args.layers, hidden=args.hidden, heads=args.heads,
                       kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab,
                       eps=args.eps, dtype=args.dtype, seed=args.seed, batch=args.batch,
                       prompt_len=args.prompt_len, steps=args.steps)


def site_name(cfg: ModelConfig, site: int) -> str:
    """What fused op `site` is: its allreduce input and the norm it fuses."""
    layer = site // 2
    if site % 2 == 0:
        return f"layer {layer} attention o_proj + post_attention_layernorm"
    nxt = "final norm" if layer == cfg.layers - 1 else f"layer {layer + 1} input_layernorm"
    return f"layer {layer} mlp down_proj + {nxt}"


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Byte offsets of the static tensors in the one registered buffer.

    partial  [max_tokens, hidden]  the row-parallel layer output (the allreduce input)
    residual [max_tokens, hidden]  the residual stream (residual_in = residual_out, in place)
    h        [max_tokens, hidden]  the norm output (next layer's input)
    gamma    [2*layers+1, hidden]  norm weights: in_0, post_0, in_1, post_1, ..., final;
                                   fused op `site` uses row site+1 (row 0 is local, no allreduce)
    """
    offsets: Dict[str, Tuple[int, int]]
    total: int
    hidden: int
    elem: int
    max_tokens: int

    def offset(self, name: str) -> int:
        return self.offsets[name][0]

    def gamma_offset(self, row: int) -> int:
        return self.offsets["gamma"][0] + row * self.hidden * self.elem


def pool_layout(cfg: ModelConfig, max_tokens: Optional[int] = None) -> PoolLayout:
    from arfuse.pool import align_up

    max_tokens = max_tokens or cfg.max_tokens
    elem = DTYPE_BYTES[cfg.dtype]
    rows = max_tokens * cfg.hidden * elem
    offsets, used = {}, 0
    for name, nbytes in (("partial", rows), ("residual", rows), ("h", rows),
                         ("gamma", (cfg.sites + 1) * cfg.hidden * elem)):
        offsets[name] = (used, nbytes)
        used += align_up(nbytes)
    return PoolLayout(offsets, used, cfg.hidden, elem, max_tokens)


# =============================================================================================
# Sidecars
# =============================================================================================

def find_arfused(explicit: Optional[str] = None) -> Optional[str]:
    for cand in (explicit, os.environ.get("ARFUSE_ARFUSED")):
        if cand:
            return cand if os.access(cand, os.X_OK) else None
    found = [p for p in glob.glob(str(REPO / "build*" / "server" / "daemon" / "arfused"))
             if os.access(p, os.X_OK)]
    if found:
        return max(found, key=os.path.getmtime)
    staged = REPO / ".devstage" / "bin" / "arfused"
    if os.access(staged, os.X_OK):
        return str(staged)
    return shutil.which("arfused")


def arfused_lib_dir(binary: str, explicit: Optional[str] = None) -> Optional[str]:
    d = explicit or os.environ.get("ARFUSE_ARFUSED_LIBS")
    if d:
        return d
    devlibs = pathlib.Path(binary).resolve().parent.parent / "devlibs"
    return str(devlibs) if devlibs.is_dir() else None


def socket_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.sock")


def fusion_flags(args, scenario: str = "main", device: str = "cuda") -> List[str]:
    """SGLang's fusion flags, as the sidecars get them (the config service reads them there)."""
    out = []
    if args.flashinfer_allreduce_fusion_backend:
        backend = args.flashinfer_allreduce_fusion_backend
        out.append(f"--flashinfer-allreduce-fusion-backend={backend}")
    if args.enable_flashinfer_allreduce_fusion:
        out.append("--enable-flashinfer-allreduce-fusion")
    if args.enforce_disable_flashinfer_allreduce_fusion or scenario == "off":
        out.append("--enforce-disable-flashinfer-allreduce-fusion")
    if args.enable_deterministic_inference:
        out.append("--enable-deterministic-inference")
    sm = args.sm if args.sm is not None else (90 if device == "cpu" else None)
    if sm is not None:
        out.append(f"--sm={sm}")
    return out


def sidecar_argv(binary: str, rank: int, world: int, folder: str, device: str,
                 gpu: Optional[int], cfg: ModelConfig, flags: Sequence[str],
                 spin_timeout: float = 5.0, extra: Sequence[str] = ()) -> List[str]:
    argv = [binary, f"--device={'cuda' if device == 'cuda' else 'host'}", f"--rank={rank}",
            f"--world-size={world}", f"--peer-dir={os.path.join(folder, 'peers')}",
            f"--socket={socket_path(folder, rank)}", "--health-port=0",
            f"--hidden={cfg.hidden}", f"--max-tokens={cfg.max_tokens}", f"--dtype={cfg.dtype}",
            f"--spin-timeout={spin_timeout:g}", "--peer-timeout=60", "--log-level=info"]
    if device == "cuda" and gpu is not None:
        argv.append(f"--gpu={gpu}")
    return argv + list(flags) + list(extra)


class SidecarGroup:
    """N arfused processes of one group (like client/demo/demo.cc starts them)."""

    def __init__(self, binary: str, world: int, folder: str, device: str, gpus: int,
                 cfg: ModelConfig, flags: Sequence[str], spin_timeout: float = 5.0,
                 extra: Sequence[str] = (), lib_dir: Optional[str] = None):
        self.binary, self.world, self.folder = binary, world, folder
        self.device, self.gpus, self.cfg = device, max(gpus, 1), cfg
        self.flags, self.spin_timeout, self.extra = list(flags), spin_timeout, list(extra)
        self.lib_dir = lib_dir
        self.procs: List[subprocess.Popen] = []
        os.makedirs(os.path.join(folder, "peers"), exist_ok=True)

    def argv(self, rank: int) -> List[str]:
        return sidecar_argv(self.binary, rank, self.world, self.folder, self.device,
                            rank % self.gpus, self.cfg, self.flags, self.spin_timeout, self.extra)

    def log_path(self, rank: int) -> str:
        return os.path.join(self.folder, f"arfused.{rank}.log")

    def sockets(self) -> List[str]:
        return [socket_path(self.folder, r) for r in range(self.world)]

    def start(self):
        env = dict(os.environ)
        if self.lib_dir:
            env["LD_LIBRARY_PATH"] = self.lib_dir + (":" + env["LD_LIBRARY_PATH"]
                                                     if env.get("LD_LIBRARY_PATH") else "")
        for r in range(self.world):
            with open(self.log_path(r), "w") as logf:
                self.procs.append(subprocess.Popen(self.argv(r), stdout=logf,
                                                   stderr=subprocess.STDOUT, env=env))

    def wait_sockets(self, timeout: float = 60.0):
        until = time.monotonic() + timeout
        for r in range(self.world):
            while not os.path.exists(socket_path(self.folder, r)):
                for i, p in enumerate(self.procs):
                    if p.poll() is not None:
                        raise SetupError(f"arfused rank {i} exited with {p.returncode} before "
                                         f"serving:\n{self.tail(i)}")
                if time.monotonic() > until:
                    raise SetupError(f"arfused rank {r} did not create its socket within "
                                     f"{timeout:g} s:\n{self.tail(r)}")
                time.sleep(0.05)

    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    def tail(self, rank: int, lines: int = 8) -> str:
        try:
            with open(self.log_path(rank), errors="replace") as f:
                got = f.read().splitlines()[-lines:]
        except OSError:
            return "(no log)"
        return "\n".join(f"  arfused.{rank}: {line[:300]}" for line in got)

    def stop(self, grace: float = 15.0):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        until = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


# =============================================================================================
# Rank side, no torch: connect, negotiate, decide, plans
# =============================================================================================

def connect_sidecar(socket: str, rank: int, world: int, op_timeout: float,
                    ready_timeout: float):
    """Opens the session with this rank's sidecar and waits for its workspace."""
    import arfuse

    client = arfuse.Client(socket, client_name=f"{PROG}-rank{rank}", timeout=op_timeout,
                           connect_timeout=ready_timeout)
    if client.rank != rank or client.world_size != world:
        client.close()
        raise SetupError(f"the sidecar at {socket} is rank {client.rank} of {client.world_size}, "
                         f"not rank {rank} of {world} (sockets out of order?)")
    info = client.wait_ready(ready_timeout)
    return client, info


def negotiate(client, want_mode: str, in_graph: bool, device: str, timeout: float):
    """Config.Negotiate (retried while the group has not decided)."""
    import grpc
    import arfuse

    mode = want_mode if device == "cuda" else "none"
    until = time.monotonic() + timeout
    while True:
        try:
            return client.negotiate(mode, fused_op_in_graph=in_graph and mode != "none")
        except arfuse.ArfuseError as e:
            if e.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > until:
                raise
            time.sleep(0.1)


def negotiation_key(neg) -> Tuple:
    """What every rank must agree on."""
    return (neg.backend, neg.fusion_enabled, neg.cuda_graph_mode, neg.data_plane)


@dataclasses.dataclass
class ExecPlan:
    """How this rank runs the per-layer op, after negotiation (same on every rank)."""
    fused: bool                 # through the sidecar at all
    prefill_plane: str          # "eager" (allreduce_fusion) or "framework"
    decode_graph: str           # "none", "piecewise" or "full"
    decode_plane: str           # "doorbell", "eager" or "framework"
    op_in_graph: bool           # the per-layer op is captured in the decode graph(s)
    notes: List[str] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        where = "inside the graph" if self.op_in_graph else (
            "between graph pieces" if self.decode_graph != "none" else "eagerly")
        plane = {"doorbell": "doorbell plane (ring kernel)", "eager": "eager plane (Execute RPC)",
                 "framework": "framework path (torch.distributed + RMSNorm)"}[self.decode_plane]
        graph = {"none": "no CUDA graph", "piecewise": "piecewise CUDA graphs",
                 "full": "one full CUDA graph"}[self.decode_graph]
        pre = ("eager plane (allreduce_fusion)" if self.prefill_plane == "eager"
               else "framework path")
        s = f"prefill: {pre}; decode: {graph}, per-layer op on the {plane} {where}"
        return s + "".join(f"\n    note: {n}" for n in self.notes)


def decide_execution(neg, device: str, want_mode: str, framework_capturable: bool,
                     doorbell_ok: Optional[bool] = None,
                     doorbell_reason: str = "") -> ExecPlan:
    """Honours the negotiation: the graph mode it allows and the data plane it names.

    neg: arfuse.Negotiation (group decision). framework_capturable: the framework's own
    collective can sit in a CUDA graph (NCCL; gloo cannot). doorbell_ok: whether every rank got
    its doorbell plans and rings (None: not tried)."""
    notes = []
    if device != "cuda":
        if neg.fusion_enabled:
            return ExecPlan(True, "eager", "none", "eager", False,
                            ["cpu: host-mode sidecars, no CUDA graphs"])
        return ExecPlan(False, "framework", "none", "framework", False,
                        [f"fusion off ({'; '.join(neg.reasons) or neg.backend}): framework path"])
    allowed = neg.cuda_graph_mode
    if not neg.fusion_enabled:
        notes.append("fusion off (" + ("; ".join(neg.reasons) or f"backend {neg.backend}") +
                     "): the framework path runs every op")
        if allowed == "none":
            return ExecPlan(False, "framework", "none", "framework", False, notes)
        if framework_capturable:
            return ExecPlan(False, "framework", allowed, "framework", True, notes)
        notes.append("the framework collective (gloo) cannot be captured: it runs between "
                     "graph pieces")
        return ExecPlan(False, "framework", "piecewise", "framework", False, notes)
    if allowed == "none":
        if want_mode != "none":
            notes.append(f"negotiation allows no CUDA graphs (asked for {want_mode})")
        return ExecPlan(True, "eager", "none", "eager", False, notes)
    if neg.data_plane == "doorbell":
        if doorbell_ok:
            return ExecPlan(True, "eager", allowed, "doorbell", True, notes)
        notes.append("doorbell plane negotiated but unavailable (" +
                     (doorbell_reason or "not set up") +
                     "): the fused op runs on the eager plane between graph pieces")
        return ExecPlan(True, "eager", "piecewise", "eager", False, notes)
    # Eager plane with graphs: a split op between graph pieces (never inside a graph).
    if allowed == "full":
        notes.append("eager plane: the full graph is split into pieces around the fused op")
    return ExecPlan(True, "eager", "piecewise", "eager", False, notes)


def site_opspec(cfg: ModelConfig, layout: PoolLayout, region, site: int, max_tokens: int):
    import arfuse

    def at(off):
        return arfuse.TensorLoc(region, off)

    return arfuse.OpSpec(pattern="allreduce_residual_rmsnorm", dtype=cfg.dtype,
                         hidden=cfg.hidden, max_tokens=max_tokens, eps=cfg.eps,
                         input=at(layout.offset("partial")),
                         residual_in=at(layout.offset("residual")),
                         residual_out=at(layout.offset("residual")),
                         norm_out=at(layout.offset("h")),
                         gamma=at(layout.gamma_offset(site + 1)))


def create_site_plans(client, cfg: ModelConfig, layout: PoolLayout, region, max_tokens: int,
                      doorbell: bool) -> list:
    """One plan per fused op of the forward (2 per layer), all over the same static tensors
    except the norm weight. On any failure the plans made so far are destroyed."""
    plans = []
    try:
        for site in range(cfg.sites):
            plan = client.create_plan(site_opspec(cfg, layout, region, site, max_tokens),
                                      doorbell=doorbell)
            plans.append(plan)
            if doorbell and plan.doorbell is None:
                raise SetupError("the sidecar made the plan but returned no doorbell")
    except BaseException:
        destroy_plans(client, plans)
        raise
    return plans


def destroy_plans(client, plans):
    for plan in plans:
        try:
            client.destroy_plan(plan)
        except Exception:
            pass


def try_doorbell(client, cfg: ModelConfig, layout: PoolLayout, region, ring_lib: Optional[str]):
    """Doorbell plans for the decode batch and their opened rings. Returns (plans, rings, None)
    or ([], [], reason) without raising: a missing doorbell plane is a fallback, not an error."""
    import arfuse
    from arfuse import ring as ringmod

    plans, rings = [], []
    try:
        lib = ringmod.load_library(ring_lib)
    except OSError as e:
        return [], [], f"libarfuse_ring.so did not load ({e}); set --ring-lib or ARFUSE_RING_LIB"
    try:
        plans = create_site_plans(client, cfg, layout, region, cfg.batch, doorbell=True)
        for i, plan in enumerate(plans):
            rings.append(ringmod.DoorbellRing.open(plan.doorbell, lib=lib, name=f"site{i}"))
        return plans, rings, None
    except (arfuse.ArfuseError, ringmod.RingError, SetupError) as e:
        if isinstance(e, arfuse.SidecarLost):
            raise
        for r in rings:
            try:
                r.close()
            except Exception:
                pass
        destroy_plans(client, plans)
        return [], [], f"{type(e).__name__}: {e}"


def describe_failure(e: BaseException, rank: int, socket: str, client=None) -> str:
    """One line naming the rank and what failed."""
    import arfuse

    lost = client.session_lost if client is not None else None
    if isinstance(e, arfuse.SidecarLost) or lost:
        reason = e.reason if isinstance(e, arfuse.SidecarLost) else lost
        return f"rank {rank}: its arfused sidecar ({socket}) is gone: {reason}"
    msg = f"rank {rank}: {type(e).__name__}: {e}" if not isinstance(e, arfuse.ArfuseError) \
        else f"rank {rank}: fused op failed: {e}"
    if client is not None and isinstance(e, (arfuse.ArfuseError, RuntimeError)):
        try:
            info = client.workspace_info(timeout=2.0)
            from arfuse import common_pb2
            state = common_pb2.WorkspaceState.Name(info.state).replace("WORKSPACE_STATE_", "")
            msg += f" [sidecar rank {rank}: workspace {state}: {info.reason}]"
        except Exception:
            pass
    return msg


class Watchdog:
    """Stops this rank at once, naming it, when its sidecar's session ends (killed, crashed)."""

    def __init__(self, client, rank: int, socket: str, on_fatal):
        self.client, self.rank, self.socket, self.on_fatal = client, rank, socket, on_fatal
        self.stopping = False
        threading.Thread(target=self._run, daemon=True, name="tp_decode-watchdog").start()

    def _run(self):
        reason = self.client.wait_session_lost(None)
        if reason and not self.stopping:
            self.on_fatal(f"rank {self.rank}: its arfused sidecar ({self.socket}) is gone: "
                          f"{reason}; stopping")


# =============================================================================================
# Setup-only rank (no torch): negotiation, pool, plans, eager ops on known data (host mode)
# =============================================================================================

def f32_to_bf16(x: float) -> int:
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def bf16_to_f32(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (u & 0xFFFF) << 16))[0]


def setup_value(rank: int, i: int, site: int) -> float:
    """Inputs exact in bf16 (multiples of 1/8 in [-1, 1])."""
    return float((i * 7 + rank * 13 + site * 5) % 17 - 8) / 8.0


def setup_residual(i: int) -> float:
    return float(i % 5 - 2) / 4.0


def setup_gamma(k: int, site: int) -> float:
    return 0.5 + float((k + site) % 9) / 8.0


def _write(view, dtype: str, i: int, v: float):
    view[i] = f32_to_bf16(v) if dtype == "bf16" else v


def _read(view, dtype: str, i: int) -> float:
    return bf16_to_f32(view[i]) if dtype == "bf16" else float(view[i])


def run_setup_only(ctx) -> dict:
    """ctx: RankContext. Returns the checks dict; raises on failure."""
    import arfuse

    cfg, layout, rank, world = ctx.cfg, ctx.layout, ctx.rank, ctx.world
    client = ctx.client
    result = {"plans": 0, "ops": 0, "checked_values": 0}
    if ctx.device == "cuda":
        buf = arfuse.CudaBuffer(layout.total, ctx.gpu)
    else:
        buf = arfuse.HostShmBuffer(layout.total)
    ctx.buffers.append(buf)
    ws = arfuse.FusionWorkspace(client)
    region = ws.register(buf, f"{PROG}-pool")
    doorbell_ok, doorbell_reason = None, ""
    neg = ctx.neg
    if neg.fusion_enabled and neg.data_plane == "doorbell" and ctx.device == "cuda":
        plans, rings, doorbell_reason = try_doorbell(client, cfg, layout, region, ctx.ring_lib)
        doorbell_ok = doorbell_reason is None
        for r in rings:
            r.close()
        destroy_plans(client, plans)
    ex = decide_execution(neg, ctx.device, ctx.want_mode, framework_capturable=False,
                          doorbell_ok=doorbell_ok, doorbell_reason=doorbell_reason or "")
    ctx.report_execution(ex)
    # Every fused op of the forward as a plan: the sidecar validates each one's tensors once.
    plans = create_site_plans(client, cfg, layout, region, cfg.max_tokens, doorbell=False)
    result["plans"] = len(plans)
    log(f"{len(plans)} plans validated (path: {plans[0].reason})", rank)
    destroy_plans(client, plans)
    if not ex.fused:
        log("fusion off: the framework path would run every op (needs torch; not exercised in "
            "--setup-only)", rank)
        return result
    if ctx.device == "cuda":
        log("cuda --setup-only stops here (filling device memory needs torch)", rank)
        return result
    H, n, dt = cfg.hidden, cfg.batch, cfg.dtype
    fmt = dt if dt in ("bf16", "fp32") else None
    if fmt is None:
        log("--setup-only checks values for bf16 and fp32 only", rank)
        return result
    x = buf.view(dt, n * H, layout.offset("partial"))
    res = buf.view(dt, n * H, layout.offset("residual"))
    y = buf.view(dt, n * H, layout.offset("h"))
    views = [x, res, y]
    try:
        kill = ctx.inject
        for step in range(cfg.steps):
            if kill is not None and kill[0] == rank and step == kill[1]:
                ctx.kill_own_sidecar(step)
            for site in range(cfg.sites):
                verify = step == 0
                g = buf.view(dt, H, layout.gamma_offset(site + 1))
                views.append(g)
                if verify:
                    for i in range(n * H):
                        _write(x, dt, i, setup_value(rank, i, site))
                        _write(res, dt, i, setup_residual(i))
                    for k in range(H):
                        _write(g, dt, k, setup_gamma(k, site))
                out = arfuse.allreduce_fusion(input=x.reshape(n, H), workspace=ws,
                                              residual_in=res, residual_out=res, norm_out=y,
                                              rms_gamma=g, rms_eps=cfg.eps,
                                              timeout=ctx.op_timeout)
                if out is None:
                    raise SetupError(f"allreduce_fusion returned None (fusion unavailable) at "
                                     f"step {step}, {site_name(cfg, site)}")
                result["ops"] += 1
                if verify:
                    result["checked_values"] += check_setup_values(cfg, world, site, res, y, g)
    finally:
        for v in views:
            v.release()
    log(f"{result['ops']} fused ops ran; {result['checked_values']} values checked against the "
        "CPU reference", rank)
    return result


def check_setup_values(cfg, world, site, res, y, g) -> int:
    H, n, dt = cfg.hidden, cfg.batch, cfg.dtype
    tol = 2.0 ** -6 if dt == "bf16" else 1e-5
    for t in range(n):
        s = []
        for k in range(H):
            i = t * H + k
            v = sum(setup_value(r, i, site) for r in range(world)) + setup_residual(i)
            got = _read(res, dt, i)
            if got != v:
                raise SetupError(f"{site_name(cfg, site)}: residual_out[{t},{k}] = {got}, "
                                 f"expected {v}")
            s.append(v)
        inv = 1.0 / math.sqrt(sum(v * v for v in s) / H + cfg.eps)
        for k in range(H):
            want = s[k] * inv * _read(g, dt, k)
            got = _read(y, dt, t * H + k)
            if abs(got - want) > tol * max(1.0, abs(want)):
                raise SetupError(f"{site_name(cfg, site)}: norm_out[{t},{k}] = {got}, expected "
                                 f"{want}")
    return 2 * n * H


# =============================================================================================
# Rank process
# =============================================================================================

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
        self.ring_lib = args.ring_lib or os.environ.get("ARFUSE_RING_LIB")
        self.workdir = args.workdir
        self.inject = parse_inject(args.inject_kill) if args.inject_kill else None
        self.sidecar_pids = ([int(p) for p in args.sidecar_pids.split(",")]
                             if args.sidecar_pids else [])
        self.client = None
        self.neg = None
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


def gpu_count() -> int:
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return len([v for v in vis.split(",") if v.strip() and v.strip() != "-1"])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        return len([line for line in out.stdout.splitlines() if line.startswith("GPU ")])
    except (OSError, subprocess.SubprocessError):
        return 0


def rank_main(args, rank: int, world: int, sockets: List[str]):
    ctx = RankContext(args, rank, world, sockets)
    try:
        check_world(args, world)
        client, info = connect_sidecar(ctx.socket, rank, world, args.op_timeout,
                                       args.ready_timeout)
        ctx.client = client
        ctx.watchdog = Watchdog(client, rank, ctx.socket, lambda m: ctx.finish(3, m))
        neg = negotiate(client, ctx.want_mode, args.fused_op_in_graph, ctx.device,
                        args.ready_timeout)
        ctx.neg = neg
        ctx.result["negotiation"] = dataclasses.asdict(neg)
        log(f"negotiated (asked cuda_graph_mode={ctx.want_mode}, fused op in graph="
            f"{args.fused_op_in_graph and ctx.want_mode != 'none'}): {neg.summary()}", rank)
        for w in neg.warnings:
            log(f"  warning: {w}", rank)
        for r in neg.reasons:
            log(f"  reason: {r}", rank)
        if ctx.device == "cuda" and neg.device == "cuda" and not neg.mps_detected:
            log("  warning: the sidecar does not see MPS: every hop between this process and "
                "its sidecar costs a GPU context switch (docs/mps.md)", rank)
        if args.setup_only:
            ctx.result["setup"] = run_setup_only(ctx)
            ctx.result["status"] = "pass"
            log("PASS (setup-only)", rank)
            ctx.finish(0)
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
                "dtype", "seed", "batch", "prompt_len", "steps", "cuda_graph",
                "fused_op_in_graph", "framework_graph", "check", "perf_iters", "perf_warmup",
                "op_timeout", "ready_timeout", "pg_timeout", "ring_lib", "gpu_count")
FORWARD_FLAGS = ("strict_tokens", "perf", "setup_only")


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
    # NVLink multicast stays off (design.md §2); the example needs none of it.
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


def judge_normal(args, scenario: str, results: Dict[int, dict], verdict: dict):
    problems = verdict["problems"]
    for r, res in results.items():
        if res.get("exit_code") != 0 or res.get("status") != "pass":
            problems.append(f"rank {r}: {res.get('status')} (exit {res.get('exit_code')})"
                            + (f": {res['error']}" if res.get("error") else ""))
            for c in res.get("checks", []):
                if not c.get("ok"):
                    problems.append(f"rank {r}: check {c.get('name')}: {c.get('message')}")
    toks = {r: res.get("tokens") for r, res in results.items() if res.get("tokens") is not None}
    if len(toks) > 1 and len({json.dumps(t) for t in toks.values()}) != 1:
        problems.append("ranks decoded different tokens")
    if scenario == "off":
        for r, res in results.items():
            ex = res.get("execution") or {}
            if ex.get("fused"):
                problems.append(f"rank {r}: fusion still on with "
                                "--enforce-disable-flashinfer-allreduce-fusion")
    verdict["ok"] = not problems


def judge_kill(args, folder: str, results: Dict[int, dict], procs: RankProcs, verdict: dict):
    problems = verdict["problems"]
    try:
        with open(os.path.join(folder, "kill.json")) as f:
            kill = json.load(f)
    except (OSError, ValueError):
        problems.append("the fault was never injected (the run failed or ended before it)")
        for r, res in results.items():
            if res.get("error"):
                problems.append(f"rank {r}: {res['error']}")
        verdict["ok"] = False
        return
    verdict["kill"] = kill
    killed = kill["rank"]
    bound = args.op_timeout + 10.0
    stops = {}
    for r, res in results.items():
        code = res.get("exit_code")
        at = procs.exit_at.get(r)
        stops[r] = round(at - kill["time"], 2) if at else None
        if code == 0:
            problems.append(f"rank {r} exited 0 although rank {killed}'s sidecar was killed")
        elif code is None or code < 0:
            problems.append(f"rank {r} was killed by the launcher (did not stop by itself)")
        if not res.get("error"):
            problems.append(f"rank {r} stopped without an error message")
        if stops[r] is None or stops[r] > bound:
            problems.append(f"rank {r} stopped {stops[r]} s after the kill (bound: op deadline "
                            f"{args.op_timeout:g} s + 10 s)")
    named = [r for r, res in results.items() if f"rank {killed}" in (res.get("error") or "")]
    if killed not in named:
        problems.append(f"rank {killed}'s own error does not name it")
    verdict["stop_seconds"] = stops
    verdict["ok"] = not problems


def print_perf(perf: dict, cfg_line: str):
    if not perf or not perf.get("rows"):
        return
    print(f"\n{PROG}: decode step ({cfg_line})")
    print(f"  {'path':<34} {'graph':<10} {'plane':<10} {'p50 ms':>8} {'p90 ms':>8} "
          f"{'tok/s':>9}")
    for row in perf["rows"]:
        print(f"  {row['name']:<34} {row['graph']:<10} {row['plane']:<10} {row['p50_ms']:>8.3f} "
              f"{row['p90_ms']:>8.3f} {row['tokens_per_s']:>9.0f}")
    for line in perf.get("summary", []):
        print(f"  {line}")
    print()


def summarize(args, verdicts: List[dict], device: str, gpus: int) -> bool:
    all_ok = True
    cfg = model_config(args)
    for v in verdicts:
        ok = v["ok"]
        all_ok &= ok
        detail = ""
        r0 = v["ranks"].get(0, {})
        if v["scenario"] == "kill" and "kill" in v:
            errs = " | ".join((res.get("error") or f"rank {r}: no error")[:240]
                              for r, res in v["ranks"].items())
            detail = (f"rank {v['kill']['rank']}'s sidecar killed before step "
                      f"{v['kill']['step']}; ranks stopped after {v.get('stop_seconds')} s "
                      f"(op deadline {args.op_timeout:g} s); {errs}")
        elif ok:
            checks = r0.get("checks", [])
            detail = "; ".join(f"{c['name']}: {c['message']}" for c in checks)
            if not detail and r0.get("setup"):
                detail = f"setup-only: {r0['setup']}"
        print(f"{PROG}: scenario {v['scenario']}: {'PASS' if ok else 'FAIL'} "
              f"({v.get('seconds')} s){': ' + detail if detail else ''}")
        for p in v["problems"]:
            print(f"{PROG}:   problem: {p}")
        for r, tail in (v.get("sidecar_logs") or {}).items():
            print(tail)
        ex = r0.get("execution")
        neg = r0.get("negotiation")
        if neg:
            print(f"{PROG}:   negotiated: backend={neg['backend']} fusion="
                  f"{'on' if neg['fusion_enabled'] else 'off'} cuda_graph_mode="
                  f"{neg['cuda_graph_mode']} data_plane={neg['data_plane']} "
                  f"mps={neg.get('mps_detected')}")
        if ex:
            print(f"{PROG}:   ran: decode graph={ex['decode_graph']} plane={ex['decode_plane']} "
                  f"op_in_graph={ex['op_in_graph']}")
        if r0.get("perf"):
            print_perf(r0["perf"], f"batch {cfg.batch}, {cfg.layers} layers, hidden "
                                   f"{cfg.hidden}, tp {args.ranks}, {device}"
                                   + (f" x{gpus}" if device == "cuda" else ""))
    print(f"{PROG}: {'PASS' if all_ok else 'FAIL'}")
    return all_ok


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
    sys.modules.setdefault("tp_decode", sys.modules["__main__"])  # tp_model imports it by name
    sys.exit(main())
