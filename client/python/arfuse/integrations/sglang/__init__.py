"""arfuse in SGLang's place for FlashInfer's fused allreduce + residual add + RMSNorm.

SGLang loads it by itself: the arfuse package ships an `sglang.srt.plugins` entry point
(arfuse.integrations.sglang:plugin) that every SGLang process runs first, the tensor-parallel
scheduler processes included. Configure it with the environment:

    ARFUSE_SOCKET=/run/arfuse/rank{rank}.sock     # this rank's sidecar; {rank}: the rank in
                                                  # SGLang's TP group ({global_rank}, {gpu} too)
    ARFUSE_SGLANG=1                               # on (the default when ARFUSE_SOCKET is set);
                                                  # 0: off whatever else is set
    python -m sglang.launch_server ... --tp 2 --flashinfer-allreduce-fusion-backend auto

install() picks an adapter by SGLang's module layout (layouts.py), never by version string, and
replaces what SGLang's callers use:

- in sglang.srt.layers.flashinfer_comm_fusion: flashinfer_allreduce_residual_rmsnorm (same
  signature; SGLang's layernorm imports it at call time), is_flashinfer_allreduce_unavailable,
  ensure_workspace_initialized, pre_initialize_workspaces (SGLang calls it on every rank before
  graph capture: the attach and the vote happen there) and cleanup_flashinfer_workspace;
- in the gate's module (communicator.py up to 0.5.20, layer_boundary/residual/add_norm.py from
  0.5.21): its binding of is_flashinfer_allreduce_unavailable, and the globals its gate reads for
  FlashInfer's presence and the SM check (set True: FlashInfer is not needed). SGLang's own gate
  function runs unchanged, with every caller's binding of it: it still applies SGLang's batch
  limit (FUSE_ALLREDUCE_MAX_BATCH_SIZE), DP attention and the backend flag.

What the gate and the op agree on. SGLang's gate sees only the batch size. So everything else
is decided once, at setup, and voted across the TP group: this rank's sidecar attached; the
model's hidden size and dtype served fused; the attention TP group and the post-experts group
(use_attn_tp_group=False) both exactly the TP group the sidecars form (checked against SGLang's
group objects: not so under DP attention, attention context parallelism or expert parallelism
narrower than TP). Not served on any rank: the gate says no on every rank, for every call, and
SGLang runs its own path. Served: the op serves every batch the gate admits. Batches larger than
the sidecar's fused range run as consecutive fused launches over token chunks
(torch.ops.arfuse.allreduce_residual_rmsnorm; exact, since the allreduce is elementwise and
RMSNorm per row), a residual or weight of another dtype than the input runs the fused allreduce
and an fp32 add + RMSNorm. The op never answers (None, None) after a yes gate; a workspace that
fails while serving (poisoned, its sidecar gone) raises arfuse.instream.Unavailable, never
hangs. A shape the setup did not decide (another hidden size or input dtype) raises too.

The per-group FP8 hook (layouts.QUANT_HOOK, layernorm's
_forward_with_allreduce_fusion_quant_per_group, 0.5.20 on): where a release has it, install()
replaces it too, and setup() decides and votes it with the op (every rank's sidecar serves the
per-group FP8 pattern at the model's hidden size; the smallest per-launch limit any rank
serves). A served call answers what SGLang's fallback hands its GEMM: ((fp8, scale),
residual_out), the E4M3 codes, fp32 scales per group of 128 in the layout ARFUSE_SGLANG_FP8_SCALES
names (fp32_row_major by default: [tokens, hidden / 128], per_token_group_quant_fp8's default;
fp32_mn_major or ue8m0_packed for the GEMMs that read those), and a fresh residual. A call it
cannot serve (keep_bf16, another group size, shape or dtype, beyond the FP8 launch limit, not
voted on) runs SGLang's own hook, which answers None off ROCm/aiter, and logs its reason the
first time. ARFUSE_SGLANG_FP8=0 turns the hook off. SGLang's callers ask for the hook only under
aiter, so on CUDA it serves callers that ask for it; SGLang itself still runs the fused op and a
separate quant there.

torch.compile: what SGLang calls is a plain function that reads one attribute and calls the
opaque custom op torch.ops.arfuse.allreduce_residual_rmsnorm (fake implementation registered):
no locks, ctypes or dict lookups on the traced path, so fullgraph=True traces through it.

status() says what was decided and why. The setup logs one line per rank: the path that serves
(arfuse or SGLang's own), whether this rank attached, the vote, every patched name and why. A
gate or op call that declines (the gate says no: not set up, voted off) logs its reason the first
time it occurs, at INFO, once per distinct reason; outside torch.compile's tracing only (the
note is skipped while Dynamo traces, so compiled graphs hold nothing of it). The FP8 hook's
declines are noted alike, with the classes fp8_not_served, fp8_keep_bf16, fp8_group_size,
fp8_shape, fp8_dtype, fp8_not_contiguous, fp8_no_residual and fp8_range.
"""
import importlib
import logging
import os
import sys
from typing import Dict, List, Optional, Tuple

from .. import _decisions, _patches
from . import layouts, process_groups
from .state import State
from .layouts import FUSION_MODULE, OP_NAME, QUANT_GROUP_SIZE, QUANT_HOOK, QUANT_HOOK_MODULE, Layout

logger = logging.getLogger("arfuse.integrations.sglang")


class UnknownLayout(RuntimeError):
    """The installed SGLang's modules match no layout arfuse knows: nothing is patched."""

    def __init__(self, version: str, why: str):
        super().__init__(f"SGLang {version}: {why}")
        self.version, self.why = version, why


_state = State()

OWN_PATH = "SGLang's own allreduce + RMSNorm"
OWN_FP8_PATH = ("SGLang's own per-group FP8 hook (None off ROCm/aiter: its caller runs the "
                "fused allreduce + RMSNorm and a separate per-group quant)")
# Each reason the gate or the op declines for, logged the first time (docs/integration.md).
_declines = _decisions.FirstDeclines(logger, OWN_PATH)
_fp8_declines = _decisions.FirstDeclines(logger, OWN_FP8_PATH)


def _compiling() -> bool:
    """torch.compiler.is_compiling once torch is loaded (setup binds it): Dynamo folds it to
    True while tracing, so the decline note below never enters a traced graph."""
    return False


def _bind_compiling():
    global _compiling
    try:
        import torch
        _compiling = torch.compiler.is_compiling
    except (ImportError, AttributeError):  # no torch: nothing compiles
        pass


def _note_decline():
    if not _compiling():
        _declines.note(_state.reason_class, _state.reason)


# ---- what SGLang's callers get ----

def flashinfer_allreduce_residual_rmsnorm(
        input_tensor, residual, weight, eps: float = 1e-6, max_token_num: int = 2048,
        use_oneshot: Optional[bool] = None, trigger_completion_at_end: bool = False,
        fp32_acc: bool = False, use_attn_tp_group: bool = True):
    """SGLang's op through arfuse: (norm_out, residual_out), fresh tensors; (None, None) only
    when the gate says no on every call (not set up, voted off). use_oneshot,
    trigger_completion_at_end and fp32_acc are accepted and not needed: the sidecar's dispatch
    picks one-shot or two-shot alike on every rank and accumulates in fp32. Both groups are
    the sidecars' group (setup checked it) and max_token_num is SGLang's bookkeeping (the op
    serves any token count)."""
    if not _state.served:
        _note_decline()
        return None, None
    return _state.op(input_tensor, residual, weight, float(eps))


def _fp8_why_not(x, residual, weight, group_size, keep_bf16) -> Optional[Tuple[str, str]]:
    """(reason class, why) when the per-group FP8 hook declines this call, else None. Reads only
    what is alike on every rank (the voted setup, shapes, dtypes, flags), so every rank declines
    the same calls."""
    if not _state.fp8_served:
        return "fp8_not_served", _state.fp8_reason
    if residual is None:
        return "fp8_no_residual", "no residual (SGLang's hook declines it too)"
    if keep_bf16:
        # The FP8 op hands back the codes and scales, not the bf16 normalized value as well.
        return "fp8_keep_bf16", "keep_bf16 (a bf16 copy of the normalized value is not served)"
    if int(group_size) != QUANT_GROUP_SIZE:
        return "fp8_group_size", f"group size {group_size} (served: {QUANT_GROUP_SIZE})"
    hidden, name = _state.decided
    if x.dim() != 2 or int(x.shape[-1]) != hidden:
        return "fp8_shape", (f"input {tuple(x.shape)} (served: [tokens, {hidden}], the hidden "
                             "size the setup decided)")
    if tuple(residual.shape) != tuple(x.shape) or weight is None or \
            tuple(weight.shape) != (hidden,):
        return "fp8_shape", (f"residual {tuple(residual.shape)} or weight "
                             f"{None if weight is None else tuple(weight.shape)} does not match "
                             f"input {tuple(x.shape)}")
    if x.dtype != _state.fp8_dtype or residual.dtype != x.dtype or weight.dtype != x.dtype:
        return "fp8_dtype", (f"dtypes input {x.dtype}, residual {residual.dtype}, weight "
                             f"{weight.dtype} (served: all {name})")
    if not (x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()):
        return "fp8_not_contiguous", "a tensor is not contiguous"
    tokens = int(x.shape[0])
    if tokens <= 0 or tokens > _state.fp8_limit:
        return "fp8_range", (f"{tokens} tokens (served: 1 to {_state.fp8_limit} per launch; "
                             "the FP8 op is not chunked)")
    return None


def forward_with_allreduce_fusion_quant_per_group(norm_module, x, residual, weight,
                                                  group_size: int = 128,
                                                  use_attn_tp_group: bool = True,
                                                  keep_bf16: bool = False):
    """SGLang's per-group FP8 hook (layouts.QUANT_HOOK) through arfuse: ((fp8, scale),
    residual_out) with fp8 the E4M3 codes (torch.float8_e4m3fn, x's shape) of
    rmsnorm(allreduce(x) + residual) * weight, scale one fp32 per 128 values of a token in the
    voted layout (fp32_row_major: [tokens, hidden / 128], strides [hidden / 128, 1], what
    SGLang's per_token_group_quant_fp8 returns by default), residual_out = allreduce(x) +
    residual, fresh (x and residual are not written). A call it declines (_fp8_why_not) runs
    SGLang's own hook, which answers None off ROCm/aiter. Both groups are the sidecars' group
    (setup checked it), so use_attn_tp_group selects nothing here."""
    why = _fp8_why_not(x, residual, weight, group_size, keep_bf16)
    if why is None:
        q, residual_out, scale = _state.fp8_op(x, residual, weight,
                                               float(norm_module.variance_epsilon),
                                               _state.fp8_quant, _state.fp8_layout, None)
        return (q, scale), residual_out
    if not _compiling():
        _fp8_declines.note(*why)
    original = _state.quant_hook_original
    if original is None:
        return None
    return original(norm_module, x, residual, weight, group_size, use_attn_tp_group, keep_bf16)


def is_flashinfer_allreduce_unavailable() -> bool:
    if _state.served:
        return False
    _note_decline()
    return True


def ensure_workspace_initialized(max_token_num: int = 2048, hidden_dim: int = 4096,
                                 use_fp32_lamport: bool = False, dtype=None, token_num=None,
                                 use_oneshot=None, use_attn_tp_group: bool = True) -> bool:
    """True when the op serves (setup happens in pre_initialize_workspaces, on every rank)."""
    return _state.served


def pre_initialize_workspaces(max_token_num: int, hidden_dim: int, dtype, use_oneshot=None):
    """SGLang calls this on every rank before graph capture: attach and vote here."""
    setup(hidden=hidden_dim, dtype=dtype, max_token_num=max_token_num)


def cleanup_flashinfer_workspace():
    teardown()


REPLACEMENTS = tuple(layouts.FUSION_FUNCTIONS)


# ---- setup: attach, decide, vote ----

def sglang_groups(layout: Optional[Layout] = None):
    """SGLang's (TP, attention TP, post-experts) group coordinators, as the layout finds them."""
    return process_groups.sglang_groups(layout or _state.layout)


def _local_decision(hidden: int, name: Optional[str], tp, attn, moe, socket: Optional[str],
                    client, timeout: float) -> Optional[str]:
    """Why this rank cannot serve (None: it can). Attaches as a side effect."""
    import arfuse
    import arfuse.torch as aft
    from arfuse import instream

    if list(attn.ranks) != list(tp.ranks):
        return (f"the attention TP group (ranks {list(attn.ranks)}) is not the TP group "
                f"(ranks {list(tp.ranks)}): DP attention or attention context parallelism")
    if list(moe.ranks) != list(tp.ranks):
        return (f"the post-experts group (ranks {list(moe.ranks)}) is not the TP group "
                f"(ranks {list(tp.ranks)}): expert parallelism narrower than TP")
    if name is None:
        return "the model's dtype is not bf16, fp16 or fp32"
    ctx = _state.ctx
    if ctx is None or int(hidden) not in ctx.hiddens:
        if ctx is not None:
            return (f"already attached for hidden {ctx.hiddens}; a second model with hidden "
                    f"{hidden} is not served")
        template = socket or os.environ.get("ARFUSE_SOCKET")
        if not template and client is None:
            return "no sidecar socket (set ARFUSE_SOCKET, {rank} allowed)"
        import torch
        use_cuda = torch.cuda.is_available()
        device_index = torch.cuda.current_device() if use_cuda else 0
        owns = client is None
        try:
            if client is None:
                target = process_groups.socket_for(template, tp.rank_in_group, device_index)
                client = arfuse.Client(target, client_name="sglang", connect_timeout=timeout)
                client.wait_ready(timeout)
            if (client.rank, client.world_size) != (tp.rank_in_group, tp.world_size):
                raise arfuse.ArfuseError(
                    instream.status_code(instream.FAILED_PRECONDITION),
                    f"the sidecar at {client.target} is rank {client.rank} of "
                    f"{client.world_size}, this process rank {tp.rank_in_group} of "
                    f"{tp.world_size} of SGLang's TP group (wrong socket?)")
            ctx = client.attach([int(hidden)])
            device = "cpu" if ctx.device == "host" else torch.device("cuda", device_index)
            aft.set_context(ctx, device)
        except (arfuse.ArfuseError, ValueError, KeyError, IndexError, OSError) as e:
            if owns and client is not None:
                client.close()
            return f"{type(e).__name__}: {e}"
        _state.ctx, _state.client, _state.owns_client = ctx, client, owns
    ctx.poll(at_agreement=True)
    if ctx.disabled:
        return ctx.disabled_reason
    fused = ctx.max_fused_tokens(hidden, name, instream.PATTERN_ALLREDUCE_RESIDUAL_RMSNORM)
    plain = ctx.max_fused_tokens(hidden, name, instream.PATTERN_ALLREDUCE)
    if fused <= 0 or plain <= 0:
        return (f"the sidecar does not serve hidden {hidden} {name} fused "
                f"({ctx.why_not(1, hidden, name) or 'allreduce-only pattern not served'})")
    return None


def _local_fp8_decision(hidden: int, name: Optional[str], scales: str) -> Tuple[Optional[str], int]:
    """(why this rank cannot serve the per-group FP8 hook or None, tokens per launch), once the
    fused op serves here."""
    from arfuse import instream

    mode = os.environ.get("ARFUSE_SGLANG_FP8", "").strip().lower()
    if mode in _OFF:
        return f"ARFUSE_SGLANG_FP8={mode}", 0
    if mode and mode not in _ON:
        return f"ARFUSE_SGLANG_FP8={mode} is not 1 or 0", 0
    if not _state.quant_hook_installed:
        return (f"no {QUANT_HOOK_MODULE}.{QUANT_HOOK} patched (SGLang "
                f"{_state.version or '?'} has none, or install() did not run)"), 0
    if scales not in instream.SCALE_LAYOUTS:
        return (f"ARFUSE_SGLANG_FP8_SCALES={scales!r} is none of "
                f"{', '.join(instream.SCALE_LAYOUTS)}"), 0
    if name not in ("bf16", "fp16"):
        return f"FP8 outputs are served for bf16 and fp16 input, not {name}", 0
    if hidden % QUANT_GROUP_SIZE:
        return f"hidden {hidden} is not a multiple of the group size {QUANT_GROUP_SIZE}", 0
    ctx = _state.ctx
    limit = ctx.max_fused_tokens(hidden, name, instream.PATTERN_FP8_PER_GROUP)
    if limit <= 0:
        return (f"the sidecar does not serve per-group FP8 at hidden {hidden} {name} "
                f"({ctx.why_not(1, hidden, name, instream.PATTERN_FP8_PER_GROUP)})"), 0
    return None, int(limit)


def setup(hidden: int, dtype, max_token_num: int = 2048, socket: Optional[str] = None,
          groups=None, client=None, timeout: Optional[float] = None) -> bool:
    """Attaches this rank to its sidecar, decides whether the op serves SGLang's model
    (hidden, dtype, groups) and votes with the TP group; True when it serves. Every rank calls
    it at the same point, outside graph capture (pre_initialize_workspaces does).

    groups: (tp, attention tp, post-experts) coordinators with .ranks, .rank_in_group,
    .world_size, .cpu_group (default: SGLang's, sglang_groups()); client: an arfuse.Client to
    attach through instead of connecting to the socket."""
    import arfuse.torch as aft

    _bind_compiling()
    with _state.lock:
        if timeout is None:
            timeout = float(os.environ.get("ARFUSE_TIMEOUT", "30"))
        socket = socket or _state.socket
        tp, attn, moe = groups if groups is not None else sglang_groups()
        world, rank = int(tp.world_size), int(tp.rank_in_group)
        _state.world_size, _state.rank = world, rank
        name = process_groups.dtype_name(dtype)
        if (int(hidden), name) == _state.decided and _state.served:
            return True
        who = f"SGLang rank {rank}/{world}"
        if world <= 1:
            _disable(f"world size {world}: nothing to reduce", "world_size")
            _decisions.path_line(logger, logging.INFO, who, False, OWN_PATH, "no",
                                 "not needed", _state.patched_names, _state.reason)
            return False
        local = _local_decision(int(hidden), name, tp, attn, moe, socket, client, timeout)
        attached = ("yes" if _state.ctx is not None
                    else f"no ({local})" if local else "no")
        scales = os.environ.get("ARFUSE_SGLANG_FP8_SCALES", "").strip() or "fp32_row_major"
        fp8_local, fp8_limit = (_local_fp8_decision(int(hidden), name, scales) if local is None
                                else ("the fused op is not served on this rank", 0))
        # One gather decides both: the fused op, and the FP8 hook on top of it (its launches are
        # collectives too, so every rank must take the same calls and cut the same limit). It
        # also carries each rank's draw of the group's program key (the largest wins).
        from arfuse import instream
        votes = process_groups.gather(
            (local, fp8_local, fp8_limit, scales, instream.draw_program_key()), tp.cpu_group,
            world)
        reasons = [v[0] for v in votes]
        bad = [(r, why) for r, why in enumerate(reasons) if why is not None]
        _state.decided = (int(hidden), name)
        if bad:
            _disable("; ".join(f"rank {r}: {why}" for r, why in bad),
                     _decisions.reason_class(bad[0][1]))
            _decisions.path_line(logger, logging.WARNING, who, False, OWN_PATH, attached,
                                 "off on every rank", _state.patched_names, _state.reason)
            return False
        # Ops of this group pair only with each other's, never with a client of another program
        # on a peer rank (docs/instream.md, "A client that dies mid-op").
        _state.ctx.set_program_key(max(int(v[4]) for v in votes))
        aft.register_ops()
        import torch
        _state.op = torch.ops.arfuse.allreduce_residual_rmsnorm
        per_launch = _state.ctx.max_fused_tokens(hidden, name,
                                                 instream.PATTERN_ALLREDUCE_RESIDUAL_RMSNORM)
        fp8_bad = [(r, v[1]) for r, v in enumerate(votes) if v[1] is not None]
        if not fp8_bad and len({v[3] for v in votes}) > 1:
            fp8_bad = [(r, f"ARFUSE_SGLANG_FP8_SCALES={v[3]}") for r, v in enumerate(votes)]
        if fp8_bad:
            _state.fp8_served = False
            _state.fp8_reason = "; ".join(f"rank {r}: {why}" for r, why in fp8_bad)
            fp8_line = f"per-group FP8 hook: {OWN_FP8_PATH} ({_state.fp8_reason})"
        else:
            _state.fp8_op = torch.ops.arfuse.fused_allreduce_residual_rmsnorm_fp8
            _state.fp8_quant = instream.QUANTS["per_group"]
            _state.fp8_layout = instream.SCALE_LAYOUTS[scales]
            _state.fp8_layout_name = scales
            _state.fp8_limit = min(int(v[2]) for v in votes)
            _state.fp8_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
            _state.fp8_served, _state.fp8_reason = True, ""
            fp8_line = (f"per-group FP8 hook: served ({scales} scales, up to "
                        f"{_state.fp8_limit} tokens per launch)")
        _state.served, _state.reason, _state.reason_class = True, "", ""
        _decisions.path_line(
            logger, logging.INFO, who, True, OWN_PATH, attached, "on on every rank",
            _state.patched_names,
            f"{_state.layout.name if _state.layout else '-'} adapter, SGLang "
            f"{_state.version or '?'}: hidden {hidden} {name}, both groups, every batch the "
            f"gate admits (up to {per_launch} tokens per fused launch, larger batches in "
            f"chunks); {fp8_line}; {_state.ctx!r}")
        return True


def _disable(reason: str, reason_class: str = "not_set_up"):
    """Under _state.lock: the gate says no from now on; detaches what setup attached."""
    import arfuse
    import arfuse.torch as aft

    _state.served, _state.reason, _state.reason_class = False, reason, reason_class
    _state.fp8_served, _state.fp8_reason = False, reason
    ctx, _state.ctx = _state.ctx, None
    if ctx is not None:
        aft.set_context(None, "cpu" if ctx.device == "host" else None)
        try:
            ctx.detach()
        except arfuse.ArfuseError:
            pass
    if _state.client is not None and _state.owns_client:
        _state.client.close()
    _state.client = None


def teardown():
    """Detaches (SGLang's cleanup_flashinfer_workspace, once installed)."""
    with _state.lock:
        _disable("not set up (torn down)")
        _state.decided = None


def status() -> Dict[str, object]:
    """What was decided: served, why not, the adapter, the context's launches so far."""
    ctx = _state.ctx
    return {"served": _state.served, "reason": _state.reason,
            "adapter": _state.layout.name if _state.layout else None,
            "gate": _state.gate_name, "sglang": _state.version,
            "rank": _state.rank, "world_size": _state.world_size,
            "decided": _state.decided, "launches": ctx.launches if ctx is not None else 0,
            "patched": list(_state.patched_names), "declined": _declines.seen(),
            "fp8": {"served": _state.fp8_served, "reason": _state.fp8_reason,
                    "scale_layout": _state.fp8_layout_name if _state.fp8_served else None,
                    "max_tokens": _state.fp8_limit if _state.fp8_served else 0,
                    "declined": _fp8_declines.seen()}}


# ---- install ----

def sglang_version() -> str:
    try:
        from importlib.metadata import version
        return version("sglang")
    except Exception:
        pass
    try:
        return importlib.import_module("sglang.version").__version__
    except Exception:
        return "unknown"


def detect_layout(import_module=importlib.import_module) -> Tuple[Layout, str]:
    """(layout, gate name) of the installed SGLang, by what its modules contain; raises
    UnknownLayout naming what is missing."""
    misses = []
    for layout in layouts.LAYOUTS:
        why = None
        for mod_name in (layout.gate_module, *layout.requires):
            try:
                mod = import_module(mod_name)
            except ImportError as e:
                why = f"no module {mod_name} ({e})"
                break
            for attr in layout.requires.get(mod_name, ()):
                if not hasattr(mod, attr):
                    why = f"{mod_name} has no {attr}"
                    break
            if why:
                break
        if why is None:
            gate_mod = import_module(layout.gate_module)
            gate = next((g for g in layout.gate_names if callable(getattr(gate_mod, g, None))),
                        None)
            if gate is None:
                why = f"{layout.gate_module} has none of {', '.join(layout.gate_names)}"
            else:
                missing = [g for g in layout.gate_true_globals if g not in vars(gate_mod)]
                if missing:
                    why = f"{layout.gate_module} has no {', '.join(missing)}"
                else:
                    return layout, gate
        misses.append(f"{layout.name} layout: {why}")
    raise UnknownLayout(sglang_version(), "unknown module layout (" + "; ".join(misses) + ")")


def _patch(owner, name, value):
    _patches.patch(_state.installed, owner, name, value)
    _state.patched_names.append(f"{owner.__name__}.{name}")


def installed() -> bool:
    return bool(_state.installed)


def install(socket: Optional[str] = None, import_module=importlib.import_module) -> List[str]:
    """Puts this package's functions in SGLang's place (module docstring) and returns the
    patched names ("module.attribute"). `socket` ("{rank}" allowed; default $ARFUSE_SOCKET) is
    what the setup at pre_initialize_workspaces connects to. Raises UnknownLayout (nothing
    patched) when SGLang's modules match no known layout. Idempotent."""
    with _state.lock:
        if _state.installed:
            return list(_state.patched_names)
        layout, gate = detect_layout(import_module)
        _bind_compiling()
        me = sys.modules[__name__]
        fusion = import_module(FUSION_MODULE)
        for name in REPLACEMENTS:
            _patch(fusion, name, getattr(me, name))
        gate_mod = import_module(layout.gate_module)
        for name in layout.gate_true_globals:
            _patch(gate_mod, name, True)
        for mod_name in layout.unavailable_bindings:
            mod = import_module(mod_name)
            if "is_flashinfer_allreduce_unavailable" in vars(mod):
                _patch(mod, "is_flashinfer_allreduce_unavailable",
                       is_flashinfer_allreduce_unavailable)
        for mod_name in layout.callers:
            import_module(mod_name)  # bound now, so that nothing imports an unpatched name
        norm_mod = import_module(QUANT_HOOK_MODULE)
        hook = vars(norm_mod).get(QUANT_HOOK)
        if callable(hook):
            _state.quant_hook_original = hook
            _patch(norm_mod, QUANT_HOOK, forward_with_allreduce_fusion_quant_per_group)
            _state.quant_hook_installed = True
        _state.layout, _state.gate_name = layout, f"{layout.gate_module}.{gate}"
        _state.version = sglang_version()
        _state.socket = socket
        logger.info("arfuse: SGLang %s: %s adapter (gate %s); patched %s", _state.version,
                    layout.name, _state.gate_name, ", ".join(_state.patched_names))
        return list(_state.patched_names)


def uninstall():
    """Restores every attribute install() replaced (in reverse order) and detaches."""
    teardown()
    with _state.lock:
        _patches.restore(_state.installed)
        _state.patched_names.clear()
        _state.layout, _state.gate_name, _state.op = None, "", None
        _state.quant_hook_original, _state.quant_hook_installed = None, False
        _state.fp8_op = None
        _state.reason = "not installed"


# ---- the sglang.srt.plugins entry point ----

_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")


def _log_to_stderr():
    """SGLang configures logging after it loads plugins: arfuse's lines get their own handler,
    so the INFO lines of the install and the setup show."""
    root = logging.getLogger("arfuse")
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("[%(asctime)s] %(name)s %(levelname)s: %(message)s"))
        root.addHandler(h)
        root.setLevel(os.environ.get("ARFUSE_LOG_LEVEL", "INFO").upper())
        root.propagate = False


def plugin():
    """Entry point of the `sglang.srt.plugins` group: SGLang runs it first in every process.
    Installs when ARFUSE_SGLANG=1, or ARFUSE_SGLANG is unset and ARFUSE_SOCKET is set."""
    mode = os.environ.get("ARFUSE_SGLANG", "").strip().lower()
    socket = os.environ.get("ARFUSE_SOCKET", "").strip()
    if mode in _OFF or (not mode and not socket):
        return
    _log_to_stderr()
    if mode and mode not in _ON:
        logger.error("arfuse: ARFUSE_SGLANG=%s is not 1 or 0: fused allreduce off", mode)
        return
    if not socket:
        logger.error("arfuse: ARFUSE_SGLANG=1 but ARFUSE_SOCKET is not set (e.g. "
                     "/run/arfuse/rank{rank}.sock): fused allreduce off")
        return
    try:
        install(socket=socket)
    except UnknownLayout as e:
        logger.error("arfuse: %s; arfuse's fused allreduce is off on every rank and SGLang "
                     "runs its own path. Supported: SGLang 0.5.14-0.5.23 "
                     "(docs/integration.md)", e)
