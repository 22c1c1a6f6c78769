"""The Python package as a wheel: built from this checkout (client/python/setup.py), installed into
a clean virtual environment, it imports without generating anything or warning, knows its version
(the VERSION file) and carries the native library of the build (libarfuse_ring, CUDA builds),
which it loads from its own folder; its stubs talk to a real sidecar.

The virtual environment has pip and the wheel only; grpcio, protobuf and numpy come from the
Python that runs this test (a .pth file names its site-packages), so nothing is downloaded.
"""
import os
import shutil
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import arfuse_run as run

VERSION = run.VERSION




def _native_in_build():
    return sorted((run.build_dir() / "client" / "ring").glob("libarfuse_ring.so.*.*.*"))


def _client_lib_in_build():
    return sorted((run.build_dir() / "client" / "instream").glob("libarfuse_client.so.*.*.*"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    try:
        __import__("setuptools")
    except ImportError:
        run.missing("python module setuptools", "scripts/setup installs the Python packages")
    # The stubs come from the system protoc + grpc_python_plugin, else grpc_tools (setup.py).
    if not (shutil.which("protoc") and shutil.which("grpc_python_plugin")):
        try:
            __import__("grpc_tools")
        except ImportError:
            run.missing("protoc + grpc_python_plugin or grpc_tools",
                        "Debian: protobuf-compiler protobuf-compiler-grpc")
    out = tmp_path_factory.mktemp("wheel")
    env = dict(os.environ, ARFUSE_BUILD_DIR=str(run.build_dir()))
    # pip builds in client/python; its scratch build/ and egg-info stay there (git-ignored).
    run.sh([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-w", out, run.REPO / "client" / "python"], env=env,
        timeout=300)
    (whl,) = out.glob("arfuse-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    d = tmp_path_factory.mktemp("venv") / "env"
    made = subprocess.run([sys.executable, "-m", "venv", str(d)], capture_output=True, text=True)
    if made.returncode != 0:
        run.missing("python3 -m venv", f"Debian: apt-get install python3-venv ({made.stderr[-300:]})")
    python = d / "bin" / "python"
    site = Path(run.sh([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                .stdout.strip())
    # Where this Python finds the client's dependencies (Debian's python3-* packages live outside
    # sysconfig's paths, in /usr/lib/python3/dist-packages).
    try:
        import google.protobuf
        import grpc
        import numpy
    except ImportError as e:
        run.missing(f"the client's dependencies ({e.name})", "scripts/setup installs them")

    deps = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    deps |= {str(Path(m.__file__).resolve().parents[n]) for m, n in
             ((grpc, 1), (numpy, 1), (google.protobuf, 2))}
    (site / "arfuse_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    run.sh([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--disable-pip-version-check", wheel], timeout=120)
    return python, site


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for n in ("common", "config", "fusion", "admin", "peer"):
        assert f"arfuse/v1/{n}_pb2.py" in names and f"arfuse/v1/{n}_pb2_grpc.py" in names, n
    assert "arfuse/_version.py" in names
    meta = zipfile.ZipFile(wheel).read(f"arfuse-{VERSION}.dist-info/METADATA").decode()
    assert f"Version: {VERSION}" in meta
    native = sorted(n for n in names if n.startswith("arfuse/_lib/lib"))
    so = lambda p: re.search(r"\.so\.(\d+\.\d+)", p.name).group(1)  # noqa: E731
    want = sorted([f"arfuse/_lib/libarfuse_client.so.{so(p)}" for p in _client_lib_in_build()[:1]] +
                  [f"arfuse/_lib/libarfuse_ring.so.{so(p)}" for p in _native_in_build()[:1]])
    # The libraries under their SONAMEs: libarfuse_client (every build) and the ring library
    # (CUDA builds); a wheel with a native library is for this platform only.
    assert native == want, native
    if want:
        assert re.search(r"-py3-none-manylinux_\d+_\d+_\w+\.whl$", wheel.name), wheel.name
    else:
        assert wheel.name.endswith("-py3-none-any.whl"), wheel.name


def test_import_is_quiet_and_knows_its_version(venv, tmp_path):
    python, site = venv
    code = ("import arfuse, arfuse._proto as p; arfuse.Client; print(arfuse.__version__); "
            "print(p.mode()); print(arfuse.__file__)")
    out = run.sh([python, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""})
    version, mode, where = out.stdout.split()
    assert out.stderr == "", out.stderr  # no "generated stubs unusable"
    assert version == VERSION
    assert mode == "generated"
    assert Path(where).is_relative_to(site), where  # the wheel's, not the checkout's


def test_native_library_loads_from_the_wheel(venv, tmp_path):
    if not _native_in_build():
        pytest.skip("this build has no ring library (built without CUDA)")
    python, site = venv
    code = ("import arfuse.ring as r; p = r.find_ring_library(); lib = r.load_library(p); "
            "print(p); print(lib.arfuse_ring_strerror(-1).decode())")
    env = {k: v for k, v in os.environ.items() if k != "ARFUSE_RING_LIB"}
    out = run.sh([python, "-c", code], cwd=tmp_path, env=env)
    path, message = out.stdout.splitlines()
    assert Path(path).is_relative_to(site / "arfuse" / "_lib"), path
    assert message, out.stdout


def test_client_library_loads_from_the_wheel(venv, tmp_path):
    python, site = venv
    code = ("from arfuse import instream; p = instream.find_client_library(); "
            "lib = instream.load_library(p); "
            "print(p); print(lib.arfuse_client_abi_version(), instream.CLIENT_ABI_VERSION)")
    env = {k: v for k, v in os.environ.items() if k != "ARFUSE_CLIENT_LIB"}
    out = run.sh([python, "-c", code], cwd=tmp_path, env=env)
    path, abi = out.stdout.splitlines()
    assert Path(path).is_relative_to(site / "arfuse" / "_lib"), path
    library_abi, package_abi = abi.split()
    assert library_abi == package_abi, out.stdout


def test_installed_stubs_talk_to_a_sidecar(venv, tmp_path):
    python, _ = venv
    sock = tmp_path / "arfused.sock"
    with run.host_sidecar(tmp_path) as s:
        s.wait_for("event=ready")
        code = ("import arfuse; c = arfuse.Client('unix:%s'); w = c.workspace_info(); "
                "print(w.world_size, w.max_tokens, w.hidden); c.close()" % sock)
        out = run.sh([python, "-c", code], cwd=tmp_path, timeout=60)
    assert out.stdout.split() == ["1", "16", "256"], out.stdout + out.stderr
