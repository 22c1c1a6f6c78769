"""SGLang's module layouts that arfuse knows, described as data.

An adapter is chosen by what the installed SGLang's modules contain, never by its version
string. Each Layout names:

- the fusion module and the names in it that arfuse replaces (the op and the workspace
  lifecycle SGLang calls: pre_initialize_workspaces before graph capture, ensure_..., cleanup);
- the gate: the module-level function SGLang asks whether a boundary fuses, and the module
  globals it reads that arfuse sets (FlashInfer's availability and the SM check; arfuse decides
  availability itself, at setup, voted across the ranks), plus the module-level bindings of
  is_flashinfer_allreduce_unavailable that the gate reads;
- the caller modules whose call sites reach the op and the gate, for the checks in
  tests/frameworks/sglang that every call site reaches arfuse.

Nothing here imports SGLang or torch: the CI checks read these tables against the released
wheels' source without either installed.
"""
from dataclasses import dataclass, field
from typing import Dict, Tuple

FUSION_MODULE = "sglang.srt.layers.flashinfer_comm_fusion"
OP_NAME = "flashinfer_allreduce_residual_rmsnorm"

# The fusion module's functions that arfuse replaces, with the parameters SGLang's callers
# pass (checked against each release's signature).
FUSION_FUNCTIONS: Dict[str, Tuple[str, ...]] = {
    OP_NAME: ("input_tensor", "residual", "weight", "eps", "max_token_num", "use_oneshot",
              "trigger_completion_at_end", "fp32_acc", "use_attn_tp_group"),
    "is_flashinfer_allreduce_unavailable": (),
    "ensure_workspace_initialized": ("max_token_num", "hidden_dim", "use_fp32_lamport", "dtype",
                                     "token_num", "use_oneshot", "use_attn_tp_group"),
    "pre_initialize_workspaces": ("max_token_num", "hidden_dim", "dtype", "use_oneshot"),
    "cleanup_flashinfer_workspace": (),
}


# SGLang's fused allreduce + RMSNorm + per-group FP8 hook (0.5.20 on): a module function of
# layernorm that RMSNorm's and GemmaRMSNorm's forward_with_allreduce_fusion_quant_per_group look
# up at call time, so replacing the module attribute reaches both. It answers
# ((fp8, scale), residual), ((bf16, fp8, scale), residual) with keep_bf16, or None (the caller
# then runs forward_with_allreduce_fusion and its own quant). SGLang implements it for ROCm/aiter
# only; arfuse serves it with the per-group FP8 op. Optional: a release without it (0.5.14) is
# served as before, the FP8 hook off.
QUANT_HOOK_MODULE = "sglang.srt.layers.layernorm"
QUANT_HOOK = "_forward_with_allreduce_fusion_quant_per_group"
QUANT_HOOK_PARAMS = ("norm_module", "x", "residual", "weight", "group_size",
                     "use_attn_tp_group", "keep_bf16")
# The norm methods that call QUANT_HOOK, and the group size SGLang's callers leave at default.
QUANT_HOOK_METHOD = "forward_with_allreduce_fusion_quant_per_group"
QUANT_GROUP_SIZE = 128


@dataclass(frozen=True)
class Layout:
    name: str
    # Releases whose wheels this layout was checked against (tests/frameworks/sglang pins).
    checked: Tuple[str, ...]
    gate_module: str
    # The gate's name in gate_module; the first present is used (0.5.21 calls it
    # apply_flashinfer_allreduce_fusion, 0.5.23 flashinfer_ar_fusion_applies).
    gate_names: Tuple[str, ...]
    # Globals of gate_module the gate reads that arfuse sets to True (FlashInfer present, an
    # SM90/SM100 GPU): arfuse's own availability answers through
    # is_flashinfer_allreduce_unavailable instead.
    gate_true_globals: Tuple[str, ...]
    # Where the token limit the gate applies lives (SGLang's FUSE_ALLREDUCE_MAX_BATCH_SIZE).
    max_batch_module: str
    # Modules that bind is_flashinfer_allreduce_unavailable at import (re-bound by install()).
    unavailable_bindings: Tuple[str, ...]
    # Modules that call the gate or the op (imported by install() so that every binding is
    # patched before SGLang's model code runs; the CI checks scan them).
    callers: Tuple[str, ...]
    # How the post-experts group (use_attn_tp_group=False) is found: "reduction_group" (the
    # release's sglang.srt.layers.moe.utils.post_experts_reduction_group) or "ep_else_moe_tp"
    # (the MoE-EP group when its size > 1, else the MoE-TP group, as the release's
    # ensure_workspace_initialized picks it).
    post_experts_group: str
    # Names a module of this layout must have (module -> names): what tells layouts apart.
    requires: Dict[str, Tuple[str, ...]] = field(default_factory=dict)


COMMUNICATOR = Layout(
    name="communicator",
    checked=("0.5.14", "0.5.20"),
    gate_module="sglang.srt.layers.communicator",
    gate_names=("apply_flashinfer_allreduce_fusion",),
    gate_true_globals=("_is_flashinfer_available", "_is_sm90_supported"),
    max_batch_module="sglang.srt.layers.communicator",
    unavailable_bindings=("sglang.srt.layers.communicator",),
    callers=("sglang.srt.layers.communicator", "sglang.srt.layers.layernorm"),
    post_experts_group="ep_else_moe_tp",
    requires={
        "sglang.srt.layers.communicator": ("apply_flashinfer_allreduce_fusion",
                                           "FUSE_ALLREDUCE_MAX_BATCH_SIZE"),
        FUSION_MODULE: tuple(FUSION_FUNCTIONS),
    },
)

LAYER_BOUNDARY = Layout(
    name="layer_boundary",
    checked=("0.5.21", "0.5.23"),
    gate_module="sglang.srt.layers.layer_boundary.residual.add_norm",
    gate_names=("flashinfer_ar_fusion_applies", "apply_flashinfer_allreduce_fusion"),
    gate_true_globals=("_is_flashinfer_available", "_is_sm90_supported"),
    max_batch_module="sglang.srt.layers.layer_boundary.residual.add_norm",
    unavailable_bindings=("sglang.srt.layers.layer_boundary.residual.add_norm",),
    callers=("sglang.srt.layers.layer_boundary.residual.add_norm",
             "sglang.srt.layers.layer_boundary.exit",
             "sglang.srt.layers.layer_boundary.fusions.allreduce",
             "sglang.srt.layers.layernorm"),
    post_experts_group="reduction_group",
    requires={
        "sglang.srt.layers.layer_boundary.residual.add_norm": ("FUSE_ALLREDUCE_MAX_BATCH_SIZE",),
        "sglang.srt.layers.moe.utils": ("post_experts_reduction_group",),
        FUSION_MODULE: tuple(FUSION_FUNCTIONS),
    },
)

LAYOUTS = (LAYER_BOUNDARY, COMMUNICATOR)

# Releases arfuse refuses by layout, with why (the install logs it as an ERROR).
REFUSED = {
    "0.5.6.post2": "the gate is inline in communicator.py and there is no "
                   "pre_initialize_workspaces: no place to decide and vote before the op runs",
}
