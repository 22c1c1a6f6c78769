"""vLLM integration with torch: the arfuse pass on post-grad FX graphs of vLLM's real ops, two
TP ranks (processes, gloo) with their host-mode sidecars, for every pinned release; and
register() on the real modules. Skips without torch or without vLLM's Python dependencies
(tests/frameworks/vllm/run --torch PYTHON installs them into build/frameworks/vllm/deps)."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]
DEPS = pathlib.Path(os.environ.get("ARFUSE_VLLM_DEPS", REPO / "build/frameworks/vllm/deps"))

_spec = importlib.util.spec_from_file_location("arfuse_python_fixtures",
                                               REPO / "tests/python/conftest.py")
fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures)

if not (DEPS / "regex").exists() or not (DEPS / "transformers").exists():
    pytest.skip(f"vLLM's Python dependencies are not in {DEPS} (tests/frameworks/vllm/run "
                "--torch PYTHON)", allow_module_level=True)


@pytest.fixture(scope="module")
def arfused():
    binary = fixtures.find_arfused()
    if binary is None:
        pytest.skip("arfused is not built")
    return binary


def _env():
    env = dict(os.environ)
    lib = REPO / "build/client/instream/libarfuse_client.so"
    if "ARFUSE_CLIENT_LIB" not in env and lib.exists():
        env["ARFUSE_CLIENT_LIB"] = str(lib)
    return env


def run_ranks(arfused, src, tmp_path, hidden=256, max_tokens=64, dtype="bf16", extra=()):
    g = fixtures.Group(arfused, 2, hidden=hidden, max_tokens=max_tokens, dtype=dtype)
    try:
        procs = [subprocess.Popen(
            [sys.executable, str(HERE / "pass_rank.py"), "--rank", str(r), "--world", "2",
             "--init", str(tmp_path / "init"), "--socket", os.path.join(g.dir, "rank{rank}.sock"),
             "--vllm-src", str(src), "--deps", str(DEPS), "--hidden", str(hidden),
             "--dtype", dtype, "--out", str(tmp_path / f"rank{r}.json"), *extra],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(2)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:  # the rank that failed first, not the peer that lost it
            procs, outs = [procs[failed[-1]]] + procs, [outs[failed[-1]]] + outs
        for r, (p, out) in enumerate(zip(procs, outs)):
            assert p.returncode == 0, f"rank {r}:\n{out[-4000:]}"
        return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        g.stop()


def test_the_pass_serves_vllms_sites_within_the_fused_range(arfused, vllm_source, tmp_path):
    version, src = vllm_source
    results = run_ranks(arfused, src, tmp_path)
    for res in results:
        assert res["vllm_file"].startswith(str(src))
        assert not res["disabled"] and res["status"]["on"], res["status"]
        m = res["max_token_num"]
        assert m == 64                  # the sidecar's fused range at hidden 256 bf16 here
        assert m in res["endpoints"]    # its own compile range
        assert res["applicable"] == {"1..m": True, "m+1..max": False, "1..max": False}
        model = res["model"]
        # First layer (AR + RMSNorm), a middle one (AR + add-RMSNorm), the last (residual
        # unused): all three on arfuse, none of vLLM's allreduces or IR norms left.
        assert model["before"] == {"arfuse": 0, "all_reduce": 3, "vllm_ir": 3}
        assert model["after"] == {"arfuse": 3, "all_reduce": 0, "vllm_ir": 0}
        assert model["matched"] == 3
        # The zero-residual replacement's residual output is the allreduce, bit for bit.
        assert model["ar0_equal"]
        for diff, ref in zip(model["max_abs_diff"], model["max_abs_ref"]):
            assert diff <= 1.6e-2 * ref + 1e-2, (version, model)
        # vLLM's static per-tensor FP8 sites (the first layer's and a middle one's), as its
        # custom op under auto_functionalized (with and without group_shape) and as
        # QuantFP8's native form: on arfuse's FP8 op, nothing of vLLM's site left, the codes
        # within one E4M3 step of vLLM's path (arfuse quantizes the fp32 normalized value,
        # vLLM the bf16 norm output), the residual streams as vLLM's.
        for name in ("fp8_custom", "fp8_custom_no_group_shape", "fp8_native"):
            fp8 = res[name]
            assert fp8["matched"] == 2, (version, name, fp8)
            assert fp8["before"]["all_reduce"] == 2 and fp8["before"]["vllm_ir"] == 2, fp8
            assert fp8["after"] == {"arfuse": 2, "all_reduce": 0, "vllm_ir": 0}, fp8
            assert fp8["left"] == [], (name, fp8["left"])
            assert fp8["dtypes"][0::2] == ["torch.float8_e4m3fn"] * 2, fp8
            assert fp8["codes_max_steps"] == [min(s, 1) for s in fp8["codes_max_steps"]], fp8
            assert all(n > 0 for n in fp8["codes_nonzero"]), fp8
            assert fp8["residual_equal"], fp8
            assert fp8["residual_max_abs_diff"] <= 1.6e-2 * fp8["residual_max_abs_ref"] + 1e-2
        for declined in ("quant_nvfp4", "quant_dynamic", "quant_norm_used", "quant_fp32",
                         "gemma", "mixed", "partial_first"):
            assert res[declined]["matched"] == 0, (declined, res[declined])
            assert res[declined]["after"] == res[declined]["before"]
            assert res[declined]["after"]["arfuse"] == 0
        # One line for the path (attached, vote, patched), and each decline reason once, at
        # INFO, however many sites and compile ranges declined for it.
        logs = res["logs"]
        path = [l for l in logs if "path arfuse" in l]
        assert len(path) == 1 and path[0].startswith("INFO "), logs
        assert "attached: yes; vote: on on every TP rank" in path[0], path[0]
        assert "compile ranges up to 64 tokens" in path[0], path[0]
        declines = [l for l in logs if "arfuse: declined (" in l]
        reasons = [l.split("declined (", 1)[1].split(")", 1)[0] for l in declines]
        assert sorted(reasons) == sorted(set(reasons)), declines
        assert {"nvfp4", "fp8_dynamic", "fp8_norm_used", "fp8_dtype", "fp8", "dtype",
                "range"} <= set(reasons), declines
        assert all(l.startswith("INFO ") and "vLLM's own allreduce + RMSNorm runs there" in l
                   for l in declines), declines


def test_a_rank_that_cannot_attach_turns_the_pass_off_on_every_rank(arfused, vllm_source,
                                                                    tmp_path):
    _, src = vllm_source
    results = run_ranks(arfused, src, tmp_path, extra=["--break-rank", "1"])
    for res in results:
        assert res["disabled"] and not res["status"]["on"]
        assert res["max_token_num"] == 0
    assert "TP rank 1" in results[1]["status"]["reason"]
    assert results[0]["status"]["reason"] == "another TP rank could not attach"
    # Each rank says, once, that vLLM's own path serves, whether it attached, and why.
    for r, res in enumerate(results):
        path = [l for l in res["logs"] if "path vLLM's own allreduce + RMSNorm" in l]
        assert len(path) == 1 and path[0].startswith("WARNING "), res["logs"]
        assert f"vLLM TP rank {r}/2" in path[0] and "vote: off on every TP rank" in path[0]
        assert ("attached: yes" if r == 0 else "attached: no (") in path[0], path[0]


REGISTER = r"""
import json, os, sys
sys.path[:0] = [sys.argv[1], sys.argv[2], sys.argv[3]]
import vllm_env; vllm_env.setup(sys.argv[4], sys.argv[5])
os.environ["ARFUSE_SOCKET"] = "/nonexistent/rank{rank}.sock"
from arfuse.integrations import vllm as av
import vllm.compilation.passes.pass_manager as pm
import vllm.config.vllm as vc
before = pm.__dict__.get("AllReduceFusionPass")
level2 = vc.OPTIMIZATION_LEVEL_02["compilation_config"]["pass_config"]["fuse_allreduce_rms"]
av.register(); av.register()
out = {"layout": av.check_layout(), "status": av.status(),
       "pass": pm.AllReduceFusionPass.__name__,
       "level2": getattr(vc.OPTIMIZATION_LEVEL_02["compilation_config"]["pass_config"]
                         ["fuse_allreduce_rms"], "arfuse", False),
       "level1_untouched": vc.OPTIMIZATION_LEVEL_01["compilation_config"]["pass_config"]
                           ["fuse_allreduce_rms"] is False}
av.unregister()
out["restored"] = pm.__dict__.get("AllReduceFusionPass") is before and \
    vc.OPTIMIZATION_LEVEL_02["compilation_config"]["pass_config"]["fuse_allreduce_rms"] is level2
print(json.dumps(out))
"""


def test_register_on_the_real_modules(vllm_source):
    _, src = vllm_source
    out = subprocess.run(
        [sys.executable, "-c", REGISTER, str(REPO / "client/python"), str(HERE),
         str(REPO / "tests/python"), str(src), str(DEPS)],
        env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["layout"] == []
    assert res["status"]["registered"]
    assert res["pass"] == "ArfuseAllReduceFusionPass"
    assert sorted(res["status"]["patched"]) == sorted([
        "vllm.compilation.passes.pass_manager.AllReduceFusionPass",
        "OPTIMIZATION_LEVEL_02.fuse_allreduce_rms", "OPTIMIZATION_LEVEL_03.fuse_allreduce_rms"])
    assert res["level2"] and res["level1_untouched"] and res["restored"]
