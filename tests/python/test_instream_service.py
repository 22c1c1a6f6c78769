"""Fusion.Attach / Detach refusals of a host-mode sidecar (server/services/fusion/instream_rpc.cc),
each with its status code and part of its message, and the one-plane-per-workspace rule: while a
client is attached, the sidecar runs no op of its own on the workspace."""
import re

import grpc
import pytest

import arfuse
from arfuse import instream
from instream_fakes import RecordingLib

fusion_pb2 = arfuse.fusion_pb2


def request(hiddens=(1024,), **overrides):
    versions = {"attach_abi_version": 4, "launch_abi_version": 4, "launch_args_bytes": 368}
    versions.update(overrides)
    return fusion_pb2.AttachRequest(hidden=list(hiddens), **versions)


@pytest.fixture
def client(group2):
    c = arfuse.Client(group2.socket(0), client_name="attach-rules")
    c.wait_ready(30)
    yield c
    c.close()


def refused(client, req):
    with pytest.raises(arfuse.ArfuseError) as e:
        client.attach_rpc(req)
    return e.value


@pytest.mark.parametrize("field,value,words", [
    # Client libraries of older attach ABIs (no op counter page; no counter slot; no FP8
    # entries) are refused, as are older launch ABIs (their arguments lack the counter slot, or
    # the FP8 fields).
    ("attach_abi_version", 1, "attach ABI 1"),
    ("attach_abi_version", 2, "attach ABI 2"),
    ("attach_abi_version", 3, "attach ABI 3"),
    ("launch_abi_version", 1, "launch ABI 1"),
    ("launch_abi_version", 2, "launch ABI 2"),
    ("launch_args_bytes", 352, "352-byte arguments"),
    ("launch_args_bytes", 344, "344-byte arguments"),
    ("launch_abi_version", 7, "launch ABI 7"),
    ("launch_args_bytes", 312, "312-byte arguments"),
])
def test_another_client_abi_is_refused_before_anything_is_handed_out(client, field, value, words):
    e = refused(client, request(**{field: value}))
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION
    assert words in e.message and "needs attach ABI 4, launch ABI 4" in e.message
    assert "the client library of an unnamed release speaks" in e.message


class OtherReleaseLib(RecordingLib):
    """libarfuse_client of another release: its launch layout differs from the sidecar's."""

    def arfuse_launch_abi_version(self):
        return 9

    def arfuse_client_version(self):
        return b"0.0.9"


def test_a_client_library_of_another_release_is_refused_naming_both_releases(client):
    lib = OtherReleaseLib()
    with pytest.raises(arfuse.ArfuseError) as e:
        instream.attach(client, [1024], lib=lib)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "the client library 0.0.9 speaks attach ABI 4, launch ABI 9" in e.value.message
    assert re.search(r"this sidecar \(arfuse \d+\.\d+\.\d+\) needs attach ABI 4, launch ABI 4",
                     e.value.message), e.value.message
    # Refused before anything existed: the session's one attachment is still free.
    assert client.attach_rpc(request()).attach_id > 0


def test_too_many_hidden_sizes_are_refused(client):
    e = refused(client, request(hiddens=[8 * (i + 1) for i in range(17)]))
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 16 hidden sizes per attach, got 17" in e.message


def test_a_hidden_above_the_workspace_is_refused(client):
    e = refused(client, request(hiddens=[2048]))
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "2048" in e.message


def test_one_attachment_per_session_and_the_eager_plane_waits_for_the_detach(client):
    first = client.attach_rpc(request())
    assert first.attach_id > 0 and first.memory_kind == "host_shm"
    # The host workspace and the attachment's op counter page.
    assert first.fd_count == 2 and first.fd_socket.endswith(".fd") and first.fd_ticket
    e = refused(client, request())
    assert e.code == grpc.StatusCode.ALREADY_EXISTS
    assert "already holds attachment" in e.message
    # The workspace belongs to the in-stream plane: an eager op is refused while attached.
    buf = arfuse.HostShmBuffer(1 << 16)
    try:
        ws = arfuse.FusionWorkspace(client)
        ws.register(buf)
        x = buf.view("fp32", 1024, 0)
        with pytest.raises(arfuse.ArfuseError) as op:
            arfuse.allreduce_fusion(input=x.reshape(1, 1024), workspace=ws, output=x,
                                    pattern=arfuse.AllReduceFusionPattern.kAllReduce)
        assert op.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "attached in-stream" in op.value.message
        x.release()
    finally:
        buf.close()
    client.detach_rpc(first.attach_id)
    e = refused(client, fusion_pb2.AttachRequest())  # versions 0: refused, nothing attached
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION


def test_detach_of_an_attachment_the_session_does_not_hold_is_denied(client):
    with pytest.raises(arfuse.ArfuseError) as e:
        client.detach_rpc(12345)
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "not held by this session" in e.value.message
    assert "12345" not in e.value.message


def test_the_descriptors_go_only_to_the_caller_and_once(client, group2):
    resp = client.attach_rpc(request())
    fds = instream.pick_up_fds(resp, 5.0)
    assert len(fds) == 2  # the host workspace and the attachment's op counter page
    import os
    for fd in fds:
        os.close(fd)
    # A single-use ticket: a second pickup is refused.
    with pytest.raises(instream.InStreamError) as e:
        instream.pick_up_fds(resp, 5.0)
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    client.detach_rpc(resp.attach_id)
