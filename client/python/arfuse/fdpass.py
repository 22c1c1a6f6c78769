"""The sidecar's fd channel: file descriptors handed over by ticket.

A file descriptor cannot travel inside a gRPC message, so it goes over a second Unix socket the
sidecar serves beside its main one (``<socket>.fd``) and the gRPC call names it by ticket:

    ticket = fdpass.deposit(fdpass.channel_path("/run/arfuse/arfused.sock"), [memfd])
    client.stub.RegisterRegion(... host_fd=HostFdMemory(fd_ticket=ticket) ...)

The protocol (common/fd/fd_wire.h): a 16-byte little-endian header (magic "ARFD", version,
op, descriptor count, body length, reserved), then the body; descriptors ride on the header's
first byte (SCM_RIGHTS). A ticket is single use, bound to this process's user and expires after a
few seconds.
"""
import socket
import struct
import time
from typing import List, Sequence

import grpc

MAGIC = 0x44465241  # "ARFD" little-endian
VERSION = 1
OP_DEPOSIT, OP_DEPOSIT_OK, OP_PICKUP, OP_PICKUP_OK, OP_ERROR = 1, 2, 3, 4, 5
HEADER = struct.Struct("<IBBHII")
MAX_BODY = 1024
MAX_FDS = 16
TICKET_CHARS = 32

_CODES = {sc.value[0]: sc for sc in grpc.StatusCode}


class FdChannelError(Exception):
    """The fd channel refused or failed; `code` is a grpc.StatusCode."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def channel_path(socket_path: str) -> str:
    """Where the sidecar whose main socket is `socket_path` serves its fd channel."""
    return socket_path + ".fd"


def _connect(path: str, timeout: float) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
    except OSError as e:
        s.close()
        raise FdChannelError(grpc.StatusCode.UNAVAILABLE,
                             f"cannot connect to the fd channel at {path}: {e}") from None
    return s


def _send(s: socket.socket, op: int, body: bytes, fds: Sequence[int]):
    if len(fds) > MAX_FDS:
        raise FdChannelError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"an fd channel message carries at most {MAX_FDS} descriptors")
    data = HEADER.pack(MAGIC, VERSION, op, len(fds), len(body), 0) + body
    sent = socket.send_fds(s, [data], list(fds)) if fds else s.send(data)
    if sent < len(data):
        s.sendall(data[sent:])


def _recv_exact(s: socket.socket, n: int, fds: List[int]) -> bytes:
    out = b""
    while len(out) < n:
        data, got, _flags, _addr = socket.recv_fds(s, n - len(out), MAX_FDS)
        fds.extend(got)
        if not data:
            raise FdChannelError(grpc.StatusCode.UNAVAILABLE,
                                 "the fd channel closed the connection")
        out += data
    return out


def _round_trip(path: str, op: int, body: bytes, fds: Sequence[int], expected: int,
                timeout: float):
    import os

    deadline = time.monotonic() + timeout
    s = _connect(path, timeout)
    received: List[int] = []
    try:
        _send(s, op, body, fds)
        s.settimeout(max(0.001, deadline - time.monotonic()))
        header = _recv_exact(s, HEADER.size, received)
        magic, version, rop, nfds, body_len, _ = HEADER.unpack(header)
        if magic != MAGIC or version != VERSION or body_len > MAX_BODY:
            raise FdChannelError(grpc.StatusCode.INTERNAL, "malformed fd channel reply")
        reply = _recv_exact(s, body_len, received) if body_len else b""
        if rop == OP_ERROR:
            code = struct.unpack_from("<I", reply)[0] if len(reply) >= 4 else 2
            raise FdChannelError(_CODES.get(code, grpc.StatusCode.UNKNOWN),
                                 reply[4:].decode(errors="replace"))
        if rop != expected or len(received) < nfds:
            raise FdChannelError(grpc.StatusCode.INTERNAL,
                                 f"the fd channel answered op {rop} to op {op}")
        out = received[:nfds]
        for extra in received[nfds:]:
            os.close(extra)
        received = []
        return reply, out
    except socket.timeout:
        raise FdChannelError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"no answer from the fd channel within {timeout} s") from None
    finally:
        for fd in received:
            os.close(fd)
        s.close()


def deposit(path: str, fds: Sequence[int], timeout: float = 10.0) -> str:
    """Hands `fds` to the sidecar; returns the ticket a gRPC call then names. The caller's
    descriptors stay open (the sidecar holds its own copies)."""
    if not fds:
        raise FdChannelError(grpc.StatusCode.INVALID_ARGUMENT, "nothing to deposit")
    reply, _ = _round_trip(path, OP_DEPOSIT, b"", fds, OP_DEPOSIT_OK, timeout)
    ticket = reply.decode(errors="replace")
    if len(ticket) != TICKET_CHARS:
        raise FdChannelError(grpc.StatusCode.INTERNAL, "the fd channel answered a bad ticket")
    return ticket


def pickup(path: str, ticket: str, timeout: float = 10.0) -> List[int]:
    """Takes the descriptors the sidecar offered under `ticket`; the caller owns them."""
    _, fds = _round_trip(path, OP_PICKUP, ticket.encode(), (), OP_PICKUP_OK, timeout)
    return fds
