"""arfuse.torch: the in-stream plane as torch ops, on the current stream.

    import arfuse, arfuse.torch as aft
    client = arfuse.Client("/run/arfuse/rank0.sock")
    aft.attach(client, [hidden])                  # once per process and GPU, before capture
    norm, res = aft.fused_allreduce_residual_rmsnorm(x, residual, weight, eps)
    if norm is None:                              # not served fused: the framework's own path
        x = tensor_model_parallel_all_reduce(x); norm, res = fused_add_rmsnorm(x, residual, ...)

fused_allreduce_residual_rmsnorm returns (norm_out, residual_out) like SGLang's
flashinfer_allreduce_residual_rmsnorm, or (None, None) when this op is not served fused: no
context attached for the tensor's device, a shape / hidden / dtype outside what the sidecar
serves fused, non-contiguous tensors, a weight of another dtype, or a context drained by its
sidecar. Each of these is decided alike on every rank (the same shapes, the same sidecar
decisions), so every rank takes the same path. A context whose workspace failed (poisoned,
re-initialized, its sidecar gone) raises arfuse.instream.Unavailable instead: falling back on
one rank while its peers' kernels wait for it is the hang this project exists to avoid; re-attach
(reattach()) and capture graphs again.

The ops underneath are registered with torch.library, so torch.compile traces them (fake
implementations) and CUDA graphs capture them (one kernel launch each, on
torch.cuda.current_stream()):

    torch.ops.arfuse.fused_allreduce_residual_rmsnorm(input, residual, weight, eps)
        -> (norm_out, residual_out)                     mutates nothing; fresh outputs
    torch.ops.arfuse.fused_allreduce_residual_rmsnorm_(input, residual, weight, eps, norm_out)
        -> ()                                           residual updated in place, norm_out set
    torch.ops.arfuse.fused_allreduce(input) -> output   mutates nothing
    torch.ops.arfuse.allreduce_residual_rmsnorm(input, residual, weight, eps)
        -> (norm_out, residual_out)                     any token count: consecutive chunks of
                                                        at most max_fused_tokens() rows, one
                                                        fused launch each (what framework
                                                        integrations call)
    torch.ops.arfuse.fused_allreduce_residual_rmsnorm_fp8(input, residual, weight, eps, quant,
                                                          scale_layout, static_scale)
        -> (quant_out, residual_out, scale)             FP8 E4M3 codes of the normalized value
                                                        (torch.float8_e4m3fn), fresh outputs;
                                                        quant 1 static (static_scale: fp32 [1]
                                                        read, scale an empty tensor), 2 per
                                                        token (scale fp32 [tokens, 1]), 3 per
                                                        group of 128 (scale_layout 1 fp32
                                                        [tokens, G], 2 the same with strides
                                                        [1, A], 3 int32 UE8M0 [tokens, G/4]
                                                        with strides [1, A]; A = tokens rounded
                                                        up to 4)

Called directly they raise Unavailable for an op not served fused: under torch.compile decide
eligibility before compiling (max_fused_tokens() for the token range, as vLLM's fusion pass
gates on its range), so nothing is decided inside the compiled graph. In host mode (a sidecar
with --device=host) the tensors are CPU tensors and the ops run the CPU implementation.

torch is imported when a function of this module is first called, not at import.
"""
import threading
from typing import Optional, Tuple

from . import instream

_contexts = {}
_lock = threading.Lock()
_ops_registered = False
_library = None  # the torch.library.Library of older torch (kept alive)

# Unavailable states that mean the workspace failed, not "not served": raise.
FAULTS = ("sidecar gone", "poisoned", "reinitialized", "client closed")


def _torch():
    import torch
    return torch


_DTYPE_NAMES = {}


def dtype_name(dtype) -> Optional[str]:
    """"bf16", "fp16", "fp32" for a torch dtype; None for any other."""
    if not _DTYPE_NAMES:
        torch = _torch()
        _DTYPE_NAMES.update({torch.bfloat16: "bf16", torch.float16: "fp16",
                             torch.float32: "fp32"})
    return _DTYPE_NAMES.get(dtype)


def _key(device) -> object:
    """Context registry key of a torch device: "cpu" (host mode) or a CUDA device index."""
    torch = _torch()
    device = torch.device(device) if not isinstance(device, torch.device) else device
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return device.index if device.index is not None else torch.cuda.current_device()
    return str(device)


# ---- contexts ----

def set_context(ctx: Optional["instream.InStreamContext"], device=None):
    """Serves ops on `device`'s tensors with `ctx` (None: stop). Default device: "cpu" for a
    host-mode context, else the current CUDA device."""
    if device is None:
        device = "cpu" if ctx is not None and ctx.device == "host" else _default_cuda()
    with _lock:
        if ctx is None:
            _contexts.pop(_key(device), None)
        else:
            _contexts[_key(device)] = ctx
    register_ops()


def _default_cuda():
    torch = _torch()
    return torch.device("cuda", torch.cuda.current_device())


def get_context(device=None) -> Optional["instream.InStreamContext"]:
    # Reads take no lock: set_context() swaps entries under _lock, and a dict read is atomic in
    # CPython. The ops' real implementations call this on every launch.
    if device is None:
        values = list(_contexts.values())
        if len(values) == 1:
            return values[0]
        device = _default_cuda()
    return _contexts.get(_key(device))


def attach(client, hiddens=None, device=None, **kwargs) -> "instream.InStreamContext":
    """client.attach(hiddens) and set_context() for `device`: ops on its tensors go through it."""
    ctx = client.attach(hiddens, **kwargs)
    set_context(ctx, device)
    return ctx


def reattach(device=None, **kwargs) -> "instream.InStreamContext":
    """instream.reattach() of `device`'s context, served from then on (destroy graphs that
    captured the old context's launches first)."""
    ctx = get_context(device)
    if ctx is None:
        raise instream.InStreamError(instream.FAILED_PRECONDITION,
                                     "no in-stream context to re-attach")
    new = instream.reattach(ctx, **kwargs)
    set_context(new, device if device is not None else
                ("cpu" if new.device == "host" else None))
    return new


def detach(device=None):
    ctx = get_context(device)
    if ctx is not None:
        set_context(None, device if device is not None else
                    ("cpu" if ctx.device == "host" else None))
        ctx.detach()


def max_fused_tokens(hidden: int, dtype, device=None) -> int:
    """Largest token count served fused for this hidden size and torch dtype (0: none)."""
    ctx = get_context(device)
    name = dtype_name(dtype) if not isinstance(dtype, str) else dtype
    if ctx is None or name is None:
        return 0
    return ctx.max_fused_tokens(hidden, name)


# ---- eligibility ----

def why_not(input, residual=None, weight=None, pattern: Optional[int] = None) -> Optional[str]:
    """None when fused_allreduce_residual_rmsnorm(input, residual, weight) would run fused;
    else why not (the same answer on every rank for the same shapes and sidecar state). With
    residual and weight None: the allreduce-only op. `pattern` (instream.PATTERN_FP8_*): the FP8
    op's answer instead."""
    try:
        return _why_not(input, residual, weight, pattern)
    except instream.Unavailable as e:
        return e.message


def _why_not(input, residual, weight, pattern: Optional[int] = None) -> Optional[str]:
    """As why_not, but raises Unavailable when the context's workspace failed (FAULTS)."""
    ctx = get_context(input.device)
    if ctx is None:
        return f"no in-stream context attached for {input.device}"
    ctx.poll()
    if ctx.disabled in FAULTS:
        raise instream.Unavailable(instream.UNAVAILABLE, ctx.disabled_reason, ctx.disabled)
    if ctx.disabled:
        return ctx.disabled_reason
    name = dtype_name(input.dtype)
    if name is None:
        return f"dtype {input.dtype} is not served (bf16, fp16, fp32)"
    if input.dim() < 2:
        return "input must be [tokens, hidden]"
    hidden = int(input.shape[-1])
    tensors = [("input", input)]
    if residual is not None:
        if tuple(residual.shape) != tuple(input.shape):
            return f"residual {tuple(residual.shape)} differs from input {tuple(input.shape)}"
        if weight is None or tuple(weight.shape) != (hidden,):
            return f"weight must be [{hidden}]"
        if residual.dtype != input.dtype or weight.dtype != input.dtype:
            return (f"dtypes differ (input {input.dtype}, residual {residual.dtype}, weight "
                    f"{weight.dtype})")
        tensors += [("residual", residual), ("weight", weight)]
    for label, t in tensors:
        if t.device != input.device:
            return f"{label} is on {t.device}, input on {input.device}"
        if not t.is_contiguous():
            return f"{label} is not contiguous"
    tokens = input.numel() // hidden if hidden else 0
    if pattern is None:
        pattern = (instream.PATTERN_ALLREDUCE_RESIDUAL_RMSNORM if residual is not None
                   else instream.PATTERN_ALLREDUCE)
    return ctx.why_not(tokens, hidden, name, pattern)


# ---- the ops ----

def _launch(input, residual_in, residual_out, norm_out, weight, eps: float):
    torch = _torch()
    ctx = get_context(input.device)
    if ctx is None:
        raise instream.Unavailable(instream.UNAVAILABLE,
                                   f"no in-stream context attached for {input.device}")
    stream = None if input.device.type == "cpu" else \
        torch.cuda.current_stream(input.device).cuda_stream
    hidden = int(input.shape[-1])
    tokens = input.numel() // hidden if hidden else 0
    name = dtype_name(input.dtype)
    if name is None:
        raise instream.Unavailable(instream.OUT_OF_RANGE, f"dtype {input.dtype} is not served")
    if residual_in is None:
        ctx.fused_allreduce(stream, input.data_ptr(), norm_out.data_ptr(), tokens, hidden, name)
    else:
        ctx.fused_allreduce_residual_rmsnorm(stream, input.data_ptr(), residual_in.data_ptr(),
                                             residual_out.data_ptr(), norm_out.data_ptr(),
                                             weight.data_ptr(), tokens, hidden, name, eps)


def _functional(input, residual, weight, eps):
    torch = _torch()
    norm_out = torch.empty_like(input)
    residual_out = torch.empty_like(residual)
    _launch(input, residual, residual_out, norm_out, weight, float(eps))
    return norm_out, residual_out


def _in_place(input, residual, weight, eps, norm_out):
    _launch(input, residual, residual, norm_out, weight, float(eps))


def _stream_of(input) -> Optional[int]:
    if input.device.type == "cpu":
        return None
    return _torch().cuda.current_stream(input.device).cuda_stream


def _served_tokens(ctx, hidden: int, name: str, pattern: int, what: str) -> int:
    per_launch = ctx.max_fused_tokens(hidden, name, pattern)
    if per_launch <= 0:
        ctx.poll()
        if ctx.disabled:
            raise instream.Unavailable(instream.UNAVAILABLE, ctx.disabled_reason, ctx.disabled)
        raise instream.Unavailable(instream.OUT_OF_RANGE,
                                   f"{what} is not served at hidden {hidden} {name}")
    return per_launch


def _served_rows(input):
    """The attached context of input's device, its dtype's name and its [tokens, hidden] shape;
    instream.Unavailable when no context is attached or the dtype is not served."""
    ctx = get_context(input.device)
    if ctx is None:
        raise instream.Unavailable(instream.UNAVAILABLE,
                                   f"no in-stream context attached for {input.device}")
    name = dtype_name(input.dtype)
    if name is None:
        raise instream.Unavailable(instream.OUT_OF_RANGE, f"dtype {input.dtype} is not served")
    hidden = int(input.shape[-1])
    tokens = input.numel() // hidden if hidden else 0
    return ctx, name, tokens, hidden


def _chunked(input, residual, weight, eps):
    """allreduce + residual add + RMSNorm over any number of tokens: consecutive chunks of at
    most max_fused_tokens() rows, one fused launch each. Exact: the allreduce is elementwise and
    RMSNorm works per row, and every rank cuts the same chunks from the same shapes. With a
    residual or weight of another dtype than the input, the allreduce runs fused in the input's
    dtype (chunked alike) and the add and norm run here in fp32, as RMSNorm's reference does."""
    torch = _torch()
    ctx, name, tokens, hidden = _served_rows(input)
    x = input.reshape(tokens, hidden)
    r = residual.reshape(tokens, hidden)
    stream = _stream_of(input)
    norm_out = torch.empty_like(x)
    residual_out = torch.empty_like(r)
    same = residual.dtype == input.dtype and weight.dtype == input.dtype
    if same:
        step = _served_tokens(ctx, hidden, name, instream.PATTERN_ALLREDUCE_RESIDUAL_RMSNORM,
                              "allreduce + residual + RMSNorm")
        for s in range(0, tokens, step):
            e = min(tokens, s + step)
            ctx.fused_allreduce_residual_rmsnorm(
                stream, x[s:e].data_ptr(), r[s:e].data_ptr(), residual_out[s:e].data_ptr(),
                norm_out[s:e].data_ptr(), weight.data_ptr(), e - s, hidden, name, float(eps))
    else:
        step = _served_tokens(ctx, hidden, name, instream.PATTERN_ALLREDUCE, "allreduce")
        reduced = torch.empty_like(x)
        for s in range(0, tokens, step):
            e = min(tokens, s + step)
            ctx.fused_allreduce(stream, x[s:e].data_ptr(), reduced[s:e].data_ptr(), e - s,
                                hidden, name)
        total = reduced.float() + r.float()
        residual_out.copy_(total)
        var = total.pow(2).mean(dim=-1, keepdim=True)
        norm_out.copy_(total * torch.rsqrt(var + float(eps)) * weight.float())
    return norm_out.view(input.shape), residual_out.view(residual.shape)


def _allreduce(input):
    torch = _torch()
    out = torch.empty_like(input)
    _launch(input, None, None, out, None, 0.0)
    return out


def _fp8_dtype():
    torch = _torch()
    return getattr(torch, "float8_e4m3fn", torch.uint8)


def _fp8_outputs(input, quant: int, scale_layout: int):
    """The FP8 op's fresh codes and scale tensor (real and fake alike: the scale's shape and
    strides are the layout's, instream.fp8_scale_tensor)."""
    torch = _torch()
    hidden = int(input.shape[-1])
    tokens = input.numel() // hidden if hidden else 0
    quant_out = torch.empty(tuple(input.shape), dtype=_fp8_dtype(), device=input.device)
    if quant == instream.QUANTS["static"]:
        scale = torch.empty((0,), dtype=torch.float32, device=input.device)
    else:
        shape, strides, kind = instream.fp8_scale_tensor(quant, tokens, hidden, scale_layout)
        scale = torch.empty_strided(shape, strides, dtype=getattr(torch, kind),
                                    device=input.device)
    return quant_out, scale


def _fp8_functional(input, residual, weight, eps, quant, scale_layout, static_scale):
    torch = _torch()
    ctx, name, tokens, hidden = _served_rows(input)
    quant_out, scale = _fp8_outputs(input, int(quant), int(scale_layout))
    residual_out = torch.empty_like(residual)
    static = int(quant) == instream.QUANTS["static"]
    scale_ptr = (static_scale.data_ptr() if static_scale is not None else None) if static \
        else scale.data_ptr()
    ctx.fused_allreduce_residual_rmsnorm_fp8(
        _stream_of(input), input.data_ptr(), residual.data_ptr(), residual_out.data_ptr(), None,
        quant_out.data_ptr(), scale_ptr, weight.data_ptr(), tokens, hidden, name, float(eps),
        int(quant), int(scale_layout))
    return quant_out, residual_out, scale


_SCHEMAS = {
    "fused_allreduce_residual_rmsnorm":
        ("(Tensor input, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
         (), _functional),
    "fused_allreduce_residual_rmsnorm_":
        ("(Tensor input, Tensor(a!) residual, Tensor weight, float eps, Tensor(b!) norm_out) "
         "-> ()", ("residual", "norm_out"), _in_place),
    "fused_allreduce": ("(Tensor input) -> Tensor", (), _allreduce),
    "allreduce_residual_rmsnorm":
        ("(Tensor input, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
         (), _chunked),
    "fused_allreduce_residual_rmsnorm_fp8":
        ("(Tensor input, Tensor residual, Tensor weight, float eps, int quant, int scale_layout, "
         "Tensor? static_scale) -> (Tensor, Tensor, Tensor)", (), _fp8_functional),
}


def _fake(name):
    def fake_functional(input, residual, weight, eps):
        return input.new_empty(input.shape), residual.new_empty(residual.shape)

    def fake_in_place(input, residual, weight, eps, norm_out):
        return None

    def fake_allreduce(input):
        return input.new_empty(input.shape)

    def fake_fp8(input, residual, weight, eps, quant, scale_layout, static_scale):
        quant_out, scale = _fp8_outputs(input, int(quant), int(scale_layout))
        return quant_out, residual.new_empty(residual.shape), scale

    return {"fused_allreduce_residual_rmsnorm": fake_functional,
            "allreduce_residual_rmsnorm": fake_functional,
            "fused_allreduce_residual_rmsnorm_": fake_in_place,
            "fused_allreduce": fake_allreduce,
            "fused_allreduce_residual_rmsnorm_fp8": fake_fp8}[name]


def register_ops():
    """Registers the torch.ops.arfuse ops (once; set_context() calls it)."""
    global _ops_registered, _library
    with _lock:
        if _ops_registered:
            return
        torch = _torch()
        if hasattr(torch.library, "custom_op"):  # torch >= 2.4
            for name, (schema, mutates, fn) in _SCHEMAS.items():
                op = torch.library.custom_op(f"arfuse::{name}", fn, mutates_args=mutates,
                                             schema=schema)
                op.register_fake(_fake(name))
        else:
            lib = torch.library.Library("arfuse", "DEF")
            register_fake = getattr(torch.library, "register_fake", None) or \
                torch.library.impl_abstract
            for name, (schema, _, fn) in _SCHEMAS.items():
                lib.define(name + schema)
                lib.impl(name, fn, "CompositeExplicitAutograd")
                register_fake(f"arfuse::{name}", _fake(name), lib=lib)
            _library = lib
        _ops_registered = True


def _fault(e: "instream.Unavailable") -> bool:
    return e.disabled in FAULTS


def fused_allreduce_residual_rmsnorm(input, residual, weight, eps: float = 1e-6
                                     ) -> Tuple[Optional[object], Optional[object]]:
    """(norm_out, residual_out): residual_out = allreduce(input) + residual, norm_out =
    rmsnorm(residual_out) * weight; fresh tensors, nothing mutated. (None, None) when this op
    is not served fused (the module docstring says when); raises Unavailable for a failed
    workspace and InStreamError for bad arguments.

    Under torch.compile nothing is decided here (the eligibility checks talk to the library):
    the graph gets torch.ops.arfuse.allreduce_residual_rmsnorm, which serves every token count
    and raises Unavailable for a shape it cannot serve. Decide eligibility before compiling."""
    torch = _torch()
    if torch.compiler.is_compiling():
        return torch.ops.arfuse.allreduce_residual_rmsnorm(input, residual, weight, float(eps))
    if _why_not(input, residual, weight) is not None:
        return None, None
    register_ops()
    try:
        return torch.ops.arfuse.fused_allreduce_residual_rmsnorm(input, residual, weight,
                                                                 float(eps))
    except instream.Unavailable as e:
        if _fault(e):
            raise
        return None, None


def fused_allreduce_residual_rmsnorm_(input, residual, weight, eps: float, norm_out) -> bool:
    """In place: residual += allreduce(input), norm_out = rmsnorm(residual) * weight. False
    (nothing written) when this op is not served fused."""
    if _why_not(input, residual, weight) is not None:
        return False
    if tuple(norm_out.shape) != tuple(input.shape) or norm_out.dtype != input.dtype or \
            not norm_out.is_contiguous() or norm_out.device != input.device:
        return False
    torch = _torch()
    register_ops()
    try:
        torch.ops.arfuse.fused_allreduce_residual_rmsnorm_(input, residual, weight, float(eps),
                                                           norm_out)
        return True
    except instream.Unavailable as e:
        if _fault(e):
            raise
        return False


def fused_allreduce_residual_rmsnorm_fp8(input, residual, weight, eps: float = 1e-6,
                                         quant="per_token", scale_layout=None,
                                         static_scale=None):
    """(quant_out, residual_out, scale): residual_out = allreduce(input) + residual and the FP8
    E4M3 codes of rmsnorm(residual_out) * weight in fp32 (torch.float8_e4m3fn), fresh tensors.
    quant: "static" (static_scale: an fp32 tensor of one element on the input's device, read;
    scale is then an empty tensor), "per_token" (scale fp32 [tokens, 1]) or "per_group" (groups
    of 128 along hidden; scale_layout "fp32_row_major", "fp32_mn_major" or "ue8m0_packed").
    (None, None, None) when not served fused (also fp32 input, a per-group hidden that is not a
    multiple of 128); raises as fused_allreduce_residual_rmsnorm. Under torch.compile the graph
    gets the op directly (no chunking): decide eligibility before compiling."""
    torch = _torch()
    q = instream.quant_code(quant)
    layout = instream.scale_layout_code(scale_layout)
    if q == instream.QUANTS["static"]:
        if static_scale is None or static_scale.numel() != 1 or \
                static_scale.dtype != torch.float32 or static_scale.device != input.device:
            raise ValueError("the static FP8 pattern needs static_scale: an fp32 tensor of one "
                             f"element on {input.device}")
    if torch.compiler.is_compiling():
        return torch.ops.arfuse.fused_allreduce_residual_rmsnorm_fp8(
            input, residual, weight, float(eps), q, layout, static_scale)
    if _why_not(input, residual, weight, instream.fp8_pattern(q)) is not None:
        return None, None, None
    register_ops()
    try:
        return torch.ops.arfuse.fused_allreduce_residual_rmsnorm_fp8(
            input, residual, weight, float(eps), q, layout, static_scale)
    except instream.Unavailable as e:
        if _fault(e):
            raise
        return None, None, None


def fused_allreduce(input):
    """allreduce(input) as a fresh tensor, or None when not served fused."""
    if _why_not(input, None, None) is not None:
        return None
    torch = _torch()
    register_ops()
    try:
        return torch.ops.arfuse.fused_allreduce(input)
    except instream.Unavailable as e:
        if _fault(e):
            raise
        return None


def check(device=None):
    """The context's check() (raises when a launch failed; answers a pending drain)."""
    ctx = get_context(device)
    if ctx is not None:
        ctx.check()


def agree(group=None, device=None) -> bool:
    """All ranks of `group` (a torch.distributed group; None: the default) agree whether the
    fused ops are served: if any rank has no usable context, every rank disables its own, so
    that none fuses while a peer runs its own path. A MAX all-reduce of an "unavailable" flag
    (as SGLang does for FlashInfer), on the CPU when the group can (gloo). Call it at the same
    point on every rank, outside capture. Returns whether the fused ops are served.

    The same all-reduce gives the group its program key (the largest of a random key per rank),
    which every rank sets on its context (InStreamContext.set_program_key): from then on the
    group's ops pair only with each other, never with a client of another program on a peer
    rank (docs/instream.md, "A client that dies mid-op")."""
    torch = _torch()
    import torch.distributed as dist

    ctx = get_context(device)
    if ctx is not None:
        # Events the session thread recorded (a drain) count in the vote, and from now on a
        # drain applies only here, so no rank skips an op its peers voted to fuse.
        ctx.poll(at_agreement=True)
    bad = 1 if ctx is None or ctx.disabled else 0
    on_cpu = dist.get_backend(group) != "nccl"
    key = instream.draw_program_key()
    flags = torch.tensor([bad, key], dtype=torch.int32,
                         device="cpu" if on_cpu else torch.device("cuda",
                                                                  torch.cuda.current_device()))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    bad, key = (int(v) for v in flags.tolist())
    if ctx is not None and not ctx.disabled:
        if bad:
            ctx.disable("another rank of the group cannot use the in-stream plane")
        else:
            ctx.set_program_key(key)
    return not bad
