"""allreduce_fusion's answer when the fused path cannot run an op (docs/config.md, "Fallback
honesty"): the sidecar refuses it with OUT_OF_RANGE ("fusion unavailable for this op: ...", larger
than the workspace or another dtype) and the call returns None, as FlashInfer's fused op returns
nothing, so the framework's own path runs. The workspace stays available for the next op."""
import grpc
import pytest

import arfuse
from arfuse import common_pb2

H, T = 64, 4
F32 = 4


class FakeClient:
    """The parts of arfuse.Client that FusionWorkspace and allreduce_fusion use; Execute answers
    with the code a test sets."""

    def __init__(self, code=None, message=""):
        self.code = code
        self.message = message
        self.executed = 0
        self.info_calls = 0

    def register_host_shm(self, name, shm_name, byte_size):
        return arfuse.Region(id=1, generation=1, name=name, byte_size=byte_size)

    def register_host_fd(self, name, fd, byte_size):
        return arfuse.Region(id=1, generation=1, name=name, byte_size=byte_size)

    def workspace_info(self, timeout=None):
        self.info_calls += 1
        return arfuse.fusion_pb2.GetWorkspaceInfoResponse(
            fusion_enabled=True, state=common_pb2.WORKSPACE_STATE_READY)

    def execute_op(self, op, num_tokens, wait_event=b"", timeout=None):
        self.executed += 1
        if self.code is not None:
            raise arfuse.ArfuseError(self.code, self.message)
        return arfuse.fusion_pb2.ExecuteResponse(path=common_pb2.EXEC_PATH_HOST)

    def raise_if_lost(self, grace=0.0):
        pass


@pytest.fixture
def tensors():
    buf = arfuse.HostShmBuffer(4 * T * H * F32)
    views = [buf.view("fp32", T * H, i * T * H * F32) for i in range(3)]
    views.append(buf.view("fp32", H, 3 * T * H * F32))
    yield buf, views
    for v in views:
        v.release()
    buf.close()


def call(client, buf, views):
    ws = arfuse.FusionWorkspace(client)
    ws.register(buf)
    x, res, y, g = views
    out = arfuse.allreduce_fusion(input=x.reshape(T, H), workspace=ws, residual_in=res,
                                  norm_out=y, rms_gamma=g)
    return ws, out


def test_out_of_range_op_returns_none_and_keeps_the_workspace_available(tensors):
    buf, views = tensors
    client = FakeClient(grpc.StatusCode.OUT_OF_RANGE,
                        "fusion unavailable for this op: 4096 tokens exceed the workspace's 2048")
    ws, out = call(client, buf, views)
    assert out is None  # the framework's own path takes the op
    assert client.executed == 1
    # Only this op was unavailable: the next one asks the sidecar again without a recheck.
    client.code = None
    x, res, y, g = views
    out = arfuse.allreduce_fusion(input=x.reshape(T, H), workspace=ws, residual_in=res,
                                  norm_out=y, rms_gamma=g)
    assert out is y
    assert client.executed == 2
    assert client.info_calls == 1


def test_other_refusals_still_raise(tensors):
    buf, views = tensors
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
        client = FakeClient(code, "bad op")
        with pytest.raises(arfuse.ArfuseError) as e:
            call(client, buf, views)
        assert e.value.code == code and "bad op" in e.value.message


def test_unavailable_group_returns_none_and_marks_the_workspace(tensors):
    buf, views = tensors
    client = FakeClient(grpc.StatusCode.UNAVAILABLE, "engine initializing")
    ws, out = call(client, buf, views)
    assert out is None
    assert ws._available is False  # rechecked before the next op
