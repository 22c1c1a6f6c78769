"""The FP8 output patterns' codes and scale tensors: the quant and scale-layout numbers of
arfuse_fused_allreduce_residual_rmsnorm_fp8 and the shape and strides of the scale tensor each
quant reads or writes (docs/kernels.md, "FP8 outputs"). arfuse.instream re-exports them.
"""
from .instream_abi import PATTERN_FP8_STATIC

# arfuse_fused_allreduce_residual_rmsnorm_fp8's quant (ARFUSE_QUANT_FP8_*) and the per-group
# pattern's scale layouts (ARFUSE_SCALE_*; docs/kernels.md, "FP8 outputs").
QUANTS = {"static": 1, "per_token": 2, "per_group": 3}
SCALE_LAYOUTS = {"fp32_row_major": 1, "fp32_mn_major": 2, "ue8m0_packed": 3}
FP8_GROUP_SIZE = 128


def quant_code(quant) -> int:
    """ARFUSE_QUANT_FP8_* of "static", "per_token", "per_group" (an int passes through: the
    library answers INVALID_ARGUMENT for a bad one)."""
    if isinstance(quant, int):
        return quant
    try:
        return QUANTS[quant]
    except KeyError:
        raise ValueError(f"quant {quant!r}: expected one of {sorted(QUANTS)}") from None


def scale_layout_code(layout) -> int:
    """ARFUSE_SCALE_* of a layout name; None and 0 are 0 (static and per-token scales)."""
    if layout is None:
        return 0
    if isinstance(layout, int):
        return layout
    try:
        return SCALE_LAYOUTS[layout]
    except KeyError:
        raise ValueError(f"scale layout {layout!r}: expected one of {sorted(SCALE_LAYOUTS)}") \
            from None


def fp8_pattern(quant) -> int:
    """The pattern number (PATTERN_FP8_*) of a quant."""
    return PATTERN_FP8_STATIC + quant_code(quant) - QUANTS["static"]


def tma_aligned_tokens(tokens: int) -> int:
    return (int(tokens) + 3) // 4 * 4


def fp8_scale_tensor(quant, tokens: int, hidden: int, scale_layout=None):
    """(shape, strides, element) of the scale tensor an FP8 op reads or writes, in elements of
    4 bytes: static ((1,), (1,), "float32"), per token ((tokens, 1), (1, 1), "float32"), per
    group the layout's [tokens, G] fp32 or [tokens, ceil(G / 4)] int32 tensor with its strides
    (kernels/quant/fp8_format.h: row-major, or token-contiguous columns of TmaAlignedTokens)."""
    q = quant_code(quant)
    if q == QUANTS["static"]:
        return (1,), (1,), "float32"
    if q == QUANTS["per_token"]:
        return (int(tokens), 1), (1, 1), "float32"
    groups = int(hidden) // FP8_GROUP_SIZE
    layout = scale_layout_code(scale_layout)
    if layout == SCALE_LAYOUTS["fp32_row_major"]:
        return (int(tokens), groups), (groups, 1), "float32"
    aligned = tma_aligned_tokens(tokens)
    if layout == SCALE_LAYOUTS["fp32_mn_major"]:
        return (int(tokens), groups), (1, aligned), "float32"
    return (int(tokens), (groups + 3) // 4), (1, aligned), "int32"


def fp8_scale_elements(quant, tokens: int, hidden: int, scale_layout=None) -> int:
    """Elements of 4 bytes the scale tensor spans (fp8::GroupScaleElements for per group)."""
    shape, strides, _ = fp8_scale_tensor(quant, tokens, hidden, scale_layout)
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))

