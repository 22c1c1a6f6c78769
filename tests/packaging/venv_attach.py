"""Run by the Python of a fresh virtual environment holding only the arfuse wheel and its declared
dependencies (test_wheel.py): attaches to two host-mode sidecars in-stream, runs one fused op on
both ranks and checks it against numpy. Prints one JSON line: where the package and the library
were found, and the result."""
import json
import sys
import threading

import numpy as np

import arfuse
from arfuse import instream


def main(sockets):
    hidden, tokens = 256, 4
    clients = [arfuse.Client(s) for s in sockets]
    try:
        for c in clients:
            c.wait_ready(30)
        ctxs = [c.attach([hidden]) for c in clients]
        rng = np.random.default_rng(0)
        xs = [rng.standard_normal((tokens, hidden), dtype=np.float32) for _ in range(2)]
        res = rng.standard_normal((tokens, hidden), dtype=np.float32)
        gamma = rng.standard_normal(hidden, dtype=np.float32)
        outs = [(res.copy(), np.zeros_like(res)) for _ in range(2)]
        errors = []

        def run(r):
            try:
                r_out, n_out = outs[r]
                ctxs[r].fused_allreduce_residual_rmsnorm(
                    None, xs[r].ctypes.data, r_out.ctypes.data, r_out.ctypes.data,
                    n_out.ctypes.data, gamma.ctypes.data, tokens, hidden, "fp32", 1e-6)
            except Exception as e:  # reported below, with the rank
                errors.append(f"rank {r}: {e!r}")

        ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        want_r = xs[0] + xs[1] + res
        want_n = want_r / np.sqrt((want_r ** 2).mean(-1, keepdims=True) + 1e-6) * gamma
        err_r = max(float(np.abs(outs[r][0] - want_r).max()) for r in range(2))
        err_n = max(float(np.abs(outs[r][1] - want_n).max()) for r in range(2))
        devices = [ctx.info.device for ctx in ctxs]
        for ctx in ctxs:
            ctx.check()
            ctx.detach()
    finally:
        for c in clients:
            c.close()
    print(json.dumps({"package": arfuse.__file__, "library": instream.find_client_library(),
                      "errors": errors, "devices": devices, "residual_err": err_r,
                      "norm_err": err_n}))


if __name__ == "__main__":
    main(sys.argv[1:3])
