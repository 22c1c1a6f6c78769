"""The Python client's negotiation, doorbell plans, session-loss detection, tensor pool, ring
library binding and the stub fallback (descriptors.pb), against real host-mode sidecars."""
import os
import subprocess
import sys
import time

import grpc
import pytest

import arfuse
from arfuse import pool as pool_mod
from arfuse import ring as ring_mod

from conftest import REPO
from test_client import F32, H, T, wait_ready


def test_negotiate_reports_the_group_decision(group2):
    with arfuse.Client(group2.socket(1)) as c:
        wait_ready(c)
        n = c.negotiate("full")
        # The conftest group decides as SM90 with backend auto on one node: mnnvl. Host mode has
        # no doorbell, so a full graph that wants the op inside becomes piecewise + eager.
        assert (n.backend, n.fusion_enabled, n.data_plane) == ("mnnvl", True, "eager")
        assert n.cuda_graph_mode == "piecewise"
        assert n.device == "host" and n.rank == 1 and n.world_size == 2
        assert "fusion=on" in n.summary()
        assert c.negotiate("none").cuda_graph_mode == "none"
        with pytest.raises(ValueError):
            c.negotiate("sometimes")


def test_doorbell_plan_is_refused_in_host_mode(group2):
    with arfuse.Client(group2.socket(0)) as c:
        wait_ready(c)
        ws = arfuse.FusionWorkspace(c)
        buf = arfuse.HostShmBuffer(4 * T * H * F32)
        ws.register(buf)
        x = buf.view("fp32", T * H, 0).reshape(T, H)
        res = buf.view("fp32", T * H, T * H * F32)
        y = buf.view("fp32", T * H, 2 * T * H * F32)
        g = buf.view("fp32", H, 3 * T * H * F32)
        plan = ws.create_plan(input=x, residual_in=res, norm_out=y, rms_gamma=g, max_tokens=2)
        assert plan.doorbell is None and plan.path == arfuse.common_pb2.EXEC_PATH_HOST
        with pytest.raises(arfuse.ArfuseError) as e:
            ws.create_plan(input=x, residual_in=res, norm_out=y, rms_gamma=g, doorbell=True)
        assert e.value.code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION,
                                grpc.StatusCode.INVALID_ARGUMENT)
        c.destroy_plan(plan)
        for v in (x, res, y, g):
            v.release()
        buf.close()


def test_killed_sidecar_is_sidecar_lost_not_unavailable(group2):
    c = arfuse.Client(group2.socket(0))
    wait_ready(c)
    ws = arfuse.FusionWorkspace(c)
    buf = arfuse.HostShmBuffer(4 * T * H * F32)
    ws.register(buf)
    assert ws.fusion_available() and c.session_lost is None
    group2.procs[0].kill()
    group2.procs[0].wait(10)
    reason = c.wait_session_lost(10)
    assert reason and "session stream ended" in reason
    x = buf.view("fp32", T * H, 0).reshape(T, H)
    res = buf.view("fp32", T * H, T * H * F32)
    y = buf.view("fp32", T * H, 2 * T * H * F32)
    g = buf.view("fp32", H, 3 * T * H * F32)
    t0 = time.monotonic()
    with pytest.raises(arfuse.SidecarLost) as e:
        arfuse.allreduce_fusion(input=x, workspace=ws, residual_in=res, norm_out=y, rms_gamma=g)
    assert time.monotonic() - t0 < 5
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "is gone" in str(e.value)
    with pytest.raises(arfuse.SidecarLost):
        c.workspace_info()
    for v in (x, res, y, g):
        v.release()
    buf.close()
    c.close()


def test_close_is_not_a_lost_session(group2):
    c = arfuse.Client(group2.socket(0))
    c.close()
    assert c.wait_session_lost(2) is None


def test_tensor_pool_offsets():
    buf = arfuse.HostShmBuffer(4096)
    try:
        p = pool_mod.TensorPool(buf)
        assert p.reserve(10, "a") == 0
        assert p.reserve(300, "b") == 256
        assert p.named == {"a": (0, 10), "b": (256, 300)}
        assert pool_mod.size_for([10, 300]) == 256 + 512
        with pytest.raises(MemoryError):
            p.reserve(4096)
    finally:
        buf.close()


def test_ring_library_binding():
    path = ring_mod.find_ring_library()
    if path is None:
        pytest.skip("libarfuse_ring.so is not built (build*/client/ring; or set ARFUSE_RING_LIB)")
    try:
        lib = ring_mod.load_library(path)
    except OSError as e:
        pytest.skip(f"libarfuse_ring.so does not load here: {e}")
    assert lib.arfuse_doorbell_check_values(0x52494E47, 0x444F4E45, 0) == 0
    assert lib.arfuse_doorbell_check_values(1, 2, 3) == ring_mod.RING_EVERSION
    assert "invalid argument" in ring_mod.strerror(ring_mod.RING_EINVAL, lib)
    assert "timed out" in ring_mod.slot_error_name(1, lib)
    assert ring_mod.slot_error_name(0, lib) == "none"

    class Bell:
        ipc_handle = b"\x01" * 64
        offset = 0
        request_value, complete_value, reset_value = 0x52494E47, 0x444F4E45, 0

    with pytest.raises(ring_mod.RingError):  # no GPU here, or a handle that does not open
        ring_mod.DoorbellRing.open(Bell, lib=lib)
    Bell.request_value = 7
    with pytest.raises(ring_mod.RingError, match="handshake values"):
        ring_mod.DoorbellRing.open(Bell, lib=lib)
    with pytest.raises(ring_mod.RingError, match="no doorbell"):
        ring_mod.DoorbellRing.open(None, lib=lib)


def test_stub_fallback_matches_the_generated_stubs(group2):
    """descriptors.pb is current, and the fallback (no grpcio-tools) talks to a sidecar."""
    from arfuse import _proto

    assert _proto.descriptors_fresh(), \
        "protos changed: run `cd client/python && python3 -m arfuse._proto --descriptors`"
    code = (
        "import arfuse, arfuse._proto as p\n"
        "assert p.mode() == 'fallback', p.mode()\n"
        f"c = arfuse.Client({group2.socket(0)!r})\n"
        "n = c.negotiate('piecewise')\n"
        "op = arfuse.OpSpec(dtype='bf16', hidden=8, max_tokens=1)\n"
        "print(n.backend, n.cuda_graph_mode, op.to_proto().SerializeToString().hex())\n"
        "c.close()\n")
    env = dict(os.environ, ARFUSE_PROTO_FALLBACK="1",
               PYTHONPATH=str(REPO / "client" / "python"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    backend, mode, wire = p.stdout.split()
    assert (backend, mode) == ("mnnvl", "piecewise")
    assert wire == arfuse.OpSpec(dtype="bf16", hidden=8, max_tokens=1).to_proto() \
        .SerializeToString().hex()
