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

The parts: tp_decode.py (the rank process, main), tpd_args.py (arguments), tpd_launch.py (the
launcher: sidecars and rank processes per scenario), tpd_common.py (geometry, pool layout,
logging), tpd_sidecars.py (starting and reaching sidecars, negotiation), tpd_planes.py (what runs
where, plans, rings, attach, setup-only), tpd_verdicts.py (judging and printing), tp_model.py
(the run of a model rank; imported only by model ranks) over tpm_layers.py (the torch model) and
tpm_comms.py (the per-plane ops), tp_oracle.py (the oracle's torch side). None imports
tp_decode.py.
Exit status: 0 when every scenario passed, 1 otherwise, 2 for bad arguments.
"""
import dataclasses
import json
import os
import pathlib
import signal
import sys
import threading
import time
from typing import List, Optional, Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from tpd_args import (SCENARIOS, build_parser, check_world, parse_args,  # noqa: E402
                      parse_inject, scenario_list, validate_args)
from tpd_common import (DTYPE_BYTES, HERE, PKG_DIR, PROG, REPO, ModelConfig,  # noqa: E402
                        PoolLayout, SetupError, UsageError, gpu_count, log, model_config,
                        pool_layout, site_name)
from tpd_launch import (FORWARD_FLAGS, FORWARD_OPTS, Interrupted, RankProcs,  # noqa: E402
                        launch, rank_argv, rank_env, run_scenario)
from tpd_planes import (EAGER_BANNER, ExecPlan, create_site_plans,  # noqa: E402
                        decide_execution, destroy_plans, eager_decode_check, run_setup_only,
                        site_opspec, try_doorbell, try_instream)
from tpd_sidecars import (PLANES, SidecarGroup, Watchdog, arfused_lib_dir,  # noqa: E402
                          capture_request, checkout_library, connect_sidecar, describe_failure,
                          find_arfused, fusion_flags, negotiate, negotiation_key, sidecar_argv,
                          socket_path)
from tpd_verdicts import judge_kill, judge_normal, print_perf, summarize  # noqa: E402

# The names the tests and oracle.py reach through this module, wherever they live.
__all__ = [
    "SCENARIOS", "build_parser", "check_world", "parse_args", "parse_inject", "scenario_list",
    "validate_args",
    "DTYPE_BYTES", "HERE", "PKG_DIR", "PROG", "REPO", "ModelConfig", "PoolLayout", "SetupError",
    "UsageError", "gpu_count", "log", "model_config", "pool_layout", "site_name",
    "FORWARD_FLAGS", "FORWARD_OPTS", "Interrupted", "RankProcs", "launch", "rank_argv",
    "rank_env", "run_scenario",
    "EAGER_BANNER", "ExecPlan", "create_site_plans", "decide_execution", "destroy_plans",
    "eager_decode_check", "run_setup_only", "site_opspec", "try_doorbell", "try_instream",
    "PLANES", "SidecarGroup", "Watchdog", "arfused_lib_dir", "capture_request",
    "checkout_library", "connect_sidecar", "describe_failure", "find_arfused", "fusion_flags",
    "negotiate", "negotiation_key", "sidecar_argv", "socket_path",
    "judge_kill", "judge_normal", "print_perf", "summarize",
    "RankContext", "rank_main", "main",
]


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
