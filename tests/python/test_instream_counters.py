"""Every in-stream op's path counted, end to end in host mode: real sidecars, the real
libarfuse_client, and `arfusectl info --json` reporting per rank what the client did (fused ops by
pattern and token bucket, declined ops by reason), while attached and after the detach."""
import threading

import grpc
import numpy as np
import pytest

import arfuse
from arfuse import instream
from conftest import Group, arfusectl_info

HIDDEN, MAX_TOKENS = 256, 16




def info(arfusectl, socket):
    return arfusectl_info(arfusectl, socket)["instream_ops"]


def test_arfusectl_info_shows_what_the_client_did_per_rank(arfused, real_lib, arfusectl):
    g = Group(arfused, 2, hidden=HIDDEN, max_tokens=MAX_TOKENS, dtype="fp32")
    clients = []
    try:
        clients = [arfuse.Client(g.socket(r)) for r in range(2)]
        for c in clients:
            c.wait_ready(30)
        ctxs = [c.attach([HIDDEN], lib=real_lib) for c in clients]
        rng = np.random.default_rng(1)

        def fused(pattern_norm, tokens):
            xs = [rng.standard_normal((tokens, HIDDEN), dtype=np.float32) for _ in range(2)]
            res = rng.standard_normal((tokens, HIDDEN), dtype=np.float32)
            gamma = np.ones(HIDDEN, dtype=np.float32)
            outs = [(res.copy(), np.zeros_like(res)) for _ in range(2)]
            errors = []

            def run(r):
                try:
                    if pattern_norm:
                        ctxs[r].fused_allreduce_residual_rmsnorm(
                            None, xs[r].ctypes.data, outs[r][0].ctypes.data,
                            outs[r][0].ctypes.data, outs[r][1].ctypes.data, gamma.ctypes.data,
                            tokens, HIDDEN, "fp32", 1e-6)
                    else:
                        ctxs[r].fused_allreduce(None, xs[r].ctypes.data, outs[r][1].ctypes.data,
                                                tokens, HIDDEN, "fp32")
                except Exception as e:  # reported below, on the test's thread
                    errors.append(e)

            ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(30)
            assert not errors, errors
            np.testing.assert_allclose(outs[0][1] if not pattern_norm else outs[0][0],
                                       xs[0] + xs[1] + (res if pattern_norm else 0), rtol=1e-6,
                                       atol=1e-6)

        for tokens in (1, 1, 4, 16):
            fused(True, tokens)
        fused(False, 3)
        buf = np.zeros((MAX_TOKENS + 1, HIDDEN), dtype=np.float32)
        for ctx in ctxs:
            with pytest.raises(instream.Unavailable):  # beyond the workspace: capacity
                ctx.fused_allreduce(None, buf.ctypes.data, buf.ctypes.data, MAX_TOKENS + 1,
                                    HIDDEN, "fp32")
            with pytest.raises(instream.Unavailable):  # another dtype than the workspace's
                ctx.fused_allreduce(None, buf.ctypes.data, buf.ctypes.data, 2, HIDDEN, "bf16")
            ctx.note_declined("not_contiguous")
            with pytest.raises(ValueError):
                ctx.note_declined("sideways")

        want = {"fused": 5, "declined": 3, "fused_share": 0.625,
                "fused_by_bucket": [
                    {"pattern": "allreduce", "tokens": "2-8", "count": 1},
                    {"pattern": "allreduce_residual_rmsnorm", "tokens": "1", "count": 2},
                    {"pattern": "allreduce_residual_rmsnorm", "tokens": "2-8", "count": 1},
                    {"pattern": "allreduce_residual_rmsnorm", "tokens": "9-64", "count": 1}],
                "declined_by_reason": [{"reason": "dtype", "count": 1},
                                       {"reason": "capacity", "count": 1},
                                       {"reason": "not_contiguous", "count": 1}],
                # Host mode: the library's decisions (CUDA: the kernels' launch counts).
                "kernel_counted": False}
        for r in range(2):
            assert info(arfusectl, g.socket(r)) == want, f"rank {r}"
        for ctx in ctxs:
            ctx.detach()
        # The counts of an attachment that ended stay in the sidecar's sums.
        for r in range(2):
            assert info(arfusectl, g.socket(r)) == want, f"rank {r} after the detach"
    finally:
        for c in clients:
            c.close()
        g.stop()
