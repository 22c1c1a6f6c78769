"""Where the client's native libraries are (libarfuse_ring.so, libarfuse_client.so).

One rule for every library, in order: the environment variable naming it; a copy in the
package's _lib/ folder (a wheel ships it there, under its SONAME) or next to the package; a build of this checkout (build/<subdir>/ first, the directory
that scripts/setup and CI build, else the newest build*/<subdir>/); .devstage/bin/ (what
scripts/gpu-stage stages on the GPU machines). None when there is none on disk, and the caller
then tries the loader's search path by name.
"""
import glob
import os
import pathlib
from typing import Optional

PKG_DIR = pathlib.Path(__file__).resolve().parent
REPO = PKG_DIR.parents[2]  # client/python/arfuse -> repository root


def find_native_library(filename: str, env_var: str, build_subdir: str) -> Optional[str]:
    env = os.environ.get(env_var)
    if env:
        return env
    # An installed wheel's own copy (client/python/setup.py ships it under its SONAME).
    wheel = sorted(glob.glob(str(PKG_DIR / "_lib" / (filename + "*"))))
    if wheel:
        return wheel[0]
    shipped = PKG_DIR / filename
    if shipped.is_file():
        return str(shipped)
    main = REPO / "build" / build_subdir / filename
    if main.is_file():
        return str(main)
    found = [p for p in glob.glob(str(REPO / "build*" / build_subdir / filename))
             if os.path.isfile(p)]
    if found:
        return max(found, key=os.path.getmtime)
    staged = REPO / ".devstage" / "bin" / filename
    if staged.is_file():
        return str(staged)
    return None
