"""The client's native libraries need only glibc, libstdc++ and libgcc_s and export only
arfuse_* (native_libs.py). $ARFUSE_PACKAGING_LIBS names the built libraries (colon-separated;
tests/packaging/CMakeLists.txt passes libarfuse_client.so, and libarfuse_ring.so where CUDA
builds it)."""
import os
import shutil
import subprocess

import pytest

import native_libs

LIBS = [p for p in os.environ.get("ARFUSE_PACKAGING_LIBS", "").split(":") if p]


@pytest.mark.parametrize("lib", LIBS or [pytest.param(None, marks=pytest.mark.skip(
    reason="ARFUSE_PACKAGING_LIBS names no library (run through ctest)"))])
def test_library_needs_and_exports_only_what_loads_anywhere(lib):
    entries = native_libs.needed(lib)
    print(f"{os.path.basename(lib)} NEEDED: {' '.join(entries)}")
    assert "libc.so.6" in entries  # the listing really read the library
    assert not any(e.startswith("libcuda") for e in entries), entries
    assert native_libs.problems(lib) == []
    assert native_libs.exported(lib), "no exported symbol read: the C ABI must be there"


def test_the_rules_refuse_a_library_that_breaks_them(tmp_path):
    """A library built here that needs another library of its own (libother.so, as one that
    needed abseil would) and exports a non-arfuse symbol: both are reported."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "other.c").write_text("int other(void) { return 3; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "libother.so"),
                    str(tmp_path / "other.c")], check=True)
    (tmp_path / "bad.c").write_text("int other(void);\nint arfuse_fine(void) { return other(); }\n"
                                    "int leaked_helper(void) { return 2; }\n")
    lib = tmp_path / "libbad.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "bad.c"),
                    f"-L{tmp_path}", "-lother"], check=True)
    assert "libother.so" in native_libs.needed(lib)
    found = native_libs.problems(lib)
    assert len(found) == 2, found
    assert "NEEDED outside glibc/libstdc++/libgcc_s: libother.so" in found[0]
    assert "leaked_helper" in found[1] and "arfuse_fine" not in found[1]


def test_the_allowed_set_is_glibc_and_the_cxx_runtime_only():
    assert native_libs.disallowed_needed(
        ["libc.so.6", "libstdc++.so.6", "libabsl_status.so.20220623", "libcuda.so.1"]) == [
            "libabsl_status.so.20220623", "libcuda.so.1"]
    assert native_libs.disallowed_exports(["arfuse_attach", "_ZN4absl6StatusD1Ev"]) == [
        "_ZN4absl6StatusD1Ev"]
