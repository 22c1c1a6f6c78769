"""Real model sizes (docs/performance.md, "Model-level check"): tp_decode --setup-only at
layers 4, 8, 12, 32 and 80 at hidden 4096 (Llama-3-8B's layer) and 8 layers at hidden 8192 (a 70B
layer), two host-mode sidecars: every site of the forward gets its fused op (no slot or plan
exhausted), each site's op runs on known data and is checked against the CPU reference.

- eager plane: one plan per site (2 x layers), every one created and run;
- in-stream plane: one attachment for every site, every site served fused, each op through
  libarfuse_client's CPU implementation. It needs a sidecar that negotiates the in-stream plane
  (Fusion.Attach); against one that does not, the test skips and says so.

The full check at these sizes (the model, on the GPU) is in docs/integration.md's commands."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

EXAMPLES = REPO / "examples"

LLAMA_8B = ["--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--intermediate", "14336",
            "--vocab", "32000"]
LLAMA_70B = ["--hidden", "8192", "--heads", "64", "--kv-heads", "8", "--intermediate", "28672",
             "--vocab", "32000"]
MATRIX = [(LLAMA_8B, layers) for layers in (4, 8, 12, 32, 80)] + [(LLAMA_70B, 8)]
IDS = [f"hidden{m[1]}-layers{layers}" for m, layers in MATRIX]
STEPS = 2


def run(arfused, tmp_path, model, layers, plane):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(EXAMPLES / "tp_decode.py"), "--device", "cpu", "--ranks", "2",
           "--setup-only", "--arfused", arfused, "--flashinfer-allreduce-fusion-backend", "auto",
           "--spin-timeout", "2", "--plane", plane, *model, "--layers", str(layers),
           "--batch", "2", "--prompt-len", "4", "--steps", str(STEPS), "--json", str(out)]
    env = dict(os.environ)
    env.pop("RANK", None)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    res = json.loads(out.read_text()) if out.exists() else None
    return p, res


def rank_results(res):
    return [res["scenarios"][0]["ranks"][str(r)] for r in range(2)]


@pytest.mark.parametrize("model, layers", MATRIX, ids=IDS)
def test_eager_plane_plans_and_runs_every_site(arfused, tmp_path, model, layers):
    p, res = run(arfused, tmp_path, model, layers, "eager")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    hidden = int(model[1])
    sites = 2 * layers
    for r in rank_results(res):
        st = r["setup"]
        assert (st["plane"], st["plans"], st["sites"], st["sites_fused"]) == \
            ("eager", sites, sites, sites)
        assert st["ops"] == STEPS * sites
        assert st["checked_values"] == sites * 2 * 2 * hidden
    assert "RESOURCE_EXHAUSTED" not in p.stdout


@pytest.mark.parametrize("model, layers", MATRIX, ids=IDS)
def test_instream_plane_serves_every_site_with_one_attachment(arfused, tmp_path, model, layers):
    p, res = run(arfused, tmp_path, model, layers, "instream")
    assert res is not None, p.stdout[-3000:] + p.stderr[-2000:]
    ranks = rank_results(res)
    plane = (ranks[0].get("negotiation") or {}).get("data_plane")
    if plane != "instream":
        pytest.skip(f"the host-mode sidecar negotiates the {plane} plane, not the in-stream "
                    "plane (no Fusion.Attach yet)")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    hidden = int(model[1])
    sites = 2 * layers
    for r in ranks:
        st = r["setup"]
        assert (st["plane"], st["attached"], st["plans"]) == ("instream", 1, 0)
        assert (st["sites"], st["sites_fused"], st["ops"]) == (sites, sites, STEPS * sites)
        assert st["checked_values"] == sites * 2 * 2 * hidden
