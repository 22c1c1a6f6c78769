"""docs/operations.md and the README's "Running a sidecar" run as written: every command block
runs against host-mode sidecars (runbook.py says how blocks are chosen and annotated), and every
metric, label and flag the runbook names exists. A block that cannot run here is annotated in the
markdown, with its reason, and counted below."""
import json
import os
import re
import subprocess
import sys

import pytest

import arfuse_deploy_checks as checks
import arfuse_run as run
import runbook

BLOCKS = runbook.runbook_blocks()
# Blocks that cannot run in CI (a Docker engine, GPUs and a model server, this very suite, a Kubernetes cluster). A new
# skip is a decision: raise the number here together with the annotation.
EXPECTED_SKIPS = 5
# Host mode stands in for the GPUs: an architecture so that backends resolve as on an H200, and a
# small workspace.
HOST_MODE = {"ARFUSE_DEVICE": "host", "ARFUSE_SM": "90", "ARFUSE_HIDDEN": "256",
             "ARFUSE_MAX_TOKENS": "16", "ARFUSE_PEER_TIMEOUT": "60"}


def test_runbook_has_blocks_and_few_skips():
    assert len(BLOCKS) >= 8, [b.where for b in BLOCKS]
    skipped = [b for b in BLOCKS if b.mode == "skip"]
    for b in skipped:
        print(f"skipped {b.where} ({b.heading}): {b.reason}")
    assert len(skipped) == EXPECTED_SKIPS, [(b.where, b.reason) for b in skipped]
    # The README's block is there (its heading is how it is found).
    assert any(b.source == "README.md" for b in BLOCKS)


def test_annotations_are_read(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text("# A\n<!-- runbook: skip: needs a GPU -->\n```sh\nnvidia-smi\n```\n\n"
                   "<!-- runbook: fresh -->\n\n```sh\necho hi\n```\n```sh\nx\n```\n"
                   "```yaml\na: 1\n```\n")
    monkeypatch.setattr(runbook, "REPO", tmp_path)
    got = [(b.mode, b.reason, b.text) for b in runbook.command_blocks(doc)]
    # An annotation separated from its fence by a blank line still holds; prose in between ends it.
    assert got == [("skip", "needs a GPU", "nvidia-smi\n"), ("fresh", "", "echo hi\n"),
                   ("pod", "", "x\n")]
    doc.write_text("<!-- runbook: skip -->\n```sh\nx\n```\n")
    with pytest.raises(ValueError, match="must say why"):
        runbook.command_blocks(doc)


def test_foreground_daemons_go_to_the_background():
    script = "build/server/daemon/arfused --rank=0 \\\n    --world-size=2\narfused --help\n" \
             "arfused --rank=1 &\narfusectl health\n"
    assert runbook.background_daemons(script).splitlines() == [
        "runbook_daemon build/server/daemon/arfused --rank=0      --world-size=2",
        "arfused --help", "arfused --rank=1 &", "arfusectl health"]


@pytest.fixture(scope="session")
def unshare():
    path = run.tool("unshare", "util-linux")
    run.tool("ip", "apt-get install iproute2")
    argv = [path, "--mount", "--net", "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0:
        argv.insert(1, "--map-root-user")
    probe = subprocess.run([*argv, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        run.missing("private namespaces (unshare)", probe.stderr.strip())
    return argv


@pytest.fixture(scope="session")
def pod_sidecars(kubectl, flags, image):
    """The arfused sidecars of the single-node-tp2 overlay: their arguments and environment as
    the pod gives them, in host mode."""
    docs = checks.kustomize(checks.K8S / "overlays" / "single-node-tp2", kubectl)
    configmaps = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "ConfigMap"}
    arfused = str(run.binary("server/daemon/arfused"))
    out = []
    for t in checks.pod_templates(docs):
        for c in t.spec.get("initContainers") or []:
            words = checks.arfused_words(c, image)
            if words is None:
                continue
            env = {k: v for k, (v, _) in checks.container_env(c, configmaps, image.env).items()
                   if v is not None}
            env.update(HOST_MODE)
            parsed, problems = checks.parse_cli(words[0], flags)
            assert problems == [], problems
            rank = next((int(v) for k, v in parsed if k == "rank"), 0)
            socket = next((v for k, v in parsed if k == "socket"),
                          "/run/arfuse/arfused.sock" + (f".rank{rank}" if rank else ""))
            out.append({"name": c["name"], "argv": [arfused, *words[0]], "env": env,
                        "socket": socket})
    assert [s["name"] for s in out] == ["arfused-0", "arfused-1"]
    return out


def _run_block(block, unshare, sidecars, kubectl, tmp_path):
    for s in sidecars:
        s["log"] = str(tmp_path / f"{s['name']}.log")
    spec = {"script": block.text, "mode": block.mode, "dir": str(tmp_path),
            "bin": {"arfused": str(run.binary("server/daemon/arfused")),
                    "arfusectl": str(run.binary("tools/arfusectl/arfusectl"))},
            "sidecars": sidecars, "real_kubectl": kubectl}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    driver = run.REPO / "tests" / "deploy" / "runbook_sandbox.py"
    ran = subprocess.run([*unshare, sys.executable, str(driver), str(tmp_path / "spec.json")],
                         capture_output=True, text=True, timeout=300)
    logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                   for p in sorted(tmp_path.glob("*.log")))
    assert ran.returncode == 0, (f"{block.where} ({block.heading}) exited {ran.returncode}:\n"
                                 f"{block.text}\n--- output\n{ran.stdout}{ran.stderr}{logs}")
    return ran.stdout


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_block_runs(block, unshare, pod_sidecars, kubectl, tmp_path):
    if block.mode == "skip":
        pytest.skip(f"annotated: {block.reason}")
    _run_block(block, unshare, [dict(s) for s in pod_sidecars], kubectl, tmp_path)


def test_a_failing_block_fails(unshare, pod_sidecars, kubectl, tmp_path):
    # The harness itself: a runbook command that fails makes its block fail.
    bad = runbook.Block("x.md", 1, "sh", "kubectl exec deploy/llm -c arfused-9 -- true\n", "pod")
    with pytest.raises(AssertionError, match="no container arfused-9"):
        _run_block(bad, unshare, [dict(s) for s in pod_sidecars], kubectl, tmp_path)


# ---- what the runbook names exists -----------------------------------------------------------

@pytest.fixture(scope="module")
def scrape(tmp_path_factory):
    """/metrics of rank 0 of two host-mode sidecars after one op on both."""
    return run.scrape_after_one_op(tmp_path_factory.mktemp("metrics"))


def _families(text):
    fam = {}
    for m in re.finditer(r"^# TYPE (\w+) (\w+)$", text, re.M):
        fam[m.group(1)] = set()
    for m in re.finditer(r"^(\w+)\{([^}]*)\}", text, re.M):
        name = re.sub(r"_(bucket|sum|count)$", "", m.group(1)) \
            if re.sub(r"_(bucket|sum|count)$", "", m.group(1)) in fam else m.group(1)
        fam.setdefault(name, set()).update(re.findall(r'(\w+)="', m.group(2)))
    return fam


def test_every_metric_the_runbook_names_exists(scrape):
    fam = _families(scrape)
    text = runbook.OPERATIONS.read_text()
    named = set(re.findall(r"\barfuse_[a-z_]+[a-z]\b", text))
    # Histogram series names stand for their family.
    named = {re.sub(r"_(bucket|sum|count)$", "", n) for n in named}
    assert named, "the runbook names no metric"
    # Names the dashboard test allows before the sidecar exports them.
    from test_dashboard import NOT_YET_EXPORTED
    assert sorted(named - set(fam) - set(NOT_YET_EXPORTED)) == [], \
        "named in docs/operations.md, not served by arfused"


def test_metric_labels_in_the_table_exist(scrape):
    fam = _families(scrape)
    rows = re.findall(r"^\| `(arfuse_\w+)\{([a-z_,]+)\}`", runbook.OPERATIONS.read_text(), re.M)
    assert rows, "the metrics table lists no labels"
    for name, labels in rows:
        assert name in fam, name
        # Every series has rank; histogram buckets have le.
        assert set(labels.split(",")) | {"rank"} == fam[name] - {"le"}, (name, labels, fam[name])
    info = dict(rows)["arfuse_build_info"].split(",")
    assert set(info) <= fam["arfuse_build_info"], fam["arfuse_build_info"]


def test_promql_blocks_name_real_metrics(scrape):
    fam = _families(scrape)
    for b in runbook.blocks(runbook.OPERATIONS):
        if b.lang != "promql":
            continue
        for name in re.findall(r"\barfuse_[a-z_]+[a-z]\b", b.text):
            assert re.sub(r"_(bucket|sum|count)$", "", name) in fam, (b.where, name)


def test_yaml_blocks_parse():
    yaml = pytest.importorskip("yaml")
    for b in runbook.blocks(runbook.OPERATIONS):
        if b.lang == "yaml":
            assert yaml.safe_load(b.text) is not None, b.where


# ---- the device-plugin overlay's launcher, run as its container would --------------------------

LAUNCH = "deploy/k8s/overlays/device-plugin-tp2/launch.sh"


def test_device_plugin_launcher_starts_the_group_then_the_server(unshare, kubectl, tmp_path):
    env = " ".join(f"{k}={v}" for k, v in {**HOST_MODE, "ARFUSE_WORLD_SIZE": "2"}.items())
    script = (f"{env} bash {LAUNCH} arfusectl health --all --service arfuse.v1.Fusion\n"
              f"! {env} bash {LAUNCH} sh -c 'exit 7'\n"
              f"set +e; {env} bash {LAUNCH} sh -c 'exit 7'; test $? -eq 7\n")
    out = _run_block(runbook.Block("launch.sh", 1, "sh", script, "fresh"), unshare, [], kubectl,
                     tmp_path)
    assert "the group of 2 ranks is ready" in out, out
    assert out.count("SERVING") >= 2, out
    assert "a process of the group exited with 7" in out, out
