"""arfuse in SGLang's place for FlashInfer's fused allreduce + residual add + RMSNorm.

    from arfuse.integrations import sglang as arfuse_sglang
    arfuse_sglang.install(socket="/run/arfuse/rank{rank}.sock")   # before SGLang builds its model
    ... launch SGLang as usual, with --flashinfer-allreduce-fusion-backend auto (or trtllm/mnnvl)

install() replaces, in SGLang's modules, what its callers use:

- sglang.srt.layers.flashinfer_comm_fusion: flashinfer_allreduce_residual_rmsnorm (this
  module's, same signature and semantics), is_flashinfer_allreduce_unavailable,
  ensure_workspace_initialized, pre_initialize_workspaces (SGLang calls it on every rank before
  graph capture: the attach and the vote happen there) and cleanup_flashinfer_workspace;
- the same names where a caller module bound them at import (sglang.srt.layers.communicator,
  sglang.srt.layers.layernorm), and the communicator's `_is_flashinfer_available` (True: the
  fused path no longer needs FlashInfer installed);
- torch.ops.sglang.flashinfer_allreduce_residual_rmsnorm, where SGLang registered its op and
  callers go through torch.ops.

uninstall() puts every one of them back.

Semantics, as upstream: the op returns (norm_out, residual_out), or (None, None) when fusion is
unavailable (not set up, the group voted it off, world size 1, non-contiguous tensors, a shape
the sidecar does not serve fused, a drained attachment); the caller then runs its own allreduce
and RMSNorm. `input_tensor.shape[0] <= max_token_num` is asserted as upstream does.
use_oneshot, trigger_completion_at_end and fp32_acc are accepted and not needed: the sidecar's
dispatch picks one-shot or two-shot from its measured table, alike on every rank, and always
accumulates in fp32. use_attn_tp_group=False (the MoE group) is served only when setup() was
told that group is the same (serve_moe_group=True); otherwise (None, None).

All ranks enable or none does: setup() attaches, then the group votes with a MAX all-reduce of
an "unavailable" flag (SGLang's _sync_allreduce_unavailable_across_tp), so a rank that could not
attach turns fusion off on every rank. A workspace that fails later (poisoned, re-initialized, a
sidecar gone) raises arfuse.instream.Unavailable from the op instead of returning (None, None).
"""
import importlib
import logging
import os
import sys
import threading
from typing import Optional, Tuple

logger = logging.getLogger("arfuse.integrations.sglang")

FUSION_MODULE = "sglang.srt.layers.flashinfer_comm_fusion"
CALLER_MODULES = ("sglang.srt.layers.communicator", "sglang.srt.layers.layernorm")
OP_NAME = "flashinfer_allreduce_residual_rmsnorm"


class _State:
    def __init__(self):
        self.ctx = None
        self.client = None
        self.group = None
        self.world_size = 1
        self.unavailable = False
        self.reason = "not set up (arfuse.integrations.sglang.setup)"
        self.serve_moe_group = False
        # install()'s arguments for the setup SGLang's pre_initialize_workspaces triggers.
        self.socket = None
        self.setup_kwargs = {}
        self.installed = []  # (owner, attribute, original, had_attribute)
        self.lock = threading.Lock()


_state = _State()


# ---- setup ----

def _socket_for(socket: Optional[str], rank: int) -> str:
    socket = socket or os.environ.get("ARFUSE_SOCKET")
    if not socket:
        raise ValueError("no sidecar socket: pass socket= (may contain {rank}) or set "
                         "ARFUSE_SOCKET")
    return socket.format(rank=rank)


def _default_group():
    """SGLang's tensor-parallel CPU group when SGLang is there, else the default group."""
    try:
        from sglang.srt.distributed import get_tp_group
        return get_tp_group().cpu_group
    except Exception:
        return None


def _vote_unavailable(local_unavailable: bool, group) -> bool:
    """MAX all-reduce of the flag over `group`: True when any rank is unavailable."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) <= 1:
        return local_unavailable
    on_cpu = dist.get_backend(group) != "nccl"
    flag = torch.tensor([1 if local_unavailable else 0], dtype=torch.int32,
                        device="cpu" if on_cpu else torch.device("cuda",
                                                                 torch.cuda.current_device()))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(int(flag.item()))


def setup(socket: Optional[str] = None, group=None, hiddens=None, client=None,
          serve_moe_group: bool = False, client_name: str = "sglang",
          timeout: float = 60.0) -> bool:
    """Attaches this rank to its sidecar and votes with the group; True when fusion is on.

    socket: this rank's sidecar ("{rank}" is replaced by the rank in `group`; default
    $ARFUSE_SOCKET); group: the tensor-parallel torch.distributed group (default SGLang's TP CPU
    group, else the default group); hiddens: the hidden sizes the model runs. Call it on every
    rank at the same point, outside graph capture (pre_initialize_workspaces does, once
    installed)."""
    import torch.distributed as dist

    import arfuse
    import arfuse.torch as aft
    from arfuse import instream

    with _state.lock:
        if group is None:
            group = _default_group()
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        _state.group, _state.world_size = group, world
        _state.serve_moe_group = serve_moe_group
        local_reason = None
        ctx = None
        try:
            if client is None:
                client = arfuse.Client(_socket_for(socket, rank), client_name=client_name,
                                       connect_timeout=timeout)
                client.wait_ready(timeout)
            if (client.rank, client.world_size) != (rank, world):
                raise arfuse.ArfuseError(
                    instream.status_code(instream.FAILED_PRECONDITION),
                    f"the sidecar is rank {client.rank} of {client.world_size}, this process "
                    f"rank {rank} of {world} (wrong socket?)")
            ctx = aft.attach(client, hiddens)
        except (arfuse.ArfuseError, ValueError, OSError) as e:
            local_reason = f"rank {rank}: {e}"
            logger.warning("arfuse: in-stream attach failed: %s", local_reason)
        unavailable = _vote_unavailable(local_reason is not None, group)
        _state.client, _state.ctx = client, ctx
        if unavailable:
            _state.unavailable = True
            _state.reason = local_reason or "another rank of the group could not attach"
            if ctx is not None:
                aft.set_context(None, "cpu" if ctx.device == "host" else None)
                try:
                    ctx.detach()
                except arfuse.ArfuseError:
                    pass
                _state.ctx = None
            logger.warning("arfuse: fused allreduce off on every rank: %s", _state.reason)
            return False
        _state.unavailable = False
        _state.reason = ""
        logger.info("arfuse: in-stream plane attached: %r", ctx)
        return True


def teardown():
    """Detaches (SGLang's cleanup_flashinfer_workspace, once installed)."""
    import arfuse.torch as aft

    with _state.lock:
        ctx, _state.ctx = _state.ctx, None
        _state.unavailable, _state.reason = False, "not set up (torn down)"
        if ctx is not None:
            aft.set_context(None, "cpu" if ctx.device == "host" else None)
            ctx.detach()
        if _state.client is not None:
            _state.client.close()
            _state.client = None


def is_flashinfer_allreduce_unavailable() -> bool:
    return _state.unavailable or _state.ctx is None


def ensure_workspace_initialized(max_token_num: int = 2048, hidden_dim: int = 4096,
                                 use_fp32_lamport: bool = False, dtype=None, token_num=None,
                                 use_oneshot=None, use_attn_tp_group: bool = True) -> bool:
    if _state.ctx is None and not _state.unavailable and (_state.socket or
                                                          os.environ.get("ARFUSE_SOCKET")):
        setup(_state.socket, hiddens=[hidden_dim], **_state.setup_kwargs)
    if not use_attn_tp_group and not _state.serve_moe_group:
        return False
    return not is_flashinfer_allreduce_unavailable()


def pre_initialize_workspaces(max_token_num: int, hidden_dim: int, dtype, use_oneshot=None):
    """SGLang calls this on every rank before graph capture: attach and vote there."""
    ensure_workspace_initialized(max_token_num=max_token_num, hidden_dim=hidden_dim, dtype=dtype)


def cleanup_flashinfer_workspace():
    teardown()


# ---- the op ----

def flashinfer_allreduce_residual_rmsnorm(
        input_tensor, residual, weight, eps: float = 1e-6, max_token_num: int = 2048,
        use_oneshot: Optional[bool] = None, trigger_completion_at_end: bool = False,
        fp32_acc: bool = False, use_attn_tp_group: bool = True) -> Tuple[object, object]:
    """SGLang's flashinfer_allreduce_residual_rmsnorm through arfuse's in-stream plane: returns
    (norm_output, residual_output), or (None, None) when unavailable."""
    if _state.ctx is None or _state.unavailable:
        return None, None
    if not use_attn_tp_group and not _state.serve_moe_group:
        return None, None
    if _state.world_size <= 1:
        return None, None
    assert input_tensor.shape[0] <= max_token_num
    import arfuse.torch as aft

    return aft.fused_allreduce_residual_rmsnorm(input_tensor, residual, weight, eps)


# ---- install ----

def _replacements():
    me = sys.modules[__name__]
    return {name: getattr(me, name) for name in (
        OP_NAME, "is_flashinfer_allreduce_unavailable", "ensure_workspace_initialized",
        "pre_initialize_workspaces", "cleanup_flashinfer_workspace")}


def _patch(owner, name, value):
    had = name in vars(owner) if hasattr(owner, "__dict__") else hasattr(owner, name)
    _state.installed.append((owner, name, getattr(owner, name, None), had))
    setattr(owner, name, value)


def installed() -> bool:
    return bool(_state.installed)


def install(socket: Optional[str] = None, fusion_module=None, caller_modules=None,
            patch_torch_ops: bool = True, **setup_kwargs):
    """Puts this module's functions in SGLang's place (module docstring). `socket` ("{rank}"
    allowed; default $ARFUSE_SOCKET) and setup_kwargs are used by the setup that SGLang's
    pre_initialize_workspaces triggers. fusion_module / caller_modules: module objects to patch
    instead of importing SGLang's (tests). Idempotent; returns the patched (module, name)
    pairs."""
    with _state.lock:
        if _state.installed:
            return [(o, n) for o, n, _, _ in _state.installed]
        fusion = fusion_module if fusion_module is not None else \
            importlib.import_module(FUSION_MODULE)
        if caller_modules is None:
            caller_modules = []
            for name in CALLER_MODULES:
                try:
                    caller_modules.append(importlib.import_module(name))
                except ImportError:
                    pass
        _state.socket = socket
        _state.setup_kwargs = dict(setup_kwargs)
        repl = _replacements()
        for name, fn in repl.items():
            if hasattr(fusion, name):
                _patch(fusion, name, fn)
        if not hasattr(fusion, OP_NAME):
            _patch(fusion, OP_NAME, repl[OP_NAME])
        for mod in caller_modules:
            for name, fn in repl.items():
                if name in vars(mod):
                    _patch(mod, name, fn)
            if "_is_flashinfer_available" in vars(mod) and \
                    mod.__name__.endswith("communicator"):
                _patch(mod, "_is_flashinfer_available", True)
        if patch_torch_ops and "torch" in sys.modules:
            ns = sys.modules["torch"].ops.sglang
            try:
                getattr(ns, OP_NAME)
                present = True
            except (AttributeError, RuntimeError):
                present = False
            if present:
                _patch(ns, OP_NAME, repl[OP_NAME])
        logger.info("arfuse: installed in SGLang's place for %s (%d attributes)", OP_NAME,
                    len(_state.installed))
        return [(o, n) for o, n, _, _ in _state.installed]


def uninstall():
    """Restores every attribute install() replaced (in reverse order)."""
    with _state.lock:
        while _state.installed:
            owner, name, original, had = _state.installed.pop()
            if had:
                setattr(owner, name, original)
            else:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
