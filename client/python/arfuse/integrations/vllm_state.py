"""The vLLM integration's state in this process (arfuse.integrations.vllm): what register()
patched, the attach to this rank's sidecar and the TP group's vote (attach_and_vote, called by
the pass when vLLM builds it), status(), and the log lines saying which path serves and each
decline reason the first time.

Imports without vLLM or torch: vLLM runs the plugin in every process it starts."""
import logging
import os
import threading

from . import _decisions

# The one logger of the integration's modules (vllm.py, vllm_pass.py, vllm_fp8.py): its name is
# what the docs tell operators to look for.
logger = logging.getLogger("arfuse.integrations.vllm")


class State:
    def __init__(self):
        self.lock = threading.Lock()
        self.registered = False
        self.patched = []          # (owner, name, original, had)
        self.voted = False         # attach and vote done in this process
        self.on = False            # the group voted fusion on
        self.reason = "not set up"
        self.client = None
        self.ctx = None
        self.replaced = 0          # sites replaced, all compile ranges
        self.rank_world = (0, 1)
        self.attach_error = ""


state = State()

OWN_PATH = "vLLM's own allreduce + RMSNorm"
# Each reason the fusion pass declines a site or a compile range for, logged the first time: the
# pass decides at compile time, in Python, outside the graphs it rewrites.
declines = _decisions.FirstDeclines(logger, OWN_PATH)
_paths_logged = set()


def declined(reason: str, detail: str) -> bool:
    """False (the site stays on vLLM's path), noting the reason the first time."""
    declines.note(reason, detail)
    return False


def log_path(level, on: bool, why: str):
    """The one line per TP rank (per distinct outcome) saying which path serves and why."""
    rank, world = state.rank_world
    attached = "yes" if state.ctx is not None else \
        f"no ({state.attach_error})" if state.attach_error else "no"
    vote = "not held" if not state.voted else \
        "on on every TP rank" if state.on else "off on every TP rank"
    key = (on, why, attached, vote)
    if key in _paths_logged:
        return
    _paths_logged.add(key)
    _decisions.path_line(logger, level, f"vLLM TP rank {rank}/{world}", on, OWN_PATH, attached,
                         vote, status()["patched"], why)


def status() -> dict:
    """What ran in this process: whether the group fused, why not, how many sites the pass
    replaced (summed over compile ranges and compiled models)."""
    return {"registered": state.registered, "on": state.on, "reason": state.reason,
            "replaced": state.replaced,
            "patched": [_label(o, n, had) for o, n, _, had in state.patched],
            "declined": declines.seen()}


def _label(owner, name, had) -> str:
    if isinstance(had, str) and had.startswith("item:"):
        return f"{had[5:]}.{name}"
    return f"{getattr(owner, '__name__', owner)}.{name}"


# ---- attach and vote (in a worker, from the pass) ----

def _socket_for(rank: int) -> str:
    socket = os.environ.get("ARFUSE_SOCKET")
    if not socket:
        raise ValueError("ARFUSE_SOCKET is not set")
    return socket.format(rank=rank)


def attach_and_vote(hiddens, tp_group, device=None, timeout: float = 60.0,
                    client=None) -> bool:
    """Attaches this rank (tp_group.rank_in_group) to its sidecar and votes over
    tp_group.cpu_group; once per process (later calls return the first answer). Every rank of
    the group must call it at the same point: vLLM builds the pass on every rank when it
    compiles. device: vLLM's device ("cuda"; "cpu" for a host-mode sidecar), where the vote
    looks for this rank's context."""
    import arfuse
    import arfuse.torch as aft
    from arfuse import instream

    with state.lock:
        if state.voted:
            return state.on
        rank, world = tp_group.rank_in_group, tp_group.world_size
        state.rank_world = (rank, world)
        local = None
        try:
            if client is None:
                client = arfuse.Client(_socket_for(rank), client_name="vllm",
                                       connect_timeout=timeout)
                client.wait_ready(timeout)
            if (client.rank, client.world_size) != (rank, world):
                raise arfuse.ArfuseError(
                    instream.status_code(instream.FAILED_PRECONDITION),
                    f"the sidecar is rank {client.rank} of {client.world_size}, this process "
                    f"TP rank {rank} of {world} (wrong socket?)")
            ctx = aft.attach(client, list(hiddens))
            state.client, state.ctx = client, ctx
        except (arfuse.ArfuseError, ValueError, OSError) as e:
            local = f"TP rank {rank}: {e}"
            state.attach_error = str(e)
            logger.warning("arfuse: in-stream attach failed: %s", local)
        # agree() counts a rank without a context as unavailable, so every rank disables its
        # own when any could not attach.
        on = aft.agree(tp_group.cpu_group, device=device)
        state.voted, state.on = True, on
        if not on:
            state.reason = local or "another TP rank could not attach"
            logger.warning("arfuse: fused allreduce off on every TP rank: %s", state.reason)
        else:
            state.reason = ""
            logger.info("arfuse: TP rank %d of %d attached: %r", rank, world, state.ctx)
        return on


def _reset_for_tests():
    import arfuse.torch as aft
    with state.lock:
        ctx, state.ctx = state.ctx, None
        if ctx is not None:
            aft.set_context(None, "cpu" if ctx.device == "host" else None)
            try:
                ctx.detach()
            except Exception:
                pass
        if state.client is not None:
            state.client.close()
        state.client = None
        state.voted = state.on = False
        state.reason = "not set up"
        state.replaced = 0
        state.attach_error = ""
        declines.reset()
        _paths_logged.clear()
