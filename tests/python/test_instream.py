"""arfuse.instream (the in-stream plane's ctypes binding) and the Client's attachment events.

What runs where:
- always: finding and loading libarfuse_client (search order, clear errors), the fd pickup's
  "unavailable" error, and the Python side of the session events (drain, re-initialization,
  poisoning, a sidecar that is gone) against real host-mode sidecars, with the C library
  replaced by a recorder of its calls (RecordingLib: it answers as arfuse_client.h says);
- when libarfuse_client is built (target arfuse_instream): the binding against the real library;
- when the sidecar serves Fusion.Attach and arfuse.fdpass is there: attach end to end in host
  mode, the fused op on known data in two ranks.
"""
import contextlib
import ctypes
import ctypes.util
import threading
import types

import grpc
import numpy as np
import pytest

import arfuse
from arfuse import _native, instream, instream_context
from conftest import Group
from fp8_values import e4m3_values
from instream_fakes import RecordingLib, bound_context, deliver_event

DRAIN = arfuse.fusion_pb2.AttachEvent.KIND_DRAIN
REINIT = arfuse.fusion_pb2.AttachEvent.KIND_REINITIALIZED
POISONED = arfuse.fusion_pb2.AttachEvent.KIND_POISONED


# ---- finding and loading the library ----

def test_library_search_order(tmp_path, monkeypatch):
    # The package as client/python/arfuse of a checkout, with builds and a stage folder beside.
    repo = tmp_path / "repo"
    pkg = repo / "client" / "python" / "arfuse"
    monkeypatch.setattr(_native, "PKG_DIR", pkg)
    monkeypatch.delenv("ARFUSE_CLIENT_LIB", raising=False)

    def put(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        return str(path)

    put(repo / "VERSION")
    put(repo / "CMakeLists.txt")
    put(repo / ".devstage" / "bin" / "libarfuse_client.so")
    put(repo / "build-x" / "client" / "instream" / "libarfuse_client.so")
    put(repo / "build" / "client" / "instream" / "libarfuse_client.so")
    # Nothing outside the package is searched: the loader's path by name then.
    assert instream.find_client_library() is None
    shipped = put(pkg / "libarfuse_client.so")
    assert instream.find_client_library() == shipped
    wheel = put(pkg / "_lib" / "libarfuse_client.so.0.1")
    assert instream.find_client_library() == wheel  # a wheel's copy first
    monkeypatch.setenv("ARFUSE_CLIENT_LIB", "/somewhere/libarfuse_client.so")
    assert instream.find_client_library() == "/somewhere/libarfuse_client.so"


def test_missing_library_is_unavailable_and_named(tmp_path):
    with pytest.raises(instream.InStreamError) as e:
        instream.load_library(str(tmp_path / "libarfuse_client.so"))
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "did not load" in e.value.message and "ARFUSE_CLIENT_LIB" in e.value.message


def test_a_library_without_the_abi_is_refused():
    libm = ctypes.util.find_library("m")
    if libm is None:
        pytest.skip("no libm to stand in for a library without arfuse_* symbols")
    with pytest.raises(instream.InStreamError) as e:
        instream.load_library(libm)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "arfuse_" in e.value.message


def test_fd_pickup_from_a_channel_that_is_not_there_names_it():
    resp = types.SimpleNamespace(fd_count=2, fd_socket="/nonexistent/rank0.sock.fd",
                                 fd_ticket="0" * 32)
    with pytest.raises(instream.InStreamError) as e:
        instream.pick_up_fds(resp, 1.0)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "2 descriptor(s)" in e.value.message
    assert "/nonexistent/rank0.sock.fd" in e.value.message


# ---- the Python side of the events, with the library replaced by a recorder ----

@pytest.fixture
def client(group2):
    c = arfuse.Client(group2.socket(0), client_name="instream-test")
    answered = []
    original = c.send_session_request
    c.send_session_request = lambda req: (answered.append(req.drained_attach_id), original(req))
    c.answered = answered
    yield c
    c.close()


def test_drain_of_an_idle_host_context_is_applied_and_answered_at_once(client):
    lib = RecordingLib(device_kind=2)
    ctx = bound_context(client, lib)
    deliver_event(client, DRAIN, lib.attach_id, "backend switch to trtllm")
    assert ctx.disabled == "drained"
    assert lib.calls == [("disable", "drained by the sidecar: backend switch to trtllm")]
    assert client.answered == [lib.attach_id]
    with pytest.raises(instream.Unavailable) as e:
        ctx.fused_allreduce_residual_rmsnorm(None, 1, 2, 2, 3, 4, 8, 256, "fp32", 1e-6)
    assert e.value.disabled == "drained" and "backend switch to trtllm" in e.value.message
    assert ctx.why_not(8, 256, "fp32").startswith("drained by the sidecar")


def test_drain_of_a_cuda_context_waits_for_the_last_launch_then_answers(client, monkeypatch):
    lib = RecordingLib(device_kind=1)
    ctx = bound_context(client, lib)
    waited, capturing = [], [True]
    monkeypatch.setattr(instream_context, "capturing", lambda stream: capturing[0])
    monkeypatch.setattr(instream_context, "wait_stream",
                        lambda stream, timeout: waited.append((stream, timeout)) or True)
    ctx.fused_allreduce_residual_rmsnorm(0x1234, 1, 2, 2, 3, 4, 8, 256, "fp32", 1e-6)
    deliver_event(client, DRAIN, lib.attach_id, "shutdown")
    # A CUDA context that launched: the session thread records the drain; nothing yet.
    assert ctx.disabled == "" and client.answered == [] and waited == []
    # The caller's next op applies it; inside a capture the answer waits (no synchronization).
    with pytest.raises(instream.Unavailable):
        ctx.fused_allreduce_residual_rmsnorm(0x1234, 1, 2, 2, 3, 4, 8, 256, "fp32", 1e-6)
    assert ctx.disabled == "drained" and client.answered == [] and waited == []
    # Outside capture, check() waits (bounded) for the last launch's stream, then answers.
    capturing[0] = False
    ctx.check()
    assert waited == [(0x1234, ctx.drain_wait_s)] and client.answered == [lib.attach_id]
    ctx.check()
    assert client.answered == [lib.attach_id]  # answered once


def test_drain_unanswered_while_the_last_launch_runs(client, monkeypatch, capsys):
    lib = RecordingLib(device_kind=1)
    ctx = bound_context(client, lib)
    monkeypatch.setattr(instream_context, "capturing", lambda stream: False)
    monkeypatch.setattr(instream_context, "wait_stream", lambda stream, timeout: False)
    ctx.fused_allreduce_residual_rmsnorm(5, 1, 2, 2, 3, 4, 8, 256, "fp32", 1e-6)
    deliver_event(client, DRAIN, lib.attach_id, "switch")
    ctx.check()
    assert ctx.disabled == "drained" and client.answered == []
    assert "did not finish" in capsys.readouterr().err


@pytest.mark.parametrize("kind, state, words", [
    (REINIT, "reinitialized", "workspace re-initialized (peer restarted): attach again"),
    (POISONED, "poisoned", "workspace poisoned: op 12 timed out"),
])
def test_reinitialized_and_poisoned_disable_with_the_reason(client, kind, state, words):
    lib = RecordingLib()
    ctx = bound_context(client, lib)
    deliver_event(client, kind, lib.attach_id,
                  "peer restarted" if kind == REINIT else "op 12 timed out")
    assert ctx.disabled == state and words in ctx.disabled_reason
    assert lib.calls[-1] == ("disable", ctx.disabled_reason)
    assert client.answered == []
    with pytest.raises(instream.Unavailable) as e:
        ctx.fused_allreduce_residual_rmsnorm(None, 1, 2, 2, 3, 4, 8, 256, "fp32", 1e-6)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and words in e.value.message


def test_events_before_the_context_is_bound_are_kept(client):
    lib = RecordingLib(attach_id=11)
    instream.attachments_of(client).expect(11)
    deliver_event(client, POISONED, 11, "early")  # between Attach's answer and arfuse_attach
    ctx = instream.InStreamContext(lib, object(), client,
                                   types.SimpleNamespace(attach_id=11), [256])
    instream.attachments_of(client).bind(11, ctx)
    assert ctx.disabled == "poisoned" and "early" in ctx.disabled_reason


def test_a_drain_for_an_unknown_attachment_is_answered_at_once(client):
    deliver_event(client, DRAIN, 99, "switch")
    assert client.answered == [99]


def test_a_sidecar_that_is_gone_disables_with_the_reason(arfused):
    g = Group(arfused, 2)
    try:
        c = arfuse.Client(g.socket(0), client_name="instream-test")
        lib = RecordingLib()
        ctx = bound_context(c, lib)
        assert ctx.supports(8, 256, "fp32") and not ctx.supports(65, 256, "fp32")
        g.procs[0].kill()
        assert c.wait_session_lost(10) is not None
        with pytest.raises(instream.Unavailable) as e:
            ctx.fused_allreduce_residual_rmsnorm(None, 1, 2, 2, 3, 4, 8, 256, "fp32", 1e-6)
        assert e.value.disabled == "sidecar gone"
        assert e.value.message.endswith(ctx.disabled_reason)
        assert ctx.disabled_reason.startswith("sidecar gone: session stream ended")
        # Detaching unmaps without asking the sidecar that is gone.
        ctx.detach()
        assert lib.detached and instream.attachments(c) == []
        c.close()
    finally:
        g.stop()


def test_closing_the_client_disables_its_contexts(group2):
    c = arfuse.Client(group2.socket(0))
    lib = RecordingLib()
    ctx = bound_context(c, lib)
    c.close()
    assert c.wait_session_lost(5) is None
    for _ in range(100):
        if ctx.disabled:
            break
        threading.Event().wait(0.02)
    assert ctx.disabled == "client closed"


def test_attach_failure_leaves_no_state(group2):
    """Whatever stops an attach (a sidecar without Fusion.Attach, no fd-socket client, a blob
    the library refuses), it raises an ArfuseError and the client holds nothing for it."""
    c = arfuse.Client(group2.socket(0))
    lib = RecordingLib()
    lib.arfuse_attach = lambda *a: (setattr(lib, "error", b"bad magic"),
                                    instream.INVALID_ARGUMENT)[1]
    try:
        with pytest.raises(arfuse.ArfuseError):
            instream.attach(c, [256], lib=lib, fd_pickup=lambda resp, t: [])
        assert instream.attachments(c) == [] and instream.attachments_of(c).expecting() == []
    finally:
        c.close()


# ---- the real library (when built) ----


def test_real_library_versions(real_lib):
    v = instream.library_versions(real_lib)
    assert v["attach_abi_version"] == instream.CLIENT_ABI_VERSION
    # kernels/instream/attach_abi.h: kLaunchAbiVersion, kLaunchArgsBytes.
    assert (v["launch_abi_version"], v["launch_args_bytes"]) == (4, 368)
    assert "stale" in instream.error_name(16, real_lib)


def test_real_library_refuses_a_malformed_blob(real_lib):
    handle = ctypes.c_void_p()
    arr = (ctypes.c_int * 1)()
    rc = real_lib.arfuse_attach(b"\0" * 64, 64, arr, 0, ctypes.byref(handle))
    assert rc == instream.INVALID_ARGUMENT
    assert real_lib.arfuse_last_error()


# ---- end to end (when the sidecar serves Fusion.Attach) ----

@contextlib.contextmanager
def attached_pair(arfused, hidden, dtype):
    """Two host-mode sidecars (max 16 tokens of `hidden`, `dtype`) and one attached in-stream
    context per rank; detached and stopped after. Skips where the attach does not complete."""
    g = Group(arfused, 2, hidden=hidden, max_tokens=16, dtype=dtype)
    clients = []
    try:
        clients = [arfuse.Client(g.socket(r)) for r in range(2)]
        for c in clients:
            c.wait_ready(30)
        try:
            ctxs = [c.attach([hidden]) for c in clients]
        except arfuse.ArfuseError as e:
            if e.code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE):
                pytest.skip(f"the in-stream attach does not complete here yet: {e}")
            raise
        yield ctxs
        for ctx in ctxs:
            ctx.detach()
    finally:
        for c in clients:
            c.close()
        g.stop()

def test_attach_end_to_end_host_mode(arfused, real_lib):
    hidden, tokens = 256, 4
    with attached_pair(arfused, hidden, "fp32") as ctxs:
        rng = np.random.default_rng(0)
        xs = [rng.standard_normal((tokens, hidden), dtype=np.float32) for _ in range(2)]
        res = rng.standard_normal((tokens, hidden), dtype=np.float32)
        gamma = rng.standard_normal(hidden, dtype=np.float32)
        outs = [(res.copy(), np.zeros_like(res)) for _ in range(2)]

        def run(r):
            r_out, n_out = outs[r]
            ctxs[r].fused_allreduce_residual_rmsnorm(
                None, xs[r].ctypes.data, r_out.ctypes.data, r_out.ctypes.data,
                n_out.ctypes.data, gamma.ctypes.data, tokens, hidden, "fp32", 1e-6)

        ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        want_r = xs[0] + xs[1] + res
        want_n = want_r / np.sqrt((want_r ** 2).mean(-1, keepdims=True) + 1e-6) * gamma
        for r in range(2):
            np.testing.assert_allclose(outs[r][0], want_r, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(outs[r][1], want_n, rtol=1e-5, atol=1e-5)
            ctxs[r].check()
            assert ctxs[r].info.device == "host" and ctxs[r].info.rank == r
        # Beyond the workspace: nothing launched, OUT_OF_RANGE.
        assert not ctxs[0].supports(17, hidden, "fp32")


# ---- validation rules of the binding ----

LIB_STUB = r"""
#include <stddef.h>
#include <stdint.h>
uint32_t arfuse_client_abi_version(void) { return 99; }
uint32_t arfuse_launch_abi_version(void) { return 1; }
uint32_t arfuse_launch_args_bytes(void) { return 352; }
const char* arfuse_client_version(void) { return "stub"; }
const char* arfuse_last_error(void) { return ""; }
int arfuse_attach(const void* b, size_t n, const int* f, size_t m, void** o) { return 3; }
int arfuse_detach(void* c) { return 0; }
int arfuse_ctx_get_info(const void* c, void* i) { return 0; }
int arfuse_supports(const void* c, int p, uint32_t t, uint32_t h, int d) { return 0; }
int arfuse_fused_allreduce_residual_rmsnorm(void* c, void* s, const void* a, const void* b,
    void* r, void* n, const void* g, uint32_t t, uint32_t h, int d, float e) { return 0; }
int arfuse_fused_allreduce(void* c, void* s, const void* a, void* o, uint32_t t, uint32_t h,
    int d) { return 0; }
int arfuse_check(void* c, uint32_t* code) { return 0; }
int arfuse_disable(void* c, const char* r) { return 0; }
const char* arfuse_error_name(uint32_t c) { return "none"; }
"""


def test_a_library_of_another_abi_is_refused(tmp_path):
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a library of another ABI")
    src, lib = tmp_path / "stub.c", tmp_path / "libarfuse_client.so"
    src.write_text(LIB_STUB)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    with pytest.raises(instream.InStreamError) as e:
        instream.load_library(str(lib))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "speaks client ABI 99" in e.value.message
    assert f"binds ABI {instream.CLIENT_ABI_VERSION}" in e.value.message


def test_fd_pickup_count_must_match(monkeypatch):
    import os

    picked = []

    def pickup(path, ticket, timeout):
        fd = os.dup(0)
        picked.append(fd)
        return [fd]

    from arfuse import fdpass
    monkeypatch.setattr(fdpass, "pickup", pickup)
    resp = types.SimpleNamespace(fd_count=2, fd_socket="/x.fd", fd_ticket="t")
    with pytest.raises(instream.InStreamError) as e:
        instream.pick_up_fds(resp, 1.0)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "picked up 1 descriptors, the attach announced 2" in e.value.message
    with pytest.raises(OSError):
        os.fstat(picked[0])  # closed again


def fake_attach_response(attach_id, fd_count=0):
    return types.SimpleNamespace(attach_id=attach_id, generation=3, attach_blob=b"blob",
                                 fd_count=fd_count, fd_ticket="t" if fd_count else "",
                                 fd_socket="/x.fd" if fd_count else "", memory_kind="host_shm",
                                 image_bytes=0)


def test_attach_binds_the_context_and_detach_tells_the_sidecar(group2, monkeypatch):
    """attach()'s orchestration with the RPC answered by the test (the sidecar's Fusion.Attach
    is not what is under test here) and the library recorded."""
    c = arfuse.Client(group2.socket(0))
    lib = RecordingLib(attach_id=7)
    lib.arfuse_attach = lambda blob, n, fds, nfds, out: (lib.calls.append(("attach", blob, nfds)),
                                                         0)[1]
    requests, detached, handed = [], [], []
    monkeypatch.setattr(c, "attach_rpc",
                        lambda req, timeout=None: (requests.append(req),
                                                   fake_attach_response(7, fd_count=1))[1])
    monkeypatch.setattr(c, "detach_rpc", lambda attach_id, timeout=None:
                        detached.append(attach_id))
    try:
        import os
        ctx = instream.attach(c, [256, 512], lib=lib,
                              fd_pickup=lambda resp, t: (handed.append(os.dup(0)), handed)[1])
        req = requests[0]
        assert list(req.hidden) == [256, 512]
        assert (req.attach_abi_version, req.launch_abi_version, req.launch_args_bytes) == \
            (instream.CLIENT_ABI_VERSION, 4, 368)
        assert lib.calls[0] == ("attach", b"blob", 1)
        with pytest.raises(OSError):
            os.fstat(handed[0])  # the caller's descriptors are closed after arfuse_attach
        assert instream.attachments(c) == [ctx] and ctx.attach_id == 7 and ctx.hiddens == [256, 512]
        assert ctx.info.device == "host" and ctx.info.memory_kind == "host_shm"
        ctx.detach()
        assert detached == [7] and instream.attachments(c) == [] and lib.detached
        ctx.detach()  # idempotent
        assert detached == [7]
        with pytest.raises(instream.InStreamError, match="detached"):
            ctx.check()
    finally:
        c.close()


def test_attach_refuses_a_blob_of_another_attachment(group2, monkeypatch):
    c = arfuse.Client(group2.socket(0))
    lib = RecordingLib(attach_id=7)
    lib.arfuse_attach = lambda *a: 0
    detached = []
    monkeypatch.setattr(c, "attach_rpc", lambda req, timeout=None: fake_attach_response(5))
    monkeypatch.setattr(c, "detach_rpc", lambda attach_id, timeout=None:
                        detached.append(attach_id))
    try:
        with pytest.raises(instream.InStreamError) as e:
            instream.attach(c, [256], lib=lib)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "names attachment 7, the response 5" in e.value.message
        assert lib.detached and detached == [5] and instream.attachments(c) == []
    finally:
        c.close()


def test_after_a_vote_a_drain_waits_for_the_next_agreement_point(client, monkeypatch):
    lib = RecordingLib(device_kind=1)
    ctx = bound_context(client, lib)
    monkeypatch.setattr(instream_context, "capturing", lambda stream: False)
    monkeypatch.setattr(instream_context, "wait_stream", lambda stream, timeout: True)
    ctx.poll(at_agreement=True)  # the ranks voted: fused
    ctx.fused_allreduce_residual_rmsnorm(0x1234, 1, 2, 2, 3, 4, 8, 256, "fp32", 1e-6)
    deliver_event(client, DRAIN, lib.attach_id, "backend switch to mnnvl")
    # Between the vote and the next one, ops and checks launch and answer nothing.
    ctx.fused_allreduce_residual_rmsnorm(0x1234, 1, 2, 2, 3, 4, 8, 256, "fp32", 1e-6)
    ctx.check()
    assert ctx.disabled == "" and client.answered == [] and ctx.launches == 2
    # The next vote applies it and answers (the last launch waited for).
    ctx.poll(at_agreement=True)
    assert ctx.disabled == "drained" and client.answered == [lib.attach_id]
    with pytest.raises(instream.Unavailable):
        ctx.fused_allreduce_residual_rmsnorm(0x1234, 1, 2, 2, 3, 4, 8, 256, "fp32", 1e-6)


def test_after_a_vote_a_poisoning_still_applies_at_the_next_op(client):
    lib = RecordingLib(device_kind=1)
    ctx = bound_context(client, lib)
    ctx.poll(at_agreement=True)
    ctx.fused_allreduce_residual_rmsnorm(0x1234, 1, 2, 2, 3, 4, 8, 256, "fp32", 1e-6)
    deliver_event(client, POISONED, lib.attach_id, "timeout: a peer did not arrive")
    with pytest.raises(instream.Unavailable) as e:
        ctx.fused_allreduce_residual_rmsnorm(0x1234, 1, 2, 2, 3, 4, 8, 256, "fp32", 1e-6)
    assert e.value.disabled == "poisoned"


# ---- the FP8 patterns (arfuse_fused_allreduce_residual_rmsnorm_fp8) ----

def test_fp8_binding_hands_the_library_its_numbers():
    from instream_fakes import unbound_context

    lib = RecordingLib()
    ctx = unbound_context(lib)
    ctx.fused_allreduce_residual_rmsnorm_fp8(None, 1, 2, 3, None, 5, 6, 7, 8, 256, "bf16", 1e-6,
                                             "per_group", "ue8m0_packed")
    assert lib.calls[-1] == ("launch_fp8", None, 8, 256, 1, 3, 3, True, 6)
    ctx.fused_allreduce_residual_rmsnorm_fp8(0x10, 1, 2, 3, 4, 5, 6, 7, 2, 128, "fp16", 1e-6,
                                             "static")
    assert lib.calls[-1] == ("launch_fp8", 0x10, 2, 128, 2, 1, 0, False, 6)
    # Numbers pass through (the library judges them); unknown names are the binding's error.
    ctx.fused_allreduce_residual_rmsnorm_fp8(None, 1, 2, 3, 4, 5, 6, 7, 2, 128, "fp16", 1e-6, 9, 7)
    assert lib.calls[-1][5:7] == (9, 7)
    with pytest.raises(ValueError, match="quant 'dynamic'"):
        ctx.fused_allreduce_residual_rmsnorm_fp8(None, 1, 2, 3, 4, 5, 6, 7, 2, 128, "fp16", 1e-6,
                                                 "dynamic")
    with pytest.raises(ValueError, match="scale layout 'mn'"):
        ctx.fused_allreduce_residual_rmsnorm_fp8(None, 1, 2, 3, 4, 5, 6, 7, 2, 128, "fp16", 1e-6,
                                                 "per_group", "mn")
    assert [instream.fp8_pattern(q) for q in ("static", "per_token", "per_group")] == \
        [instream.PATTERN_FP8_STATIC, instream.PATTERN_FP8_PER_TOKEN,
         instream.PATTERN_FP8_PER_GROUP] == [3, 4, 5]
    ctx.disable("drained")
    with pytest.raises(instream.Unavailable):
        ctx.fused_allreduce_residual_rmsnorm_fp8(None, 1, 2, 3, 4, 5, 6, 7, 2, 128, "fp16", 1e-6,
                                                 "per_token")


def test_fp8_scale_tensors_span_the_formats_extents():
    # kernels/quant/fp8_format.h's GroupScaleElements: row-major T * G, the token-contiguous
    # layouts (columns - 1) * A + T with A = T rounded up to 4.
    t = instream.fp8_scale_tensor
    assert t("static", 5, 512) == ((1,), (1,), "float32")
    assert t("per_token", 5, 512) == ((5, 1), (1, 1), "float32")
    assert t("per_group", 5, 512, "fp32_row_major") == ((5, 4), (4, 1), "float32")
    assert t("per_group", 5, 512, "fp32_mn_major") == ((5, 4), (1, 8), "float32")
    assert t("per_group", 5, 640, "ue8m0_packed") == ((5, 2), (1, 8), "int32")
    e = instream.fp8_scale_elements
    assert e("per_group", 5, 512, "fp32_row_major") == 20
    assert e("per_group", 5, 512, "fp32_mn_major") == 3 * 8 + 5
    assert e("per_group", 5, 512, "ue8m0_packed") == 5
    assert e("per_group", 5, 640, "ue8m0_packed") == 8 + 5
    assert e("per_token", 7, 128) == 7 and e("static", 7, 128) == 1
    assert e("per_group", 0, 128, "fp32_mn_major") == 0


def test_fp8_end_to_end_host_mode(arfused, real_lib):
    """Two ranks through the sidecar's attach and the real library: the codes, dequantized with
    their scales, are the normalized value to E4M3's precision (the bit-exact comparison with the
    CPU reference is tests/instream/instream_host_test.cc's)."""
    hidden, tokens = 256, 5
    with attached_pair(arfused, hidden, "fp16") as ctxs:
        rng = np.random.default_rng(1)
        xs = [rng.standard_normal((tokens, hidden)).astype(np.float16) for _ in range(2)]
        res = rng.standard_normal((tokens, hidden)).astype(np.float16)
        gamma = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float16)
        values = e4m3_values()
        for quant, layout in (("per_token", None), ("per_group", "fp32_row_major")):
            outs = [dict(r=np.zeros_like(res), q=np.zeros((tokens, hidden), np.uint8),
                         s=np.zeros(instream.fp8_scale_elements(quant, tokens, hidden, layout),
                                    np.float32)) for _ in range(2)]

            def run(r):
                o = outs[r]
                ctxs[r].fused_allreduce_residual_rmsnorm_fp8(
                    None, xs[r].ctypes.data, res.ctypes.data, o["r"].ctypes.data, None,
                    o["q"].ctypes.data, o["s"].ctypes.data, gamma.ctypes.data, tokens, hidden,
                    "fp16", 1e-6, quant, layout)

            ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(30)
            y = outs[0]["r"].astype(np.float64)
            x = y / np.sqrt((y ** 2).mean(-1, keepdims=True) + 1e-6) * gamma.astype(np.float64)
            for r in range(2):
                np.testing.assert_array_equal(outs[r]["q"], outs[0]["q"])
                s = outs[r]["s"].reshape(tokens, -1).astype(np.float64)
                per = np.repeat(s, hidden // s.shape[1], axis=1)
                got = values[outs[r]["q"]] * per
                # E4M3 keeps 3 fraction bits: half a step is 2^-4 of the value, plus the smallest
                # subnormal step for values near 0.
                np.testing.assert_allclose(got, x, rtol=2 ** -4 + 1e-3, atol=per.max() * 2 ** -9)
                ctxs[r].check()
        # fp32 input is not served by the FP8 patterns.
        assert "takes bf16 or fp16 input" in ctxs[0].why_not(1, hidden, "fp32",
                                                             instream.PATTERN_FP8_PER_TOKEN)
