"""Attaching to the sidecar's workspace: attach() (Fusion.Attach, the descriptors picked up on
the fd socket, arfuse_attach), pick_up_fds() and reattach() once the sidecar is back.
arfuse.instream re-exports them and registers attach() as Client.attach's implementation.
"""
import ctypes
import os
import time
from typing import Callable, List, Optional, Sequence

from .client import ArfuseError, Client, SidecarLost, fusion_pb2
from .instream_abi import (FAILED_PRECONDITION, INVALID_ARGUMENT, OK, UNAVAILABLE, InStreamError,
                           last_error, library_versions, load_library)
from .instream_context import InStreamContext
from .instream_sessions import attachments_of

def pick_up_fds(resp, timeout: float) -> List[int]:
    """The descriptors the sidecar offers for this attach on its fd socket (fd_ticket)."""
    try:
        from . import fdpass  # the fd-socket client (docs/security.md)
        pickup = fdpass.pickup
    except (ImportError, AttributeError):
        raise InStreamError(
            UNAVAILABLE,
            f"the sidecar offers {resp.fd_count} file descriptor(s) for this attachment on its "
            f"fd socket {resp.fd_socket or '(unnamed)'}, and this arfuse package has no "
            "fd-socket client to pick them up (arfuse.fdpass is not installed): the in-stream "
            "plane is unavailable") from None
    try:
        fds = list(pickup(resp.fd_socket, resp.fd_ticket, timeout=timeout))
    except fdpass.FdChannelError as e:
        raise InStreamError(e.code.value[0], f"picking up the attach's {resp.fd_count} descriptor(s) on "
                                    f"the fd channel {resp.fd_socket}: {e.message}") from None
    if len(fds) != resp.fd_count:
        for fd in fds:
            os.close(fd)
        raise InStreamError(INVALID_ARGUMENT, f"picked up {len(fds)} descriptors, the attach "
                                              f"announced {resp.fd_count}")
    return fds


def attach(client: Client, hiddens: Optional[Sequence[int]] = None, lib=None,
           timeout: Optional[float] = None,
           fd_pickup: Optional[Callable] = None) -> InStreamContext:
    """Attaches this process to its sidecar's workspace for ops of these hidden sizes (empty:
    the workspace's). Not inside a CUDA graph capture; with the client's GPU current (CUDA).

    Raises InStreamError/ArfuseError with the sidecar's or the library's status:
    FAILED_PRECONDITION (versions or GPU differ, fusion off, poisoned), UNAVAILABLE (no library,
    no fd-socket client, workspace not ready), UNIMPLEMENTED (a sidecar without the plane)."""
    lib = lib if lib is not None and not isinstance(lib, str) else load_library(lib)
    v = library_versions(lib)
    hiddens = [int(h) for h in (hiddens or [])]
    req = fusion_pb2.AttachRequest(hidden=hiddens, attach_abi_version=v["attach_abi_version"],
                                   launch_abi_version=v["launch_abi_version"],
                                   launch_args_bytes=v["launch_args_bytes"],
                                   client_version=v["version"])
    resp = client.attach_rpc(req, timeout)
    table = attachments_of(client)
    table.expect(resp.attach_id)
    fds: List[int] = []
    try:
        if resp.fd_count:
            fds = (fd_pickup or pick_up_fds)(resp, timeout or client.timeout)
        blob = bytes(resp.attach_blob)
        arr = (ctypes.c_int * max(1, len(fds)))(*fds)
        handle = ctypes.c_void_p()
        rc = lib.arfuse_attach(blob, len(blob), arr, len(fds), ctypes.byref(handle))
        if rc != OK:
            raise InStreamError(rc, f"arfuse_attach: {last_error(lib)}")
        try:
            ctx = InStreamContext(lib, handle, client, resp, hiddens)
            if ctx.info.attach_id != resp.attach_id:
                raise InStreamError(FAILED_PRECONDITION,
                                    f"the attach blob names attachment {ctx.info.attach_id}, "
                                    f"the response {resp.attach_id}")
        except BaseException:
            lib.arfuse_detach(handle)
            raise
    except BaseException:
        table.forget(resp.attach_id)
        if not client.session_lost:
            try:
                client.detach_rpc(resp.attach_id)
            except ArfuseError:
                pass
        raise
    finally:
        for fd in fds:
            try:
                os.close(fd)  # the library keeps its own duplicates
            except OSError:
                pass
    table.bind(resp.attach_id, ctx)
    return ctx


def reattach(ctx: InStreamContext, timeout: float = 60.0, detach_old: bool = True,
             poll: float = 0.25, newer_than: Optional[int] = None,
             **client_kwargs) -> InStreamContext:
    """A new client and context for the same sidecar socket, once it answers again (after a
    sidecar restart, a re-initialization, a drain). Retries until `timeout`. With detach_old, the
    old context is detached first (destroy the graphs that captured its launches before).
    newer_than: only a workspace of a later generation will do (after a failed op: the group
    re-forms, and an attach that came before the re-formation would be to the failed workspace;
    the sidecars' generations restart after a sidecar restart, so not then). The new context
    keeps the old one's program key."""
    if detach_old:
        ctx.detach()
    old = ctx.client
    target = ctx.target
    name = client_kwargs.pop("client_name", "arfuse-py")
    until = time.monotonic() + timeout
    last = None
    while True:
        client = None
        try:
            client = Client(target, client_name=name,
                            timeout=old.timeout if old is not None else 10.0,
                            connect_timeout=max(0.5, min(5.0, until - time.monotonic())),
                            **client_kwargs)
            client.wait_ready(max(0.5, until - time.monotonic()))
            new = attach(client, ctx.hiddens, lib=ctx.lib)
            if newer_than is not None and new.info.generation <= newer_than:
                gen = new.info.generation
                new.detach()
                raise InStreamError(UNAVAILABLE, f"the workspace is still generation {gen}, "
                                                 f"not newer than {newer_than}")
            new.owns_client = True
            # The same program: its ranks keep the key they agreed on (every rank re-attaches).
            if ctx.program_key:
                new.set_program_key(ctx.program_key)
            if old is not None and getattr(ctx, "owns_client", False):
                old.close()
            return new
        except (ArfuseError, SidecarLost) as e:
            last = e
            if client is not None:
                client.close()
        if time.monotonic() > until:
            raise InStreamError(UNAVAILABLE, f"reattach to {target}: no attachment within "
                                             f"{timeout:g} s (last: {last})")
        time.sleep(poll)
