"""The Python client against real host-mode sidecars: sessions, regions, plans, the eager op,
allreduce_fusion, and bad input answered with specific codes."""
import math
import threading
import time

import grpc
import pytest

import arfuse
from arfuse import common_pb2

H, T = 64, 4
F32 = 4


def wait_ready(client, timeout=60):
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        info = client.workspace_info()
        if info.state == common_pb2.WORKSPACE_STATE_READY:
            return info
        time.sleep(0.05)
    raise AssertionError(f"workspace not ready: {info.reason}")


def run_ranks(fn, world):
    results, errors = {}, []

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # surfaced below
            errors.append((r, e))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def input_value(rank, i):
    return float((i * 7 + rank * 13) % 17 - 8) / 8.0


def expected(world, t, h, residual, gamma, eps):
    s = [sum(input_value(r, t * H + k) for r in range(world)) + residual for k in range(H)]
    inv = 1.0 / math.sqrt(sum(v * v for v in s) / H + eps)
    return s, [v * inv * gamma for v in s]


def test_session_identity(group2):
    with arfuse.Client(group2.socket(1)) as c:
        # 128 random bits as 32 lowercase hex characters.
        assert len(c.session_token) == 32 and int(c.session_token, 16) >= 0
        assert c.device == common_pb2.DEVICE_KIND_HOST
        assert c.rank == 1 and c.world_size == 2
        assert c.server_api[0] == 1


def test_allreduce_fusion_two_ranks(group2):
    eps = 1e-6

    def rank(r):
        with arfuse.Client(group2.socket(r), client_name=f"py{r}") as c:
            wait_ready(c)
            ws = arfuse.FusionWorkspace(c)
            buf = arfuse.HostShmBuffer(4 * T * H * F32)
            ws.register(buf, "tensors")
            x = buf.view("fp32", T * H, 0)
            res = buf.view("fp32", T * H, T * H * F32)
            y = buf.view("fp32", T * H, 2 * T * H * F32)
            g = buf.view("fp32", H, 3 * T * H * F32)
            for i in range(T * H):
                x[i] = input_value(r, i)
                res[i] = 0.5
            for i in range(H):
                g[i] = 2.0
            out = arfuse.allreduce_fusion(input=x.reshape(T, H), workspace=ws, residual_in=res,
                                          residual_out=res, norm_out=y, rms_gamma=g,
                                          rms_eps=eps)
            assert out is y
            got = ([res[i] for i in range(T * H)], [y[i] for i in range(T * H)])
            for v in (x, res, y, g):
                v.release()
            buf.close()
            return got

    results = run_ranks(rank, 2)
    for t in range(T):
        want_res, want_norm = expected(2, t, H, 0.5, 2.0, eps)
        for r in range(2):
            got_res, got_norm = results[r]
            for k in range(H):
                assert got_res[t * H + k] == pytest.approx(want_res[k], abs=0)
                assert got_norm[t * H + k] == pytest.approx(want_norm[k], rel=1e-5, abs=1e-6)
    # Every rank got bit-identical outputs.
    assert results[0] == results[1]


def test_plan_execute_and_bad_input(group2):
    def rank(r):
        with arfuse.Client(group2.socket(r)) as c:
            wait_ready(c)
            buf = arfuse.HostShmBuffer(4 * T * H * F32, named=True)
            region = c.register_host_shm("buf", buf.shm_name, buf.byte_size)
            op = arfuse.OpSpec(pattern="allreduce", dtype="fp32", hidden=H, max_tokens=T,
                               input=arfuse.TensorLoc(region, 0),
                               output=arfuse.TensorLoc(region, T * H * F32))
            plan = c.create_plan(op)
            x = buf.view("fp32", T * H, 0)
            out = buf.view("fp32", T * H, T * H * F32)
            for i in range(T * H):
                x[i] = float(r + 1)
            resp = c.execute(plan, T)
            assert resp.path == common_pb2.EXEC_PATH_HOST
            assert all(out[i] == 3.0 for i in range(T * H))
            errors = {}
            if r == 0:
                # Only rank 0 sends bad input: each is refused before any collective work.
                def code_of(fn):
                    with pytest.raises(arfuse.ArfuseError) as e:
                        fn()
                    return e.value.code, e.value.message

                errors["dup"] = code_of(lambda: c.register_host_shm("buf", buf.shm_name, 64))
                errors["cuda"] = code_of(lambda: c.register_cuda_ipc("g", b"x" * 64, 0, 64))
                errors["short"] = code_of(lambda: c.register_cuda_ipc("g", b"x" * 10, 0, 64))
                errors["big"] = code_of(
                    lambda: c.register_host_shm("big", buf.shm_name, buf.byte_size + 1))
                errors["stale"] = code_of(lambda: c.execute(
                    arfuse.Plan(plan.id, plan.generation ^ 1, 0, ""), 1))
                errors["unknown"] = code_of(lambda: c.execute(
                    arfuse.Plan(plan.id + 99, plan.generation, 0, ""), 1))
                errors["tokens"] = code_of(lambda: c.execute(plan, T + 1))
                bad = arfuse.OpSpec(pattern="allreduce", dtype="fp32", hidden=12, max_tokens=1,
                                    input=arfuse.TensorLoc(region, 0),
                                    output=arfuse.TensorLoc(region, 0))
                errors["hidden"] = code_of(lambda: c.create_plan(bad))
                mis = arfuse.OpSpec(pattern="allreduce", dtype="fp32", hidden=H, max_tokens=1,
                                    input=arfuse.TensorLoc(region, 8),
                                    output=arfuse.TensorLoc(region, 8))
                errors["align"] = code_of(lambda: c.create_plan(mis))
            resp = c.execute(plan, T)  # still serving after the bad input
            assert resp.path == common_pb2.EXEC_PATH_HOST
            x.release()
            out.release()
            buf.close()
            return errors

    errors = run_ranks(rank, 2)[0]
    SC = grpc.StatusCode
    assert errors["dup"][0] == SC.ALREADY_EXISTS and "already registered" in errors["dup"][1]
    assert errors["cuda"][0] == SC.INVALID_ARGUMENT and "not cuda_ipc" in errors["cuda"][1]
    assert errors["short"][0] == SC.INVALID_ARGUMENT
    assert errors["big"][0] == SC.INVALID_ARGUMENT and "exceeds the exported" in errors["big"][1]
    assert errors["stale"][0] == SC.FAILED_PRECONDITION and "stale generation" in errors["stale"][1]
    assert errors["unknown"][0] == SC.PERMISSION_DENIED
    assert "not held by this session" in errors["unknown"][1]
    assert errors["tokens"][0] == SC.INVALID_ARGUMENT and "max_tokens" in errors["tokens"][1]
    assert errors["hidden"][0] == SC.INVALID_ARGUMENT and "multiple of 8" in errors["hidden"][1]
    assert errors["align"][0] == SC.INVALID_ARGUMENT and "multiple of 16" in errors["align"][1]


class HostTensors:
    """input, residual, norm_out and gamma views (fp32, T x H) in one registered host buffer."""

    def __init__(self, ws):
        self.buf = arfuse.HostShmBuffer(4 * T * H * F32)
        ws.register(self.buf)
        self.x = self.buf.view("fp32", T * H, 0)
        self.res = self.buf.view("fp32", T * H, T * H * F32)
        self.y = self.buf.view("fp32", T * H, 2 * T * H * F32)
        self.g = self.buf.view("fp32", H, 3 * T * H * F32)
        self.call = dict(input=self.x.reshape(T, H), workspace=ws, residual_in=self.res,
                         norm_out=self.y, rms_gamma=self.g)

    def close(self):
        for v in (self.x, self.res, self.y, self.g):
            v.release()
        self.buf.close()


def test_allreduce_fusion_returns_none_while_unavailable(lonely):
    with arfuse.Client(lonely.socket(0)) as c:
        t = HostTensors(arfuse.FusionWorkspace(c))
        with pytest.warns(arfuse.FusionUnavailableWarning, match="initializing"):
            out = arfuse.allreduce_fusion(**t.call)
        assert out is None  # rank 1 never came: the framework keeps its own path
        t.close()


def test_other_api_version_is_refused(group2):
    with arfuse.Client(group2.socket(0)) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.stub.GetWorkspaceInfo(arfuse.fusion_pb2.GetWorkspaceInfoRequest(),
                                    metadata=[("arfuse-api-version", "2.0")], timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "2.0" in e.value.details() and "1.1" in e.value.details()


def test_keepalive_outside_its_range_is_refused(tmp_path):
    for bad in (0.5, 0.0, 7201.0):
        with pytest.raises(arfuse.ArfuseError) as e:
            arfuse.Client(str(tmp_path / "none.sock"), keepalive_time=bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "keepalive_time must be within 1..7200 s" in e.value.message


def test_connect_to_nothing_is_unavailable(tmp_path):
    with pytest.raises(arfuse.ArfuseError) as e:
        arfuse.Client(str(tmp_path / "none.sock"), connect_timeout=0.5)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no arfused answers" in e.value.message


def test_torch_cuda_region(group2):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    buf = arfuse.CudaBuffer(1 << 20)
    t = buf.tensor(torch.bfloat16, (16, 64))
    t.fill_(1.0)
    assert t.data_ptr() == buf.base_address
    assert len(buf.ipc_handle) == 64
    del t
    buf.close()
