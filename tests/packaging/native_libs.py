"""What the client's native libraries (libarfuse_client.so, libarfuse_ring.so) may need and
export: they are loaded into framework processes (torch, SGLang, vLLM) on machines that have
nothing of this build, so they need only glibc's libraries, libstdc++ and libgcc_s (the CUDA
driver is opened at run time, never a NEEDED entry), and export only the C ABI (arfuse_*)."""
import re
import subprocess

# glibc (with the libraries older glibc splits off), the C++ runtime, the dynamic loader.
ALLOWED_NEEDED = frozenset({
    "libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
    "libstdc++.so.6", "libgcc_s.so.1",
    "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1",
})
EXPORT_PREFIX = "arfuse_"


def needed(path) -> list:
    """The library's NEEDED entries, in order (readelf -d)."""
    out = subprocess.run(["readelf", "-d", "--wide", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def exported(path) -> list:
    """The names of the dynamic symbols the library defines (nm -D --defined-only)."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True,
                         text=True, check=True).stdout
    names = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            names.append(parts[2].split("@")[0])
    return names


def disallowed_needed(entries) -> list:
    return [e for e in entries if e not in ALLOWED_NEEDED]


def disallowed_exports(names) -> list:
    return [n for n in names if not n.startswith(EXPORT_PREFIX)]


def problems(path) -> list:
    """One line per rule the library breaks; empty when it loads anywhere."""
    out = []
    bad = disallowed_needed(needed(path))
    if bad:
        out.append(f"{path}: NEEDED outside glibc/libstdc++/libgcc_s: {', '.join(bad)}")
    bad = disallowed_exports(exported(path))
    if bad:
        shown = ", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        out.append(f"{path}: exports {len(bad)} symbol(s) outside {EXPORT_PREFIX}*: {shown}")
    return out
