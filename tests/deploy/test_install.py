"""Item "install" of docs/operations.md: a client-only build (no GoogleTest, prometheus-cpp, clang
or libFuzzer) installs with `cmake --install`, and a project outside the tree builds against it
with find_package(arfuse) and with pkg-config, and talks to a sidecar.

The client-only build compiles only the protos, the client and arfusectl (about a minute on two
cores; faster with ccache where it exists). The sidecar is the main build's arfused.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import arfuse_run as run

DOWNSTREAM = Path(__file__).resolve().parent / "downstream"
VERSION = run.VERSION




def _generator():
    return ["-G", "Ninja"] if shutil.which("ninja") else []


def _launcher():
    if shutil.which("ccache"):
        return ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache", "-DCMAKE_C_COMPILER_LAUNCHER=ccache"]
    return []


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A client-only build of this checkout, installed under a fresh prefix."""
    run.tool("cmake", "apt-get install cmake")
    root = tmp_path_factory.mktemp("install")
    build, prefix = root / "build", root / "prefix"
    # -O0 without debug info: this build is compiled to be linked against, not run for speed.
    run.sh(["cmake", "-S", run.REPO, "-B", build, *_generator(), *_launcher(),
         "-DARFUSE_BUILD_SERVER=OFF", "-DARFUSE_CUDA=OFF", "-DCMAKE_BUILD_TYPE=Debug",
         "-DCMAKE_CXX_FLAGS_DEBUG=-O0", "-DCMAKE_C_FLAGS_DEBUG=-O0"])
    run.sh(["cmake", "--build", build, "-j", str(os.cpu_count() or 2)])
    run.sh(["cmake", "--install", build, "--prefix", prefix])
    return build, prefix


def test_client_only_build_needs_no_test_or_server_packages(installed):
    build, _ = installed
    cache = (build / "CMakeCache.txt").read_text()
    for package in ("GTest_DIR", "prometheus-cpp_DIR", "yaml-cpp_DIR"):
        assert f"{package}:" not in cache, f"a client-only build looked for {package}"


def test_install_tree(installed):
    _, prefix = installed
    libdir = next(p for p in (prefix / "lib", prefix / "lib64") if p.is_dir())
    expected = [
        prefix / "bin" / "arfusectl",
        prefix / "include" / "arfuse" / "client" / "cpp" / "client.h",
        prefix / "include" / "arfuse" / "kernels" / "common" / "op_types.h",
        prefix / "include" / "arfuse" / "arfuse" / "v1" / "fusion.grpc.pb.h",
        prefix / "include" / "arfuse" / "arfuse" / "v1" / "common.pb.h",
        # The C++ gRPC client (libarfuse_grpc_client.a) and the in-stream plane's C ABI library
        # (libarfuse_client.so, with its header and pkg-config file).
        libdir / "libarfuse_grpc_client.a",
        libdir / "libarfuse_fdpass_client.a",
        libdir / "libarfuse_client.so",
        prefix / "include" / "arfuse" / "client" / "instream" / "arfuse_client.h",
        libdir / "pkgconfig" / "arfuse-client.pc",
        libdir / "libarfuse_proto.a",
        libdir / "cmake" / "arfuse" / "arfuseConfig.cmake",
        libdir / "cmake" / "arfuse" / "arfuseConfigVersion.cmake",
        libdir / "cmake" / "arfuse" / "arfuseTargets.cmake",
        libdir / "pkgconfig" / "arfuse.pc",
        prefix / "share" / "doc" / "arfuse" / "LICENSE",
    ]
    assert [str(p) for p in expected if not p.exists()] == []
    # A client-only build installs no daemon.
    assert not (prefix / "bin" / "arfused").exists()
    assert "Apache License" in (prefix / "share" / "doc" / "arfuse" / "LICENSE").read_text()
    pc = (libdir / "pkgconfig" / "arfuse.pc").read_text()
    assert f"Version: {VERSION}" in pc
    ctl = run.sh([prefix / "bin" / "arfusectl", "--version"]).stdout
    assert ctl.startswith(f"arfusectl {VERSION} "), ctl


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    d = tmp_path_factory.mktemp("sidecar")
    with run.host_sidecar(d) as s:
        s.wait_for(run.READY_LINE)
        yield f"unix:{d / 'arfused.sock'}"


def _run_downstream(exe, sidecar):
    out = run.sh([exe, sidecar], timeout=60).stdout
    assert re.search(r"connected: rank 0 of 1, device DEVICE_KIND_HOST, server API 1\.\d+", out), out


def test_find_package_gives_arfuse_client(installed, sidecar, tmp_path):
    _, prefix = installed
    build = tmp_path / "downstream"
    run.sh(["cmake", "-S", DOWNSTREAM, "-B", build, *_generator(), f"-DCMAKE_PREFIX_PATH={prefix}",
         "-DCMAKE_BUILD_TYPE=Debug", "-DCMAKE_CXX_FLAGS_DEBUG=-O0"])
    run.sh(["cmake", "--build", build])
    _run_downstream(build / "arfuse-downstream", sidecar)


def test_find_package_refuses_another_minor(installed, tmp_path):
    _, prefix = installed
    src = tmp_path / "src"
    src.mkdir()
    major, minor = (int(x) for x in VERSION.split(".")[:2])
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.25)\nproject(p LANGUAGES CXX)\n"
        f"find_package(arfuse {major}.{minor + 1} REQUIRED)\n")
    out = subprocess.run(["cmake", "-S", src, "-B", tmp_path / "b", f"-DCMAKE_PREFIX_PATH={prefix}"],
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "not compatible" in out.stderr or "version" in out.stderr, out.stderr


def test_pkg_config_builds_the_same_program(installed, sidecar, tmp_path):
    _, prefix = installed
    pkg_config = run.tool("pkg-config", "apt-get install pkg-config")
    libdir = next(p for p in (prefix / "lib", prefix / "lib64") if p.is_dir())
    env = dict(os.environ, PKG_CONFIG_PATH=str(libdir / "pkgconfig"))
    assert run.sh([pkg_config, "--modversion", "arfuse"], env=env).stdout.strip() == VERSION
    flags = run.sh([pkg_config, "--cflags", "--libs", "arfuse"], env=env).stdout.split()
    includes = {Path(f[2:]).resolve() for f in flags if f.startswith("-I")}
    assert (prefix / "include" / "arfuse").resolve() in includes, flags
    exe = tmp_path / "arfuse-downstream"
    run.sh(["c++", "-std=c++20", "-O0", DOWNSTREAM / "main.cc", "-o", exe, *flags])
    _run_downstream(exe, sidecar)


def test_the_main_build_installs_the_daemon_too(tmp_path):
    # The build CI already has (scripts/setup's build/): installing it compiles nothing.
    build = run.build_dir()
    run.binary("server/daemon/arfused")
    prefix = tmp_path / "prefix"
    run.sh(["cmake", "--install", build, "--prefix", prefix])
    out = run.sh([prefix / "bin" / "arfused", "--version"]).stdout
    assert out.startswith(f"arfused {VERSION} "), out
    assert (prefix / "bin" / "arfusectl").is_file()
    libdir = next(p for p in (prefix / "lib", prefix / "lib64") if p.is_dir())
    rings = sorted(libdir.glob("libarfuse_ring.so*"))
    if (build / "client" / "ring" / "libarfuse_ring.so").exists():
        # The versioned file, its SONAME link and the development link.
        names = [p.name for p in rings]
        assert len(names) == 3 and names[0] == "libarfuse_ring.so", names
        assert (libdir / "pkgconfig" / "arfuse-ring.pc").is_file()
        assert (prefix / "include" / "arfuse" / "client" / "ring" / "arfuse_ring.h").is_file()
    else:
        assert rings == []
