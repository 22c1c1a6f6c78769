"""deploy/k8s: every overlay renders with `kubectl kustomize` and agrees with arfused's flags."""
import copy
import re
import subprocess

import pytest

import arfuse_deploy_checks as checks
import arfuse_run as run

OVERLAYS = [p.name for p in checks.overlays() if not p.name.startswith("device-plugin")]
DEVICE_PLUGIN = [p.name for p in checks.overlays() if p.name.startswith("device-plugin")]


def test_overlays_exist():
    assert {"single-node-tp2", "single-node-tp8", "multi-node-gb200"} <= set(OVERLAYS)
    assert DEVICE_PLUGIN == ["device-plugin-tp2"]


@pytest.mark.parametrize("overlay", DEVICE_PLUGIN)
def test_device_plugin_overlay_passes(overlay, kubectl, flags):
    docs = checks.kustomize(checks.K8S / "overlays" / overlay, kubectl)
    assert checks.is_device_plugin(docs)
    assert checks.check_device_plugin(docs, flags) == []


def test_device_plugin_checker_catches(kubectl, flags):
    docs = checks.kustomize(checks.K8S / "overlays" / "device-plugin-tp2", kubectl)
    c = checks.pod_templates(docs)[0].spec["containers"][0]
    c["resources"]["limits"]["nvidia.com/gpu"] = 4
    c["livenessProbe"]["exec"]["command"] = ["arfusectl", "health"]
    script = next(d for d in docs if d["metadata"]["name"].startswith("arfuse-launch"))
    script["data"]["launch.sh"] = script["data"]["launch.sh"].replace("--gpu=", "--gpus=")
    problems = checks.check_device_plugin(docs, flags)
    assert any("nvidia.com/gpu 4 != ARFUSE_WORLD_SIZE 2" in p for p in problems), problems
    assert any("livenessProbe does not check every rank" in p for p in problems), problems
    assert any("launch.sh: unknown flag --gpus" in p for p in problems), problems


@pytest.mark.parametrize("directory", checks.kustomizations(), ids=lambda p: str(p.relative_to(checks.K8S)))
def test_kustomize_prints_no_warning(directory, kubectl):
    # Deprecated fields (bases, patchesJson6902, patchesStrategicMerge, ...) make kustomize warn.
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == "", out.stderr
    for name in ("bases", "patchesJson6902", "patchesStrategicMerge", "vars", "commonLabels"):
        assert not re.search(rf"^{name}:", (directory / "kustomization.yaml").read_text(), re.M), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_passes(overlay, rendered, flags, image):
    assert checks.check_manifests(rendered[overlay], flags, image) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_flags_exist_in_built_arfused(overlay, rendered, image, arfused_help):
    # The same flags, as the built binary lists them (options.cc was the reference above).
    help_flags = {name: checks.Flag(name, "std::string", '""') for name in arfused_help}
    used, envs = set(), set()
    for t in checks.pod_templates(rendered[overlay]):
        for c in (t.spec.get("initContainers") or []) + (t.spec.get("containers") or []):
            words = checks.arfused_words(c, image)
            if words is None:
                continue
            used |= {w[2:].split("=")[0] for w in words[0] if w.startswith("--")}
    for d in rendered[overlay]:
        if d.get("kind") == "ConfigMap":
            envs |= {k for k in (d.get("data") or {}) if k.startswith("ARFUSE_")}
    assert used and used <= set(help_flags), used - set(help_flags)
    assert envs <= set(arfused_help.values()), envs - set(arfused_help.values())


def test_monitoring_covers_every_metrics_port(kubectl, rendered):
    monitors = checks.kustomize(checks.K8S / "monitoring", kubectl)
    scraped = {e["port"] for m in monitors if m["kind"] == "PodMonitor"
               for e in m["spec"]["podMetricsEndpoints"]}
    for overlay, docs in rendered.items():
        for t in checks.pod_templates(docs):
            for c in t.spec.get("initContainers") or []:
                for p in c.get("ports") or []:
                    if p["name"].startswith("metrics"):
                        assert p["name"] in scraped, (overlay, c["name"], p["name"])


# --- the checker catches what it should, on doctored copies of the TP2 overlay -----------------

def _pod(docs):
    for d in docs:
        if d["kind"] == "Deployment":
            return d["spec"]["template"]
        if d["kind"] == "LeaderWorkerSet":
            return d["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    raise AssertionError("no workload")


def _container(docs, name):
    spec = _pod(docs)["spec"]
    for c in (spec.get("initContainers") or []) + spec["containers"]:
        if c["name"] == name:
            return c
    raise AssertionError(name)


def _configmap(docs, prefix):
    return next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith(prefix))


def add_arg(name, arg):
    def doctor(docs):
        _container(docs, name)["args"].append(arg)
    return doctor


def replace_arg(name, old, new):
    def doctor(docs):
        c = _container(docs, name)
        assert old in c["args"], c["args"]
        c["args"] = [new if a == old else a for a in c["args"]]
    return doctor


def set_annotation(key, value):
    def doctor(docs):
        _pod(docs)["metadata"]["annotations"][key] = value
    return doctor


def set_probe(name, probe, **grpc):
    def doctor(docs):
        _container(docs, name)[probe]["grpc"].update(grpc)
    return doctor


def set_config(prefix, key, value):
    def doctor(docs):
        data = _configmap(docs, prefix)["data"]
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    return doctor


def set_pod(key, value):
    def doctor(docs):
        spec = _pod(docs)["spec"]
        if value is None:
            spec.pop(key, None)
        else:
            spec[key] = value
    return doctor


def unmount(name, path):
    def doctor(docs):
        c = _container(docs, name)
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != path]
    return doctor


def remove_probe(name, probe):
    def doctor(docs):
        del _container(docs, name)[probe]
    return doctor


def move_gate_to_first(docs):
    _container(docs, "arfused-0")["startupProbe"]["grpc"]["service"] = checks.READINESS_SERVICE


def drop_sidecar(docs):
    spec = _pod(docs)["spec"]
    spec["initContainers"] = [c for c in spec["initContainers"] if c["name"] != "arfused-1"]
    _container(docs, "arfused-0")["startupProbe"]["grpc"]["service"] = checks.READINESS_SERVICE


def share_port(docs):
    _container(docs, "arfused-1")["args"] = [
        a if not a.startswith("--health-port") else "--health-port=9310"
        for a in _container(docs, "arfused-1")["args"]]
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        _container(docs, "arfused-1")[probe]["grpc"]["port"] = 9310
    _container(docs, "arfused-1")["ports"][0]["containerPort"] = 9310


def rename_configmap_ref(docs):
    _container(docs, "arfused-0")["envFrom"][0]["configMapRef"]["name"] = "arfuse-config"


def no_restart_policy(docs):
    del _container(docs, "arfused-0")["restartPolicy"]


def no_mps_daemon(docs):
    spec = _pod(docs)["spec"]
    spec["initContainers"] = [c for c in spec["initContainers"] if c["name"] != "mps-daemon"]


TP2_DOCTORED = {
    "unknown flag": (add_arg("arfused-0", "--no-such-flag=1"), "unknown flag --no-such-flag"),
    "bad flag value": (add_arg("arfused-0", "--dtype=fp64"), "--dtype: 'fp64' is not one of"),
    "backend on the command line": (add_arg("arfused-1", "--flashinfer-allreduce-fusion-backend=trtllm"),
                                    "overrides the ConfigMap"),
    "deprecated flag": (add_arg("arfused-0", "--enable-flashinfer-allreduce-fusion"), "deprecated"),
    "readiness on the wrong port": (set_probe("arfused-1", "readinessProbe", port=9999),
                                    "readinessProbe port 9999 != --health-port 9311"),
    "liveness depends on peers": (set_probe("arfused-0", "livenessProbe", service=checks.READINESS_SERVICE),
                                  "liveness never depends on peers"),
    "readiness on the liveness entry": (set_probe("arfused-0", "readinessProbe", service=""),
                                        "readinessProbe service '' must be"),
    "no liveness probe": (remove_probe("arfused-1", "livenessProbe"), "no livenessProbe"),
    "gate on the first sidecar": (move_gate_to_first, "deadlock"),
    "startup shorter than peer timeout": (set_config("arfuse-config", "ARFUSE_PEER_TIMEOUT", "900"),
                                          "does not cover --peer-timeout 900"),
    "unknown env name": (set_config("arfuse-config", "ARFUSE_BOGUS_KNOB", "1"),
                         "ARFUSE_BOGUS_KNOB (from ConfigMap/"),
    "bad backend in ConfigMap": (set_config("arfuse-config", "ARFUSE_FLASHINFER_ALLREDUCE_FUSION_BACKEND", "fast"),
                                 "'fast' is not one of auto, trtllm, mnnvl"),
    "backend not from ConfigMap": (set_config("arfuse-config", "ARFUSE_FLASHINFER_ALLREDUCE_FUSION_BACKEND", None),
                                   "does not come from a ConfigMap"),
    "nvls left on": (set_config("gpu-env", "NCCL_NVLS_ENABLE", None), "NCCL_NVLS_ENABLE=None"),
    "no MPS pipe directory": (set_config("gpu-env", "CUDA_MPS_PIPE_DIRECTORY", None),
                              "CUDA_MPS_PIPE_DIRECTORY not set"),
    "no MPS daemon": (no_mps_daemon, "no MPS control daemon"),
    "world size off": (set_config("arfuse-config", "ARFUSE_WORLD_SIZE", "4"), "--world-size=4 but"),
    "sidecar missing": (drop_sidecar, "--world-size=2 but the group has 1 sidecars"),
    "health bound to loopback": (set_config("arfuse-config", "ARFUSE_HEALTH_HOST", "127.0.0.1"),
                                 "the kubelet probes the pod IP"),
    "socket not shared with the model server": (unmount("model-server", "/run/arfuse"),
                                                "does not mount volume arfuse-run at /run/arfuse"),
    "socket outside the emptyDir": (add_arg("arfused-0", "--socket=/var/run/x/arfused.sock"),
                                    "is not an emptyDir mounted"),
    "no shared PID namespace": (set_pod("shareProcessNamespace", None), "shareProcessNamespace"),
    "service links on": (set_pod("enableServiceLinks", None), "enableServiceLinks"),
    "grace period not covered": (set_pod("terminationGracePeriodSeconds", 15),
                                 "does not cover --grace-period 20"),
    "two sidecars on one port": (share_port, "port 9310 also used by"),
    "dangling ConfigMap reference": (rename_configmap_ref, "is not in the rendered output"),
    "init container that never exits": (no_restart_policy, "restartPolicy: Always"),
    "metrics off": (replace_arg("arfused-1", "--metrics-port=9331", "--metrics-port=-1"),
                    "--metrics-port -1: metrics off"),
    "annotation on no metrics port": (set_annotation("prometheus.io/port", "9999"),
                                      "prometheus.io/port 9999 is no sidecar's --metrics-port"),
}


@pytest.mark.parametrize("case", sorted(TP2_DOCTORED))
def test_checker_catches_doctored_tp2(case, rendered, flags, image):
    doctor, expected = TP2_DOCTORED[case]
    docs = copy.deepcopy(rendered["single-node-tp2"])
    doctor(docs)
    problems = checks.check_manifests(docs, flags, image)
    assert any(expected in p for p in problems), problems


def lws_leader_ready(docs):
    next(d for d in docs if d["kind"] == "LeaderWorkerSet")["spec"]["startupPolicy"] = "LeaderReady"


def lws_peer_addr_missing(docs):
    c = _container(docs, "arfused-2")
    c["args"] = [c["args"][0].replace(" --peer-addr=${LWS_LEADER_ADDRESS}:9350", "")]


def lws_rank_overlap(docs):
    c = _container(docs, "arfused-3")
    c["args"] = [c["args"][0].replace("+ 3))", "+ 2))")]


def lws_no_imex(docs):
    c = _container(docs, "arfused-1")
    c["resources"]["claims"] = [x for x in c["resources"]["claims"] if x["name"] != "imex-channel"]


def lws_size_changed(docs):
    next(d for d in docs if d["kind"] == "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["size"] = 4


def lws_peer_tls_off(docs):
    data = _configmap(docs, "arfuse-config")["data"]
    for key in ("ARFUSE_PEER_TLS_CERT", "ARFUSE_PEER_TLS_KEY", "ARFUSE_PEER_TLS_CA"):
        data.pop(key)


LWS_DOCTORED = {
    "peer channel without TLS": (lws_peer_tls_off, "no --peer-tls-cert: the peer channel across"),
    "peer TLS secret not mounted": (unmount("arfused-2", "/etc/arfuse/peer-tls"),
                                    "is not in a Secret volume this container mounts"),
    "leader ready deadlock": (lws_leader_ready, "LeaderReady deadlocks"),
    "peer address missing": (lws_peer_addr_missing, "the same --peer-addr"),
    "ranks overlap across pods": (lws_rank_overlap, "ranks across the group are not"),
    "no IMEX channel": (lws_no_imex, "no IMEX channel claim"),
    "group size without world size": (lws_size_changed, "--world-size=8 but the group has 16"),
}


@pytest.mark.parametrize("case", sorted(LWS_DOCTORED))
def test_checker_catches_doctored_multi_node(case, rendered, flags, image):
    doctor, expected = LWS_DOCTORED[case]
    docs = copy.deepcopy(rendered["multi-node-gb200"])
    doctor(docs)
    problems = checks.check_manifests(docs, flags, image)
    assert any(expected in p for p in problems), problems


def test_shell_words_keep_arithmetic_together():
    words = checks.shell_words("exec arfused --rank=$((LWS_WORKER_INDEX * 4 + 3)) --gpu=3")
    assert words == ["exec", "arfused", "--rank=$((LWS_WORKER_INDEX * 4 + 3))", "--gpu=3"]
    assert checks.expand(words[2], {"LWS_WORKER_INDEX": "1"}) == "--rank=7"
    assert checks.expand("${LWS_LEADER_ADDRESS}:9350", {}) is None


# --- rendered manifests against the Kubernetes 1.34 schemas (offline, tests/deploy/schemas) ---

@pytest.fixture(scope="session")
def schema():
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        run.missing("python module jsonschema", "Debian: python3-jsonschema")
    import k8s_schema

    return k8s_schema


@pytest.mark.parametrize("directory", checks.kustomizations(), ids=lambda p: str(p.relative_to(checks.K8S)))
def test_rendered_manifests_match_the_schemas(directory, kubectl, schema):
    docs = checks.kustomize(directory, kubectl)
    assert docs
    problems = [p for d in docs for p in schema.validate(d)]
    assert problems == []


def test_every_kind_rendered_has_a_schema_and_the_monitoring_kinds_are_there(kubectl, schema):
    rendered = {f"{d['apiVersion']}/{d['kind']}" for k in checks.kustomizations()
                for d in checks.kustomize(k, kubectl)}
    assert rendered <= schema.kinds()
    # What operators expect beside the workload.
    assert {"networking.k8s.io/v1/NetworkPolicy", "policy/v1/PodDisruptionBudget",
            "monitoring.coreos.com/v1/PrometheusRule", "monitoring.coreos.com/v1/PodMonitor"} <= rendered


def test_schemas_catch_misspellings_types_and_unknown_kinds(rendered, schema):
    docs = copy.deepcopy(rendered["single-node-tp2"])
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    probe = deploy["spec"]["template"]["spec"]["initContainers"][1]["readinessProbe"]
    probe["periodSecond"] = probe.pop("periodSeconds")
    probe["grpc"]["port"] = "9310"
    problems = schema.validate(deploy)
    assert any("readinessProbe" in p and "periodSecond" in p for p in problems), problems
    assert any("grpc.port" in p for p in problems), problems
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    pdb["spec"]["minAvailable"] = 1
    assert schema.validate(pdb), "minAvailable with maxUnavailable must be refused"
    assert "no schema for batch/v1/Job" in schema.validate(
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}})[0]


def test_prometheus_rule_and_dashboard_name_real_metrics(kubectl):
    import json

    docs = checks.kustomize(checks.K8S / "monitoring", kubectl)
    served = set(re.findall(r'\.Name\("(arfuse_\w+)"\)',
                            (checks.REPO / "server" / "metrics" / "metrics.cc").read_text()))
    assert "arfuse_world_size" in served and "arfuse_build_info" in served
    # The dashboard may name what test_dashboard.py allows before the sidecar exports it.
    from test_dashboard import NOT_YET_EXPORTED
    served |= set(NOT_YET_EXPORTED)
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    board = next(d for d in docs if d["kind"] == "ConfigMap"
                 and d["metadata"]["name"] == "arfuse-grafana-dashboard")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(board["data"]["arfuse.json"])
    exprs += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for e in exprs:
        names = {re.sub(r"_(bucket|sum|count)$", "", n) for n in re.findall(r"\barfuse_\w+", e)}
        assert names and names <= served, (e, names - served)
    # The runbook's alerts are the rule's.
    alerts = (checks.REPO / "docs" / "operations.md").read_text()
    for r in rule["spec"]["groups"][0]["rules"]:
        assert f"`{r['expr']}`" in alerts, f"docs/operations.md does not show {r['alert']}: {r['expr']}"


def test_overlays_name_the_version_of_this_checkout(rendered):
    version = (checks.REPO / "VERSION").read_text().strip()
    for overlay, docs in rendered.items():
        for t in checks.pod_templates(docs):
            for c in (t.spec.get("initContainers") or []) + (t.spec.get("containers") or []):
                if c["image"].split("@")[0].rsplit(":", 1)[0].endswith("/arfuse"):
                    assert c["image"].endswith(f":{version}"), (overlay, c["name"], c["image"])
