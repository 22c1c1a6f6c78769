"""The static per-tensor FP8 sites of the vLLM integration's fusion pass (vllm_pass.py), found
by a walk over the post-grad FX graph, and the quantization a norm's output feeds (quant_kind:
the pass's pattern check declines those sites, naming the reason).

vLLM's AllReduceFusionPass fuses, besides the plain patterns, all_reduce + rms_norm or
fused_add_rms_norm whose output is quantized to FP8 E4M3 with a static fp32 scale
(AllReduceFused[Add]RMSNormStaticQuantFP8Pattern). replace_static_fp8_sites() puts
torch.ops.arfuse.fused_allreduce_residual_rmsnorm_fp8 (quant static) in their place. Imports
without vLLM or torch; the functions import torch when called, at compile time."""
import contextlib
import operator
from typing import Optional

from .vllm_state import declined

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


def quant_kind(node, depth: int = 4) -> Optional[str]:
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


# The decline detail logged for each quant_kind() reason.
QUANT_DETAIL = {
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



def replace_static_fp8_sites(graph, group_name, end) -> int:
    """Replaces vLLM's static per-tensor FP8 sites (its AllReduceFusionPass's
    AllReduceFused[Add]RMSNormStaticQuantFP8Pattern: all_reduce, then rms_norm or
    fused_add_rms_norm, then the norm's output quantized to FP8 E4M3 with a static fp32 scale,
    as _C.static_scaled_fp8_quant under auto_functionalized or QuantFP8's native form) by
    torch.ops.arfuse.fused_allreduce_residual_rmsnorm_fp8 with quant static. A graph walk, not a
    registered pattern: the quant op's arguments differ between vLLM releases (group_shape
    present or not) and its custom op exists only with vLLM's CUDA extension. Both ops take the
    scale itself (q = x * (1 / scale)); arfuse quantizes the fp32 normalized value, vLLM the
    norm output rounded to the model dtype, so a code may differ by one E4M3 step.
    group_name: the TP group's unique name (the all_reduce's group_name); end: the compile
    range's end, which the static FP8 pattern's fused range must cover. Returns the sites
    replaced."""
    import torch

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
        site = _fp8_site(value, scale, group_name, end)
        if site:  # None or False (declined, noted)
            sites.append((site, scale, chain, out))
    for (norm, ar, residual, weight, eps, res_out), scale, chain, out in sites:
        _replace_fp8(graph, norm, ar, residual, weight, eps, res_out, scale, chain, out)
    return len(sites)


def _fp8_site(value, scale, group_name, end):
    """(norm node, all_reduce node, residual or None, weight, eps, the residual-out node or
    None) when `value` is the output of an RMSNorm of an all_reduce of the TP group
    `group_name` that arfuse's static FP8 op serves up to `end` tokens; else None, noting
    why."""
    import torch

    import arfuse.torch as aft
    from arfuse import instream

    ir_rms = torch.ops.vllm_ir.rms_norm.default
    ir_add_rms = torch.ops.vllm_ir.fused_add_rms_norm.default
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
    if group != group_name:
        return None
    # rms_norm(x, weight, epsilon, variance_size=None); fused_add_rms_norm(x, x_residual,
    # weight, epsilon, variance_size=None).
    first = 2 if residual is None else 3
    eps = norm.args[first] if len(norm.args) > first else norm.kwargs.get("epsilon")
    if len(norm.args) > first + 1 and norm.args[first + 1] is not None or \
            norm.kwargs.get("variance_size") is not None:
        return declined("fp8_shape", "a static FP8 site whose RMSNorm covers part of the "
                        "hidden size (variance_size)")
    if not _single_user(value, next(iter(value.users), None)):
        return declined("fp8_norm_used", "a static FP8 site whose RMSNorm output is also used "
                        "unquantized (arfuse's FP8 op writes the codes only)")
    if residual is not None and len(ar.users) != 1:
        return declined("fp8_allreduce_used", "a static FP8 site whose allreduce result is "
                        "used besides the add-RMSNorm")
    if weight is None or eps is None:
        return declined("fp8_shape", "a static FP8 site whose RMSNorm has no weight")
    vals = [_val(a) for a in (ar.args[0], residual, weight) if a is not None]
    sv = _val(scale)
    if any(v is None for v in vals) or len({v.dtype for v in vals}) != 1:
        return declined("fp8_dtype", "a static FP8 site with input, residual and weight of "
                        "different dtypes (or unknown)")
    dtype = vals[0].dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return declined("fp8_dtype", f"a static FP8 site in {dtype} (arfuse's FP8 patterns "
                        "take bf16 or fp16 input)")
    if sv is None or sv.dtype != torch.float32 or sv.numel() != 1 or \
            sv.device != vals[0].device:
        return declined("fp8_scale", "a static FP8 site whose scale is not one fp32 value on "
                        "the input's device")
    hidden = int(vals[0].shape[-1])
    ctx = aft.get_context(vals[0].device)
    fused = 0 if ctx is None else ctx.max_fused_tokens(
        hidden, aft.dtype_name(dtype), instream.PATTERN_FP8_STATIC)
    if fused < end:
        return declined("fp8_range", f"static FP8 at hidden {hidden} {dtype}: fused range "
                        f"{fused} below the compile range's end {end}")
    return norm, ar, residual, weight, eps, res_out


def _replace_fp8(graph, norm, ar, residual, weight, eps, res_out, scale, chain, out):
    import torch

    from arfuse import instream

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
    # The residual stream: the add-RMSNorm's residual output, or (first layer, a zero residual)
    # the allreduce result itself, which residual_out equals bit for bit.
    (res_out if res_out is not None else ar).replace_all_uses_with(res)
    # vLLM's quant, norm and allreduce nodes of the site, now unused, users first.
    for node in chain + [u for u in list(norm.users) if u.target is operator.getitem] + \
            [norm, ar]:
        if node.op != "placeholder" and not node.users:
            graph.erase_node(node)
