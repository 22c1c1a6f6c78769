"""docs/security.md from the Python client: host memory by sealed memfd over the fd channel (the
default), the seal the sidecar requires, single-use tickets, and what an oversized metadata
value costs."""
import fcntl
import os

import grpc
import pytest

import arfuse
from arfuse import fdpass
from arfuse.client import METADATA_CLOSED_CONNECTION, fusion_pb2

H, T = 64, 4
F32 = 4


@pytest.fixture
def one(arfused):
    from conftest import Group

    g = Group(arfused, 1, hidden=H, max_tokens=T)
    yield g
    g.stop()


def test_host_buffers_are_sealed_memfds_registered_by_descriptor(one):
    buf = arfuse.HostShmBuffer(4096)
    assert buf.fd is not None and buf.shm_name is None
    seals = fcntl.fcntl(buf.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_SEAL
    with pytest.raises(OSError):
        os.ftruncate(buf.fd, 0)  # the seal holds
    with arfuse.Client(one.socket(0)) as c:
        ws = arfuse.FusionWorkspace(c)
        region = ws.register(buf, "sealed")
        assert [r.name for r in c.list_regions()] == ["sealed"]
        x = buf.view("fp32", T * H, 0)
        for i in range(T * H):
            x[i] = float(i)
        plan = c.create_plan(arfuse.OpSpec(pattern="allreduce", dtype="fp32", hidden=H,
                                           max_tokens=T, input=arfuse.TensorLoc(region, 0),
                                           output=arfuse.TensorLoc(region, T * H * F32)))
        c.execute(plan, T)
        out = buf.view("fp32", T * H, T * H * F32)
        assert out[T * H - 1] == float(T * H - 1)
        x.release()
        out.release()
    buf.close()


def test_an_unsealed_memfd_is_refused_naming_the_seal(one):
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    with arfuse.Client(one.socket(0)) as c:
        with pytest.raises(arfuse.ArfuseError) as e:
            c.register_host_fd("r", fd, 4096)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "F_SEAL_SHRINK" in e.value.message
    os.close(fd)


def test_a_ticket_is_claimed_once(one):
    buf = arfuse.HostShmBuffer(4096)
    with arfuse.Client(one.socket(0)) as c:
        ticket = fdpass.deposit(c.fd_channel_path(), [buf.fd])
        assert len(ticket) == 32
        req = fusion_pb2.RegisterRegionRequest(
            name="a", byte_size=4096, host_fd=fusion_pb2.HostFdMemory(fd_ticket=ticket))
        c._call(c.stub.RegisterRegion, req)
        req.name = "b"
        with pytest.raises(arfuse.ArfuseError) as e:
            c._call(c.stub.RegisterRegion, req)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "fd ticket unknown, expired or not the caller's" in e.value.message
        assert ticket not in e.value.message
    buf.close()


def test_the_fd_channel_refuses_garbage_and_a_pickup_of_nothing(one):
    with pytest.raises(fdpass.FdChannelError) as e:
        fdpass.pickup(fdpass.channel_path(one.socket(0)), "0" * 32)
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(fdpass.FdChannelError) as e:
        fdpass.deposit(fdpass.channel_path(one.socket(0)), [])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_oversized_metadata_says_what_was_lost(one):
    with arfuse.Client(one.socket(0)) as c:
        md = [("arfuse-api-version", "1.1"), ("arfuse-session", c.session_token)]
        # 32 KiB is within the limit: the call is served and the session stays.
        c.stub.ListRegions(fusion_pb2.ListRegionsRequest(), metadata=md + [("x", "a" * 32768)],
                           timeout=10)
        assert c.session_lost is None
        # Past it gRPC 1.51 closes the whole connection, and the session with it: the client
        # says so instead of a bare RESOURCE_EXHAUSTED.
        with pytest.raises(grpc.RpcError) as e:
            c.stub.ListRegions(fusion_pb2.ListRegionsRequest(),
                               metadata=md + [("x", "a" * (80 << 10))], timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert c.wait_session_lost(10) == METADATA_CLOSED_CONNECTION
        with pytest.raises(arfuse.ArfuseError) as later:
            c.list_regions()
        assert "regions and plans were released" in later.value.message
