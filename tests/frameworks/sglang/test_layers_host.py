"""SGLang's real layer modules of each pinned release (layernorm, the gate, the fusion module) with
arfuse installed as the plugin does, two ranks with host-mode sidecars: tests/gpu/sglang_layers.py
--device=host over a token sweep that crosses SGLang's gate limit. Every output equals a reference
from both ranks' inputs within bf16 tolerance, every yes of SGLang's gate ran a fused launch, and
torch.compile(fullgraph=True) through SGLang's layernorm has no graph break and is bit-identical
to eager. Needs torch, a built arfused and libarfuse_client; skips without them."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (CI): real-module layer tests")

from conftest import REPO, source_dir  # noqa: E402

LAYERS = REPO / "tests" / "gpu" / "sglang_layers.py"
RELEASES = ("0.5.14", "0.5.20", "0.5.23")


def _arfused():
    import importlib.util
    spec = importlib.util.spec_from_file_location("arfuse_python_conftest",
                                                  REPO / "tests" / "python" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.find_arfused()


@pytest.mark.parametrize("version", RELEASES)
def test_real_layers_match_the_reference_across_the_gate_limit(tmp_path, version):
    binary = _arfused()
    if binary is None:
        pytest.skip("arfused is not built (or set ARFUSE_ARFUSED)")
    src = source_dir(version, full=True)
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(LAYERS), "--device=host", "--sglang-src", str(src),
         "--arfused", str(binary), "--hidden", "4096", "--tokens", "1,64,2048,2049,4096",
         "--graph-tokens", "16", "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=dict(os.environ))
    if "did not load" in proc.stdout and "libarfuse_client" in proc.stdout:
        pytest.skip("libarfuse_client is not built (or set ARFUSE_CLIENT_LIB)")
    assert out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert summary["ok"], proc.stdout[-6000:]
    results = summary["results"]
    assert len(results) == 2
    for res in results:
        assert res["sglang"] == version and res["served"], res.get("problems")
        paths = {(row["tokens"], row["use_attn_tp_group"]): row["path"] for row in res["rows"]}
        # Within SGLang's limit the fused op serves both groups; beyond it SGLang's own path.
        for use_attn in (True, False):
            assert paths[(2048, use_attn)] == "fused"
            assert paths[(2049, use_attn)] == "sglang"
        assert all(row["ok"] for row in res["rows"])
        assert res["graphs"] and res["graphs"][0]["graph_breaks"] == 0
        assert res["graphs"][0]["compile_default"] is True
        assert res["launches"] > 0


FP8_RELEASES = ("0.5.20", "0.5.21", "0.5.23")


@pytest.mark.parametrize("version", FP8_RELEASES)
def test_the_per_group_fp8_hook_is_served_and_matches_sglangs_fallback(tmp_path, version):
    """SGLang's per-group FP8 hook (layouts.QUANT_HOOK) through RMSNorm's and GemmaRMSNorm's
    methods and, from 0.5.21, the layer boundary's attention-input fusion: one fused launch per
    call, codes within one E4M3 step of SGLang's CUDA fallback (fused allreduce + RMSNorm, then
    its per-group quant), scales equal once the group's amax is rounded to bf16 alike (at least
    99.9 % of groups, the rest one bf16 step), row-major fp32 [tokens, hidden / 128], the
    residual bit-identical; keep_bf16, another group size and a batch beyond the FP8 launch
    limit run SGLang's own hook (None here) with the reason noted; torch.compile(fullgraph)
    through the hook has no graph break and is bit-identical."""
    binary = _arfused()
    if binary is None:
        pytest.skip("arfused is not built (or set ARFUSE_ARFUSED)")
    src = source_dir(version, full=True)
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(LAYERS), "--device=host", "--sglang-src", str(src),
         "--arfused", str(binary), "--hidden", "4096", "--tokens", "1", "--graph-tokens", "",
         "--fp8", "--fp8-tokens", "1,7,64,2048", "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=dict(os.environ))
    if "did not load" in proc.stdout and "libarfuse_client" in proc.stdout:
        pytest.skip("libarfuse_client is not built (or set ARFUSE_CLIENT_LIB)")
    assert out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert summary["ok"], proc.stdout[-6000:]
    for res in summary["results"]:
        fp8 = res["fp8"]
        assert fp8["status"]["served"] and fp8["status"]["scale_layout"] == "fp32_row_major"
        cases = {row["case"] for row in fp8["rows"]}
        assert {"RMSNorm hook", "GemmaRMSNorm hook"} <= cases
        if version != "0.5.20":
            assert any(c.startswith("boundary ") for c in cases), cases
            assert fp8["caller_fuses_quant_here"] is False  # SGLang asks only on ROCm/aiter
        assert all(row["ok"] and row["max_code_steps"] <= 1 for row in fp8["rows"])
        assert all(row["residual_bit_equal"] and row["scales_equal_after_rounding"] >= 0.999
                   for row in fp8["rows"]), fp8["rows"]
        assert all(d["none"] and not d["launched"] for d in fp8["declines"].values())
        for cls in ("fp8_keep_bf16", "fp8_group_size", "fp8_range"):
            assert any(f"declined ({cls})" in line for line in fp8["decline_lines"]), fp8
        assert fp8["graph_breaks"] == 0 and fp8["compile_bit_identical"]
