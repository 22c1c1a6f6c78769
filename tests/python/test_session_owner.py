"""Sessions belong to their user, end to end against host-mode sidecars (docs/security.md).

The takeover this guards against: an admitted uid that learns (or guesses) another user's session
token sets it in `arfuse-session` and lists that user's regions, plans over their memory, or
detaches their attachment. Every call naming a session is refused with PERMISSION_DENIED unless it
comes from the uid that opened it, with one message whether the token is leaked, guessed or
malformed; a plan id or attach id named from another session is refused the same way. The other
uid runs in a child process started as uid 65534 (`nobody`): these tests need root, and skip
without.
"""
import json
import os
import secrets
import subprocess
import sys
import textwrap

import grpc
import pytest

import arfuse
from conftest import REPO, Group
from test_instream_uid import OTHER_UID, as_root, open_to_everyone  # noqa: F401 (fixture)

fusion_pb2 = arfuse.fusion_pb2
H, T = 256, 16
F32 = 4
ATTACH = dict(hidden=[H], attach_abi_version=4, launch_abi_version=4, launch_args_bytes=368)

# The other uid's side: every Fusion RPC that names a session, with the token it is given, aimed at
# the victim's region, plan and attachment; then, from a session of its own, the victim's plan id
# and attach id. Prints one JSON object {call: [code, message]}. It drops to the uid before
# anything starts a thread (gRPC's): a multi-threaded process must not change ids.
CHILD = textwrap.dedent(r"""
    import os
    os.setgroups([])
    os.setgid(int(os.environ["ARFUSE_TEST_UID"]))
    os.setuid(int(os.environ["ARFUSE_TEST_UID"]))
    import json, sys
    import grpc
    import arfuse
    from arfuse.client import fusion_pb2, fusion_pb2_grpc
    a = json.loads(sys.argv[1])
    out = {}

    def record(name, fn):
        try:
            fn()
            out[name] = ["OK", ""]
        except grpc.RpcError as e:
            out[name] = [e.code().name, e.details()]
        except arfuse.ArfuseError as e:
            out[name] = [e.code.name, e.message]

    def ref(offset):
        return fusion_pb2.RegionRef(region_id=a["region_id"], generation=a["region_gen"],
                                    offset=offset)

    op = fusion_pb2.OpSpec(pattern=2, dtype=3, hidden=a["hidden"], max_tokens=a["tokens"],
                           input=ref(0), residual_in=ref(a["tensor"]),
                           residual_out=ref(a["tensor"]), norm_out=ref(2 * a["tensor"]),
                           gamma=ref(3 * a["tensor"]))
    channel = grpc.insecure_channel("unix:" + a["socket"])
    stub = fusion_pb2_grpc.FusionStub(channel)
    for label, token in a["tokens_to_try"].items():
        md = [("arfuse-api-version", "1.1"), ("arfuse-session", token)]
        calls = {
            "ListRegions": lambda: stub.ListRegions(fusion_pb2.ListRegionsRequest(),
                                                    metadata=md, timeout=10),
            "RegisterRegion": lambda: stub.RegisterRegion(fusion_pb2.RegisterRegionRequest(
                name="intruder", byte_size=4096,
                host_fd=fusion_pb2.HostFdMemory(fd_ticket="0" * 32)), metadata=md, timeout=10),
            "UnregisterRegion": lambda: stub.UnregisterRegion(fusion_pb2.UnregisterRegionRequest(
                region_id=a["region_id"], generation=a["region_gen"]), metadata=md, timeout=10),
            "CreatePlan": lambda: stub.CreatePlan(fusion_pb2.CreatePlanRequest(op=op),
                                                  metadata=md, timeout=10),
            "DestroyPlan": lambda: stub.DestroyPlan(fusion_pb2.DestroyPlanRequest(
                plan_id=a["plan_id"], generation=a["plan_gen"]), metadata=md, timeout=10),
            "Execute(plan)": lambda: stub.Execute(fusion_pb2.ExecuteRequest(
                plan_id=a["plan_id"], plan_generation=a["plan_gen"], num_tokens=1),
                metadata=md, timeout=10),
            "Execute(op)": lambda: stub.Execute(fusion_pb2.ExecuteRequest(op=op, num_tokens=1),
                                                metadata=md, timeout=10),
            "Attach": lambda: stub.Attach(fusion_pb2.AttachRequest(**a["attach"]),
                                          metadata=md, timeout=10),
            "Detach": lambda: stub.Detach(fusion_pb2.DetachRequest(attach_id=a["attach_id"]),
                                          metadata=md, timeout=10),
        }
        for name, fn in calls.items():
            record(f"{label} {name}", fn)
    # A session of its own, naming the victim's ids.
    c = arfuse.Client(a["socket"], client_name="intruder", timeout=10.0, connect_timeout=10.0)
    victim_plan = arfuse.Plan(id=a["plan_id"], generation=a["plan_gen"], path=0, reason="")
    nobodys_plan = arfuse.Plan(id=a["plan_id"] ^ 0x5a5a5a5a, generation=a["plan_gen"], path=0,
                               reason="")
    if a["phase"] == "plans":
        record("own Execute(victim plan)", lambda: c.execute(victim_plan, 1))
        record("own Execute(nobody's plan)", lambda: c.execute(nobodys_plan, 1))
    record("own DestroyPlan(victim plan)", lambda: c.destroy_plan(victim_plan))
    record("own DestroyPlan(nobody's plan)", lambda: c.destroy_plan(nobodys_plan))
    if a["attach_id"]:
        record("own Detach(victim attachment)", lambda: c.detach_rpc(a["attach_id"]))
        record("own Detach(nobody's attachment)", lambda: c.detach_rpc(a["attach_id"] ^ 0x5a5a))
    c.close()
    print(json.dumps(out))
""")


def run_intruder(arg):
    env = dict(os.environ, PYTHONPATH=str(REPO / "client" / "python"), HOME="/tmp")
    env["ARFUSE_TEST_UID"] = str(OTHER_UID)
    p = None
    for python in dict.fromkeys(["/usr/bin/python3", sys.executable]):
        if not os.access(python, os.X_OK):
            continue
        p = subprocess.run([python, "-X", "faulthandler", "-c", CHILD, json.dumps(arg)],
                           env=env, capture_output=True, text=True, timeout=120)
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
def victim(arfused, as_root):
    """A group whose rank 0 serves a session of this (root) process: a region, a plan over it."""
    g = Group(arfused, 2, hidden=H, max_tokens=T, dtype="fp32",
              extra_args=[f"--allowed-uids={OTHER_UID}"])
    open_to_everyone(g)
    c = arfuse.Client(g.socket(0), client_name="victim")
    c.wait_ready(60)
    buf = arfuse.HostShmBuffer(4 * T * H * F32)
    region = c.register_host_fd("victim-secret-region", buf.fd, buf.byte_size)
    t = T * H * F32
    plan = c.create_plan(arfuse.OpSpec(
        pattern="allreduce_residual_rmsnorm", dtype="fp32", hidden=H, max_tokens=T,
        input=arfuse.TensorLoc(region, 0), residual_in=arfuse.TensorLoc(region, t),
        residual_out=arfuse.TensorLoc(region, t), norm_out=arfuse.TensorLoc(region, 2 * t),
        gamma=arfuse.TensorLoc(region, 3 * t)))
    yield g, c, region, plan
    c.close()
    buf.close()
    g.stop()


def intruder_args(g, c, region, plan, phase, attach_id=0):
    token = c.session_token
    flipped = token[:-1] + ("1" if token[-1] == "0" else "0")
    return {"socket": g.socket(0), "phase": phase, "region_id": region.id,
            "region_gen": region.generation, "plan_id": plan.id, "plan_gen": plan.generation,
            "attach_id": attach_id, "hidden": H, "tokens": T, "tensor": T * H * F32,
            "attach": ATTACH,
            "tokens_to_try": {"leaked": token, "guessed": secrets.token_hex(16),
                              "neighbour": flipped, "decimal": "12345"}}


def check_denied(seen, token, plan, attach_id=0):
    assert seen, seen
    messages = set()
    for call, (code, message) in seen.items():
        assert code == "PERMISSION_DENIED", (call, code, message)
        assert token not in message and str(plan.id) not in message, (call, message)
        assert "victim" not in message and "not found" not in message.lower(), (call, message)
        if attach_id:
            assert str(attach_id) not in message, (call, message)
        if not call.startswith("own "):
            messages.add(message)
    # One message for a leaked, a guessed, a neighbouring and a malformed token, on every RPC.
    assert len(messages) == 1, messages
    assert "names no open session of this caller" in messages.pop()
    # From its own session: the victim's ids get the answer ids nobody holds get.
    for kind in ("Execute", "DestroyPlan", "Detach"):
        ours = [v for k, v in seen.items() if k.startswith(f"own {kind}(victim")]
        nobodys = [v for k, v in seen.items() if k.startswith(f"own {kind}(nobody")]
        assert ours == nobodys, (kind, ours, nobodys)


def test_another_uid_with_a_leaked_token_reaches_nothing_of_the_session(victim):
    g, c, region, plan = victim
    seen = run_intruder(intruder_args(g, c, region, plan, "plans"))
    assert len(seen) == 4 * 9 + 4, seen
    check_denied(seen, c.session_token, plan)
    assert "plan is not held by this session" in seen["own DestroyPlan(victim plan)"][1]
    # Nothing of the victim's changed: its region is listed (and only it), its plan is there.
    assert [r.name for r in c.list_regions()] == ["victim-secret-region"]
    c.destroy_plan(plan)


def test_another_uid_cannot_detach_the_attachment(victim):
    g, c, region, plan = victim
    resp = c.attach_rpc(fusion_pb2.AttachRequest(**ATTACH))
    assert resp.attach_id != 0
    try:
        from arfuse import instream
        for fd in instream.pick_up_fds(resp, 5.0):
            os.close(fd)
        seen = run_intruder(intruder_args(g, c, region, plan, "attach", resp.attach_id))
        check_denied(seen, c.session_token, plan, resp.attach_id)
        assert "attachment is not held by this session" in \
            seen["own Detach(victim attachment)"][1]
    finally:
        # The owner's own Detach still finds it (the intruder's did not take it).
        c.detach_rpc(resp.attach_id)
    with pytest.raises(arfuse.ArfuseError) as e:
        c.detach_rpc(resp.attach_id)
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
