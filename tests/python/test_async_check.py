"""FusionWorkspace.check() (docs/api.md, "Asynchronous ops"): on CUDA allreduce_fusion returns
once the sidecar enqueued the op, and check() confirms afterwards that every op since the last
check completed: READY in the generation the first of them ran in. Driven here through the
bookkeeping allreduce_fusion feeds (_note_unconfirmed) with a client whose GetWorkspaceInfo a test
sets, since host mode completes every op before its reply."""
import grpc
import pytest

import arfuse
from arfuse import common_pb2


class Info:
    """The one RPC check() calls, answering what a test sets."""

    def __init__(self, generation, state=common_pb2.WORKSPACE_STATE_READY, reason="fused"):
        self.answer = arfuse.fusion_pb2.GetWorkspaceInfoResponse(
            fusion_enabled=state == common_pb2.WORKSPACE_STATE_READY, state=state,
            generation=generation, reason=reason)
        self.calls = 0
        self.error = None

    def workspace_info(self, timeout=None):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.answer

    def raise_if_lost(self, grace=0.0):
        pass


class Event:
    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def test_nothing_to_confirm_asks_nothing():
    info = Info(3)
    ws = arfuse.FusionWorkspace(info)
    ws.check()
    assert info.calls == 0


def test_ops_of_one_ready_generation_are_confirmed_once():
    info, first, last = Info(3), Event(), Event()
    ws = arfuse.FusionWorkspace(info)
    ws._note_unconfirmed(3, first)
    ws._note_unconfirmed(3, last)
    ws.check()
    assert (first.waited, last.waited, info.calls) == (0, 1, 1)  # the last op's event
    ws.check()  # confirmed: nothing pending
    assert info.calls == 1


def test_a_reinitialized_workspace_fails_the_check():
    info = Info(4, reason="fused, NCCL fallback ready")
    ws = arfuse.FusionWorkspace(info)
    ws._note_unconfirmed(3, Event())
    with pytest.raises(arfuse.ArfuseError) as e:
        ws.check()
    assert e.value.code == grpc.StatusCode.ABORTED
    assert "re-initialized while they ran (generation 3, now 4" in e.value.message
    assert "outputs are undefined" in e.value.message
    ws.check()  # reported once


def test_a_generation_change_between_ops_fails_even_when_the_last_matches():
    info = Info(4)
    ws = arfuse.FusionWorkspace(info)
    ws._note_unconfirmed(3, Event())
    ws._note_unconfirmed(4, Event())
    with pytest.raises(arfuse.ArfuseError) as e:
        ws.check()
    assert e.value.code == grpc.StatusCode.ABORTED
    assert "generation 3, now 4" in e.value.message


def test_a_poisoned_workspace_fails_the_check_with_its_reason():
    info = Info(3, state=common_pb2.WORKSPACE_STATE_POISONED,
                reason="workspace poisoned: timeout")
    ws = arfuse.FusionWorkspace(info)
    ws._note_unconfirmed(3, Event())
    with pytest.raises(arfuse.ArfuseError) as e:
        ws.check()
    assert e.value.code == grpc.StatusCode.ABORTED
    assert "WORKSPACE_STATE_POISONED: workspace poisoned: timeout" in e.value.message
    # Marked unavailable (the next allreduce_fusion returns None) until re-checked.
    assert ws.fusion_available() is False
    assert ws.unavailable_reason == "workspace poisoned: timeout"


def test_a_sidecar_that_cannot_answer_fails_the_check():
    info = Info(3)
    info.error = arfuse.ArfuseError(grpc.StatusCode.UNAVAILABLE, "engine initializing")
    ws = arfuse.FusionWorkspace(info)
    ws._note_unconfirmed(3, Event())
    with pytest.raises(arfuse.ArfuseError) as e:
        ws.check()
    assert e.value.code == grpc.StatusCode.ABORTED
    assert "could not be confirmed: engine initializing" in e.value.message
