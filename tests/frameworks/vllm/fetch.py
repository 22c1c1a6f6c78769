"""Fetches the pinned vLLM releases' source for the tests: `pip download --no-deps` of each
wheel into build/frameworks/vllm/wheels (kept as a cache), then only its .py files and METADATA
unpacked into build/frameworks/vllm/src/<version>. Prints the source directories.

    python3 tests/frameworks/vllm/fetch.py [VERSION ...]     (default: PINNED)
"""
import glob
import os
import pathlib
import subprocess
import sys
import zipfile

REPO = pathlib.Path(__file__).resolve().parents[3]
CACHE = REPO / "build" / "frameworks" / "vllm"
# The releases arfuse.integrations.vllm is tested on (its TESTED_VERSIONS).
PINNED = ("0.30.0", "0.31.0", "0.32.0", "0.33.0")


def wheel(version: str) -> str:
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = glob.glob(str(wheels / f"vllm-{version}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                        str(wheels), f"vllm=={version}"], check=True)
        found = glob.glob(str(wheels / f"vllm-{version}-*.whl"))
    if not found:
        raise SystemExit(f"fetch: no wheel of vllm {version} after pip download")
    return found[0]


def source(version: str) -> pathlib.Path:
    dest = CACHE / "src" / version
    done = dest / ".unpacked"
    if done.exists():
        return dest
    with zipfile.ZipFile(wheel(version)) as z:
        for name in z.namelist():
            if (name.startswith("vllm/") and name.endswith(".py")) or \
                    name.endswith(".dist-info/METADATA"):
                z.extract(name, dest)
    done.write_text(version + "\n")
    return dest


def main(argv):
    for v in argv or PINNED:
        print(source(v))


if __name__ == "__main__":
    main(sys.argv[1:])
