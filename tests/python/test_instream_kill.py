"""A client SIGKILLed mid-op on the in-stream plane, against two host-mode sidecars.

One client attached per rank, one paired op, then an op started by one rank's client alone, that
client SIGKILLed half a second later, then the ranks' next op (in-stream, or eager Execute of a
plan) with one rank starting 0.3 s before the other. The dead client's op is never paired with
anything: every op that answers OK has the correct result (the dead client's input is in no
sum), every other op ends in a specific error, and the group serves correct paired ops again
afterwards. Variants: the dead client on either rank, the next op in-stream or eager, the peer
early or late.

Needs arfused and libarfuse_client (target arfuse_instream); skips without the library.
"""
import os
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

import arfuse
from arfuse import instream
from conftest import REPO, Group

H, T = 256, 4  # 1024 elements per tensor, fp32
EPS = 1e-6
SC = grpc.StatusCode
# What an op may end in when it does not answer OK: its peer never came or gave up, the workspace
# is poisoned or re-forming, or its attachment is refused until the group re-formed.
FAILURES = {SC.ABORTED, SC.DEADLINE_EXCEEDED, SC.FAILED_PRECONDITION, SC.UNAVAILABLE}

# The doomed client, in a process of its own: attaches to one rank, runs the paired op when told,
# then an op its peer never joins (it is SIGKILLed while that op waits).
CHILD = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import arfuse
rank, sock, H, T = int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
c = arfuse.Client(sock)
c.wait_ready(30)
ctx = c.attach([H])
print("attached", flush=True)
def inputs(call):
    rng = np.random.default_rng(1000 * rank + call)
    return (rng.standard_normal((T, H), dtype=np.float32),
            rng.standard_normal((T, H), dtype=np.float32),
            rng.standard_normal(H, dtype=np.float32))
for line in sys.stdin:
    call = int(line)
    x, res, g = inputs(call)
    r_out, n_out = np.zeros_like(res), np.zeros_like(res)
    ctx.fused_allreduce_residual_rmsnorm(None, x.ctypes.data, res.ctypes.data, r_out.ctypes.data,
                                         n_out.ctypes.data, g.ctypes.data, T, H, "fp32", 1e-6)
    print("done", flush=True)
"""


def inputs(rank, call):
    rng = np.random.default_rng(1000 * rank + call)
    return (rng.standard_normal((T, H), dtype=np.float32),
            rng.standard_normal((T, H), dtype=np.float32),
            rng.standard_normal(H, dtype=np.float32))


def gamma(call):
    return inputs(0, call)[2]  # every rank passes rank 0's gamma and residual of the call


def residual(call):
    return inputs(0, call)[1]


def expected(call):
    """residual_out and norm_out of call `call` paired across both ranks (the CPU reference's
    order: x_0 + x_1 in fp32, then + residual_in)."""
    r_out = (inputs(0, call)[0] + inputs(1, call)[0]) + residual(call)
    n_out = r_out / np.sqrt((r_out.astype(np.float64) ** 2).mean(-1, keepdims=True) + EPS)
    return r_out, (n_out * gamma(call)).astype(np.float32)


def run_instream(ctx, rank, call):
    x = inputs(rank, call)[0]
    res, g = residual(call), gamma(call)
    r_out = np.full_like(res, np.nan)
    n_out = np.full_like(res, np.nan)
    ctx.fused_allreduce_residual_rmsnorm(None, x.ctypes.data, res.ctypes.data, r_out.ctypes.data,
                                         n_out.ctypes.data, g.ctypes.data, T, H, "fp32", EPS)
    return r_out, n_out


class EagerRank:
    """One rank's plan over a registered host buffer: input, residual_in, residual_out, norm_out,
    gamma."""

    def __init__(self, client):
        self.client = client
        n = T * H * 4
        self.buf = arfuse.HostShmBuffer(4 * n + H * 4, named=True)
        region = client.register_host_shm("t", self.buf.shm_name, self.buf.byte_size)
        self.x = self.buf.array(np.float32, (T, H), 0)
        self.res = self.buf.array(np.float32, (T, H), n)
        self.r_out = self.buf.array(np.float32, (T, H), 2 * n)
        self.n_out = self.buf.array(np.float32, (T, H), 3 * n)
        self.g = self.buf.array(np.float32, (H,), 4 * n)
        loc = lambda off: arfuse.TensorLoc(region, off)  # noqa: E731
        self.plan = client.create_plan(arfuse.OpSpec(
            pattern="allreduce_residual_rmsnorm", dtype="fp32", hidden=H, max_tokens=T, eps=EPS,
            input=loc(0), residual_in=loc(n), residual_out=loc(2 * n), norm_out=loc(3 * n),
            gamma=loc(4 * n)))

    def run(self, rank, call):
        self.x[...] = inputs(rank, call)[0]
        self.res[...] = residual(call)
        self.g[...] = gamma(call)
        self.r_out[...] = np.nan
        self.n_out[...] = np.nan
        self.client.execute(self.plan, T)
        return self.r_out.copy(), self.n_out.copy()

    def close(self):
        del self.x, self.res, self.r_out, self.n_out, self.g
        self.buf.close()


def check_or_failed(outcome, call, what):
    """An op's outcome: ("ok", (r_out, n_out)) must be the correct pairing; ("error", e) must be
    a specific error. Returns "ok" or the code's name."""
    kind, value = outcome
    if kind == "error":
        assert isinstance(value, arfuse.ArfuseError), f"{what}: {value!r}"
        assert value.code in FAILURES, f"{what}: {value.code} {value.message}"
        assert value.message, f"{what}: an error without a message"
        return value.code.name
    r_out, n_out = value
    want_r, want_n = expected(call)
    wrong = int(np.count_nonzero(r_out != want_r))
    assert wrong == 0, f"{what}: OK with residual_out wrong in {wrong} of {r_out.size} elements"
    np.testing.assert_allclose(n_out, want_n, rtol=1e-5, atol=1e-5, err_msg=what)
    return "ok"


def attempt(fn):
    try:
        return ("ok", fn())
    except arfuse.ArfuseError as e:
        return ("error", e)


@pytest.fixture
def lib():
    path = instream.find_client_library()
    if path is None:
        pytest.skip("libarfuse_client.so is not built (target arfuse_instream; or set "
                    "ARFUSE_CLIENT_LIB)")
    return instream.load_library(path)


@pytest.mark.parametrize("peer_first", [True, False], ids=["peer_early", "peer_late"])
@pytest.mark.parametrize("next_op", ["instream", "eager"])
@pytest.mark.parametrize("dead", [0, 1], ids=["dead_rank0", "dead_rank1"])
def test_a_client_killed_mid_op_is_never_paired(arfused, lib, dead, next_op, peer_first):
    peer = 1 - dead
    g = Group(arfused, 2, hidden=H, max_tokens=T, dtype="fp32",
              extra_args=("--spin-timeout=2", "--flashinfer-allreduce-fusion-backend=trtllm"))
    clients, child = [], None
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(REPO / "client" / "python"), str(dead),
             g.socket(dead), str(H), str(T)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "ARFUSE_CLIENT_LIB": instream.find_client_library()})
        assert child.stdout.readline().strip() == "attached"
        peer_client = arfuse.Client(g.socket(peer))
        clients.append(peer_client)
        peer_client.wait_ready(30)
        peer_ctx = peer_client.attach([H])

        # 1. One paired op (pattern 0): correct on the peer, done in the child.
        child.stdin.write("0\n")
        child.stdin.flush()
        assert check_or_failed(attempt(lambda: run_instream(peer_ctx, peer, 0)), 0,
                               "paired op") == "ok"
        assert child.stdout.readline().strip() == "done"
        # 2. The dead client's op (pattern 99), which its peer never joins; SIGKILL 0.5 s into it.
        child.stdin.write("99\n")
        child.stdin.flush()
        time.sleep(0.5)
        child.kill()
        child.wait(10)
        assert child.returncode == -9

        # 3. Both ranks' next op (pattern 1), one starting 0.3 s before the other.
        if next_op == "eager":
            peer_ctx.detach()  # the eager plane serves a rank without attachments
            dead_client = arfuse.Client(g.socket(dead))
            clients.append(dead_client)
            ranks = {peer: EagerRank(peer_client), dead: EagerRank(dead_client)}
            ops = {r: (lambda r=r: ranks[r].run(r, 1)) for r in (0, 1)}
        else:
            dead_client = arfuse.Client(g.socket(dead))
            clients.append(dead_client)
            ctxs = {peer: peer_ctx}

            def dead_op():
                ctxs[dead] = dead_client.attach([H])  # refused while the workspace is poisoned
                return run_instream(ctxs[dead], dead, 1)
            ops = {peer: lambda: run_instream(peer_ctx, peer, 1), dead: dead_op}
        outcomes = {}

        def rank_op(r):
            if (r == peer) != peer_first:
                time.sleep(0.3)
            outcomes[r] = attempt(ops[r])
        threads = [threading.Thread(target=rank_op, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert set(outcomes) == {0, 1}, "an op did not end within 30 s"
        seen = {r: check_or_failed(outcomes[r], 1, f"rank {r}'s next op") for r in (0, 1)}
        print(f"next ops: {seen}")

        # 4. The group recovers: both ranks' plans serve correct paired ops again (a round or two
        # may still fail while the group re-forms).
        if next_op == "instream":
            for ctx in ctxs.values():
                try:
                    ctx.detach()
                except arfuse.ArfuseError:
                    pass
            ranks = {peer: EagerRank(peer_client), dead: EagerRank(dead_client)}
        for c in clients:
            c.wait_ready(30)
        until = time.monotonic() + 30
        call = 2
        while True:
            res = {}

            def eager(r, call=call):
                res[r] = attempt(lambda: ranks[r].run(r, call))
            ts = [threading.Thread(target=eager, args=(r,)) for r in (0, 1)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(30)
            got = {r: check_or_failed(res[r], call, f"rank {r} after recovery") for r in (0, 1)}
            if got == {0: "ok", 1: "ok"}:
                break
            assert time.monotonic() < until, f"no correct paired op within 30 s: {got}"
            for c in clients:
                c.wait_ready(30)
            call += 1
        for er in ranks.values():
            er.close()
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait(10)
        for c in clients:
            c.close()
        g.stop()
