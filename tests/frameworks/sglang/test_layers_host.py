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
