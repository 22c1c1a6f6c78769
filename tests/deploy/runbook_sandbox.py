"""Runs one runbook block in a pod-like sandbox; test_runbook.py starts it as

    unshare --mount --net --pid --fork --mount-proc python3 runbook_sandbox.py SPEC.json

so that it is PID 1 of its own namespaces: a private network (its loopback only, so the pod's
fixed ports 9310.../9330... are free), a private /run (so /run/arfuse/arfused.sock, arfused's
default socket and the manifests', is this sandbox's alone), and every process it starts ends
when it exits.

SPEC.json: {"script": text, "mode": "pod"|"fresh", "dir": scratch directory, "bin": {name: path},
"sidecars": [{"name": "arfused-0", "argv": [...], "env": {...}, "socket": path}, ...],
"real_kubectl": path or null}. Prints the block's output and exits with its status.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import runbook  # noqa: E402

READY = "arfused ready to accept"

PREAMBLE = r'''
# runbook_daemon CMD...: CMD (an arfused) in the background, back once it is ready to accept.
runbook_daemon() {
  local log="$RUNBOOK_DIR/daemon.$RANDOM.log"
  "$@" >"$log" 2>&1 &
  local pid=$! i
  for i in $(seq 600); do
    if grep -q "arfused ready to accept" "$log"; then return 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then cat "$log"; return 1; fi
    sleep 0.1
  done
  cat "$log"; return 1
}
'''


def sh(*argv):
    subprocess.run(argv, check=True)


def wait_ready(sidecar, arfusectl, deadline):
    log = Path(sidecar["log"])
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if READY in text:
            ok = subprocess.run([arfusectl, "health", "--addr", f"unix:{sidecar['socket']}",
                                 "--service", "arfuse.v1.Fusion", "--timeout-ms", "1000"],
                                capture_output=True)
            if ok.returncode == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"runbook sandbox: {sidecar['name']} did not become ready:\n"
                     f"{log.read_text(errors='replace')[-3000:]}")


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    work = Path(spec["dir"])
    sh("ip", "link", "set", "lo", "up")
    sh("mount", "-t", "tmpfs", "-o", "size=64m,mode=755", "tmpfs", "/run")
    os.makedirs("/run/arfuse", mode=0o750)

    # What the image has on its PATH (arfused, arfusectl), and kubectl/docker answered for the pod.
    bindir = work / "bin"
    bindir.mkdir()
    for name, target in spec["bin"].items():
        (bindir / name).symlink_to(target)
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["PATH"] = f"{HERE / 'runbook_shims'}:{bindir}:{env.get('PATH', '/usr/bin:/bin')}"
    env["RUNBOOK_DIR"] = str(work)
    env["RUNBOOK_SPEC"] = sys.argv[1]
    if spec.get("real_kubectl"):
        env["RUNBOOK_REAL_KUBECTL"] = spec["real_kubectl"]

    procs = []
    if spec["mode"] == "pod":
        for s in spec["sidecars"]:
            out = open(s["log"], "w")
            procs.append(subprocess.Popen(s["argv"], env={**env, **s["env"]}, stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + 90
        for s in spec["sidecars"]:
            wait_ready(s, spec["bin"]["arfusectl"], deadline)

    script = PREAMBLE + runbook.background_daemons(spec["script"])
    (work / "block.sh").write_text(script)
    ran = subprocess.run(["bash", "-euo", "pipefail", str(work / "block.sh")], env=env,
                         cwd=str(runbook.REPO), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    sys.stdout.write(ran.stdout)
    sys.stdout.flush()
    for p in procs:
        if p.poll() is not None:
            print(f"runbook sandbox: {p.args[0]} exited {p.returncode} during the block")
    sys.exit(ran.returncode)


if __name__ == "__main__":
    main()
