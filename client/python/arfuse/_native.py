"""Where the client's native libraries are (libarfuse_ring.so, libarfuse_client.so).

One rule for every library, in order: the environment variable naming it (ARFUSE_CLIENT_LIB,
ARFUSE_RING_LIB); a copy in the package's _lib/ folder (a wheel ships it there, under its
SONAME) or next to the package. Nothing outside the package is searched: None when neither
names a file, and the caller then loads the library by name through the system's library path
(LD_LIBRARY_PATH, ld.so.cache). A checkout's tests and examples name the build's copy through
the variable (tests/python/conftest.py does so for the build tree).
"""
import glob
import os
import pathlib
from typing import Optional

PKG_DIR = pathlib.Path(__file__).resolve().parent


def find_native_library(filename: str, env_var: str) -> Optional[str]:
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
    return None
