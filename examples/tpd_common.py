"""tp_decode's shared basics (no torch): paths, logging, errors, the model's geometry and the
static-tensor pool layout. Every other tp_decode module imports this one; it imports none of
them.
"""
import dataclasses
import os
import pathlib
import subprocess
import sys
from typing import Dict, Optional, Tuple

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
PKG_DIR = REPO / "client" / "python"     # the arfuse package
for _p in (str(PKG_DIR), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

PROG = "tp_decode"
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def log(msg: str, rank: Optional[int] = None, err: bool = False):
    prefix = f"{PROG}: rank {rank}: " if rank is not None else f"{PROG}: "
    print(prefix + msg, file=sys.stderr if err else sys.stdout, flush=True)


class UsageError(Exception):
    pass


class SetupError(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    eps: float
    dtype: str
    seed: int
    batch: int
    prompt_len: int
    steps: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def sites(self) -> int:
        """Fused ops per forward: after attention and after the MLP of every layer."""
        return 2 * self.layers

    @property
    def prefill_tokens(self) -> int:
        return self.batch * self.prompt_len

    @property
    def max_seq(self) -> int:
        return self.prompt_len + self.steps + 1

    @property
    def max_tokens(self) -> int:
        """Rows the pool's tensors hold: the prefill's (decode uses the first `batch`)."""
        return max(self.prefill_tokens, self.batch)


def model_config(args) -> ModelConfig:
    return ModelConfig(layers=args.layers, hidden=args.hidden, heads=args.heads,
                       kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab,
                       eps=args.eps, dtype=args.dtype, seed=args.seed, batch=args.batch,
                       prompt_len=args.prompt_len, steps=args.steps)


def site_name(cfg: ModelConfig, site: int) -> str:
    """What fused op `site` is: its allreduce input and the norm it fuses."""
    layer = site // 2
    if site % 2 == 0:
        return f"layer {layer} attention o_proj + post_attention_layernorm"
    nxt = "final norm" if layer == cfg.layers - 1 else f"layer {layer + 1} input_layernorm"
    return f"layer {layer} mlp down_proj + {nxt}"


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Byte offsets of the static tensors in the one registered buffer.

    partial  [max_tokens, hidden]  the row-parallel layer output (the allreduce input)
    residual [max_tokens, hidden]  the residual stream (residual_in = residual_out, in place)
    h        [max_tokens, hidden]  the norm output (next layer's input)
    gamma    [2*layers+1, hidden]  norm weights: in_0, post_0, in_1, post_1, ..., final;
                                   fused op `site` uses row site+1 (row 0 is local, no allreduce)
    """
    offsets: Dict[str, Tuple[int, int]]
    total: int
    hidden: int
    elem: int
    max_tokens: int

    def offset(self, name: str) -> int:
        return self.offsets[name][0]

    def gamma_offset(self, row: int) -> int:
        return self.offsets["gamma"][0] + row * self.hidden * self.elem


def pool_layout(cfg: ModelConfig, max_tokens: Optional[int] = None) -> PoolLayout:
    from arfuse.pool import align_up

    max_tokens = max_tokens or cfg.max_tokens
    elem = DTYPE_BYTES[cfg.dtype]
    rows = max_tokens * cfg.hidden * elem
    offsets, used = {}, 0
    for name, nbytes in (("partial", rows), ("residual", rows), ("h", rows),
                         ("gamma", (cfg.sites + 1) * cfg.hidden * elem)):
        offsets[name] = (used, nbytes)
        used += align_up(nbytes)
    return PoolLayout(offsets, used, cfg.hidden, elem, max_tokens)


def gpu_count() -> int:
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return len([v for v in vis.split(",") if v.strip() and v.strip() != "-1"])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        return len([line for line in out.stdout.splitlines() if line.startswith("GPU ")])
    except (OSError, subprocess.SubprocessError):
        return 0

