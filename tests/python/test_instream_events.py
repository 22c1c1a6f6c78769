"""Every poisoning reaches the attached sessions as POISONED, with its reason, before the
REINITIALIZED that follows it, however soon the group re-forms (server/instream/attachments.h,
docs/instream.md "Generations, errors and faults").

Two host-mode sidecars; rank 0's client launches an in-stream op that rank 1 never launches, so
the op fails at the spin timeout and poisons the group's workspace; both sidecars re-form within
tens of milliseconds, well inside the watcher's 50 ms probe. Round after round, every attached
session (the launching client, an observer on each rank) hears POISONED (the reason names the
timeout) and then REINITIALIZED, for the attachment it holds, and nothing else."""
import os
import threading
import time

import grpc
import numpy as np
import pytest

import arfuse
from arfuse import instream
from conftest import Group

POISONED = arfuse.fusion_pb2.AttachEvent.KIND_POISONED
REINITIALIZED = arfuse.fusion_pb2.AttachEvent.KIND_REINITIALIZED
HIDDEN, TOKENS, ROUNDS = 256, 4, 20



class Session:
    """One client session that records every AttachEvent its stream carries, in order."""

    def __init__(self, socket, name, lib=None):
        self.name = name
        self.client = arfuse.Client(socket, client_name=name)
        self.client.wait_ready(30)
        self.lib = lib
        self.ctx = None
        self.attach_id = 0
        self.generation = 0
        self.events = []
        self.cv = threading.Condition()
        # Added before the client's attachment table (the first attach adds it), so it hears
        # each event before the contexts do.
        self.client.add_session_listener(self)

    def on_session_event(self, event):
        with self.cv:
            self.events.append((event.kind, event.attach_id, event.reason))
            self.cv.notify_all()

    def on_session_end(self, lost_reason):
        pass

    def attach(self, timeout=30.0):
        """Attaches to a workspace newer than the last one (the group re-forms meanwhile)."""
        until = time.monotonic() + timeout
        last = None
        while time.monotonic() < until:
            try:
                if self.lib is not None:
                    ctx = self.client.attach([HIDDEN], lib=self.lib)
                    attach_id, generation = ctx.attach_id, ctx.info.generation
                else:
                    resp = self.client.attach_rpc(arfuse.fusion_pb2.AttachRequest(
                        hidden=[HIDDEN], attach_abi_version=4, launch_abi_version=4,
                        launch_args_bytes=368))
                    for fd in instream.pick_up_fds(resp, 5.0):
                        os.close(fd)
                    ctx, attach_id, generation = None, resp.attach_id, resp.generation
            except (arfuse.ArfuseError, instream.InStreamError) as e:
                last = e  # re-forming (UNAVAILABLE) or still the poisoned workspace
                time.sleep(0.02)
                continue
            if generation <= self.generation:
                last = f"generation {generation} again"
                if ctx is not None:
                    ctx.detach()
                else:
                    self.client.detach_rpc(attach_id)
                time.sleep(0.02)
                continue
            self.ctx, self.attach_id, self.generation = ctx, attach_id, generation
            return
        raise AssertionError(f"no attach within {timeout} s (last: {last})")

    def wait_events(self, n, timeout=20.0):
        with self.cv:
            self.cv.wait_for(lambda: len(self.events) >= n, timeout)
            return list(self.events)

    def close(self):
        self.client.close()


def test_every_poisoning_is_told_before_the_reinitialization_that_follows(arfused, real_lib):
    g = Group(arfused, 2, hidden=HIDDEN, max_tokens=16, dtype="fp32",
              extra_args=["--spin-timeout=0.2"])
    sessions = []
    try:
        launcher = Session(g.socket(0), "launcher", lib=real_lib)
        sessions = [launcher, Session(g.socket(0), "observer-0"),
                    Session(g.socket(1), "observer-1")]
        rng = np.random.default_rng(0)
        x = rng.standard_normal((TOKENS, HIDDEN), dtype=np.float32)
        res = rng.standard_normal((TOKENS, HIDDEN), dtype=np.float32)
        gamma = rng.standard_normal(HIDDEN, dtype=np.float32)
        norm = np.zeros_like(res)
        for rnd in range(ROUNDS):
            for s in sessions:
                s.attach()
            ids = [s.attach_id for s in sessions]
            # Rank 1 never launches: the op gives up at the spin timeout and poisons the group.
            with pytest.raises((instream.InStreamError, arfuse.ArfuseError)) as failed:
                launcher.ctx.fused_allreduce_residual_rmsnorm(
                    None, x.ctypes.data, res.ctypes.data, res.ctypes.data, norm.ctypes.data,
                    gamma.ctypes.data, TOKENS, HIDDEN, "fp32", 1e-6)
            assert failed.value.code in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                         grpc.StatusCode.ABORTED), failed.value
            for s, attach_id in zip(sessions, ids):
                events = s.wait_events(2 * (rnd + 1))
                mine = events[2 * rnd:]
                assert [(k, a) for k, a, _ in mine] == [(POISONED, attach_id),
                                                        (REINITIALIZED, attach_id)], \
                    f"round {rnd}, {s.name}: {events}"
                assert "timeout" in mine[0][2], mine[0][2]
                assert "re-forms" in mine[0][2], mine[0][2]
                assert "attach again" in mine[1][2], mine[1][2]
            # The launching context heard the poisoning first and keeps its reason.
            assert launcher.ctx.disabled_reason.startswith("workspace poisoned"), \
                launcher.ctx.disabled_reason
            launcher.ctx.detach()
        for s in sessions:
            assert len(s.events) == 2 * ROUNDS, s.events
    finally:
        for s in sessions:
            s.close()
        g.stop()
