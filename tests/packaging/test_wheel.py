"""The wheel as a user gets it (client/python/setup.py): built from this build's libraries, its
platform tag checked with auditwheel (PyPI's), installed into a fresh virtual environment with
only its declared dependencies (from PyPI), and used from there: an in-stream attach to two
host-mode sidecars and one fused op, with the library found inside the installed package
(arfuse/_lib/), not in a build tree.

Environment (tests/packaging/CMakeLists.txt sets it): ARFUSE_BUILD_DIR (the build whose libraries
the wheel carries), ARFUSE_ARFUSED (the sidecar), ARFUSE_PACKAGING_WORK (a folder under the build
for the wheel and the virtual environments; emptied first). Needs network access to PyPI."""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("ARFUSE_BUILD_DIR", REPO / "build")).resolve()
WORK = pathlib.Path(os.environ.get("ARFUSE_PACKAGING_WORK", BUILD / "packaging")).resolve()
ARFUSED = os.environ.get("ARFUSE_ARFUSED", str(BUILD / "server" / "daemon" / "arfused"))
CLIENT_LIB = BUILD / "client" / "instream" / "libarfuse_client.so"
RING_LIB = BUILD / "client" / "ring" / "libarfuse_ring.so"


def run(cmd, **kw):
    print("+", " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, text=True, **kw)


def clean_env():
    """The environment without anything that points at this checkout or its build."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ARFUSE_", "PYTHON", "VIRTUAL_ENV", "PIP_"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def venv(name):
    path = WORK / name
    run([sys.executable, "-m", "venv", "--clear", path])
    return path / "bin" / "python"


@pytest.fixture(scope="module")
def wheel():
    if not CLIENT_LIB.exists():
        pytest.fail(f"{CLIENT_LIB} is not built (target arfuse_instream)")
    shutil.rmtree(WORK, ignore_errors=True)
    (WORK / "dist").mkdir(parents=True)
    env = dict(os.environ, ARFUSE_BUILD_DIR=str(BUILD))
    env.pop("ARFUSE_NATIVE_LIBS", None)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
         WORK / "dist", REPO / "client" / "python"], env=env, cwd=REPO)
    (whl,) = (WORK / "dist").glob("arfuse-*.whl")
    return whl


def test_wheel_carries_the_libraries_of_this_build(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "arfuse/_lib/libarfuse_client.so.0.1" in names, names
    if RING_LIB.exists():
        assert "arfuse/_lib/libarfuse_ring.so.0.1" in names, names


def test_wheel_tag_is_what_auditwheel_finds(wheel):
    """The wheel's manylinux tag is exactly the one its libraries' symbol versions and NEEDED
    entries allow, as auditwheel judges it: not newer (it would shut out machines it runs on) and
    not older (pip would install it where it cannot load)."""
    py = venv("venv-auditwheel")
    run([py, "-m", "pip", "install", "-q", "auditwheel"], env=clean_env())
    shown = run([py, "-m", "auditwheel", "show", wheel], capture_output=True,
                env=clean_env()).stdout
    print(shown)
    text = " ".join(shown.split())
    m = re.search(r'This constrains the platform tag to "([^"]+)"', text)
    assert m, text
    tag = wheel.name[:-len(".whl")].split("-")[-1]
    assert tag.startswith("manylinux_2_"), tag
    assert tag == m.group(1), f"wheel tagged {tag}, auditwheel allows {m.group(1)}"
    assert "external shared libraries are required" not in text, text


class Sidecars:
    """Two host-mode sidecars of one group (as tests/python/conftest.py's Group starts them)."""

    def __init__(self, hidden=256, max_tokens=16):
        self.dir = tempfile.mkdtemp(prefix="arfuse-wheel-")
        os.makedirs(os.path.join(self.dir, "peers"))
        self.procs = []
        for r in range(2):
            log = open(os.path.join(self.dir, f"arfused.{r}.log"), "w")
            self.procs.append(subprocess.Popen(
                [ARFUSED, "--device=host", f"--rank={r}", "--world-size=2",
                 f"--peer-dir={self.dir}/peers", f"--socket={self.socket(r)}", "--health-port=0",
                 f"--hidden={hidden}", f"--max-tokens={max_tokens}", "--dtype=fp32",
                 "--peer-timeout=30", "--log-level=warn", "--sm=90",
                 "--flashinfer-allreduce-fusion-backend=auto"],
                stdout=log, stderr=subprocess.STDOUT))
        until = time.monotonic() + 60
        while not all(os.path.exists(self.socket(r)) for r in range(2)):
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"arfused exited with {p.returncode}; logs in {self.dir}")
            if time.monotonic() > until:
                raise RuntimeError(f"the sidecars did not create their sockets; logs in {self.dir}")
            time.sleep(0.05)

    def socket(self, rank):
        return os.path.join(self.dir, f"rank{rank}.sock")

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


def test_installed_wheel_attaches_in_host_mode(wheel, tmp_path):
    if not os.path.exists(ARFUSED):
        pytest.fail(f"{ARFUSED} is not built (target arfused)")
    py = venv("venv-wheel")
    run([py, "-m", "pip", "install", "-q", wheel], env=clean_env())
    installed = run([py, "-m", "pip", "list", "--format=freeze"], capture_output=True,
                    env=clean_env()).stdout
    names = sorted(line.split("==")[0].lower() for line in installed.split())
    print("installed:", names)
    assert {"arfuse", "grpcio", "protobuf", "numpy"} <= set(names), names
    assert "torch" not in names
    g = Sidecars()
    try:
        # From a folder outside the checkout, with nothing in the environment naming it.
        out = run([py, REPO / "tests" / "packaging" / "venv_attach.py", g.socket(0), g.socket(1)],
                  capture_output=True, cwd=tmp_path, env=clean_env(), timeout=180)
    except subprocess.CalledProcessError as e:
        logs = "".join(pathlib.Path(g.dir, f"arfused.{r}.log").read_text() for r in range(2))
        pytest.fail(f"the venv's attach failed:\n{e.stdout}\n{e.stderr}\nsidecars:\n{logs}")
    finally:
        g.stop()
    print(out.stdout, out.stderr)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    site = (WORK / "venv-wheel").resolve()
    assert pathlib.Path(result["package"]).resolve().is_relative_to(site), result
    lib = pathlib.Path(result["library"]).resolve()
    assert lib.is_relative_to(site) and lib.parent.name == "_lib", result
    assert lib.name == "libarfuse_client.so.0.1", result
    assert result["errors"] == [], result
    assert result["devices"] == ["host", "host"], result
    assert result["residual_err"] <= 1e-5 and result["norm_err"] <= 1e-4, result
