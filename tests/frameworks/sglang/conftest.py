"""The pinned SGLang releases' source (tests/frameworks/sglang/fetch.py unpacks it)."""
import os
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path[:0] = [str(HERE), str(REPO / "client" / "python")]

import fetch  # noqa: E402

# The layout each pinned release must be detected as (None: refused).
EXPECTED = {"0.5.6.post2": None, "0.5.14": "communicator", "0.5.20": "communicator",
            "0.5.21": "layer_boundary", "0.5.23": "layer_boundary"}


def source_dir(version: str, full: bool = False) -> pathlib.Path:
    d = fetch.CACHE / "src" / version
    if (d / (".full" if full else ".py")).exists() or (d / ".full").exists():
        return d
    if os.environ.get("ARFUSE_SGLANG_NO_FETCH"):
        pytest.skip(f"SGLang {version} is not fetched (tests/frameworks/sglang/fetch.py)")
    return fetch.unpack(version, full)


@pytest.fixture(params=sorted(EXPECTED), scope="module")
def release(request):
    return request.param, source_dir(request.param)
