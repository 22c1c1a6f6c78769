"""tp_decode's sidecars (no torch): finding and starting arfused, the fusion flags as SGLang
spells them, connecting a rank to its sidecar, the negotiation, and noticing a sidecar that is
gone.
"""
import glob
import os
import pathlib
import shutil
import subprocess
import threading
import time
from typing import List, Optional, Sequence, Tuple

from tpd_common import PROG, REPO, ModelConfig, SetupError


def find_arfused(explicit: Optional[str] = None) -> Optional[str]:
    for cand in (explicit, os.environ.get("ARFUSE_ARFUSED")):
        if cand:
            return cand if os.access(cand, os.X_OK) else None
    found = [p for p in glob.glob(str(REPO / "build*" / "server" / "daemon" / "arfused"))
             if os.access(p, os.X_OK)]
    if found:
        return max(found, key=os.path.getmtime)
    return shutil.which("arfused")


def checkout_library(filename: str, subdir: str) -> Optional[str]:
    """A native library built in this checkout (build/<subdir>/ first, else the newest
    build*/<subdir>/), for the examples' defaults; the package itself searches only its own
    folder and the system's library path."""
    main = REPO / "build" / subdir / filename
    if main.is_file():
        return str(main)
    found = [p for p in glob.glob(str(REPO / "build*" / subdir / filename)) if os.path.isfile(p)]
    return max(found, key=os.path.getmtime) if found else None


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
    """N arfused processes of one group (like tools/demo/demo.cc starts them)."""

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


PLANES = ("instream", "doorbell", "eager")


def capture_request(plane: str, want_mode: str, in_graph: bool, device: str) -> dict:
    """What this client asks Config.Negotiate for, by the plane it wants: instream says it
    loads the sidecar's kernels (libarfuse_client); doorbell asks for the op inside graphs;
    eager asks for it outside them. Host mode (cpu) has no CUDA graphs."""
    mode = want_mode if device == "cuda" else "none"
    return {"cuda_graph_mode": mode,
            "fused_op_in_graph": in_graph and mode != "none" and plane != "eager",
            "client_loads_kernels": plane == "instream"}


def negotiate(client, want_mode: str, in_graph: bool, device: str, timeout: float,
              plane: str = "instream", call_sites: int = 0):
    """Config.Negotiate (retried while the group has not decided). call_sites: the fused-op
    sites the model plans (2 per layer), so a plane that cannot serve them is not offered."""
    import grpc
    import arfuse

    req = capture_request(plane, want_mode, in_graph, device)
    until = time.monotonic() + timeout
    while True:
        try:
            return client.negotiate(req["cuda_graph_mode"],
                                    fused_op_in_graph=req["fused_op_in_graph"],
                                    client_loads_kernels=req["client_loads_kernels"],
                                    call_sites=call_sites)
        except arfuse.ArfuseError as e:
            if e.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > until:
                raise
            time.sleep(0.1)


def negotiation_key(neg) -> Tuple:
    """What every rank must agree on."""
    return (neg.backend, neg.fusion_enabled, neg.cuda_graph_mode, neg.data_plane)


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

