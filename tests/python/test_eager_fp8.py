"""The FP8 patterns on the eager plane (Fusion.Execute through allreduce_fusion) against two
host-mode sidecars: the same bytes as the in-stream plane's op on the same inputs (both run the
CPU implementation, kernels/host), the codes dequantized within E4M3's precision, and bad input
answered with specific codes and nothing written."""
import contextlib
import threading

import grpc
import numpy as np
import pytest

import arfuse
from arfuse import instream
from conftest import Group
from fp8_values import e4m3_values

P = arfuse.AllReduceFusionPattern
HIDDEN, TOKENS, EPS = 256, 5, 1e-6
STATIC_SCALE = 0.0625

# (FlashInfer-numbered pattern, the in-stream binding's quant name, scale layout, norm_out given)
CASES = [
    (P.kARResidualRMSNormFP8Quant, "static", None, False),
    (P.kARResidualRMSNormOutFP8Quant, "static", None, True),
    (P.kARResidualRMSNormFP8PerToken, "per_token", None, False),
    (P.kARResidualRMSNormFP8PerToken, "per_token", None, True),
    (P.kARResidualRMSNormFP8PerGroup, "per_group", "fp32_row_major", True),
    (P.kARResidualRMSNormFP8PerGroup, "per_group", "fp32_mn_major", False),
    (P.kARResidualRMSNormFP8PerGroup, "per_group", "ue8m0_packed", True),
]


def on_ranks(fn):
    out, errors = [None, None], []

    def body(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # surfaced below
            errors.append((r, e))

    ts = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    return out


class RankTensors:
    """One rank's tensors inside one registered host buffer, numpy views at 16-byte offsets."""

    def __init__(self, ws, rank):
        rng = np.random.default_rng(7)  # residual and gamma alike on every rank
        own = np.random.default_rng(100 + rank)
        scale_words = instream.fp8_scale_elements("per_group", TOKENS, HIDDEN, "fp32_mn_major")
        self.buf = arfuse.HostShmBuffer(16 * 1024 * 4)
        ws.register(self.buf, f"fp8-{rank}")
        offset = 0

        def take(dtype, shape, nbytes):
            nonlocal offset
            a = self.buf.array(dtype, shape, offset)
            offset += (nbytes + 15) // 16 * 16
            return a

        n = TOKENS * HIDDEN
        self.x = take(np.float16, (TOKENS, HIDDEN), 2 * n)
        self.res_in = take(np.float16, (TOKENS, HIDDEN), 2 * n)
        self.res_out = take(np.float16, (TOKENS, HIDDEN), 2 * n)
        self.norm = take(np.float16, (TOKENS, HIDDEN), 2 * n)
        self.gamma = take(np.float16, (HIDDEN,), 2 * HIDDEN)
        self.quant = take(np.uint8, (TOKENS, HIDDEN), n)
        self.scale = take(np.float32, (scale_words,), 4 * scale_words)
        self.static = take(np.float32, (1,), 4)
        self.x[:] = own.standard_normal((TOKENS, HIDDEN))
        self.res_in[:] = rng.standard_normal((TOKENS, HIDDEN))
        self.gamma[:] = 1 + 0.1 * rng.standard_normal(HIDDEN)
        self.static[0] = STATIC_SCALE

    def clear(self):
        for a in (self.res_out, self.norm, self.quant, self.scale):
            a.view(np.uint8)[:] = 0xee

    def outputs(self, norm):
        return (self.res_out.copy(), self.quant.copy(), self.scale.copy(),
                self.norm.copy() if norm else None)


@contextlib.contextmanager
def two_ranks(arfused):
    """Two fp16 host-mode sidecars, a client, workspace and tensors per rank."""
    g = Group(arfused, 2, hidden=HIDDEN, max_tokens=16, dtype="fp16")
    clients, tensors = [], []
    try:
        clients = [arfuse.Client(g.socket(r)) for r in range(2)]
        for c in clients:
            c.wait_ready(30)
        wss = [arfuse.FusionWorkspace(c) for c in clients]
        tensors = [RankTensors(wss[r], r) for r in range(2)]
        yield clients, wss, tensors
    finally:
        for t in tensors:
            t.buf.close()
        for c in clients:
            c.close()
        g.stop()


def test_eager_fp8_patterns_equal_the_instream_plane_byte_for_byte(arfused, real_lib):
    """Every case on the eager plane first, then (an attached workspace serves only its
    clients' in-stream ops) the same ops in-stream."""
    with two_ranks(arfused) as (clients, wss, tensors):
        values = e4m3_values()
        eager_out = {}
        for case in CASES:
            pattern, quant, layout, with_norm = case
            static = quant == "static"

            def eager(r):
                t = tensors[r]
                t.clear()
                kw = dict(scale_factor=t.static) if static else dict(scale_out=t.scale)
                out = arfuse.allreduce_fusion(
                    input=t.x, workspace=wss[r], pattern=pattern, residual_in=t.res_in,
                    residual_out=t.res_out, norm_out=t.norm if with_norm else None,
                    rms_gamma=t.gamma, rms_eps=EPS, quant_out=t.quant, scale_layout=layout, **kw)
                assert out is t.quant
                if not with_norm:
                    # norm_out left out: the eager op wrote none.
                    assert (t.norm.view(np.uint8) == 0xee).all(), case
                return t.outputs(with_norm)

            eager_out[case] = on_ranks(eager)
        try:
            ctxs = [c.attach([HIDDEN]) for c in clients]
        except arfuse.ArfuseError as e:
            if e.code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE):
                pytest.skip(f"the in-stream attach does not complete here: {e}")
            raise
        try:
            for case in CASES:
                pattern, quant, layout, with_norm = case
                static = quant == "static"

                def stream(r):
                    t = tensors[r]
                    t.clear()
                    ctxs[r].fused_allreduce_residual_rmsnorm_fp8(
                        None, t.x.ctypes.data, t.res_in.ctypes.data, t.res_out.ctypes.data,
                        t.norm.ctypes.data if with_norm else None, t.quant.ctypes.data,
                        (t.static if static else t.scale).ctypes.data, t.gamma.ctypes.data,
                        TOKENS, HIDDEN, "fp16", EPS, quant, layout)
                    ctxs[r].check()
                    return t.outputs(with_norm)

                got, want = eager_out[case], on_ranks(stream)
                for r in range(2):
                    for g, w in zip(got[r], want[r]):
                        if w is None:
                            assert g is None
                            continue
                        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8),
                                                      err_msg=str(case))
                    np.testing.assert_array_equal(got[r][1], got[0][1], err_msg=str(case))
                if layout in (None, "fp32_row_major"):
                    # The codes, dequantized, are the normalized value to E4M3's precision.
                    res_out, q, scale, _ = got[0]
                    y = res_out.astype(np.float64)
                    x = y / np.sqrt((y ** 2).mean(-1, keepdims=True) + EPS) * \
                        tensors[0].gamma.astype(np.float64)
                    if static:
                        per = np.full((TOKENS, HIDDEN), STATIC_SCALE)
                    else:
                        s = scale[:instream.fp8_scale_elements(quant, TOKENS, HIDDEN, layout)]
                        s = s.reshape(TOKENS, -1).astype(np.float64)
                        per = np.repeat(s, HIDDEN // s.shape[1], axis=1)
                    dq = values[q] * per
                    np.testing.assert_allclose(dq, x, rtol=2 ** -4 + 1e-3,
                                               atol=per.max() * 2 ** -9, err_msg=str(case))
        finally:
            for ctx in ctxs:
                ctx.detach()


def test_eager_fp8_bad_input_is_refused_with_its_reason(arfused):
    g = Group(arfused, 2, hidden=HIDDEN, max_tokens=16, dtype="fp16")
    try:
        with arfuse.Client(g.socket(0)) as c:
            c.wait_ready(30)
            ws = arfuse.FusionWorkspace(c)
            t = RankTensors(ws, 0)
            t.clear()
            base = dict(input=t.x, workspace=ws, residual_in=t.res_in, residual_out=t.res_out,
                        rms_gamma=t.gamma, rms_eps=EPS, quant_out=t.quant)
            # Caught before the call: what the pattern needs, and quantized outputs of a pattern
            # that has none.
            with pytest.raises(ValueError, match="scale_factor is required"):
                arfuse.allreduce_fusion(pattern=P.kARResidualRMSNormFP8Quant, **base)
            with pytest.raises(ValueError, match="norm_out is required"):
                arfuse.allreduce_fusion(pattern=P.kARResidualRMSNormOutFP8Quant,
                                        scale_factor=t.static, **base)
            with pytest.raises(ValueError, match="has no quantized output"):
                arfuse.allreduce_fusion(pattern=P.kARResidualRMSNorm, norm_out=t.norm, **base)
            # Refused by the sidecar (one rank suffices: nothing reaches the collective).
            with pytest.raises(arfuse.ArfuseError) as e:
                arfuse.allreduce_fusion(pattern=P.kARResidualRMSNormFP8PerGroup,
                                        scale_out=t.scale, scale_layout=7, **base)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "scale layout 7" in e.value.message
            x32 = t.buf.array(np.float32, (2, HIDDEN), 0)
            with pytest.raises(arfuse.ArfuseError) as e:
                arfuse.allreduce_fusion(**dict(base, input=x32, dtype="fp32"),
                                        pattern=P.kARResidualRMSNormFP8PerToken,
                                        scale_out=t.scale)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "takes bf16 or fp16 input" in e.value.message
            # A per-group scale that runs past its region: the extent is the layout's at
            # num_tokens, checked by the sidecar.
            tail = t.buf.array(np.float32, (4,), t.buf.byte_size - 16)
            with pytest.raises(arfuse.ArfuseError) as e:
                arfuse.allreduce_fusion(pattern=P.kARResidualRMSNormFP8PerGroup,
                                        scale_out=tail, scale_layout="fp32_mn_major", **base)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "scale: bytes" in e.value.message and "end past the region" in e.value.message
            # Nothing was written by any refused op.
            assert (t.quant.view(np.uint8) == 0xee).all()
            assert (t.res_out.view(np.uint8) == 0xee).all()
            t.buf.close()
    finally:
        g.stop()
