"""The vLLM integration's tests: the pinned releases' source (fetch.py), the arfuse client
package from this checkout, the host-mode sidecar fixtures of tests/python."""
import os
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path[:0] = [str(REPO / "client" / "python"), str(HERE), str(REPO / "tests" / "python")]

import fetch  # noqa: E402


VERSIONS = os.environ["ARFUSE_VLLM_VERSIONS"].split(",") if \
    os.environ.get("ARFUSE_VLLM_VERSIONS") else list(fetch.PINNED)


@pytest.fixture(scope="session", params=VERSIONS)
def vllm_source(request):
    """(version, the directory holding its vllm/): fetched when not cached yet."""
    return request.param, fetch.source(request.param)
