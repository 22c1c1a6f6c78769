"""What the framework integrations log: each decline reason once (thread-safe), and SGLang's
one path line per rank and first gate decline, also with the gate inside torch.compile
(fullgraph: the note stays out of the traced graph). The SGLang part needs torch."""
import logging
import threading

import pytest

from arfuse.integrations import _decisions

LOG = "arfuse.integrations.test"


def test_a_repeated_decline_logs_once_across_threads(caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    d = _decisions.FirstDeclines(logging.getLogger(LOG), "the framework's own path")
    barrier = threading.Barrier(8)
    logged = []

    def worker():
        barrier.wait()
        for _ in range(200):
            logged.append(d.note("range", "64 tokens above the fused range"))
            d.note("dtype", "fp8")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert logged.count(True) == 1
    lines = [r.getMessage() for r in caplog.records]
    # The two reasons may come in either order (the threads race); each once.
    assert sorted(lines) == [
        "arfuse: declined (dtype): fp8; the framework's own path runs there (first time for "
        "this reason, not logged again)",
        "arfuse: declined (range): 64 tokens above the fused range; the framework's own path "
        "runs there (first time for this reason, not logged again)"]
    assert all(r.levelno == logging.INFO for r in caplog.records)
    assert d.seen() == ["dtype", "range"]


def test_reason_classes():
    c = _decisions.reason_class
    assert c("input is not contiguous") == "not_contiguous"
    assert c("the context was drained by its sidecar") == "drained"
    assert c("dtype torch.int8 is not served (bf16, fp16, fp32)") == "dtype"
    assert c("residual (3, 4) differs from input (3, 5)") == "shape"
    assert c("the post-experts group (ranks [0]) is not the TP group (ranks [0, 1])") == "groups"
    assert c("no in-stream context attached for cuda:0") == "not_attached"
    assert c("") == "not_served"


class _Group:  # what setup() reads of SGLang's GroupCoordinator
    def __init__(self, ranks, rank=0):
        self.ranks, self.world_size, self.rank_in_group, self.cpu_group = \
            ranks, len(ranks), rank, None


def test_sglang_path_line_and_first_gate_decline(caplog):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (CI)")
    from arfuse.integrations import sglang as shim

    caplog.set_level(logging.INFO, logger="arfuse")
    shim._declines.reset()
    tp = _Group([0, 1])
    try:
        # A post-experts group narrower than TP: declined before anything attaches.
        assert shim.setup(4096, torch.bfloat16, groups=(tp, tp, _Group([0])), timeout=1) is False
        path = [r for r in caplog.records if "path SGLang's own" in r.getMessage()]
        assert len(path) == 1 and path[0].levelno == logging.WARNING
        msg = path[0].getMessage()
        assert msg.startswith("arfuse: SGLang rank 0/2: path SGLang's own allreduce + RMSNorm; "
                              "attached: no (the post-experts group"), msg
        assert "vote: off on every rank; patched: nothing; why: rank 0: the post-experts" in msg

        # Traced: no graph break, and nothing noted while Dynamo traces.
        def f(x):
            return x * 2 if shim.is_flashinfer_allreduce_unavailable() else x

        explain = torch._dynamo.explain(f)(torch.ones(2))
        assert explain.graph_break_count == 0
        torch.compile(f, fullgraph=True, backend="eager")(torch.ones(2))
        assert not [r for r in caplog.records if "declined (" in r.getMessage()]

        # Eager: the gate's no, three times, and the op's: one line for the reason.
        for _ in range(3):
            assert shim.is_flashinfer_allreduce_unavailable() is True
        assert shim.flashinfer_allreduce_residual_rmsnorm(None, None, None) == (None, None)
        declined = [r for r in caplog.records if "declined (" in r.getMessage()]
        assert len(declined) == 1 and declined[0].levelno == logging.INFO
        assert declined[0].getMessage().startswith(
            "arfuse: declined (groups): rank 0: the post-experts group (ranks [0]) is not the "
            "TP group"), declined[0].getMessage()
        assert "SGLang's own allreduce + RMSNorm runs there" in declined[0].getMessage()
        assert shim.status()["declined"] == ["groups"]
    finally:
        shim.teardown()
        shim._declines.reset()
