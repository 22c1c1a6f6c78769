"""examples/tp_decode.py without torch: arguments, SGLang flags -> sidecar flags,
the pool layout, the negotiation -> execution table, sidecars started by the example, plans for
every layer, and the launcher end to end in --setup-only mode (host-mode sidecars: the fused ops
run on known data and are checked; fusion off; a sidecar killed mid-run). The model itself needs
torch: those tests skip without it (PyTorch is too big for CI; docs/integration.md has the GPU
commands)."""
import os
import subprocess
import sys
import tempfile

import pytest

from conftest import REPO

EXAMPLES = REPO / "examples"
sys.path.insert(0, str(EXAMPLES))

import arfuse  # noqa: E402
import tp_decode as td  # noqa: E402

SMALL = ["--hidden", "256", "--heads", "4", "--kv-heads", "2", "--intermediate", "512",
         "--layers", "2", "--batch", "2", "--prompt-len", "4", "--steps", "4"]


def neg(fused=True, mode="full", plane="doorbell", backend="mnnvl", device="cuda"):
    # (a stand-in for Config.Negotiate's answer)
    return arfuse.Negotiation(backend=backend if fused else "none", fusion_enabled=fused,
                              cuda_graph_mode=mode, data_plane=plane, warnings=(),
                              reasons=("test",), device=device, rank=0, world_size=2,
                              mps_detected=True, doorbell_hop_us=2.0)


# ---- arguments and flags ----

def test_defaults_and_sglang_flags_reach_the_sidecars():
    a = td.parse_args([])
    assert a.ranks == 2 and a.cuda_graph == "full" and a.fused_op_in_graph is True
    assert td.fusion_flags(a, "main", "cuda") == []  # unset: fusion off unless auto-enabled
    a = td.parse_args(["--flashinfer-allreduce-fusion-backend", "trtllm",
                       "--enable-flashinfer-allreduce-fusion", "--enable-deterministic-inference"])
    # Passed through verbatim: the sidecar's config service migrates and resolves them.
    assert td.fusion_flags(a, "main", "cuda") == [
        "--flashinfer-allreduce-fusion-backend=trtllm", "--enable-flashinfer-allreduce-fusion",
        "--enable-deterministic-inference"]
    # The off scenario adds the enforce flag; host mode names an architecture (sm 90) unless given.
    assert td.fusion_flags(a, "off", "cpu")[-3:] == [
        "--enforce-disable-flashinfer-allreduce-fusion", "--enable-deterministic-inference",
        "--sm=90"]
    assert td.fusion_flags(td.parse_args(["--sm", "100"]), "main", "cpu") == ["--sm=100"]


@pytest.mark.parametrize("argv, words", [
    (["--hidden", "100", "--heads", "8"], "multiple of --heads"),
    (["--heads", "16", "--kv-heads", "5"], "multiple of --kv-heads"),
    (["--scenarios", "main,bogus"], "unknown scenario"),
    (["--scenarios", "kill", "--sockets", "a,b"], "needs sidecars"),
    (["--steps", "1"], "--steps"),
])
def test_bad_arguments(argv, words, capsys):
    with pytest.raises(td.UsageError) as e:
        td.parse_args(argv)
    assert words in str(e.value)
    assert td.main(argv) == 2
    assert words in capsys.readouterr().err


def test_world_size_must_divide_the_model():
    a = td.parse_args(["--heads", "16", "--kv-heads", "2"])
    td.check_world(a, 2)
    with pytest.raises(td.UsageError, match="kv-heads 2 is not divisible by the 4 ranks"):
        td.check_world(a, 4)


def test_sidecar_argv():
    cfg = td.model_config(td.parse_args(SMALL))
    argv = td.sidecar_argv("/x/arfused", 1, 2, "/tmp/d", "cuda", 1, cfg,
                           ["--flashinfer-allreduce-fusion-backend=auto"], 5.0,
                           ["--metrics-port=0"])
    assert argv[0] == "/x/arfused"
    for want in ("--device=cuda", "--rank=1", "--world-size=2", "--socket=/tmp/d/rank1.sock",
                 "--peer-dir=/tmp/d/peers", "--hidden=256", f"--max-tokens={2 * 4}",
                 "--dtype=bf16", "--gpu=1", "--flashinfer-allreduce-fusion-backend=auto",
                 "--metrics-port=0", "--spin-timeout=5"):
        assert want in argv
    host = td.sidecar_argv("/x/arfused", 0, 2, "/tmp/d", "cpu", 0, cfg, [], 5.0)
    assert "--device=host" in host and not any(x.startswith("--gpu") for x in host)


def test_rank_argv_forwards_the_model_and_run_options():
    a = td.parse_args(SMALL + ["--perf", "--strict-tokens", "--fused-op-in-graph", "false"])
    a.device, a.gpu_count = "cuda", 1
    argv = td.rank_argv(a, 1, 2, ["/s0", "/s1"], "/w", "kill", "file:///w/init", [11, 12], "1@2")
    back = td.parse_args(argv[2:])
    assert back.rank == 1 and back.sockets == "/s0,/s1" and back.scenario == "kill"
    assert back.inject_kill == "1@2" and back.sidecar_pids == "11,12"
    assert back.perf and back.strict_tokens and back.fused_op_in_graph is False
    assert (back.hidden, back.layers, back.batch, back.device, back.gpu_count) == \
        (256, 2, 2, "cuda", 1)


# ---- layout and the execution table ----

def test_pool_layout():
    cfg = td.model_config(td.parse_args(SMALL))
    lay = td.pool_layout(cfg)
    rows = cfg.max_tokens * 256 * 2
    spans = sorted((off, off + n) for off, n in lay.offsets.values())
    assert all(off % 256 == 0 for off, _ in spans)
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:]))  # no overlap
    assert lay.offsets["partial"][1] == rows
    assert lay.offsets["gamma"][1] == (2 * cfg.layers + 1) * 256 * 2
    assert lay.gamma_offset(3) == lay.offset("gamma") + 3 * 256 * 2
    assert lay.total >= spans[-1][1]
    assert cfg.sites == 4
    assert td.site_name(cfg, 0) == "layer 0 attention o_proj + post_attention_layernorm"
    assert td.site_name(cfg, 1) == "layer 0 mlp down_proj + layer 1 input_layernorm"
    assert td.site_name(cfg, 3) == "layer 1 mlp down_proj + final norm"


@pytest.mark.parametrize("n, device, want, capt, db_ok, expect", [
    # fused, doorbell negotiated and set up on every rank: the ring sits in the graph
    (neg(mode="full"), "cuda", "full", True, True, ("full", "doorbell", True)),
    (neg(mode="piecewise"), "cuda", "piecewise", True, True, ("piecewise", "doorbell", True)),
    # doorbell negotiated but refused (UNIMPLEMENTED, no ring library, a rank failed): split op
    (neg(mode="full"), "cuda", "full", True, False, ("piecewise", "eager", False)),
    # eager plane negotiated (host mode: full became piecewise): never inside a graph
    (neg(mode="piecewise", plane="eager"), "cuda", "full", True, None,
     ("piecewise", "eager", False)),
    (neg(mode="full", plane="eager"), "cuda", "full", True, None, ("piecewise", "eager", False)),
    (neg(mode="none", plane="eager"), "cuda", "full", True, None, ("none", "eager", False)),
    # fusion off: the framework path, inside the graph only when its collective is capturable
    (neg(fused=False, mode="full", plane="eager"), "cuda", "full", True, None,
     ("full", "framework", True)),
    (neg(fused=False, mode="full", plane="eager"), "cuda", "full", False, None,
     ("piecewise", "framework", False)),
    (neg(fused=False, mode="none", plane="eager"), "cuda", "none", True, None,
     ("none", "framework", False)),
    # cpu: host-mode sidecars, no graphs
    (neg(mode="none", plane="eager", device="host"), "cpu", "none", False, None,
     ("none", "eager", False)),
    (neg(fused=False, mode="none", plane="eager", device="host"), "cpu", "none", False, None,
     ("none", "framework", False)),
])
def test_decide_execution(n, device, want, capt, db_ok, expect):
    ex = td.decide_execution(n, device, want, framework_capturable=capt, doorbell_ok=db_ok,
                             doorbell_reason="UNIMPLEMENTED: no doorbell" if db_ok is False else "")
    assert (ex.decode_graph, ex.decode_plane, ex.op_in_graph) == expect
    assert ex.fused == n.fusion_enabled
    assert ex.prefill_plane == ("eager" if n.fusion_enabled else "framework")
    # The rule negotiation imposes: no eager-plane op inside a graph, and never a graph mode
    # the sidecar did not allow.
    assert not (ex.decode_plane == "eager" and ex.op_in_graph)
    assert ex.decode_graph == "none" or n.cuda_graph_mode != "none"
    if db_ok is False:
        assert "UNIMPLEMENTED" in ex.describe()


@pytest.mark.parametrize("n, device, want, ok, expect", [
    # attached on every rank: the torch op, inside the graph the negotiation allows
    (neg(mode="full", plane="instream"), "cuda", "full", True, ("instream", "full", True)),
    (neg(mode="piecewise", plane="instream"), "cuda", "full", True,
     ("instream", "piecewise", True)),
    (neg(mode="none", plane="instream"), "cuda", "full", True, ("instream", "none", False)),
    (neg(mode="none", plane="instream", device="host"), "cpu", "none", True,
     ("instream", "none", False)),
    # a rank could not attach: the eager plane, between graph pieces, and it says why
    (neg(mode="full", plane="instream"), "cuda", "full", False, ("eager", "piecewise", False)),
    (neg(mode="none", plane="instream", device="host"), "cpu", "none", False,
     ("eager", "none", False)),
])
def test_decide_execution_instream(n, device, want, ok, expect):
    ex = td.decide_execution(n, device, want, framework_capturable=True, instream_ok=ok,
                             instream_reason="" if ok else "UNAVAILABLE: no fd-socket client")
    assert (ex.decode_plane, ex.decode_graph, ex.op_in_graph) == expect
    assert ex.prefill_plane == ("instream" if ok else "eager")
    assert ex.eager_decode == (not ok)
    if not ok:
        assert "no fd-socket client" in ex.describe()
        check = td.eager_decode_check(ex, allowed=False)
        assert not check["ok"] and td.EAGER_BANNER in check["message"]
        assert "--allow-eager-decode" in check["message"]
        assert td.eager_decode_check(ex, allowed=True)["ok"]
    else:
        assert td.eager_decode_check(ex, allowed=False) is None


def test_capture_request_by_plane():
    assert td.capture_request("instream", "full", True, "cuda") == {
        "cuda_graph_mode": "full", "fused_op_in_graph": True, "client_loads_kernels": True}
    assert td.capture_request("doorbell", "full", True, "cuda") == {
        "cuda_graph_mode": "full", "fused_op_in_graph": True, "client_loads_kernels": False}
    assert td.capture_request("eager", "full", True, "cuda") == {
        "cuda_graph_mode": "full", "fused_op_in_graph": False, "client_loads_kernels": False}
    assert td.capture_request("instream", "full", True, "cpu")["cuda_graph_mode"] == "none"


# ---- against real host-mode sidecars ----

@pytest.fixture
def host_group(arfused):
    """Two sidecars started by the example's own SidecarGroup, with --sm 90 and a backend."""
    a = td.parse_args(SMALL + ["--flashinfer-allreduce-fusion-backend", "trtllm"])
    cfg = td.model_config(a)
    folder = tempfile.mkdtemp(prefix="tpd-test-")
    g = td.SidecarGroup(arfused, 2, folder, "cpu", 1, cfg, td.fusion_flags(a, "main", "cpu"),
                        spin_timeout=2.0)
    g.start()
    g.wait_sockets(60)
    yield a, cfg, g
    g.stop()


def test_negotiation_plans_and_doorbell_fallback(host_group):
    a, cfg, g = host_group
    layout = td.pool_layout(cfg)
    results = {}

    def rank(r):
        client, info = td.connect_sidecar(g.sockets()[r], r, 2, 10.0, 60.0)
        try:
            n = td.negotiate(client, "full", True, "cuda", 30.0, plane="doorbell")
            buf = arfuse.HostShmBuffer(layout.total)
            region = arfuse.FusionWorkspace(client).register(buf, "pool")
            plans = td.create_site_plans(client, cfg, layout, region, cfg.max_tokens, False)
            # The doorbell plane does not exist in host mode: a reason, never an exception.
            db_plans, rings, why = td.try_doorbell(client, cfg, layout, region, None)
            listed = client.list_regions()
            td.destroy_plans(client, plans)
            buf.close()
            results[r] = (n, len(plans), why, db_plans, rings, len(listed))
        finally:
            client.close()

    import threading
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert set(results) == {0, 1}
    for r, (n, nplans, why, db_plans, rings, nregions) in results.items():
        assert (n.backend, n.fusion_enabled, n.device, n.rank) == ("trtllm", True, "host", r)
        # Host mode has no doorbell: full graphs become piecewise with an eager split op.
        assert (n.cuda_graph_mode, n.data_plane) == ("piecewise", "eager")
        assert any("doorbell" in x for x in n.reasons)
        assert nplans == cfg.sites and nregions == 1
        assert why and db_plans == [] and rings == []
        ex = td.decide_execution(n, "cuda", "full", True)
        assert (ex.decode_graph, ex.decode_plane, ex.op_in_graph) == ("piecewise", "eager", False)
    assert td.negotiation_key(results[0][0]) == td.negotiation_key(results[1][0])


def test_wrong_socket_order_is_named(host_group):
    a, cfg, g = host_group
    with pytest.raises(td.SetupError, match="is rank 1 of 2, not rank 0 of 2"):
        td.connect_sidecar(g.sockets()[1], 0, 2, 5.0, 30.0)


def run_launcher(arfused, *extra, timeout=120, model=SMALL, plane="eager"):
    cmd = [sys.executable, str(EXAMPLES / "tp_decode.py"), "--device", "cpu", "--ranks", "2",
           "--setup-only", "--arfused", arfused, "--flashinfer-allreduce-fusion-backend", "auto",
           "--spin-timeout", "1", "--plane", plane, *model, *extra]
    env = dict(os.environ)
    env.pop("RANK", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_launcher_setup_only_runs_and_checks_every_fused_op(arfused, tmp_path):
    out = tmp_path / "r.json"
    p = run_launcher(arfused, "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "scenario main: PASS" in p.stdout
    assert "negotiated (asked plane=eager, cuda_graph_mode=none" in p.stdout
    import json
    res = json.loads(out.read_text())
    r0 = res["scenarios"][0]["ranks"]["0"]
    assert r0["setup"]["plans"] == 4 and r0["setup"]["ops"] == 4 * 4
    assert r0["setup"]["checked_values"] == 4 * 2 * 2 * 256
    assert r0["negotiation"]["backend"] == "mnnvl" and r0["execution"]["decode_plane"] == "eager"
    # --plane eager is the explicit allowance: still said loudly, and passed.
    assert td.EAGER_BANNER in p.stdout
    assert [c["ok"] for c in r0["setup"]["checks"]] == [True]


def test_a_decode_that_falls_to_the_eager_plane_fails_loudly(arfused):
    """Host mode has no doorbell: asking for it leaves decode on the eager plane, which fails
    the run unless --allow-eager-decode."""
    p = run_launcher(arfused, plane="doorbell")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "scenario main: FAIL" in p.stdout and td.EAGER_BANNER in p.stdout
    assert "pass --allow-eager-decode to accept it" in p.stdout
    p = run_launcher(arfused, "--allow-eager-decode", plane="doorbell")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "scenario main: PASS" in p.stdout and td.EAGER_BANNER in p.stdout


def test_launcher_fusion_off_takes_the_framework_path(arfused):
    p = run_launcher(arfused, "--scenarios", "off")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "scenario off: PASS" in p.stdout
    assert "fusion disabled by --enforce-disable-flashinfer-allreduce-fusion" in p.stdout
    assert "plane=framework" in p.stdout


def test_launcher_killed_sidecar_stops_every_rank_naming_it(arfused):
    p = run_launcher(arfused, "--scenarios", "kill", "--op-timeout", "5")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "scenario kill: PASS" in p.stdout
    assert "rank 1: its arfused sidecar" in p.stdout and "is gone" in p.stdout
    # rank 0's sidecar names the missing peer: within its spin timeout when the op was already
    # waiting, or at once when the supervisor saw the peer link break first (the op is aborted).
    assert "rank 0: fused op failed" in p.stdout
    assert "ranks 1 did not arrive" in p.stdout or "ranks 1 had yet to arrive" in p.stdout


def test_launcher_reports_a_missing_daemon(tmp_path):
    p = run_launcher(str(tmp_path / "nope"))
    assert p.returncode == 1 and "arfused not found" in p.stderr


# ---- the model (torch) ----

def test_model_tp1_cpu():
    torch = pytest.importorskip(
        "torch", reason="PyTorch is not installed (too big for CI): the model runs on the GPU "
                        "machine (docs/integration.md)")
    import tp_model

    a = td.parse_args(SMALL + ["--device", "cpu"])
    cfg = td.model_config(a)
    w = tp_model.Weights(cfg, 0, 1, torch.device("cpu"), torch.bfloat16)
    buf = arfuse.HostShmBuffer(td.pool_layout(cfg).total)
    try:
        m = tp_model.TPModel(cfg, w, buf, td.pool_layout(cfg), 0, 1, torch.device("cpu"),
                             torch.bfloat16)
        fw = tp_model.FrameworkComm(m, "gloo")  # world 1: no collective
        prompt = torch.randint(0, cfg.vocab, (cfg.batch, cfg.prompt_len),
                               generator=torch.Generator().manual_seed(1))

        class Ctx:
            rank = 0

        r1 = tp_model.run_pass(Ctx, m, prompt, "a", fw, fw, "none")
        r2 = tp_model.run_pass(Ctx, m, prompt, "b", fw, fw, "none")
        assert r1.tokens.shape == (cfg.steps, cfg.batch)
        c = tp_model.compare(r1, r2, exact=True, strict=True)
        assert c["ok"] and c["max_abs_logit_diff"] == 0.0
        x = torch.randn(3, 256).to(torch.bfloat16)
        g = torch.ones(256)
        y = tp_model.rmsnorm(x, g, 1e-5).float()
        assert torch.allclose(y.pow(2).mean(-1), torch.ones(3), atol=2e-2)
    finally:
        buf.close()


def run_model(arfused, *extra, timeout=300):
    cmd = [sys.executable, str(EXAMPLES / "tp_decode.py"), "--device", "cpu", "--ranks", "2",
           "--arfused", arfused, "--flashinfer-allreduce-fusion-backend", "auto",
           "--spin-timeout", "1", "--op-timeout", "5", *SMALL, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_launcher_cpu_model_run(arfused):
    pytest.importorskip("torch", reason="PyTorch is not installed (too big for CI)")
    p = run_model(arfused, "--plane", "eager", "--scenarios", "main,off,kill")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]


def test_launcher_cpu_model_run_instream(arfused, tmp_path):
    """The model on the in-stream plane in host mode: arfuse.torch's op on CPU tensors."""
    pytest.importorskip("torch", reason="PyTorch is not installed (too big for CI)")
    import json

    out = tmp_path / "r.json"
    p = run_model(arfused, "--scenarios", "main,kill", "--json", str(out))
    res = json.loads(out.read_text())
    r0 = res["scenarios"][0]["ranks"]["0"]
    if (r0.get("negotiation") or {}).get("data_plane") != "instream":
        pytest.skip("the host-mode sidecar does not negotiate the in-stream plane yet")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert r0["execution"]["decode_plane"] == "instream" and r0["ops"]["fused"] > 0


def test_oracle_cpu(arfused, tmp_path):
    """The oracle's pipeline end to end on CPU: (a) arfuse on host-mode sidecars, (b) gloo,
    (c) fp32, (d) transformers when installed; the report's shape and its rule."""
    pytest.importorskip("torch", reason="PyTorch is not installed (too big for CI)")
    import json

    out = tmp_path / "oracle.json"
    p = run_model(arfused, "--plane", "eager", "--oracle", str(out), "--oracle-slack", "1.0",
                  "--steps", "3")
    assert out.exists(), p.stdout[-4000:] + p.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert len(rep["layers"]) == 2 and rep["positions_per_layer"] == 2 * 4 + 2 * 2
    for row in rep["layers"]:
        assert row["ok"] == (row["arfuse"]["rel_l2"] <= 2.0 * row["framework"]["rel_l2"])
        assert 0 < row["arfuse"]["rel_l2"] < 0.05 and 0 < row["framework"]["rel_l2"] < 0.05
    t = rep["tokens"]["arfuse"]
    assert t["positions"] == 3 * 2 and t["equal"] + t["ties"] + t["mismatches"] == 6
    try:
        import transformers  # noqa: F401
        assert rep["reference_check"]["ok"] is True, rep["reference_check"]
        assert rep["logits"]["transformers"]["rel_l2"] < 1e-4
    except ImportError:
        assert rep["reference_check"]["ok"] is None
    assert (p.returncode == 0) == rep["ok"], p.stdout[-3000:]
