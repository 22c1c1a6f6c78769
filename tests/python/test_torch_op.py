"""arfuse.torch (the torch ops) and the SGLang shim's torch side. PyTorch is not installed in CI:
these skip there and run on the GPU machine (CPU tensors suffice; docs/integration.md).

The ops' launches go to RecordingLib (instream_fakes.py), so what is tested here is the torch
layer: registration, fake implementations under tracing, eligibility and the (None, None)
rules, the ranks' vote. The fused op on real data runs in test_instream.py (host mode, when the
sidecar serves Fusion.Attach) and in tp_decode on the GPU."""
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (too big for CI): these run on the GPU machine")

import arfuse.torch as aft  # noqa: E402
from arfuse import instream  # noqa: E402
from instream_fakes import RecordingLib, unbound_context  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def host_ctx():
    lib = RecordingLib(device_kind=2)
    ctx = unbound_context(lib)
    aft.set_context(ctx, "cpu")
    yield ctx, lib
    aft.set_context(None, "cpu")


def tensors(tokens=8, hidden=256, dtype=torch.float32):
    x = torch.randn(tokens, hidden, dtype=dtype)
    r = torch.randn(tokens, hidden, dtype=dtype)
    w = torch.randn(hidden, dtype=dtype)
    return x, r, w


def test_ops_are_registered_with_fake_implementations(host_ctx):
    from torch.fx.experimental.proxy_tensor import make_fx

    aft.register_ops()
    x, r, w = tensors()

    def f(x, r, w):
        n, res = torch.ops.arfuse.fused_allreduce_residual_rmsnorm(x, r, w, 1e-6)
        return n + res

    gm = make_fx(f, tracing_mode="fake")(x, r, w)
    assert "arfuse.fused_allreduce_residual_rmsnorm" in str(gm.graph)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx_, fr, fw = (mode.from_tensor(t) for t in (x, r, w))
        n, res = torch.ops.arfuse.fused_allreduce_residual_rmsnorm(fx_, fr, fw, 1e-6)
        assert n.shape == x.shape and res.shape == r.shape and n.dtype == x.dtype
        out = torch.ops.arfuse.fused_allreduce(fx_)
        assert out.shape == x.shape
    # The functional op declares no mutation; the in-place one its two outputs.
    schema = torch.ops.arfuse.fused_allreduce_residual_rmsnorm.default._schema
    assert not any(a.alias_info and a.alias_info.is_write for a in schema.arguments)
    schema_ = torch.ops.arfuse.fused_allreduce_residual_rmsnorm_.default._schema
    written = [a.name for a in schema_.arguments if a.alias_info and a.alias_info.is_write]
    assert written == ["residual", "norm_out"]


def test_torch_compile_traces_the_op(host_ctx):
    ctx, lib = host_ctx
    x, r, w = tensors()

    @torch.compile(backend="eager", fullgraph=True)
    def f(x, r, w):
        return torch.ops.arfuse.fused_allreduce_residual_rmsnorm(x, r, w, 1e-6)

    n, res = f(x, r, w)
    assert n.shape == x.shape and lib.calls[-1][:5] == ("launch", None, 8, 256, 3)


def test_the_op_launches_on_fresh_outputs(host_ctx):
    ctx, lib = host_ctx
    x, r, w = tensors()
    r0 = r.clone()
    n, res = aft.fused_allreduce_residual_rmsnorm(x, r, w, 1e-5)
    assert n.shape == x.shape and res.shape == r.shape
    assert n.data_ptr() not in (x.data_ptr(), r.data_ptr())
    assert torch.equal(r, r0)  # nothing mutated
    assert lib.calls[-1] == ("launch", None, 8, 256, 3, False)
    # In place: residual is both residual_in and residual_out.
    y = torch.empty_like(x)
    assert aft.fused_allreduce_residual_rmsnorm_(x, r, w, 1e-5, y) is True
    assert lib.calls[-1] == ("launch", None, 8, 256, 3, True)
    assert aft.fused_allreduce(x) is not None and lib.calls[-1][0] == "allreduce"


@pytest.mark.parametrize("make, words", [
    (lambda: (torch.randn(256, 8).t(), torch.randn(8, 256), torch.randn(256)), "not contiguous"),
    (lambda: (torch.randn(8, 256), torch.randn(8, 256), torch.randn(256, dtype=torch.bfloat16)),
     "dtypes differ"),
    (lambda: (torch.randn(65, 256), torch.randn(65, 256), torch.randn(256)), "beyond"),
    (lambda: (torch.randn(8, 256), torch.randn(4, 256), torch.randn(256)), "differs"),
    (lambda: (torch.randn(8, 256, dtype=torch.float64),) * 2 + (torch.randn(256),), "dtype"),
])
def test_not_served_fused_is_none_none(host_ctx, make, words):
    ctx, lib = host_ctx
    x, r, w = make()
    launches = len(lib.calls)
    assert aft.fused_allreduce_residual_rmsnorm(x, r, w) == (None, None)
    assert words in aft.why_not(x, r, w)
    assert len(lib.calls) == launches
    assert aft.fused_allreduce_residual_rmsnorm_(x, r, w, 1e-6, torch.empty_like(x)) is False


def test_no_context_is_none_none_and_the_raw_op_raises():
    aft.set_context(None, "cpu")
    x, r, w = tensors()
    assert aft.fused_allreduce_residual_rmsnorm(x, r, w) == (None, None)
    assert "no in-stream context" in aft.why_not(x, r, w)
    aft.register_ops()
    with pytest.raises(instream.Unavailable, match="no in-stream context"):
        torch.ops.arfuse.fused_allreduce_residual_rmsnorm(x, r, w, 1e-6)


def test_drained_falls_back_but_a_failed_workspace_raises(host_ctx):
    ctx, lib = host_ctx
    x, r, w = tensors()
    ctx.on_session_event(instream.EVENT_DRAIN, "switch")
    assert aft.fused_allreduce_residual_rmsnorm(x, r, w) == (None, None)
    lib2 = RecordingLib(device_kind=2)
    ctx2 = unbound_context(lib2)
    aft.set_context(ctx2, "cpu")
    ctx2.on_session_event(instream.EVENT_POISONED, "op 3 timed out")
    with pytest.raises(instream.Unavailable) as e:
        aft.fused_allreduce_residual_rmsnorm(x, r, w)
    assert e.value.disabled == "poisoned" and "op 3 timed out" in e.value.message
    assert "op 3 timed out" in aft.why_not(x, r, w)


def test_max_fused_tokens(host_ctx):
    assert aft.max_fused_tokens(256, torch.float32) == 64  # RecordingLib: tokens <= 64


FP8_LAYOUTS = [("per_token", None, (8, 1), (1, 1), torch.float32),
               ("per_group", "fp32_row_major", (8, 2), (2, 1), torch.float32),
               ("per_group", "fp32_mn_major", (8, 2), (1, 8), torch.float32),
               ("per_group", "ue8m0_packed", (8, 1), (1, 8), torch.int32)]


@pytest.mark.parametrize("quant, layout, shape, strides, dtype", FP8_LAYOUTS)
def test_fp8_op_has_a_fake_with_the_layouts_shapes_and_strides(host_ctx, quant, layout, shape,
                                                               strides, dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    aft.register_ops()
    x, r, w = tensors(dtype=torch.bfloat16)
    q, lay = instream.quant_code(quant), instream.scale_layout_code(layout)
    with FakeTensorMode() as mode:
        fx_, fr, fw = (mode.from_tensor(t) for t in (x, r, w))
        codes, res, scale = torch.ops.arfuse.fused_allreduce_residual_rmsnorm_fp8(
            fx_, fr, fw, 1e-6, q, lay, None)
        assert codes.shape == x.shape and codes.dtype == torch.float8_e4m3fn
        assert res.shape == r.shape and res.dtype == r.dtype
        assert tuple(scale.shape) == shape and scale.stride() == strides and scale.dtype == dtype
    schema = torch.ops.arfuse.fused_allreduce_residual_rmsnorm_fp8.default._schema
    assert not any(a.alias_info and a.alias_info.is_write for a in schema.arguments)


@pytest.mark.parametrize("quant, layout, shape, strides, dtype", FP8_LAYOUTS)
def test_fp8_op_launches_on_fresh_outputs(host_ctx, quant, layout, shape, strides, dtype):
    ctx, lib = host_ctx
    x, r, w = tensors(dtype=torch.float16)
    r0 = r.clone()
    codes, res, scale = aft.fused_allreduce_residual_rmsnorm_fp8(x, r, w, 1e-5, quant, layout)
    assert codes.shape == x.shape and res.shape == r.shape and torch.equal(r, r0)
    assert tuple(scale.shape) == shape and scale.stride() == strides
    call = lib.calls[-1]
    assert call[:8] == ("launch_fp8", None, 8, 256, 2, instream.quant_code(quant),
                        instream.scale_layout_code(layout), True)
    assert call[8] == scale.data_ptr()


def test_fp8_static_reads_the_callers_scale(host_ctx):
    ctx, lib = host_ctx
    x, r, w = tensors(dtype=torch.bfloat16)
    s = torch.tensor([0.05], dtype=torch.float32)
    codes, res, scale = aft.fused_allreduce_residual_rmsnorm_fp8(x, r, w, 1e-5, "static",
                                                                 static_scale=s)
    assert scale.numel() == 0 and lib.calls[-1][5:7] == (1, 0) and lib.calls[-1][8] == s.data_ptr()
    with pytest.raises(ValueError, match="static_scale"):
        aft.fused_allreduce_residual_rmsnorm_fp8(x, r, w, 1e-5, "static")
    with pytest.raises(ValueError, match="static_scale"):
        aft.fused_allreduce_residual_rmsnorm_fp8(x, r, w, 1e-5, "static",
                                                 static_scale=s.double())


def test_fp8_not_served_is_none_none_none(host_ctx):
    ctx, lib = host_ctx
    launches = len(lib.calls)
    x, r, w = tensors(dtype=torch.float32)
    assert aft.fused_allreduce_residual_rmsnorm_fp8(x, r, w) == (None, None, None)
    assert "bf16 or fp16" in aft.why_not(x, r, w, instream.PATTERN_FP8_PER_TOKEN)
    x, r, w = tensors(hidden=192, dtype=torch.bfloat16)
    assert aft.fused_allreduce_residual_rmsnorm_fp8(x, r, w, 1e-6, "per_group",
                                                    "fp32_row_major") == (None, None, None)
    assert len(lib.calls) == launches


def test_torch_compile_traces_the_fp8_op(host_ctx):
    ctx, lib = host_ctx
    x, r, w = tensors(dtype=torch.bfloat16)

    @torch.compile(backend="eager", fullgraph=True)
    def f(x, r, w):
        return torch.ops.arfuse.fused_allreduce_residual_rmsnorm_fp8(x, r, w, 1e-6, 2, 0, None)

    codes, res, scale = f(x, r, w)
    assert codes.shape == x.shape and lib.calls[-1][:6] == ("launch_fp8", None, 8, 256, 1, 2)


def run_two_gloo_ranks(tmp_path, name: str, body: str) -> dict:
    """Runs `body` (after a gloo group of two ranks is formed, `rank` set, arfuse.torch imported
    as aft and the fakes importable) in two processes; returns {rank: the words after "RESULT
    <rank>"} and the outputs."""
    script = textwrap.dedent(f"""
        import sys, torch, torch.distributed as dist
        sys.path[:0] = [{HERE!r}, {os.path.join(HERE, '..', '..', 'client', 'python')!r}]
        import arfuse.torch as aft
        from instream_fakes import RecordingLib, unbound_context
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="file://{tmp_path}/init-{name}", rank=rank,
                                world_size=2)
    """) + textwrap.dedent(body)
    path = tmp_path / f"{name}.py"
    path.write_text(script)
    procs = [subprocess.Popen([sys.executable, str(path), str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    results = {}
    for out in outs:
        for line in out.splitlines():
            if line.startswith("RESULT"):
                _, rank, rest = line.split(" ", 2)
                results[int(rank)] = rest
    return results, outs


def test_agree_sets_one_program_key_on_every_rank(tmp_path):
    """Two gloo ranks, each with a context: agree() serves and leaves the same nonzero program
    key on both (the larger of their draws), which reached the library."""
    results, outs = run_two_gloo_ranks(tmp_path, "key", """
        lib = RecordingLib(device_kind=2)
        aft.set_context(unbound_context(lib), "cpu")
        agreed = aft.agree(device="cpu")
        sent = [c[1] for c in lib.calls if c[0] == "program_key"]
        print("RESULT", rank, agreed, aft.get_context("cpu").program_key, sent)
    """)
    assert set(results) == {0, 1}, outs
    assert results[0] == results[1], outs
    agreed, key, sent = results[0].split(" ", 2)
    assert agreed == "True" and 1 <= int(key) <= instream.PROGRAM_KEY_MAX and sent == f"[{key}]"


def test_set_program_key_refuses_bad_keys(host_ctx):
    ctx, lib = host_ctx
    for bad in (-1, 1 << 32, "7", True, 1.0):
        with pytest.raises(instream.InStreamError) as e:
            ctx.set_program_key(bad)
        assert e.value.code == instream.status_code(instream.INVALID_ARGUMENT)
        assert "program key" in str(e.value)
    with pytest.raises(instream.InStreamError) as e:
        ctx.set_program_key(instream.PROGRAM_KEY_MAX + 1)
    assert "bits above the low 24" in str(e.value)
    assert ctx.program_key == 0
    ctx.set_program_key(instream.PROGRAM_KEY_MAX)
    assert ctx.program_key == instream.PROGRAM_KEY_MAX
    assert lib.calls[-1] == ("program_key", instream.PROGRAM_KEY_MAX)


def test_agree_and_the_shims_vote_over_two_ranks(tmp_path):
    """Two gloo ranks: one without a context. Both end unavailable (MAX vote)."""
    raw, outs = run_two_gloo_ranks(tmp_path, "vote", """
        from arfuse.integrations import sglang as shim
        if rank == 0:
            aft.set_context(unbound_context(RecordingLib(device_kind=2)), "cpu")
        agreed = aft.agree(device="cpu")
        ctx = aft.get_context("cpu")
        vote = shim.process_groups.vote_unavailable(rank == 1, None)
        print("RESULT", rank, agreed, bool(ctx and ctx.disabled), vote)
    """)
    results = {r: tuple(v.split()) for r, v in raw.items()}
    assert results == {0: ("False", "True", "True"), 1: ("False", "False", "True")}, outs
