"""What the tests of tests/deploy that run things share: the built binaries, host-mode sidecars
started as processes, and the rule for a missing tool (a failure in CI, a skip elsewhere)."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = (REPO / "VERSION").read_text().strip()
READY_LINE = "arfused ready to accept"


def sh(argv, **kw) -> subprocess.CompletedProcess:
    """Runs argv (paths allowed) to completion; fails the test, with its output, unless it exits 0."""
    out = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{' '.join(map(str, argv))} exited {out.returncode}:\n" \
                                f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def build_dir() -> Path:
    return Path(os.environ.get("ARFUSE_BUILD_DIR", REPO / "build"))


def missing(what: str, hint: str):
    """Fails in CI (where scripts/setup provides it), skips elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing: {hint}")
    pytest.skip(f"{what} is missing ({hint})")


def tool(name: str, hint: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(name, hint)
    return path


def binary(relative: str) -> Path:
    """A built binary, e.g. "server/daemon/arfused"; missing() when it is not built."""
    path = build_dir() / relative
    if not (path.is_file() and os.access(path, os.X_OK)):
        missing(str(path), "build it first (scripts/setup builds build/)")
    return path


class Sidecar:
    """One arfused process; its output goes to `log`. Stops on exit from the `with` block."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None, cwd: Path | None = None):
        self.argv, self.log = argv, log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, env=env,
                                     cwd=cwd, stdin=subprocess.DEVNULL)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.text():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.argv[0]} exited {self.proc.returncode} before "
                                     f"'{needle}':\n{self.text()[-4000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no '{needle}' from {self.argv[0]} within {timeout} s:\n"
                             f"{self.text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def host_sidecar(directory: Path, *extra: str) -> Sidecar:
    """One host-mode arfused of a group of one, its socket directory/arfused.sock, its log
    directory/arfused.log; wait_for() what the test needs."""
    return Sidecar([str(binary("server/daemon/arfused")), "--device=host",
                    f"--socket={directory / 'arfused.sock'}", "--health-port=0", "--world-size=1",
                    "--max-tokens=16", "--hidden=256", *extra], directory / "arfused.log")


def _one_op(socket: Path):
    """One eager op through the checkout's Python client, so that every op series exists."""
    import sys

    sys.path.insert(0, str(REPO / "client" / "python"))
    try:
        import arfuse
    except ImportError as e:
        missing("the Python client's dependencies", str(e))
    hidden, tokens, f32 = 256, 4, 4
    with arfuse.Client(f"unix:{socket}") as c:
        ws = arfuse.FusionWorkspace(c)
        buf = arfuse.HostShmBuffer(3 * tokens * hidden * f32 + hidden * f32)
        ws.register(buf, "tensors")
        x = buf.view("fp32", tokens * hidden, 0)
        res = buf.view("fp32", tokens * hidden, tokens * hidden * f32)
        y = buf.view("fp32", tokens * hidden, 2 * tokens * hidden * f32)
        g = buf.view("fp32", hidden, 3 * tokens * hidden * f32)
        for i in range(hidden):
            g[i] = 1.0
        xi = x.reshape(tokens, hidden)
        assert arfuse.allreduce_fusion(input=xi, workspace=ws, residual_in=res,
                                       residual_out=res, norm_out=y, rms_gamma=g) is y
        for v in (xi, x, res, y, g):
            v.release()
        buf.close()


def scrape_after_one_op(directory: Path) -> str:
    """/metrics of rank 0 of two host-mode sidecars (sockets and logs in `directory`) after one
    eager op on both, so that every op series exists."""
    import re
    import threading
    import urllib.request

    arfused = binary("server/daemon/arfused")
    socks = [directory / "arfused.sock", directory / "arfused.sock.rank1"]
    sidecars = [Sidecar([str(arfused), "--device=host", "--sm=90", f"--socket={socks[r]}",
                         f"--rank={r}", "--world-size=2", f"--peer-dir={directory}",
                         "--health-port=0", "--metrics-port=0", "--max-tokens=16",
                         "--hidden=256", "--dtype=fp32",
                         "--flashinfer-allreduce-fusion-backend=trtllm"],
                        directory / f"arfused.{r}.log")
                for r in range(2)]
    try:
        for s in sidecars:
            s.wait_for("event=ready")
        errors = []

        def rank(r):
            try:
                _one_op(socks[r])
            except BaseException as e:  # noqa: B902 - reported below
                errors.append(e)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        port = re.search(r"event=listening .*metrics_port=(\d+)", sidecars[0].text()).group(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()
    finally:
        for s in sidecars:
            s.stop()
