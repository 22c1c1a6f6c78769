#!/usr/bin/env python3
"""Fetches the pinned SGLang wheels (pip download --no-deps, no install) into
build/frameworks/sglang/ and unpacks what the checks read: sglang/version.py and the .py files of
sglang/srt (--full: the whole sglang/ package, for the tests that import SGLang's modules).

    tests/frameworks/sglang/fetch.py [--full] [VERSION ...]

$ARFUSE_SGLANG_WHEELS: a directory searched for the wheels first (no network then). Prints the
unpacked source directory of each version, one a line.
"""
import glob
import os
import pathlib
import subprocess
import sys
import zipfile

REPO = pathlib.Path(__file__).resolve().parents[3]
CACHE = REPO / "build" / "frameworks" / "sglang"
# The releases checked; 0.5.6.post2 is the layout arfuse refuses (layouts.REFUSED).
PINS = ("0.5.6.post2", "0.5.14", "0.5.20", "0.5.21", "0.5.23")


def wheel_for(version: str) -> pathlib.Path:
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for d in filter(None, [os.environ.get("ARFUSE_SGLANG_WHEELS"), str(wheels)]):
        found = sorted(glob.glob(os.path.join(d, f"sglang-{version}-*.whl")))
        if found:
            return pathlib.Path(found[-1])
    # pip download only: nothing is installed, so a PEP 668 system Python is fine.
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                    "--dest", str(wheels), f"sglang=={version}"], check=True)
    found = sorted(glob.glob(str(wheels / f"sglang-{version}-*.whl")))
    if not found:
        raise SystemExit(f"fetch: pip download sglang=={version} left no wheel in {wheels}")
    return pathlib.Path(found[-1])


def unpack(version: str, full: bool = False) -> pathlib.Path:
    dest = CACHE / "src" / version
    stamp = dest / (".full" if full else ".py")
    if stamp.exists() or (not full and (dest / ".full").exists()):
        return dest
    whl = wheel_for(version)
    with zipfile.ZipFile(whl) as z:
        for n in z.namelist():
            keep = n.startswith("sglang/") if full else (
                n == "sglang/version.py" or n == "sglang/__init__.py" or
                (n.startswith("sglang/srt/") and n.endswith(".py")))
            if keep:
                z.extract(n, dest)
    stamp.write_text(whl.name + "\n")
    return dest


def main(argv):
    full = "--full" in argv
    versions = [a for a in argv if not a.startswith("--")] or list(PINS)
    for v in versions:
        print(unpack(v, full))


if __name__ == "__main__":
    main(sys.argv[1:])
