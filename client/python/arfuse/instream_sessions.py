"""The in-stream attachments of each client: ClientAttachments, the table of one client's
attachments by attach id, is that client's session listener (Client.add_session_listener). It
hands every AttachEvent (drain, re-initialization, poisoning) to its context, and the session
stream's end to every context ("sidecar gone", "client closed"); a drain's answer
(SessionRequest.drained_attach_id) goes back on the session's request stream.

An attach announces its id before its context exists (events that arrive meanwhile are kept),
binds the context once it is made, and forgets it at detach. arfuse.instream_attach and
arfuse.instream_context use it; arfuse.instream re-exports attachments().
"""
import threading
from typing import Dict, List, Optional

from .client import Client, fusion_pb2

# AttachEvent.Kind numbers (fusion.proto), and the session's end as the contexts hear it.
EVENT_DRAIN = 1
EVENT_REINITIALIZED = 2
EVENT_POISONED = 3
EVENT_SESSION_LOST = 0
EVENT_CLIENT_CLOSED = -1

# Makes one table per client, however many threads attach through it at once.
_tables_lock = threading.Lock()


def _end_event(lost_reason: Optional[str]):
    """(kind, reason) for the contexts once the session ended: lost_reason is the client's
    session_lost (None: the client was closed)."""
    if lost_reason is not None:
        return EVENT_SESSION_LOST, lost_reason
    return EVENT_CLIENT_CLOSED, "the arfuse client of this attachment was closed"


class ClientAttachments:
    """One client's in-stream attachments and the events for them. Its on_session_* methods run
    on the client's session thread; a context only records what it hears there."""

    def __init__(self, client: Client):
        self.client = client
        self._lock = threading.Lock()
        self._contexts: Dict[int, object] = {}
        # Events that came before their context was bound (between Fusion.Attach's answer and
        # arfuse_attach), by attach id.
        self._early_events: Dict[int, list] = {}

    def expect(self, attach_id: int):
        """Fusion.Attach answered with this id: keep its events until bind()."""
        with self._lock:
            self._early_events.setdefault(attach_id, [])

    def bind(self, attach_id: int, ctx):
        """The context of this id: it hears the events kept for it, and the session's end if
        the session already ended."""
        with self._lock:
            early = self._early_events.pop(attach_id, [])
            self._contexts[attach_id] = ctx
        for kind, reason in early:
            ctx.on_session_event(kind, reason)
        if self.client.session_ended:
            ctx.on_session_event(*_end_event(self.client.session_lost))

    def forget(self, attach_id: int):
        with self._lock:
            self._contexts.pop(attach_id, None)
            self._early_events.pop(attach_id, None)

    def contexts(self) -> list:
        """The contexts attached through this client."""
        with self._lock:
            return list(self._contexts.values())

    def expecting(self) -> List[int]:
        """The ids announced (expect) and not yet bound or forgotten."""
        with self._lock:
            return list(self._early_events)

    def answer_drain(self, attach_id: int):
        """SessionRequest.drained_attach_id on the request stream (nothing once the session
        ended)."""
        self.client.send_session_request(fusion_pb2.SessionRequest(drained_attach_id=attach_id))

    # -- the session listener (Client.add_session_listener) --
    def on_session_event(self, event):
        """An AttachEvent: to its context, or kept until the context is bound."""
        kind, attach_id, reason = event.kind, event.attach_id, event.reason
        with self._lock:
            ctx = self._contexts.get(attach_id)
            if ctx is None:
                early = self._early_events.get(attach_id)
                if early is not None:
                    early.append((kind, reason))
                    return
        if ctx is None:
            # Not ours (any more): a drain of an attachment this client no longer holds is
            # answered at once, so the sidecar does not wait for it.
            if kind == fusion_pb2.AttachEvent.KIND_DRAIN:
                self.answer_drain(attach_id)
            return
        ctx.on_session_event(kind, reason)

    def on_session_end(self, lost_reason: Optional[str]):
        kind, reason = _end_event(lost_reason)
        for ctx in self.contexts():
            ctx.on_session_event(kind, reason)


def attachments_of(client: Client) -> ClientAttachments:
    """The client's table, made and added as its session listener at first use. It lives as
    long as the client does: the client's listeners hold it."""
    with _tables_lock:
        for listener in client.session_listeners():
            if isinstance(listener, ClientAttachments):
                return listener
        table = ClientAttachments(client)
        client.add_session_listener(table)
        return table


def attachments(client: Client) -> list:
    """The in-stream contexts attached through this client."""
    return attachments_of(client).contexts()
