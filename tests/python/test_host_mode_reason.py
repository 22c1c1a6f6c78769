"""Host mode without --sm (as the README starts a sidecar on a machine without a GPU): no GPU
architecture decides for fusion, so allreduce_fusion returns None. The reason is said where a
user looks: arfused's log, GetWorkspaceInfo and Negotiate (what `arfusectl info` prints), and a
one-time FusionUnavailableWarning at the client's first None."""
import os
import pathlib
import subprocess
import time
import warnings

import pytest

import arfuse
from conftest import Group
from test_client import HostTensors

# The part of the reason that tells the user what to do.
HINT = "--sm=90"


def _log(group, rank):
    return pathlib.Path(group.dir, f"arfused.{rank}.log").read_text()


@pytest.fixture
def no_sm(arfused):
    # Group passes --sm=90; an empty --sm afterwards unsets it again (the README's command line).
    g = Group(arfused, 2, extra_args=("--sm=", "--log-level=info"))
    yield g
    g.stop()


def _ready(client, timeout=60):
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        info = client.workspace_info()
        if info.state == arfuse.common_pb2.WORKSPACE_STATE_READY:
            return info
        time.sleep(0.05)
    raise AssertionError(f"workspace not ready: {info.reason}")


def test_reason_in_log_info_negotiation_and_first_none(no_sm):
    clients = [arfuse.Client(no_sm.socket(r)) for r in range(2)]
    try:
        info = _ready(clients[0])
        assert not info.fusion_enabled
        assert "no GPU architecture" in info.reason and HINT in info.reason, info.reason
        neg = clients[0].negotiate("none")
        assert any(HINT in r for r in neg.reasons), neg.reasons

        ws = arfuse.FusionWorkspace(clients[0])
        t = HostTensors(ws)
        with pytest.warns(arfuse.FusionUnavailableWarning) as got:
            assert arfuse.allreduce_fusion(**t.call) is None
        assert len(got) == 1 and HINT in str(got[0].message), [str(w.message) for w in got]
        assert HINT in ws.unavailable_reason
        # Once per reason: the next None is silent.
        with warnings.catch_warnings():
            warnings.simplefilter("error", arfuse.FusionUnavailableWarning)
            assert arfuse.allreduce_fusion(**t.call) is None
        t.close()
    finally:
        for c in clients:
            c.close()

    for r in range(2):
        log = _log(no_sm, r)
        start = [l for l in log.splitlines() if "event=no_gpu_architecture" in l]
        assert start and "level=warn" in start[0] and HINT in start[0], log
        ready = [l for l in log.splitlines() if "event=ready" in l]
        assert ready and "fusion_enabled=false" in ready[0] and HINT in ready[0], log


def test_arfusectl_info_says_why(no_sm, arfused):
    arfusectl = pathlib.Path(arfused).parents[2] / "tools" / "arfusectl" / "arfusectl"
    if not os.access(arfusectl, os.X_OK):
        pytest.skip(f"arfusectl is not built ({arfusectl})")
    with arfuse.Client(no_sm.socket(0)) as c:
        _ready(c)
    out = subprocess.run([str(arfusectl), "info", "--addr", f"unix:{no_sm.socket(0)}"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "fusion disabled" in out.stdout
    # Both the workspace's reason and the negotiation's name the missing architecture.
    assert out.stdout.count(HINT) >= 2, out.stdout


def test_with_sm_no_warning_and_no_hint(group2):
    with arfuse.Client(group2.socket(0)) as c:
        info = _ready(c)
        assert info.fusion_enabled and HINT not in info.reason
    assert "event=no_gpu_architecture" not in _log(group2, 0)
