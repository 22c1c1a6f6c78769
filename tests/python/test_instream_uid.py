"""Attach from a process of another uid, end to end against host-mode sidecars.

The rules (docs/security.md): a uid the sidecar does not admit is refused on connect, before gRPC
reads a byte; an admitted uid attaches and gets its own descriptors; the descriptors of one
attach go only to the uid that made it (the fd ticket is bound to it; a refused claim leaves the
ticket to its owner). The other uid's side runs in a child process started as uid 65534
(`nobody`): these tests need root to start it, and skip without.
"""
import json
import os
import stat
import subprocess
import sys
import textwrap
import types

import grpc
import pytest

import arfuse
from arfuse import instream
from conftest import REPO, Group

fusion_pb2 = arfuse.fusion_pb2
OTHER_UID = 65534

# The other uid's side: one JSON line with what it saw ({"ok": ...} or {"code", "message"}).
# It starts as root and drops to the uid itself, before anything starts a thread: a multi-threaded
# parent (gRPC's) must not change ids between fork and exec.
CHILD = textwrap.dedent(r"""
    import os
    os.setgroups([])
    os.setgid(int(os.environ["ARFUSE_TEST_UID"]))
    os.setuid(int(os.environ["ARFUSE_TEST_UID"]))
    import json, sys, types
    import grpc
    import arfuse
    from arfuse import instream
    mode, arg = sys.argv[1], json.loads(sys.argv[2])
    out = {}
    try:
        if mode == "pickup":
            resp = types.SimpleNamespace(**arg)
            fds = instream.pick_up_fds(resp, 5.0)
            out = {"ok": True, "fds": len(fds)}
        else:
            c = arfuse.Client(arg["socket"], client_name="other-uid", timeout=5.0,
                              connect_timeout=5.0)
            c.wait_ready(10)
            req = arfuse.fusion_pb2.AttachRequest(
                hidden=[arg["hidden"]], attach_abi_version=4, launch_abi_version=4,
                launch_args_bytes=368)
            resp = c.attach_rpc(req)
            fds = instream.pick_up_fds(resp, 5.0)
            out = {"ok": True, "fds": len(fds), "memory_kind": resp.memory_kind}
            c.detach_rpc(resp.attach_id)
            c.close()
    except arfuse.ArfuseError as e:
        out = {"code": e.code.name, "message": e.message}
    except Exception as e:  # connection refused before gRPC reads: the client's own wording
        out = {"code": getattr(getattr(e, "code", None), "name", type(e).__name__),
               "message": str(e)}
    print(json.dumps(out))
""")


def run_as_other_uid(mode, arg):
    env = dict(os.environ, PYTHONPATH=str(REPO / "client" / "python"), HOME="/tmp")
    env["ARFUSE_TEST_UID"] = str(OTHER_UID)
    p = None
    # The system's interpreter first: a per-user install may not be readable by the uid.
    for python in dict.fromkeys(["/usr/bin/python3", sys.executable]):
        if not os.access(python, os.X_OK):
            continue
        p = subprocess.run([python, "-X", "faulthandler", "-c", CHILD, mode, json.dumps(arg)],
                           env=env, capture_output=True, text=True, timeout=60)
        if "ModuleNotFoundError" not in p.stderr and "PermissionError" not in p.stderr:
            break
    if p is None:
        pytest.skip("no Python interpreter to start the other uid's process")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        if any(w in p.stderr for w in ("ModuleNotFoundError", "PermissionError")):
            pytest.skip(f"uid {OTHER_UID} cannot read this checkout: {p.stderr.strip()[-200:]}")
        pytest.fail(f"the other uid's process printed nothing: rc {p.returncode}, {p.stderr}")
    return json.loads(lines[-1])


@pytest.fixture
def as_root():
    if os.geteuid() != 0:
        pytest.skip("starting a process of another uid needs root")


def open_to_everyone(g):
    """The filesystem lets any uid reach the sockets: what is tested is the sidecar's own check."""
    os.chmod(g.dir, 0o711)
    for name in os.listdir(g.dir):
        path = os.path.join(g.dir, name)
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.chmod(path, 0o666)


def group(arfused, allowed=()):
    extra = [f"--allowed-uids={','.join(str(u) for u in allowed)}"] if allowed else []
    return Group(arfused, 2, hidden=256, max_tokens=16, dtype="fp32", extra_args=extra)


def test_a_uid_the_sidecar_does_not_admit_is_refused_on_connect(arfused, as_root):
    g = group(arfused)
    try:
        open_to_everyone(g)
        seen = run_as_other_uid("attach", {"socket": g.socket(0), "hidden": 256})
        assert "ok" not in seen, seen
        assert seen["code"] in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), seen
        with open(os.path.join(g.dir, "arfused.0.log")) as f:
            log = f.read()
        assert "event=connection_refused" in log and f"uid={OTHER_UID}" in log, log[-2000:]
    finally:
        g.stop()


def test_an_admitted_uid_attaches_and_picks_up_its_own_descriptors(arfused, as_root):
    g = group(arfused, allowed=[OTHER_UID])
    try:
        open_to_everyone(g)
        with arfuse.Client(g.socket(0)) as c:
            c.wait_ready(30)  # the group is formed: the attach can be served
        seen = run_as_other_uid("attach", {"socket": g.socket(0), "hidden": 256})
        assert seen.get("ok"), seen
        # The host workspace and the attachment's op counter page.
        assert seen["fds"] == 2 and seen["memory_kind"] == "host_shm", seen
    finally:
        g.stop()


def test_the_descriptors_of_an_attach_go_only_to_its_uid(arfused, as_root):
    g = group(arfused, allowed=[OTHER_UID])
    try:
        open_to_everyone(g)
        with arfuse.Client(g.socket(0), client_name="owner") as c:
            c.wait_ready(30)
            resp = c.attach_rpc(fusion_pb2.AttachRequest(
                hidden=[256], attach_abi_version=4, launch_abi_version=4, launch_args_bytes=368))
            assert resp.fd_count == 2 and resp.fd_ticket
            # Another (admitted) uid holding the ticket: refused, and the ticket is not spent.
            seen = run_as_other_uid("pickup", {"fd_socket": resp.fd_socket,
                                               "fd_ticket": resp.fd_ticket,
                                               "fd_count": resp.fd_count})
            assert seen.get("code") == "PERMISSION_DENIED", seen
            assert "fd ticket unknown, expired or not the caller's" in seen["message"], seen
            assert str(OTHER_UID) not in seen["message"], seen
            fds = instream.pick_up_fds(resp, 5.0)
            assert len(fds) == 2
            for fd in fds:
                os.close(fd)
            c.detach_rpc(resp.attach_id)
    finally:
        g.stop()

