#!/usr/bin/env python3
"""Writes the arfused sidecar containers of each overlay (overlays/*/sidecars.yaml).

One arfused per GPU rank, all alike but for rank, GPU, ports and socket, and for which one gates the
model server (below): fourteen near-copies that are easier to generate than to keep in step by
hand. The output is a JSON 6902 patch (a list of `add` operations on .../initContainers/-) that
kustomize applies to the overlay's Deployment or LeaderWorkerSet; both kustomize v2 (kubectl 1.20)
and v5 accept it.

    deploy/k8s/gen_sidecars.py           # rewrite the files
    deploy/k8s/gen_sidecars.py --check   # exit 1 if a file is stale (tests/deploy runs this)

Probe design (docs/operations.md, "Probes"):
  * liveness  grpc service ""                  the process answers; never depends on peers, so one
                                                rank's trouble never restarts the others.
  * readiness grpc service "arfuse.v1.Fusion"   backend resolved, peers joined, workspace built.
  * startup   grpc service "" on every sidecar but the last, which checks "arfuse.v1.Fusion" with a
              budget covering --peer-timeout. Native sidecars start one after the other, each once
              the previous one's startupProbe passed: a readiness-based startupProbe on any earlier
              sidecar would wait for peers that have not been started yet (deadlock). On the last
              one it makes the kubelet start the model server only when the whole group is ready.
"""
import argparse
import math
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent

HEALTH_PORT_BASE = 9310   # rank-local index l listens on 9310 + l (grpc.health.v1 only)
METRICS_PORT_BASE = 9330  # /metrics on 9330 + l
PEER_PORT = 9350          # rank 0's TCP rendezvous across nodes (--peer-addr)
SOCKET_DIR = "/run/arfuse"
READINESS_SERVICE = "arfuse.v1.Fusion"
STARTUP_MARGIN_S = 30     # workspace allocation and the vote, on top of --peer-timeout
STARTUP_PERIOD_S = 5

DEPLOYMENT_INIT = "/spec/template/spec/initContainers/-"
LWS_INIT = "/spec/leaderWorkerTemplate/workerTemplate/spec/initContainers/-"

# name -> what the overlay runs. peer_timeout must equal ARFUSE_PEER_TIMEOUT of the overlay's
# ConfigMap (tests/deploy checks it).
OVERLAYS = {
    "single-node-tp2": {"per_pod": 2, "path": DEPLOYMENT_INIT, "peer_timeout": 120, "multinode": False},
    "single-node-tp8": {"per_pod": 8, "path": DEPLOYMENT_INIT, "peer_timeout": 120, "multinode": False},
    # GB200 NVL72: 4 GPUs per compute tray; ranks 4*LWS_WORKER_INDEX + l.
    "multi-node-gb200": {"per_pod": 4, "path": LWS_INIT, "peer_timeout": 300, "multinode": True},
}


def default_socket(rank):
    """arfused's default socket for a rank (XDG_RUNTIME_DIR unset, as in the image)."""
    return f"{SOCKET_DIR}/arfused.sock" + (f".rank{rank}" if rank > 0 else "")


def grpc_probe(port, service, period, failures, timeout=None):
    probe = {"grpc": {"port": port, "service": service}, "periodSeconds": period,
             "failureThreshold": failures}
    if timeout is not None:
        probe["timeoutSeconds"] = timeout
    return probe


def sidecar(local, spec):
    per_pod = spec["per_pod"]
    health = HEALTH_PORT_BASE + local
    metrics = METRICS_PORT_BASE + local
    gates = local == per_pod - 1
    flags = [f"--gpu={local}", f"--health-port={health}", f"--metrics-port={metrics}"]
    container = {"name": f"arfused-{local}", "image": "arfuse", "restartPolicy": "Always"}
    if spec["multinode"]:
        # The global rank needs arithmetic on LWS_WORKER_INDEX (injected by LWS), hence a shell; the
        # socket is left to its default, which follows the rank (/run/arfuse/arfused.sock.rank<r>).
        script = " ".join(
            ["exec arfused", f"--rank=$((LWS_WORKER_INDEX * {per_pod} + {local}))"] + flags
            + [f"--peer-addr=${{LWS_LEADER_ADDRESS}}:{PEER_PORT}"])
        container["command"] = ["/bin/sh", "-c"]
        container["args"] = [script]
    else:
        container["args"] = [f"--rank={local}"] + flags + [f"--socket={default_socket(local)}"]
    container["envFrom"] = [{"configMapRef": {"name": "arfuse-config"}},
                            {"configMapRef": {"name": "gpu-env"}}]
    ports = [{"name": f"health-r{local}", "containerPort": health},
             {"name": f"metrics-r{local}", "containerPort": metrics}]
    if spec["multinode"] and local == 0:
        ports.append({"name": "peer", "containerPort": PEER_PORT})
    container["ports"] = ports
    if gates:
        budget = spec["peer_timeout"] + STARTUP_MARGIN_S
        container["startupProbe"] = grpc_probe(health, READINESS_SERVICE, STARTUP_PERIOD_S,
                                               math.ceil(budget / STARTUP_PERIOD_S), timeout=2)
    else:
        container["startupProbe"] = grpc_probe(health, "", 2, 30, timeout=2)
    container["readinessProbe"] = grpc_probe(health, READINESS_SERVICE, 5, 2, timeout=2)
    container["livenessProbe"] = grpc_probe(health, "", 10, 3, timeout=3)
    claims = [{"name": "gpus"}]
    if spec["multinode"]:
        claims.append({"name": "imex-channel"})
    container["resources"] = {
        # No CPU limit: throttling would stall the host side of a latency-bound op.
        "requests": {"cpu": "250m", "memory": "256Mi"},
        "limits": {"memory": "2Gi"},
        "claims": claims,
    }
    container["securityContext"] = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    container["volumeMounts"] = [
        {"name": "arfuse-run", "mountPath": SOCKET_DIR},
        {"name": "mps-pipe", "mountPath": "/run/nvidia-mps"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    return container


def render(name):
    spec = OVERLAYS[name]
    ops = [{"op": "add", "path": spec["path"], "value": sidecar(l, spec)}
           for l in range(spec["per_pod"])]
    header = (
        f"# GENERATED by deploy/k8s/gen_sidecars.py for {name}; edit the generator, not this file.\n"
        f"# {spec['per_pod']} arfused sidecars per pod (native sidecars: initContainers with\n"
        "# restartPolicy Always), appended after the MPS daemon. Liveness and the startupProbe of\n"
        "# all but the last check service \"\"; readiness checks \"arfuse.v1.Fusion\"; the last\n"
        "# sidecar's startupProbe also checks \"arfuse.v1.Fusion\" and covers ARFUSE_PEER_TIMEOUT\n"
        f"# ({spec['peer_timeout']} s) + {STARTUP_MARGIN_S} s, so the model server starts once "
        "the group is ready.\n")
    return header + yaml.safe_dump(ops, sort_keys=False, default_flow_style=False, width=1000)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a generated file is stale")
    args = parser.parse_args()
    stale = []
    for name in OVERLAYS:
        path = HERE / "overlays" / name / "sidecars.yaml"
        text = render(name)
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(str(path.relative_to(HERE.parent.parent)))
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(HERE.parent.parent)}")
    if stale:
        print("stale (run deploy/k8s/gen_sidecars.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
