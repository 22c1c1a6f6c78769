"""The SGLang integration's setup, vote and op against real host-mode sidecars (two ranks, gloo,
CPU tensors): every batch the gate admits is served (chunks beyond the fused range, mixed
residual/weight dtypes), never (None, None) after a yes; declined setups answer no on every rank;
torch.compile(fullgraph=True, inductor) through the shim's function has no graph break and is
bit-identical to eager. Needs torch and a built arfused; skips without them."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (CI): host-mode op tests")

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]

def _python_conftest():
    """tests/python/conftest.py (its host-mode sidecar Group), loaded under its own name."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("arfuse_python_conftest",
                                                  REPO / "tests" / "python" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_pc = _python_conftest()
Group, find_arfused = _pc.Group, _pc.find_arfused

RANK = textwrap.dedent(r"""
    import json, os, sys, torch, torch.distributed as dist
    sys.path.insert(0, os.environ["ARFUSE_PY"])
    from arfuse.integrations import sglang as shim
    rank, world, mode = int(sys.argv[1]), 2, sys.argv[2]
    dist.init_process_group("gloo", init_method="file://" + os.environ["INIT"], rank=rank,
                            world_size=world)
    class G:  # what setup() reads of SGLang's GroupCoordinator
        def __init__(self, ranks):
            self.ranks, self.world_size = ranks, len(ranks)
            self.rank_in_group, self.cpu_group = ranks.index(rank) if rank in ranks else 0, None
    tp = G([0, 1])
    moe = G([rank]) if mode == "ep" else tp
    sock = os.environ["SOCK"] if mode != "missing" or rank == 0 else "/nonexistent/rank{rank}.sock"
    out = {"rank": rank}
    hidden, dt = int(os.environ["HIDDEN"]), getattr(torch, os.environ["DTYPE"])
    out["served"] = shim.setup(hidden, dt, socket=sock, groups=(tp, tp, moe), timeout=5)
    out["reason"] = shim.status()["reason"]
    out["gate_yes"] = not shim.is_flashinfer_allreduce_unavailable()
    torch.manual_seed(0)
    eps = 1e-6
    def ref(xs, r, w):
        s = sum(x.float() for x in xs) + r.float()
        n = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.float()
        return n, s
    errs, nones, cases = [], 0, 0
    if mode == "sweep":
        for tokens in [int(t) for t in os.environ["TOKENS"].split(",")]:
            for rdt, wdt in ((dt, dt), (torch.float32, dt), (dt, torch.float32)):
                g = torch.Generator().manual_seed(tokens)
                xs = [torch.randn(tokens, hidden, generator=g).to(dt) for _ in range(world)]
                r = torch.randn(tokens, hidden, generator=g).to(rdt)
                w = torch.randn(hidden, generator=g).to(wdt)
                for use_attn in (True, False):
                    cases += 1
                    n, res = shim.flashinfer_allreduce_residual_rmsnorm(
                        xs[rank], r, w, eps, max(tokens, 2048), use_attn_tp_group=use_attn)
                    if n is None:
                        nones += 1
                        continue
                    rn, rs = ref(xs, r, w)
                    tol = 1e-4 if dt == torch.float32 and rdt == wdt == dt else 5e-2
                    errs.append(max((n.float() - rn).abs().max().item() / (1 + rn.abs().max().item()),
                                    (res.float() - rs).abs().max().item() / (1 + rs.abs().max().item())))
                    if errs[-1] > tol:
                        out.setdefault("bad", []).append([tokens, str(rdt), str(wdt), errs[-1]])
    if mode == "lost":
        # One served op, then this rank waits while the test kills rank 0's sidecar, then the
        # next op: it must raise (never hang, never answer on one rank alone).
        import time
        from arfuse import instream
        x = torch.randn(8, hidden).to(dt); r = torch.randn(8, hidden).to(dt)
        w = torch.randn(hidden).to(dt)
        n, _ = shim.flashinfer_allreduce_residual_rmsnorm(x, r, w, eps, 2048)
        out["first_served"] = n is not None
        print("READY", flush=True)
        while not os.path.exists(os.environ["GO"]):
            time.sleep(0.05)
        t0 = time.monotonic()
        try:
            n, _ = shim.flashinfer_allreduce_residual_rmsnorm(x, r, w, eps, 2048)
            out["next"] = "served" if n is not None else "none"
        except instream.Unavailable as e:
            out["next"] = "Unavailable"
            out["disabled"] = str(getattr(e, "disabled", ""))
            out["message"] = str(e)[:300]
        except Exception as e:  # noqa: BLE001: the test names what was raised
            out["next"] = type(e).__name__
            out["message"] = str(e)[:300]
        out["seconds"] = time.monotonic() - t0
    if mode == "compile":
        import torch._dynamo
        def f(x, r, w):
            n, res = shim.flashinfer_allreduce_residual_rmsnorm(x, r, w, eps)
            return n * 2, res
        x = torch.randn(96, hidden).to(dt); r = torch.randn(96, hidden).to(dt)
        w = torch.randn(hidden).to(dt)
        if rank == 1:
            x = x + 1
        eager = f(x, r, w)
        expl = torch._dynamo.explain(f)(x, r, w)
        out["graph_breaks"] = expl.graph_break_count
        compiled = torch.compile(f, fullgraph=True, backend="inductor")(x, r, w)
        out["bit_identical"] = all(torch.equal(a, b) for a, b in zip(eager, compiled))
    out.update(cases=cases, nones=nones, max_err=max(errs) if errs else None)
    shim.teardown()
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
""")


def run_ranks(tmp_path, group, mode, hidden, dtype, tokens="", between=None):
    """Runs both ranks in `mode`; `between(procs)`, when given, runs once both printed READY."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = dict(os.environ, ARFUSE_PY=str(REPO / "client" / "python"),
               INIT=str(tmp_path / "init"), SOCK=os.path.join(group.dir, "rank{rank}.sock"),
               HIDDEN=str(hidden), DTYPE=dtype, TOKENS=tokens, GO=str(tmp_path / "go"))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    early = ["", ""]
    if between is not None:
        for i, p in enumerate(procs):
            for line in p.stdout:
                early[i] += line
                if line.startswith("READY"):
                    break
        between(procs)
        (tmp_path / "go").write_text("")
    outs = [e + p.communicate(timeout=600)[0] for e, p in zip(early, procs)]
    res = {}
    for o in outs:
        for line in o.splitlines():
            if line.startswith("RESULT "):
                d = json.loads(line[7:])
                res[d["rank"]] = d
    assert len(res) == 2, "\n".join(outs)
    return res, outs


@pytest.fixture
def sidecars():
    binary = find_arfused()
    if binary is None:
        pytest.skip("arfused is not built (or set ARFUSE_ARFUSED)")
    g = Group(binary, 2, hidden=4096, max_tokens=64, dtype="bf16")
    yield g
    g.stop()


@pytest.mark.parametrize("hidden,dtype", [(4096, "bfloat16"), (4096, "float32"),
                                          (8192, "float16")])
def test_every_batch_the_gate_admits_is_served(tmp_path, hidden, dtype):
    binary = find_arfused()
    if binary is None:
        pytest.skip("arfused is not built (or set ARFUSE_ARFUSED)")
    # A workspace of the model's dtype, as a deployment starts its sidecars (--dtype); hidden
    # 8192 is above this workspace's 4096, so the sidecar declines it at setup.
    workspace = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]
    group = Group(binary, 2, hidden=4096, max_tokens=64, dtype=workspace)
    tokens = "1,2,63,64,65,127,128,129,500,2048,2049,4096"
    try:
        res, outs = run_ranks(tmp_path, group, "sweep", hidden, dtype, tokens)
    finally:
        group.stop()
    for r in (0, 1):
        d = res[r]
        if not d["served"]:
            # Declined at setup (not served at this size by these sidecars): the gate is no.
            assert d["gate_yes"] is False and d["nones"] == d["cases"], d
            continue
        assert d["gate_yes"] and d["nones"] == 0, d
        assert "bad" not in d, d
    assert res[0]["served"] == res[1]["served"]
    assert any(res[r]["served"] for r in (0, 1)) or hidden != 4096, (res, outs)


def test_a_narrower_post_experts_group_is_declined_on_every_rank(tmp_path, sidecars):
    res, _ = run_ranks(tmp_path, sidecars, "ep", 4096, "bfloat16")
    for r in (0, 1):
        assert res[r]["served"] is False and res[r]["gate_yes"] is False
        assert "post-experts group" in res[r]["reason"]


def test_a_missing_sidecar_turns_fusion_off_on_every_rank(tmp_path, sidecars):
    res, _ = run_ranks(tmp_path, sidecars, "missing", 4096, "bfloat16")
    for r in (0, 1):
        assert res[r]["served"] is False and res[r]["gate_yes"] is False
        assert res[r]["reason"].startswith("rank 1:"), res[r]


def test_torch_compile_fullgraph_has_no_graph_break_and_matches_eager(tmp_path, sidecars):
    res, outs = run_ranks(tmp_path, sidecars, "compile", 4096, "bfloat16")
    for r in (0, 1):
        assert res[r]["served"], (res, outs)
        assert res[r]["graph_breaks"] == 0 and res[r]["bit_identical"] is True, res[r]


def test_a_sidecar_lost_while_serving_makes_the_next_op_raise_on_every_rank(tmp_path, sidecars):
    """docs/integration.md, SGLang "Faults": rank 0's sidecar SIGKILLed after a served op; the
    next op raises on both ranks (rank 0: Unavailable, its sidecar gone; rank 1: its kernel's
    peer never arrives) within the spin timeout, and neither rank answers alone."""
    def kill_rank0(_procs):
        sidecars.procs[0].kill()
        sidecars.procs[0].wait(10)

    res, outs = run_ranks(tmp_path, sidecars, "lost", 4096, "bfloat16", between=kill_rank0)
    assert res[0]["served"] and res[1]["served"], res
    assert res[0]["first_served"] and res[1]["first_served"], res
    assert res[0]["next"] == "Unavailable", res[0]
    assert "sidecar gone" in res[0]["disabled"] + res[0]["message"], res[0]
    assert res[1]["next"] == "Unavailable", res[1]
    for r in (0, 1):
        assert res[r]["seconds"] < 30, res[r]  # never a hang: bounded by the spin timeout
