"""Where the client's native libraries are (libarfuse_ring.so, libarfuse_client.so).

One rule for every library, in order: the environment variable naming it; a copy in the
package's _lib/ folder (a wheel ships it there, under its SONAME) or next to the package; when
the package is used in place in a checkout (client/python/arfuse), a build of that checkout
(build/<subdir>/ first, the directory that scripts/setup and CI build, else the newest
build*/<subdir>/), then .devstage/bin/ (what scripts/gpu-stage stages on the GPU machines). An
installed package (site-packages) looks at nothing outside itself but the environment variable.
None when there is none on disk, and the caller then tries the loader's search path by name.
"""
import glob
import os
import pathlib
from typing import Optional

PKG_DIR = pathlib.Path(__file__).resolve().parent


def _checkout_root(pkg: pathlib.Path) -> Optional[pathlib.Path]:
    """The repository root when the package is client/python/arfuse of a checkout, else None
    (an installed package has no build tree beside it)."""
    if len(pkg.parents) < 3 or (pkg.parent.name, pkg.parents[1].name) != ("python", "client"):
        return None
    root = pkg.parents[2]
    return root if (root / "VERSION").is_file() and (root / "CMakeLists.txt").is_file() else None


REPO = _checkout_root(PKG_DIR)


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
    if REPO is None:
        return None
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
