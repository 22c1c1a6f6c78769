"""arfuse in vLLM's place for FlashInfer's fused allreduce + (residual add +) RMSNorm.

The arfuse package ships a `vllm.general_plugins` entry point (`arfuse =
arfuse.integrations.vllm:register`); vLLM calls it first in every process it starts (the API
process, the engine core, every worker). Configured by environment:

    ARFUSE_SOCKET=/run/arfuse/rank{rank}.sock   this rank's sidecar ("{rank}": the TP rank)
    ARFUSE_VLLM=1|0                             on / off (default: on when ARFUSE_SOCKET is set)

register() checks vLLM's module layout (LAYOUT below; known on vLLM 0.30.0-0.33.0) and then:

- puts ArfuseAllReduceFusionPass in the place of vLLM's AllReduceFusionPass, where vLLM's
  PostGradPassManager.configure() builds it (`pass_manager.AllReduceFusionPass`): FlashInfer's
  pass is then never built (no FlashInfer workspace, FlashInfer need not be installed) and
  arfuse's runs at its position in the pass order;
- turns `PassConfig.fuse_allreduce_rms` on by default at -O2 and -O3 for TP > 1 on CUDA (vLLM's
  own default asks for FlashInfer and SM90/SM100); an explicit
  `-cc.pass_config.fuse_allreduce_rms=false` still turns it off, as does VLLM_BATCH_INVARIANT.

A layout it does not know: an ERROR naming the vLLM version and what is missing, and nothing is
patched (vLLM runs as without arfuse).

The pass (built by vLLM in every worker when it compiles, after the TP group exists) attaches
to this rank's sidecar and votes across the TP group: all ranks fuse or none
(arfuse.torch.agree). It then replaces, in the post-grad FX graph, the patterns FlashInfer's
pass replaces that arfuse serves:

- all_reduce + fused_add_rms_norm -> torch.ops.arfuse.fused_allreduce_residual_rmsnorm (and
  the variant whose residual output is unused);
- all_reduce + rms_norm (the first layer, no residual) -> the same op with a zero residual:
  exact, since arfuse's residual_out = round(allreduce + 0) is its allreduce result bit for bit
  and its norm is computed from that rounded value, as rms_norm(all_reduce(x)) is.

- all_reduce + fused_add_rms_norm or rms_norm whose output is quantized to FP8 E4M3 with a
  static per-tensor scale (vLLM's AllReduceFused[Add]RMSNormStaticQuantFP8Pattern: the quant as
  _C.static_scaled_fp8_quant under auto_functionalized, or QuantFP8's native form) ->
  torch.ops.arfuse.fused_allreduce_residual_rmsnorm_fp8 with quant static, vLLM's scale passed
  as is (both ops compute e4m3(x * (1 / scale)), saturating). arfuse quantizes the fp32
  normalized value, vLLM the norm output rounded to the model dtype: a code may differ by one
  E4M3 step. Taken where input, residual and weight are bf16 or fp16, the norm's output feeds
  only the quant and the static FP8 pattern's fused range covers the compile range.

only for compile ranges whose end is at most arfuse's fused range for the model's hidden size
and dtype (the sidecar's, the same on every rank; added to vLLM's compile-range endpoints), and
only where input, residual and weight share a served dtype. Declined (vLLM's own path), each
reason logged once: an RMSNorm whose output feeds an NVFP4 quantization (arfuse has no FP4
outputs), a dynamic FP8 one (per-tensor, per-token, per-group: not patterns of vLLM's pass) or
another quantization op, a static FP8 site the FP8 op does not take (fp32 input, the norm's
output also used unquantized, ...; "fp8_*" reasons), Gemma's (1 + weight) norm in fp32, weights
of another dtype, TP 1.
"""
import contextlib
import importlib
import logging
import operator
import os
import threading
from typing import Optional

from . import _decisions, _patches

logger = logging.getLogger("arfuse.integrations.vllm")

TESTED_VERSIONS = ("0.30.0", "0.31.0", "0.32.0", "0.33.0")
EPSILONS = (1e-5, 1e-6)

# (module, attribute path, kind): what this integration relies on. "names:X" means the
# function's code refers to the global name X (pass_manager's configure builds
# AllReduceFusionPass by that name, so replacing the module global takes its place).
LAYOUT = (
    ("vllm.plugins", "DEFAULT_PLUGINS_GROUP", "attr"),
    ("vllm.compilation.passes.pass_manager", "PostGradPassManager.configure",
     "names:AllReduceFusionPass"),
    ("vllm.compilation.passes.vllm_inductor_pass", "VllmPatternMatcherPass", "attr"),
    ("vllm.compilation.passes.vllm_inductor_pass", "VllmInductorPass.time_and_log", "attr"),
    ("vllm.compilation.passes.inductor_pass", "enable_fake_mode", "attr"),
    ("vllm.compilation.passes.inductor_pass", "get_pass_context", "attr"),
    ("vllm.compilation.passes.inductor_pass", "InductorPass.hash_source", "attr"),
    ("vllm.ir.ops", "rms_norm", "attr"),
    ("vllm.ir.ops", "fused_add_rms_norm", "attr"),
    ("vllm.distributed.parallel_state", "get_tp_group", "attr"),
    ("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank", "attr"),
    ("vllm.distributed.parallel_state", "get_tensor_model_parallel_world_size", "attr"),
    ("vllm.distributed.parallel_state", "GroupCoordinator.all_reduce", "names:all_reduce"),
    ("vllm.config.vllm", "OPTIMIZATION_LEVEL_02", "attr"),
    ("vllm.config.vllm", "OPTIMIZATION_LEVEL_03", "attr"),
)


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in ("1", "true", "on", "yes")


def enabled(environ=None) -> bool:
    """ARFUSE_VLLM=1 (or unset with ARFUSE_SOCKET set) and a socket to attach to."""
    env = os.environ if environ is None else environ
    if not env.get("ARFUSE_SOCKET"):
        return False
    flag = env.get("ARFUSE_VLLM")
    return True if flag is None or flag.strip() == "" else _truthy(flag)


def vllm_version() -> str:
    try:
        from importlib.metadata import version
        return version("vllm")
    except Exception:
        try:
            return importlib.import_module("vllm").__version__
        except Exception:
            return "unknown"


def _resolve(module, path):
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_layout():
    """[] when vLLM's modules have every name this integration relies on; else what is
    missing, one string each."""
    missing = []
    for module_name, path, kind in LAYOUT:
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # any import failure means this layout is not served
            missing.append(f"{module_name} ({type(e).__name__}: {e})")
            continue
        try:
            obj = _resolve(module, path)
        except AttributeError:
            missing.append(f"{module_name}.{path}")
            continue
        if kind.startswith("names:"):
            name = kind.split(":", 1)[1]
            code = getattr(obj, "__code__", None)
            if code is None or name not in code.co_names:
                missing.append(f"{module_name}.{path} refers to {name}")
        if path == "DEFAULT_PLUGINS_GROUP" and obj != "vllm.general_plugins":
            missing.append(f"{module_name}.{path} == {obj!r}")
        if path.startswith("OPTIMIZATION_LEVEL_"):
            try:
                obj["compilation_config"]["pass_config"]["fuse_allreduce_rms"]
            except (KeyError, TypeError):
                missing.append(f"{module_name}.{path}[compilation_config][pass_config]"
                               "[fuse_allreduce_rms]")
    return missing


# ---- state of this process ----

class _State:
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


_state = _State()

OWN_PATH = "vLLM's own allreduce + RMSNorm"
# Each reason the fusion pass declines a site or a compile range for, logged the first time: the
# pass decides at compile time, in Python, outside the graphs it rewrites.
_declines = _decisions.FirstDeclines(logger, OWN_PATH)
_paths_logged = set()


def _declined(reason: str, detail: str) -> bool:
    """False (the site stays on vLLM's path), noting the reason the first time."""
    _declines.note(reason, detail)
    return False


def _path(level, on: bool, why: str):
    """The one line per TP rank (per distinct outcome) saying which path serves and why."""
    rank, world = _state.rank_world
    attached = "yes" if _state.ctx is not None else \
        f"no ({_state.attach_error})" if _state.attach_error else "no"
    vote = "not held" if not _state.voted else \
        "on on every TP rank" if _state.on else "off on every TP rank"
    key = (on, why, attached, vote)
    if key in _paths_logged:
        return
    _paths_logged.add(key)
    _decisions.path_line(logger, level, f"vLLM TP rank {rank}/{world}", on, OWN_PATH, attached,
                         vote, status()["patched"], why)


def status() -> dict:
    """What ran in this process: whether the group fused, why not, how many sites the pass
    replaced (summed over compile ranges and compiled models)."""
    return {"registered": _state.registered, "on": _state.on, "reason": _state.reason,
            "replaced": _state.replaced,
            "patched": [_label(o, n, had) for o, n, _, had in _state.patched],
            "declined": _declines.seen()}


def _label(owner, name, had) -> str:
    if isinstance(had, str) and had.startswith("item:"):
        return f"{had[5:]}.{name}"
    return f"{getattr(owner, '__name__', owner)}.{name}"


def _patch(owner, name, value):
    _patches.patch(_state.patched, owner, name, value)


def _patch_item(mapping, key, value, label):
    _patches.patch_item(_state.patched, mapping, key, value, label)


def unregister():
    """Undoes register() (tests)."""
    with _state.lock:
        _patches.restore(_state.patched)
        _state.registered = False


def _default_on(original):
    """fuse_allreduce_rms's default at -O2/-O3 with arfuse: on for TP > 1 on CUDA (FlashInfer
    not needed), off under VLLM_BATCH_INVARIANT (arfuse's sum is not batch-invariant either:
    the one-shot / two-shot choice depends on the token count)."""
    def enable_allreduce_rms_fusion(cfg) -> bool:
        import vllm.envs as envs
        from vllm.platforms import current_platform

        if getattr(envs, "VLLM_BATCH_INVARIANT", False):
            return False
        if cfg.parallel_config.tensor_parallel_size > 1 and current_platform.is_cuda():
            return True
        return bool(original(cfg)) if callable(original) else bool(original)
    enable_allreduce_rms_fusion.arfuse = True
    return enable_allreduce_rms_fusion


def register():
    """The vllm.general_plugins entry point (module docstring). Idempotent; vLLM may call it
    more than once per process."""
    with _state.lock:
        if _state.registered:
            return
        if not enabled():
            logger.debug("arfuse: vLLM integration off (ARFUSE_SOCKET unset or ARFUSE_VLLM=0)")
            return
        version = vllm_version()
        missing = check_layout()
        if missing:
            _state.reason = f"vLLM {version}: unknown module layout"
            logger.error("arfuse: vLLM %s has a module layout arfuse does not know (tested: "
                         "%s); fused allreduce off, vLLM's own path runs. Missing: %s",
                         version, ", ".join(TESTED_VERSIONS), "; ".join(missing))
            return
        pass_manager = importlib.import_module("vllm.compilation.passes.pass_manager")
        _patch(pass_manager, "AllReduceFusionPass", pass_class())
        vcfg = importlib.import_module("vllm.config.vllm")
        for level in ("OPTIMIZATION_LEVEL_02", "OPTIMIZATION_LEVEL_03"):
            pc = getattr(vcfg, level)["compilation_config"]["pass_config"]
            if not getattr(pc["fuse_allreduce_rms"], "arfuse", False):
                _patch_item(pc, "fuse_allreduce_rms", _default_on(pc["fuse_allreduce_rms"]),
                            level)
        _state.registered = True
        _state.reason = "registered; the pass attaches when vLLM compiles"
        logger.info("arfuse: vLLM %s (layout known; tested %s): patched %s", version,
                    ", ".join(TESTED_VERSIONS),
                    ", ".join(status()["patched"]))


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

    with _state.lock:
        if _state.voted:
            return _state.on
        rank, world = tp_group.rank_in_group, tp_group.world_size
        _state.rank_world = (rank, world)
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
            _state.client, _state.ctx = client, ctx
        except (arfuse.ArfuseError, ValueError, OSError) as e:
            local = f"TP rank {rank}: {e}"
            _state.attach_error = str(e)
            logger.warning("arfuse: in-stream attach failed: %s", local)
        # agree() counts a rank without a context as unavailable, so every rank disables its
        # own when any could not attach.
        on = aft.agree(tp_group.cpu_group, device=device)
        _state.voted, _state.on = True, on
        if not on:
            _state.reason = local or "another TP rank could not attach"
            logger.warning("arfuse: fused allreduce off on every TP rank: %s", _state.reason)
        else:
            _state.reason = ""
            logger.info("arfuse: TP rank %d of %d attached: %r", rank, world, _state.ctx)
        return on


def _reset_for_tests():
    import arfuse.torch as aft
    with _state.lock:
        ctx, _state.ctx = _state.ctx, None
        if ctx is not None:
            aft.set_context(None, "cpu" if ctx.device == "host" else None)
            try:
                ctx.detach()
            except Exception:
                pass
        if _state.client is not None:
            _state.client.close()
        _state.client = None
        _state.voted = _state.on = False
        _state.reason = "not set up"
        _state.replaced = 0
        _state.attach_error = ""
        _declines.reset()
        _paths_logged.clear()


# ---- the pass ----

_QUANT_DTYPES = None
_FP8_MAX = 448.0


def _quant_dtypes():
    global _QUANT_DTYPES
    import torch

    if _QUANT_DTYPES is None:
        _QUANT_DTYPES = {getattr(torch, n) for n in (
            "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
            "float4_e2m1fn_x2", "uint8", "int8") if hasattr(torch, n)}
    return _QUANT_DTYPES


def _quant_kind(node, depth: int = 4) -> Optional[str]:
    """The decline reason for a quantization op that `node`'s value reaches within `depth`
    users, or None when it reaches none. A quantization op is an op whose name has "quant"
    (vLLM's FP8 / NVFP4 / group quant ops, also under auto_functionalized) or a node producing
    an 8-bit or packed-4-bit tensor (a native QuantFP8: convert, multiply, clamp, convert).
    Reasons: "nvfp4" (FP4 outputs: arfuse has none), "fp8_dynamic" (dynamic per-tensor,
    per-token or per-group FP8: vLLM's AllReduceFusionPass fuses only the static per-tensor
    scale, so these sites are not the pass's), "fp8" (a static FP8 site the pass did not take:
    it says why first, under its own reason) and "quant" (any other)."""
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for user in n.users:
                names = [str(user.target)] + [str(a) for a in user.args[:1]
                                              if not hasattr(a, "users")]
                text = " ".join(names)
                val = user.meta.get("val")
                vals = val if isinstance(val, (tuple, list)) else [val]
                dtypes = {getattr(v, "dtype", None) for v in vals}
                if "fp4" in text or any("float4" in str(d) for d in dtypes):
                    return "nvfp4"
                if "static_scaled_fp8_quant" in text:
                    return "fp8"
                if "quant" in text:
                    return "fp8_dynamic" if "fp8" in text else "quant"
                if dtypes & _quant_dtypes():
                    return "fp8" if any("float8_e4m3fn" == str(d).split(".")[-1]
                                        for d in dtypes) else "quant"
                nxt.append(user)
        frontier = nxt
    return None


def _feeds_quant(node, depth: int = 4) -> bool:
    """Whether `node`'s value reaches a quantization op within `depth` users (_quant_kind)."""
    return _quant_kind(node, depth) is not None


_QUANT_DETAIL = {
    "nvfp4": "the RMSNorm's output feeds an NVFP4 quantization (arfuse has no FP4 outputs)",
    "fp8_dynamic": "the RMSNorm's output feeds a dynamic FP8 quantization (vLLM's "
                   "AllReduceFusionPass fuses the static per-tensor scale only)",
    "fp8": "the RMSNorm's output feeds a static FP8 quantization that arfuse's FP8 op does not "
           "take here (the first decline with a reason beginning \"fp8_\" says why)",
    "quant": "the RMSNorm's output feeds a quantization op arfuse does not serve",
}


def _name(node) -> str:
    return str(getattr(node, "target", ""))


def _is_cast(node) -> bool:
    return getattr(node, "op", None) == "call_function" and \
        _name(node) in ("aten._to_copy.default", "prims.convert_element_type.default",
                        "aten.to.dtype", "aten._to_copy")


def _val(node):
    return node.meta.get("val") if hasattr(node, "meta") else None


def _single_user(node, user) -> bool:
    return list(node.users) == [user]


def _native_static_fp8(q):
    """(norm value, scale, the chain's nodes from q back) when q is vLLM's QuantFP8 static
    per-tensor in its native form: cast(clamp(cast(x, fp32) * reciprocal(scale), -448, 448),
    fp8) (clamp possibly as clamp_min + clamp_max); else None."""
    import torch

    chain = [q]
    node = q.args[0] if q.args else None
    lo = hi = None
    while hasattr(node, "target") and _name(node).startswith(("aten.clamp", "prims.clamp")):
        name = _name(node)
        args = list(node.args[1:]) + [node.kwargs.get("min"), node.kwargs.get("max")]
        if name.startswith("aten.clamp_min"):
            lo = args[0]
        elif name.startswith("aten.clamp_max"):
            hi = args[0]
        else:
            lo, hi = (args[0] if len(node.args) > 1 else node.kwargs.get("min")), \
                (args[1] if len(node.args) > 2 else node.kwargs.get("max"))
        if not _single_user(node, chain[-1]):
            return None
        chain.append(node)
        node = node.args[0]
    if lo is None or hi is None or float(lo) != -_FP8_MAX or float(hi) != _FP8_MAX:
        return None
    if _name(node) != "aten.mul.Tensor" or not _single_user(node, chain[-1]):
        return None
    chain.append(node)
    a, b = node.args[:2]
    if _name(a) == "aten.reciprocal.default":
        a, b = b, a
    if _name(b) != "aten.reciprocal.default" or not _single_user(b, node) or not _is_cast(a) \
            or not _single_user(a, node):
        return None
    av = _val(a)
    if av is None or av.dtype != torch.float32:
        return None
    chain += [b, a]
    return a.args[0], b.args[0], chain


def _custom_static_fp8(node):
    """(norm value, scale, the nodes to remove, the fp8 output node) when node is
    auto_functionalized(_C.static_scaled_fp8_quant, result=, input=, scale=[, group_shape=])
    with a per-tensor group shape (absent, None or (-1, -1)); else None."""
    if getattr(node, "op", None) != "call_function" or not node.args or \
            "static_scaled_fp8_quant" not in str(node.args[0]) or \
            "auto_functionalized" not in _name(node):
        return None
    shape = node.kwargs.get("group_shape")
    if shape is not None and any(int(s) != -1 for s in shape):
        return None
    items = [u for u in node.users if u.target is operator.getitem]
    outs = [u for u in items if u.args[1] == 1]
    # Only the codes are used (an unused getitem 0, the op's return, may still be there).
    if len(items) != len(node.users) or len(outs) != 1 or \
            any(u.users for u in items if u.args[1] != 1):
        return None
    result = node.kwargs.get("result")
    return node.kwargs.get("input"), node.kwargs.get("scale"), \
        [u for u in items if u is not outs[0]] + [outs[0], node] + (
            [result] if hasattr(result, "users") and len(result.users) == 1 else []), outs[0]


_PASS_CLASS = None


def pass_class():
    """ArfuseAllReduceFusionPass (a vLLM VllmPatternMatcherPass; built on first use so this
    module imports without vLLM or torch)."""
    global _PASS_CLASS
    if _PASS_CLASS is not None:
        return _PASS_CLASS

    import torch
    import torch._inductor.pattern_matcher as pm
    from torch._inductor.pattern_matcher import PatternMatcherPass

    import vllm.ir.ops
    from vllm.compilation.passes import inductor_pass as ip
    from vllm.compilation.passes.vllm_inductor_pass import (VllmInductorPass,
                                                            VllmPatternMatcherPass)
    from vllm.distributed import parallel_state as ps

    import arfuse.torch as aft
    from arfuse import instream

    ir_rms = torch.ops.vllm_ir.rms_norm.default
    ir_add_rms = torch.ops.vllm_ir.fused_add_rms_norm.default

    class ArfuseAllReduceFusionPass(VllmPatternMatcherPass):
        """allreduce + (fused add) RMSNorm -> torch.ops.arfuse.fused_allreduce_residual_rmsnorm
        within arfuse's fused range (module docstring of arfuse.integrations.vllm)."""

        def __init__(self, config) -> None:
            super().__init__(config)
            self.pass_name = "arfuse_allreduce_fusion_pass"
            self.disabled = True
            self.max_token_num = 0
            self.range_end = None
            self.tp_size = ps.get_tensor_model_parallel_world_size()
            if self.tp_size <= 1:
                logger.info("arfuse: allreduce fusion pass off for TP size %d", self.tp_size)
                _path(logging.INFO, False, f"TP size {self.tp_size}: nothing to reduce")
                return
            if config.model_config is None:
                logger.warning("arfuse: allreduce fusion pass off: no model_config")
                return
            hidden = config.model_config.get_hidden_size()
            hiddens = [hidden]
            spec = config.speculative_config
            draft = getattr(spec, "draft_model_config", None) if spec else None
            if draft is not None and draft.get_hidden_size() not in hiddens:
                hiddens.append(draft.get_hidden_size())
            self.hiddens = hiddens
            tp = ps.get_tp_group()
            self.group_name = tp.unique_name
            if not attach_and_vote(hiddens, tp, device=self.device):
                _path(logging.WARNING, False, _state.reason)
                return
            if aft.dtype_name(self.model_dtype) is None:
                logger.warning("arfuse: allreduce fusion pass off: model dtype %s not served",
                               self.model_dtype)
                _path(logging.WARNING, False, f"model dtype {self.model_dtype} not served")
                return
            self.max_token_num = min(aft.max_fused_tokens(h, self.model_dtype)
                                     for h in hiddens)
            max_batched = config.scheduler_config.max_num_batched_tokens
            if max_batched is not None:
                self.max_token_num = min(self.max_token_num, max_batched)
            if self.max_token_num <= 0:
                logger.warning("arfuse: allreduce fusion pass off: hidden %s in %s has no "
                               "fused range", hiddens, self.model_dtype)
                _path(logging.WARNING, False,
                      f"hidden {hiddens} in {self.model_dtype} has no fused range")
                return
            self._add_compile_range_endpoint(config, max_batched)
            aft.register_ops()
            self.patterns = PatternMatcherPass(pass_name=self.pass_name)
            self.register_patterns()
            self.disabled = False
            logger.info("arfuse: allreduce fusion pass on: hidden %s %s, compile ranges up to "
                        "%d tokens (TP %d)", hiddens, self.model_dtype, self.max_token_num,
                        self.tp_size)
            _path(logging.INFO, True,
                  f"fusion pass on: hidden {hiddens} {self.model_dtype}, compile ranges up to "
                  f"{self.max_token_num} tokens; sites outside it run {OWN_PATH}")

        def _add_compile_range_endpoint(self, config, max_batched):
            """vLLM compiles each compile range separately and the pass applies to a range
            only when its end is within the fused range: give arfuse's end its own range.
            vLLM's PiecewiseBackend reads the endpoints after the pass manager is
            configured."""
            cc = config.compilation_config
            ends = list(cc.compile_ranges_endpoints or [])
            m = self.max_token_num
            if m > 1 and (max_batched is None or m < max_batched) and m not in ends:
                cc.compile_ranges_endpoints = sorted(ends + [m])

        def _check(self, match) -> bool:
            """Input, residual and weight of one served dtype; the norm's output feeds no
            quantization op; the hidden size attached with a fused range covering this
            compile range."""
            for node in match.nodes:
                # rms_norm(x, weight, epsilon, variance_size=None); fused_add_rms_norm(x,
                # x_residual, weight, epsilon, variance_size=None): variance_size's position.
                if node.target == ir_rms:
                    x, residual, weight = node.args[0], None, node.args[1]
                    vs = 3
                elif node.target == ir_add_rms:
                    x, residual, weight = node.args[0], node.args[1], node.args[2]
                    vs = 4
                else:
                    continue
                if len(node.args) > vs and node.args[vs] is not None or \
                        node.kwargs.get("variance_size") is not None:
                    return _declined("shape", "an RMSNorm over part of the hidden size "
                                     "(variance_size)")
                vals = [a.meta.get("val") if hasattr(a, "meta") else None
                        for a in (x, residual, weight) if a is not None]
                if any(v is None for v in vals) or len({v.dtype for v in vals}) != 1:
                    return _declined("dtype", "input, residual and weight of different "
                                     "dtypes (or unknown)")
                if aft.dtype_name(vals[0].dtype) is None:
                    return _declined("dtype", f"dtype {vals[0].dtype} is not served")
                hidden = int(vals[0].shape[-1])
                end = self.range_end if self.range_end is not None else self.max_token_num
                if aft.max_fused_tokens(hidden, vals[0].dtype) < end:
                    return _declined("range", f"hidden {hidden} {vals[0].dtype}: fused "
                                     f"range below the compile range's end {end}")
                norm_nodes = [node] if node.target == ir_rms else \
                    [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
                kinds = [k for k in (_quant_kind(n) for n in norm_nodes) if k is not None]
                if kinds:
                    return _declined(kinds[0], _QUANT_DETAIL[kinds[0]])
            return True

        def _fp8_sites(self, graph) -> int:
            """Replaces vLLM's static per-tensor FP8 sites (its AllReduceFusionPass's
            AllReduceFused[Add]RMSNormStaticQuantFP8Pattern: all_reduce, then rms_norm or
            fused_add_rms_norm, then the norm's output quantized to FP8 E4M3 with a static
            fp32 scale, as _C.static_scaled_fp8_quant under auto_functionalized or QuantFP8's
            native form) by torch.ops.arfuse.fused_allreduce_residual_rmsnorm_fp8 with quant
            static. A graph walk, not a registered pattern: the quant op's arguments differ
            between vLLM releases (group_shape present or not) and its custom op exists only
            with vLLM's CUDA extension. Both ops take the scale itself (q = x * (1 / scale));
            arfuse quantizes the fp32 normalized value, vLLM the norm output rounded to the
            model dtype, so a code may differ by one E4M3 step. Returns the sites replaced."""
            fp8 = getattr(torch, "float8_e4m3fn", None)
            if fp8 is None:
                return 0
            sites = []
            for node in graph.nodes:
                found = _custom_static_fp8(node)
                if found is not None:
                    value, scale, chain, out = found
                elif _is_cast(node) and getattr(_val(node), "dtype", None) == fp8:
                    native = _native_static_fp8(node)
                    if native is None:
                        continue
                    (value, scale, chain), out = native, node
                else:
                    continue
                site = self._fp8_site(value, scale)
                if site:  # None or False (declined, noted)
                    sites.append((site, scale, chain, out))
            for (norm, ar, residual, weight, eps, res_out), scale, chain, out in sites:
                self._replace_fp8(graph, norm, ar, residual, weight, eps, res_out, scale, chain,
                                  out)
            return len(sites)

        def _fp8_site(self, value, scale):
            """(norm node, all_reduce node, residual or None, weight, eps, the residual-out
            node or None) when `value` is the output of an RMSNorm of an all_reduce of this TP
            group that arfuse's static FP8 op serves; else None, noting why."""
            if not hasattr(value, "target"):
                return None
            if value.target == ir_rms:
                norm, ar, residual, weight = value, value.args[0], None, value.args[1]
                res_out = None
            elif value.target is operator.getitem and value.args[1] == 0 and \
                    getattr(value.args[0], "target", None) == ir_add_rms:
                norm = value.args[0]
                ar, residual, weight = norm.args[0], norm.args[1], norm.args[2]
                outs = [u for u in norm.users if u.target is operator.getitem]
                if len(outs) != len(norm.users):
                    return None
                res_out = next((u for u in outs if u.args[1] == 1), None)
            else:
                return None
            if getattr(ar, "target", None) != torch.ops.vllm.all_reduce.default:
                return None
            group = ar.kwargs.get("group_name", ar.args[1] if len(ar.args) > 1 else None)
            if group != self.group_name:
                return None
            # rms_norm(x, weight, epsilon, variance_size=None); fused_add_rms_norm(x,
            # x_residual, weight, epsilon, variance_size=None).
            first = 2 if residual is None else 3
            eps = norm.args[first] if len(norm.args) > first else norm.kwargs.get("epsilon")
            if len(norm.args) > first + 1 and norm.args[first + 1] is not None or \
                    norm.kwargs.get("variance_size") is not None:
                return _declined("fp8_shape", "a static FP8 site whose RMSNorm covers part of "
                                 "the hidden size (variance_size)")
            if not _single_user(value, next(iter(value.users), None)):
                return _declined("fp8_norm_used", "a static FP8 site whose RMSNorm output is "
                                 "also used unquantized (arfuse's FP8 op writes the codes only)")
            if residual is not None and len(ar.users) != 1:
                return _declined("fp8_allreduce_used", "a static FP8 site whose allreduce "
                                 "result is used besides the add-RMSNorm")
            if weight is None or eps is None:
                return _declined("fp8_shape", "a static FP8 site whose RMSNorm has no weight")
            vals = [_val(a) for a in (ar.args[0], residual, weight) if a is not None]
            sv = _val(scale)
            if any(v is None for v in vals) or len({v.dtype for v in vals}) != 1:
                return _declined("fp8_dtype", "a static FP8 site with input, residual and "
                                 "weight of different dtypes (or unknown)")
            dtype = vals[0].dtype
            if dtype not in (torch.bfloat16, torch.float16):
                return _declined("fp8_dtype", f"a static FP8 site in {dtype} (arfuse's FP8 "
                                 "patterns take bf16 or fp16 input)")
            if sv is None or sv.dtype != torch.float32 or sv.numel() != 1 or \
                    sv.device != vals[0].device:
                return _declined("fp8_scale", "a static FP8 site whose scale is not one fp32 "
                                 "value on the input's device")
            hidden = int(vals[0].shape[-1])
            end = self.range_end if self.range_end is not None else self.max_token_num
            ctx = aft.get_context(vals[0].device)
            fused = 0 if ctx is None else ctx.max_fused_tokens(
                hidden, aft.dtype_name(dtype), instream.PATTERN_FP8_STATIC)
            if fused < end:
                return _declined("fp8_range", f"static FP8 at hidden {hidden} {dtype}: fused "
                                 f"range {fused} below the compile range's end {end}")
            return norm, ar, residual, weight, eps, res_out

        def _replace_fp8(self, graph, norm, ar, residual, weight, eps, res_out, scale, chain,
                         out):
            x = ar.args[0]
            fake = torch._guards.detect_fake_mode([_val(x)])
            ctx = fake if fake is not None else contextlib.nullcontext()
            with graph.inserting_before(out):
                if residual is None:
                    residual = graph.call_function(torch.ops.aten.zeros_like.default, (x,))
                    with ctx:
                        residual.meta["val"] = torch.zeros_like(_val(x))
                fused = graph.call_function(
                    torch.ops.arfuse.fused_allreduce_residual_rmsnorm_fp8.default,
                    (x, residual, weight, float(eps), instream.QUANTS["static"], 0, scale))
                with ctx:
                    fused.meta["val"] = torch.ops.arfuse.fused_allreduce_residual_rmsnorm_fp8(
                        _val(x), _val(residual), _val(weight), float(eps),
                        instream.QUANTS["static"], 0, _val(scale))
                codes = graph.call_function(operator.getitem, (fused, 0))
                codes.meta["val"] = fused.meta["val"][0]
                res = graph.call_function(operator.getitem, (fused, 1))
                res.meta["val"] = fused.meta["val"][1]
            out.replace_all_uses_with(codes)
            # The residual stream: the add-RMSNorm's residual output, or (first layer, a zero
            # residual) the allreduce result itself, which residual_out equals bit for bit.
            (res_out if res_out is not None else ar).replace_all_uses_with(res)
            # vLLM's quant, norm and allreduce nodes of the site, now unused, users first.
            for node in chain + [u for u in list(norm.users) if u.target is operator.getitem] + \
                    [norm, ar]:
                if node.op != "placeholder" and not node.users:
                    graph.erase_node(node)

        @staticmethod
        def _functions(group_name, eps):
            """The patterns as vLLM's models trace them (its GroupCoordinator.all_reduce
            calls torch.ops.vllm.all_reduce with the group's unique name; its norms are
            vllm.ir.ops), and arfuse's replacements. Parameters are pattern inputs only."""
            def add_pattern(residual, input, weight):
                ar = torch.ops.vllm.all_reduce(input, group_name=group_name)
                norm, res = vllm.ir.ops.fused_add_rms_norm(ar, residual, weight, eps)
                return norm, res

            def add_replacement(residual, input, weight):
                out = torch.ops.arfuse.fused_allreduce_residual_rmsnorm(
                    input, residual, weight, eps)
                return out[0], out[1]

            def rms_pattern(input, weight):
                ar = torch.ops.vllm.all_reduce(input, group_name=group_name)
                return vllm.ir.ops.rms_norm(ar, weight, eps), ar

            def rms_replacement(input, weight):
                out = torch.ops.arfuse.fused_allreduce_residual_rmsnorm(
                    input, torch.zeros_like(input), weight, eps)
                return out[0], out[1]

            return add_pattern, add_replacement, rms_pattern, rms_replacement

        @staticmethod
        def _first_only(fn):
            def first(residual, input, weight):
                return fn(residual, input, weight)[0]
            return first

        @ip.enable_fake_mode
        def register_patterns(self) -> None:
            group_name = self.group_name
            dtype, device = self.model_dtype, self.device

            def empty(*shape):
                return torch.empty(*shape, dtype=dtype, device=device)

            for eps in EPSILONS:
                add_pattern, add_replacement, rms_pattern, rms_replacement = \
                    self._functions(group_name, eps)
                add_inputs = [empty(5, 16), empty(5, 16), empty(16)]
                pm.register_replacement(add_pattern, add_replacement, add_inputs, pm.fwd_only,
                                        self.patterns, extra_check=self._check)
                # The residual output unused (the last layer's norm).
                pm.register_replacement(
                    self._first_only(add_pattern), self._first_only(add_replacement),
                    add_inputs, pm.fwd_only, self.patterns, extra_check=self._check)
                pm.register_replacement(rms_pattern, rms_replacement,
                                        [empty(5, 16), empty(16)], pm.fwd_only, self.patterns,
                                        extra_check=self._check)
                # Allow the same patterns again with the next epsilon (as vLLM's pass does).
                torch._inductor.pattern_matcher._seen_patterns.clear()

        def is_applicable_for_range(self, compile_range) -> bool:
            if self.disabled:
                return False
            if compile_range.end <= self.max_token_num:
                return True
            _declines.note("range", f"compile ranges ending above {self.max_token_num} tokens "
                           "(the fused range)")
            return False

        def uuid(self) -> str:
            return ip.InductorPass.hash_dict({
                "source": ip.InductorPass.hash_source(self),
                "max_token_num": self.max_token_num, "disabled": self.disabled})

        @VllmInductorPass.time_and_log
        def __call__(self, graph) -> None:
            if self.disabled:
                return
            try:
                self.range_end = ip.get_pass_context().compile_range.end
            except Exception:  # no pass context: outside vLLM's backend (tests)
                self.range_end = None
            fp8 = self._fp8_sites(graph)
            self.matched_count = fp8 + self.patterns.apply(graph)
            _state.replaced += self.matched_count
            VllmPatternMatcherPass.match_table[self.pass_name] += self.matched_count
            logger.info("arfuse: compile range ending at %s: %d allreduce + RMSNorm sites on "
                        "arfuse (%d of them with static FP8 outputs)", self.range_end,
                        self.matched_count, fp8)

    _PASS_CLASS = ArfuseAllReduceFusionPass
    return _PASS_CLASS
