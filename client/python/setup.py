"""Builds the arfuse wheel: the package, its generated arfuse.v1 stubs, its version, and the
native libraries of this checkout's build.

    python3 -m pip wheel --no-deps --no-build-isolation -w dist client/python
        (ARFUSE_BUILD_DIR=build by default; ARFUSE_NATIVE_LIBS=path:path to name them instead;
         relative paths are the repository's)

- Stubs: grpc_tools.protoc over proto/arfuse/v1 (or $ARFUSE_PROTO_DIR), written into the wheel,
  so an installed package never generates anything at import time.
- Version: the repository's VERSION file (the one version of every artifact), as
  arfuse/_version.py and the wheel's metadata.
- Native libraries: libarfuse_ring.so (the ring kernel's C ABI, built with CUDA) from the build
  directory, with its SONAME name, into arfuse/_lib/; arfuse.ring and arfuse.instream load them from there. A wheel
  with a native library is tagged manylinux_2_XX for the oldest glibc its libraries allow: the
  highest GLIBC_, GLIBCXX_, CXXABI_ and GCC_ symbol versions they need (readelf -V) against the
  manylinux policy's limits (MANYLINUX below; tests/packaging checks the tag with auditwheel).
  A wheel without one (no native library built) is pure Python.

Wheels are built from a checkout (the protos and VERSION live beside client/python); an sdist is
not offered.
"""
import os
import pathlib
import re
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
NAMES = ("common", "config", "fusion", "admin", "peer")
# The native libraries a wheel carries, by their link name in the build directory: the ones built
# there are shipped (a build without CUDA has none). A new library is one more entry here.
NATIVE = ("client/ring/libarfuse_ring.so", "client/instream/libarfuse_client.so")


# The manylinux policies' symbol-version limits (auditwheel's manylinux-policy.json, the same on
# x86_64 and aarch64): (glibc minor, {GLIBC, GLIBCXX, CXXABI, GCC: the highest version allowed}).
# The libraries must also need only the policy's libraries (glibc's, libstdc++, libgcc_s), which
# tests/packaging checks.
MANYLINUX = (
    (17, {"GLIBC": "2.17", "GLIBCXX": "3.4.19", "CXXABI": "1.3.7", "GCC": "4.8.0"}),
    (24, {"GLIBC": "2.24", "GLIBCXX": "3.4.22", "CXXABI": "1.3.10", "GCC": "4.8.0"}),
    (26, {"GLIBC": "2.26", "GLIBCXX": "3.4.22", "CXXABI": "1.3.10", "GCC": "4.8.0"}),
    (27, {"GLIBC": "2.27", "GLIBCXX": "3.4.24", "CXXABI": "1.3.11", "GCC": "7.0.0"}),
    (28, {"GLIBC": "2.28", "GLIBCXX": "3.4.24", "CXXABI": "1.3.11", "GCC": "7.0.0"}),
    (31, {"GLIBC": "2.31", "GLIBCXX": "3.4.28", "CXXABI": "1.3.12", "GCC": "7.0.0"}),
    (34, {"GLIBC": "2.34", "GLIBCXX": "3.4.29", "CXXABI": "1.3.13", "GCC": "7.0.0"}),
    (35, {"GLIBC": "2.35", "GLIBCXX": "3.4.30", "CXXABI": "1.3.13", "GCC": "12.0.0"}),
    (36, {"GLIBC": "2.36", "GLIBCXX": "3.4.30", "CXXABI": "1.3.13", "GCC": "12.0.0"}),
    (38, {"GLIBC": "2.38", "GLIBCXX": "3.4.30", "CXXABI": "1.3.13", "GCC": "12.0.0"}),
    (39, {"GLIBC": "2.39", "GLIBCXX": "3.4.33", "CXXABI": "1.3.15", "GCC": "14.0.0"}),
    (40, {"GLIBC": "2.40", "GLIBCXX": "3.4.33", "CXXABI": "1.3.15", "GCC": "14.0.0"}),
    (41, {"GLIBC": "2.41", "GLIBCXX": "3.4.33", "CXXABI": "1.3.15", "GCC": "14.0.0"}),
)


def _numbers(v: str) -> tuple:
    return tuple(int(x) for x in v.split("."))


def needed_versions(path: pathlib.Path) -> dict:
    """The highest version of each of GLIBC, GLIBCXX, CXXABI and GCC that the library's version
    needs (.gnu.version_r, as `readelf -V` prints it) name."""
    dump = subprocess.run(["readelf", "-V", "--wide", str(path)], capture_output=True, text=True,
                          check=True).stdout
    needs = dump.split("Version needs section", 1)[1] if "Version needs section" in dump else ""
    out = {}
    for family, v in re.findall(r"Name:\s+(GLIBC|GLIBCXX|CXXABI|GCC)_([0-9][0-9.]*)\b", needs):
        if family not in out or _numbers(v) > _numbers(out[family]):
            out[family] = v
    return out


def manylinux_platform(libs, arch: str) -> str:
    """manylinux_2_XX_<arch> for the oldest policy every library satisfies, else linux_<arch>."""
    need = {}
    for lib in libs:
        for family, v in needed_versions(lib).items():
            if family not in need or _numbers(v) > _numbers(need[family]):
                need[family] = v
    for minor, limits in MANYLINUX:
        if all(_numbers(v) <= _numbers(limits[f]) for f, v in need.items()):
            return f"manylinux_2_{minor}_{arch}"
    print(f"arfuse setup.py: the native libraries need {need}, beyond every manylinux policy "
          f"known here: the wheel is tagged linux_{arch}")
    return f"linux_{arch}"


def version() -> str:
    text = (REPO / "VERSION").read_text().strip()
    if not re.fullmatch(r"\d+\.\d+\.\d+([.-]?[A-Za-z0-9.]+)?", text):
        raise SystemExit(f"VERSION holds no version: {text!r}")
    return text


def native_libraries() -> list:
    """The native libraries to ship: $ARFUSE_NATIVE_LIBS, else those of $ARFUSE_BUILD_DIR
    (default build/), as real files (the versioned name; the loader's names are links)."""
    # Relative paths are the repository's: pip builds with client/python as its directory.
    named = os.environ.get("ARFUSE_NATIVE_LIBS")
    if named is not None:
        paths = [REPO / p for p in named.split(":") if p]
    else:
        build = REPO / os.environ.get("ARFUSE_BUILD_DIR", "build")
        paths = [build / n for n in NATIVE if (build / n).exists()]
    out = []
    for p in paths:
        if not p.exists():
            raise SystemExit(f"native library {p} does not exist")
        out.append(p.resolve())
    return out


def soname(path: pathlib.Path) -> str:
    """The SONAME the loader looks for (libarfuse_ring.so.0.1), from the ELF dynamic section."""
    try:
        dump = subprocess.run(["objdump", "-p", str(path)], capture_output=True, text=True,
                              check=True).stdout
        m = re.search(r"^\s*SONAME\s+(\S+)", dump, re.M)
        if m:
            return m.group(1)
    except (OSError, subprocess.CalledProcessError):
        pass
    return path.name


class BuildPy(build_py):
    def run(self):
        super().run()
        out = pathlib.Path(self.build_lib)
        (out / "arfuse" / "_version.py").write_text(
            "# Written by client/python/setup.py from the repository's VERSION file.\n"
            f'__version__ = "{version()}"\n')
        self._stubs(out)
        native = out / "arfuse" / "_lib"
        shutil.rmtree(native, ignore_errors=True)
        libs = native_libraries()
        if libs:
            native.mkdir(parents=True)
            (native / "__init__.py").write_text('"""Native libraries shipped in the wheel."""\n')
            for lib in libs:
                # One file under the name the loader wants; the wheel format keeps no links.
                shutil.copy2(lib, native / soname(lib))

    def _stubs(self, out):
        """The generated stubs: the system protoc with gRPC's Python plugin where they are (Debian's
        protobuf-compiler and protobuf-compiler-grpc, which match the system's grpcio and protobuf),
        else grpc_tools.protoc."""
        root = pathlib.Path(os.environ.get("ARFUSE_PROTO_DIR", REPO / "proto"))
        files = [str(root / "arfuse" / "v1" / f"{n}.proto") for n in NAMES]
        protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
        if protoc and plugin:
            rc = subprocess.run([protoc, f"-I{root}", f"--python_out={out}",
                                 f"--plugin=protoc-gen-grpc_python={plugin}",
                                 f"--grpc_python_out={out}", *files]).returncode
            if rc != 0:
                raise SystemExit(f"protoc failed ({rc}) on {root}")
            return
        from grpc_tools import protoc as grpc_protoc
        import grpc_tools

        well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
        rc = grpc_protoc.main(["grpc_tools.protoc", f"-I{root}", f"-I{well_known}",
                               f"--python_out={out}", f"--grpc_python_out={out}", *files])
        if rc != 0:
            raise SystemExit(f"grpc_tools.protoc failed ({rc}) on {root}")


try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70
    from wheel.bdist_wheel import bdist_wheel


class BdistWheel(bdist_wheel):
    """py3-none-manylinux_2_XX_<arch>: the native libraries are no CPython extension, any Python 3
    loads them, on any Linux whose glibc is at least the one their symbol versions need."""

    def get_tag(self):
        python, abi, plat = super().get_tag()
        if plat == "any":
            return python, abi, plat
        if plat.startswith("linux_"):
            plat = manylinux_platform(native_libraries(), plat[len("linux_"):])
        return "py3", "none", plat


class PlatformWhenNative(Distribution):
    """A wheel carrying a native library is for this platform only."""

    def has_ext_modules(self):
        return bool(native_libraries())


setup(version=version(), cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel},
      distclass=PlatformWhenNative)
