"""Ranks whose in-stream decisions differ, end to end in host mode: two real sidecars and the real
libarfuse_client. When one rank's library declines ops that the other's fuses (the declining
rank's framework runs its own path while its peer waits in the fused kernel: a hang until the
spin timeout), both sidecars log one ERROR naming the rank and its top decline reasons, count
arfuse_instream_divergence_total and show it in `arfusectl info`; equal decisions report
nothing."""
import os
import re
import threading
import time
import urllib.request

import numpy as np

import arfuse
from conftest import Group, arfusectl_info

HIDDEN, MAX_TOKENS = 256, 16




def divergence(arfusectl, socket):
    return arfusectl_info(arfusectl, socket)["instream_divergence"]


def log(g, r):
    with open(os.path.join(g.dir, f"arfused.{r}.log")) as f:
        return f.read()


def fused_op(ctx, tokens=2, seed=0):
    x = np.random.default_rng(seed).standard_normal((tokens, HIDDEN), dtype=np.float32)
    out = np.zeros_like(x)
    ctx.fused_allreduce(None, x.ctypes.data, out.ctypes.data, tokens, HIDDEN, "fp32")


def test_a_rank_declining_what_its_peer_fuses_is_reported_by_every_sidecar(
        arfused, real_lib, arfusectl):
    # A short spin timeout: rank 0's fused op waits for rank 1, which never comes.
    g = Group(arfused, 2, hidden=HIDDEN, max_tokens=MAX_TOKENS, dtype="fp32",
              extra_args=("--spin-timeout=0.5", "--metrics-port=0", "--log-level=info"))
    clients = []
    try:
        clients = [arfuse.Client(g.socket(r)) for r in range(2)]
        for c in clients:
            c.wait_ready(30)
        ctxs = [c.attach([HIDDEN], lib=real_lib) for c in clients]
        # Rank 0 fuses the op; rank 1's framework runs its own path for it (reported to the
        # library as a decline). Rank 0's op then times out: the workspace is poisoned.
        errors = []

        def rank0():
            try:
                fused_op(ctxs[0])
            except Exception as e:  # the timeout, expected
                errors.append(e)

        t = threading.Thread(target=rank0)
        t.start()
        ctxs[1].note_declined("other")
        t.join(30)
        assert errors, "rank 0's fused op cannot complete without rank 1"
        want = "event=instream_divergence rank=1 ops=1 lead_rank=0 top_declines=\"other 1\""
        until = time.monotonic() + 30
        while time.monotonic() < until and not all(want in log(g, r) for r in range(2)):
            time.sleep(0.2)
        for r in range(2):
            text = log(g, r)
            assert text.count(want) == 1, f"rank {r} log:\n{text}"
            assert "rank 1 declined 1 in-stream op(s) that rank 0 fused" in text
            d = divergence(arfusectl, g.socket(r))
            assert d == {"total": 1, "last_rank": 1, "last_ops": 1, "last_reasons": "other 1"}, r
        # The metric, on both sidecars (rank 1 is the one that declined).
        for r in range(2):
            port = int(re.search(r"event=listening .*metrics_port=(\d+)", log(g, r)).group(1))
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                          timeout=10).read().decode()
            counts = {m.group(1): float(m.group(2)) for m in re.finditer(
                r'arfuse_instream_divergence_total\{[^}]*diverged_rank="(\d+)"[^}]*\} (\S+)',
                body)}
            assert counts == {"0": 0.0, "1": 1.0}, f"rank {r}: {counts}"
        # Reported once: later exchanges with nothing new stay quiet.
        time.sleep(3)
        for r in range(2):
            assert log(g, r).count(want) == 1
    finally:
        for c in clients:
            c.close()
        g.stop()


def test_equal_decisions_report_nothing(arfused, real_lib, arfusectl):
    g = Group(arfused, 2, hidden=HIDDEN, max_tokens=MAX_TOKENS, dtype="fp32")
    clients = []
    try:
        clients = [arfuse.Client(g.socket(r)) for r in range(2)]
        for c in clients:
            c.wait_ready(30)
        ctxs = [c.attach([HIDDEN], lib=real_lib) for c in clients]
        for i in range(3):
            ts = [threading.Thread(target=fused_op, args=(ctxs[r], 2, i)) for r in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(30)
            for ctx in ctxs:  # both decline the same op
                ctx.note_declined("not_contiguous")
            time.sleep(0.7)
        time.sleep(2.5)  # several exchanges
        for r in range(2):
            assert "instream_divergence" not in log(g, r)
            assert divergence(arfusectl, g.socket(r)) == {
                "total": 0, "last_rank": 0, "last_ops": 0, "last_reasons": ""}
    finally:
        for c in clients:
            c.close()
        g.stop()
