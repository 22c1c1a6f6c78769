"""Fixtures: real arfused sidecars in host mode (--device=host), one per rank.

The daemon is found through $ARFUSE_ARFUSED, else build*/server/daemon/arfused under the
repository; tests skip with the reason when there is none.

The package searches only itself and the system's library path for its native libraries
(arfuse/_native.py), so this file names the build tree's copies through the package's variables
when they are unset: ARFUSE_CLIENT_LIB (build*/client/instream/libarfuse_client.so) and
ARFUSE_RING_LIB (build*/client/ring/libarfuse_ring.so), build/ first, else the newest. Child
processes the tests start inherit them.
"""
import glob
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client" / "python"))


def find_arfused():
    env = os.environ.get("ARFUSE_ARFUSED")
    if env:
        return env if os.access(env, os.X_OK) else None
    # build/ is what scripts/setup builds (and CI tests); else the most recently built daemon of
    # any build directory of this checkout.
    main = REPO / "build" / "server" / "daemon" / "arfused"
    if os.access(main, os.X_OK):
        return str(main)
    found = [pathlib.Path(p) for p in glob.glob(str(REPO / "build*/server/daemon/arfused"))
             if os.access(p, os.X_OK)]
    if not found:
        return None
    return str(max(found, key=lambda p: p.stat().st_mtime))


def find_build_library(filename, subdir):
    """A native library of this checkout's build: build/<subdir>/ (what scripts/setup and CI
    build) first, else the most recently built build*/<subdir>/; None when there is none."""
    main = REPO / "build" / subdir / filename
    if main.is_file():
        return str(main)
    found = [p for p in glob.glob(str(REPO / "build*" / subdir / filename)) if os.path.isfile(p)]
    return max(found, key=os.path.getmtime) if found else None


def _name_build_libraries():
    for var, filename, subdir in (("ARFUSE_CLIENT_LIB", "libarfuse_client.so", "client/instream"),
                                  ("ARFUSE_RING_LIB", "libarfuse_ring.so", "client/ring")):
        if not os.environ.get(var):
            path = find_build_library(filename, subdir)
            if path:
                os.environ[var] = path


_name_build_libraries()


class Group:
    """N host-mode sidecars of one group, stopped (SIGTERM, then SIGKILL) at the end."""

    def __init__(self, binary, world_size, start_ranks=None, hidden=1024, max_tokens=64,
                 dtype="fp32", extra_args=()):
        self.dir = tempfile.mkdtemp(prefix="arfuse-pytest-")
        os.makedirs(os.path.join(self.dir, "peers"))
        self.world_size = world_size
        self.procs = []
        for r in (start_ranks if start_ranks is not None else range(world_size)):
            log = open(os.path.join(self.dir, f"arfused.{r}.log"), "w")
            self.procs.append(subprocess.Popen(
                [binary, "--device=host", f"--rank={r}", f"--world-size={world_size}",
                 f"--peer-dir={self.dir}/peers", f"--socket={self.socket(r)}",
                 "--health-port=0", f"--hidden={hidden}", f"--max-tokens={max_tokens}",
                 f"--dtype={dtype}", "--peer-timeout=30", "--log-level=warn",
                 # Decide as an H200 group with fusion on, so the fused path is what is tested.
                 "--sm=90", "--flashinfer-allreduce-fusion-backend=auto", *extra_args],
                stdout=log, stderr=subprocess.STDOUT))
        for r in (start_ranks if start_ranks is not None else range(world_size)):
            self._wait_socket(r)

    def socket(self, rank):
        return os.path.join(self.dir, f"rank{rank}.sock")

    def _wait_socket(self, rank, timeout=60):
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            if os.path.exists(self.socket(rank)):
                return
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"arfused exited with {p.returncode}; logs in {self.dir}")
            time.sleep(0.05)
        raise RuntimeError(f"arfused rank {rank} did not create its socket; logs in {self.dir}")

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def arfused():
    binary = find_arfused()
    if binary is None:
        # In CI the daemon must exist: a skip there would hide a broken build.
        if os.environ.get("CI"):
            pytest.fail("arfused is not built (build/server/daemon/arfused)")
        pytest.skip("arfused is not built (build/server/daemon/arfused; or set ARFUSE_ARFUSED)")
    return binary


@pytest.fixture
def real_lib():
    """The built libarfuse_client, loaded (a failure in CI, where it must be built)."""
    from arfuse import instream
    path = instream.find_client_library()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("libarfuse_client.so is not built (target arfuse_instream)")
        pytest.skip("libarfuse_client.so is not built (target arfuse_instream; or set "
                    "ARFUSE_CLIENT_LIB)")
    return instream.load_library(path)


@pytest.fixture
def arfusectl(arfused):
    """The arfusectl built beside arfused."""
    path = pathlib.Path(arfused).parents[2] / "tools" / "arfusectl" / "arfusectl"
    if not os.access(path, os.X_OK):
        pytest.skip(f"arfusectl is not built next to {arfused}")
    return str(path)


def arfusectl_info(arfusectl, socket):
    """`arfusectl info --json` of one sidecar. The negotiation may be refused in host mode (exit
    1); the workspace part is there anyway."""
    import json
    out = subprocess.run([arfusectl, "info", "--addr", f"unix:{socket}", "--json"],
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)


@pytest.fixture
def group2(arfused):
    g = Group(arfused, 2)
    yield g
    g.stop()


@pytest.fixture
def lonely(arfused):
    """Rank 0 of a group of 2 whose rank 1 never comes: the workspace never gets ready."""
    g = Group(arfused, 2, start_ranks=[0])
    yield g
    g.stop()
