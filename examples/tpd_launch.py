"""tp_decode's launcher (no torch): the sidecars and the rank processes of each scenario, their
output echoed with a rank prefix, the hang and failure deadlines, the verdicts and the JSON
report. A rank process is tp_decode.py itself, started with --rank.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence

from tpd_args import check_world, scenario_list
from tpd_common import HERE, PKG_DIR, PROG, SetupError, UsageError, gpu_count, log, model_config
from tpd_sidecars import SidecarGroup, arfused_lib_dir, find_arfused, fusion_flags
from tpd_verdicts import judge_kill, judge_normal, summarize


FORWARD_OPTS = ("device", "layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "eps",
                "dtype", "seed", "batch", "prompt_len", "steps", "plane", "cuda_graph",
                "fused_op_in_graph", "framework_graph", "check", "perf_iters", "perf_warmup",
                "op_timeout", "ready_timeout", "pg_timeout", "ring_lib", "client_lib",
                "gpu_count", "oracle", "tie_tol", "oracle_slack", "oracle_hf")
FORWARD_FLAGS = ("strict_tokens", "perf", "setup_only", "allow_eager_decode")


def rank_argv(args, rank: int, world: int, sockets: Sequence[str], workdir: str, scenario: str,
              dist_init: str, sidecar_pids: Sequence[int] = (),
              inject: Optional[str] = None) -> List[str]:
    argv = [sys.executable, str(HERE / "tp_decode.py"), "--rank", str(rank),
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
